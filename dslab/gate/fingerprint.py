"""Fingerprints: what must be equal for two runs' timings to be comparable.

A fingerprint has three parts, each a plain JSON-able dict built from one run report:

``hardware`` (from ``report.environment``, see :func:`hardware_fingerprint`)
    ``gpu_names`` (the CUDA GPUs' names in index order), ``gpu_count``, ``torch`` and ``cuda``
    (major.minor of ``torch.__version__`` and ``torch.version.cuda``), ``dslab_kernels`` (the
    ``DSLAB_KERNELS`` variable, which forces the reference kernels), and, on a machine without
    GPUs only, ``cpu_count``.

``config`` (from ``report.config``, see :func:`config_fingerprint`)
    every key of the run's config except :data:`IGNORED_CONFIG_KEYS` (how many trials, steps and
    warm-up steps were measured, the seed of the synthetic data, which other arms ran beside,
    where the suite file lay, the device string — its kind is in ``hardware`` —, the derived
    ``flops_per_step``, and ``inject_step_sleep_ms``, the deliberate slowdown of
    ``DSLAB_INJECT_STEP_SLEEP_MS`` that exists to be caught by the gate) and except ``cases``.
    For today's bench runner that is ``scale``, ``precision``, ``family``, ``model_options`` and
    ``engine``; a key a producer adds later counts (it is safer to refuse a comparison than to
    make a wrong one).

``cases`` (from ``report.config["cases"]``)
    one entry per case name: the case's own settings (``seq_len``, ``micro_batch``, ``preset``,
    ``model_options``, ...). Cases are compared one by one, so adding a case to a suite leaves the
    others comparable.

:attr:`Fingerprint.key` hashes ``hardware`` and ``config`` (not ``cases``): it names the baseline
file ``reports/baselines/<suite>/<key>.json`` and groups runs for rolling baselines.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

IGNORED_CONFIG_KEYS = frozenset(
    {"trials", "steps", "warmup_steps", "seed", "arms", "suite_file", "device", "flops_per_step",
     "inject_step_sleep_ms"}
)
KEY_LENGTH = 16
_MISSING = object()


def major_minor(version: Any) -> str | None:
    """``"2.13.0+cu128"`` -> ``"2.13"``; ``"12.8"`` -> ``"12.8"``; None or no digits -> None."""
    if version is None:
        return None
    match = re.match(r"\s*(\d+)(?:\.(\d+))?", str(version))
    if match is None:
        return None
    return match.group(1) if match.group(2) is None else f"{match.group(1)}.{match.group(2)}"


def hardware_fingerprint(environment: dict) -> dict:
    """The hardware and software stack a run measured, from its report's ``environment``.

    Raises ValueError when ``environment`` is empty: a run that does not say where it ran cannot
    be compared with anything.
    """
    if not isinstance(environment, dict) or not environment:
        raise ValueError("the run records no 'environment': its hardware is unknown")
    cuda = environment.get("cuda") or {}
    gpus = cuda.get("gpus") or []
    torch_info = environment.get("torch") or {}
    variables = environment.get("environment_variables") or {}
    hardware = {
        "gpu_names": [str(g.get("name")) for g in sorted(gpus, key=lambda g: g.get("index", 0))],
        "gpu_count": len(gpus),
        "torch": major_minor(torch_info.get("version")),
        "cuda": major_minor(torch_info.get("cuda")),
        "dslab_kernels": variables.get("DSLAB_KERNELS"),
    }
    if not gpus:
        hardware["cpu_count"] = environment.get("cpu_count")
    return hardware


def config_fingerprint(config: dict) -> dict:
    """``config`` without :data:`IGNORED_CONFIG_KEYS` and ``cases`` (see the module docstring)."""
    if not isinstance(config, dict):
        raise ValueError(f"a run's 'config' must be an object, got {type(config).__name__}")
    return {k: v for k, v in sorted(config.items()) if k not in IGNORED_CONFIG_KEYS and k != "cases"}


def case_fingerprints(config: dict) -> dict[str, dict]:
    """``{case name: that case's settings}`` from ``config["cases"]`` (entries without a name are skipped)."""
    cases = config.get("cases") if isinstance(config, dict) else None
    out = {}
    for case in cases or []:
        if isinstance(case, dict) and "name" in case:
            out[str(case["name"])] = {k: v for k, v in sorted(case.items()) if k != "name"}
    return out


def stable_hash(value: Any, length: int = KEY_LENGTH) -> str:
    """The first ``length`` hex digits of the SHA-256 of ``value`` as canonical JSON (sorted keys)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@dataclass(frozen=True)
class Fingerprint:
    hardware: dict
    config: dict
    cases: dict[str, dict] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Hash of ``hardware`` and ``config``: equal keys mean the runs may be compared."""
        return stable_hash({"hardware": self.hardware, "config": self.config})

    def to_dict(self) -> dict:
        return {"key": self.key, "hardware": self.hardware, "config": self.config, "cases": self.cases}

    @classmethod
    def from_dict(cls, data: dict) -> Fingerprint:
        for name in ("hardware", "config"):
            if not isinstance(data.get(name), dict):
                raise ValueError(f"a fingerprint needs an object '{name}'")
        return cls(hardware=data["hardware"], config=data["config"], cases=dict(data.get("cases") or {}))


def fingerprint_of(report) -> Fingerprint:
    """The :class:`Fingerprint` of a :class:`dslab.report.RunReport`."""
    return Fingerprint(
        hardware=hardware_fingerprint(report.environment),
        config=config_fingerprint(report.config),
        cases=case_fingerprints(report.config),
    )


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    return json.dumps(value, sort_keys=True, default=str)


def diff_values(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """``[(dotted path, value in a, value in b)]`` for every leaf where ``a`` and ``b`` differ.

    Dicts are walked key by key (a key on one side only shows the other as absent); lists of
    equal length element by element (``path[i]``); anything else is compared whole.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            sub = f"{path}.{key}" if path else str(key)
            out += diff_values(a.get(key, _MISSING), b.get(key, _MISSING), sub)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += diff_values(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [(path, a, b)]


def explain_difference(
    baseline: Fingerprint, candidate: Fingerprint, first: str = "baseline", second: str = "candidate"
) -> list[str]:
    """One line per field in which the hardware or config parts differ, e.g.
    ``hardware.gpu_names[0]: "NVIDIA H100 80GB HBM3" (baseline) vs "NVIDIA A100-SXM4-80GB" (candidate)``.
    Empty when the keys are equal. Cases are compared separately, by :func:`explain_case_difference`.
    """
    lines = []
    for part in ("hardware", "config"):
        for path, a, b in diff_values(getattr(baseline, part), getattr(candidate, part), part):
            lines.append(f"{path}: {_show(a)} ({first}) vs {_show(b)} ({second})")
    return lines


def explain_case_difference(
    baseline: Fingerprint, candidate: Fingerprint, case: str, first: str = "baseline", second: str = "candidate"
) -> list[str]:
    """The fields of case ``case`` that differ, as :func:`explain_difference` words them."""
    a = baseline.cases.get(case, _MISSING)
    b = candidate.cases.get(case, _MISSING)
    if a is _MISSING and b is _MISSING:
        return []
    return [f"{path}: {_show(x)} ({first}) vs {_show(y)} ({second})"
            for path, x, y in diff_values(a, b, f"cases.{case}")]
