"""The base of every config section, and the translation of validation errors into messages that
name the key.

A component owns its section: it declares a :class:`ConfigSection` subclass next to its code and
the top-level config (:mod:`dslab.engine.config`) collects them. Unknown keys are errors that name
the key and the closest known one.

This module imports nothing of dslab, so every layer (profilers, io, engine, bench) may use it.
"""

from __future__ import annotations

import difflib
from typing import Any

import pydantic
from pydantic import ConfigDict


class ConfigSection(pydantic.BaseModel):
    """A config section: unknown keys forbidden, values validated on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


def known_keys(model: type[pydantic.BaseModel]) -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(field.alias or name)
    return keys


def _model_at(model: type[pydantic.BaseModel], loc: tuple) -> type[pydantic.BaseModel] | None:
    """The section model that owns the key at ``loc`` (all but the last element)."""
    current: Any = model
    for part in loc[:-1]:
        if not (isinstance(current, type) and issubclass(current, pydantic.BaseModel)):
            return None
        field = None
        for name, f in current.model_fields.items():
            if part in (name, f.alias):
                field = f
                break
        if field is None:
            return None
        current = _section_type(field.annotation)
    return current if isinstance(current, type) and issubclass(current, pydantic.BaseModel) else None


def _section_type(annotation: Any) -> Any:
    """Unwrap Optional[X] / X | None to X."""
    args = getattr(annotation, "__args__", None)
    if args:
        for a in args:
            if isinstance(a, type) and issubclass(a, pydantic.BaseModel):
                return a
    return annotation


def accepted_off(*fields: str, why: str):
    """A field validator for boolean ``fields`` that a config may carry only as false (a DeepSpeed
    key dslab does not implement): true raises ``why`` (the key is named by
    :func:`format_validation_error`). Assign it in the section's class body."""

    def refuse(cls, value):
        if value:
            raise ValueError(f"{why}; remove it or set it to false")
        return value

    return pydantic.field_validator(*fields)(classmethod(refuse))


def closest_key(key: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return matches[0] if matches else None


def format_validation_error(err: pydantic.ValidationError, model: type[pydantic.BaseModel],
                            prefix: str = "") -> str:
    """One line per problem, each naming the full config key."""
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        key = ".".join((prefix,) + loc if prefix else loc) if loc else prefix or "<config>"
        if e["type"] == "extra_forbidden":
            owner = _model_at(model, loc)
            hint = closest_key(loc[-1], known_keys(owner)) if owner is not None else None
            msg = f"unknown config key '{key}'"
            if hint:
                msg += f"; did you mean '{'.'.join(((prefix,) if prefix else ()) + loc[:-1] + (hint,))}'?"
            lines.append(msg)
        else:
            detail = e["msg"]
            if detail.startswith("Value error, "):
                detail = detail[len("Value error, "):]
            if detail.startswith(("config key '", "unknown config key '")):
                # a nested section already named the full key
                lines.append(detail)
                continue
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"config key '{key}': {detail}{shown}")
    return "; ".join(lines)


def parse_section(model: type[pydantic.BaseModel], data: Any, prefix: str = ""):
    """Validate ``data`` into ``model``; a bad value raises ValueError naming the key."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as err:
        raise ValueError(format_validation_error(err, model, prefix)) from None
