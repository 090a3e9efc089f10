"""The Triton autotuners of dslab's kernel modules: finding them, naming them, and their cache
entries and configs as JSON. :mod:`dslab.kernels.pinning` records and replays their choices.

An autotuner is found where a kernel module keeps it: in a module attribute (kernel key
``"module:name"``: ``dslab.kernels.moe.grouped_gemm_triton:_forward_tuned``), behind a wrapper
that holds it (dslab's ``CachedLaunch`` as ``.autotuned``, ``triton.heuristics`` as ``.fn``), or
among the results of an unbounded ``functools.cache`` factory of the module, keyed by the call
that made it (``"module:factory(args)"``: ``dslab.kernels.attention.attention_triton:
_fwd_kernel_for(64)``). The factory's cache is read through the garbage collector's view of the
wrapper, which holds its dict (CPython's C ``functools``; the pure-Python one holds it in a
closure); a call whose arguments are not JSON literals gives no key. One autotuner reached by
several names (a factory's autotuner, and the ``CachedLaunch`` another factory wraps it in) is
named once: preferably in its kernel's own module, held directly, then by the first name.
:func:`resolve` turns a key back into the autotuner in another process, calling the factory with
the recorded arguments, whose cache then hands that autotuner to the kernel's launches.
"""

from __future__ import annotations

import ast
import gc
import importlib
import math
import re
import sys
import types
from pathlib import Path
from typing import Any, Iterable

KERNELS_PACKAGE = "dslab.kernels"
KERNEL_KEY = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_]\w*)(?:\((.*)\))?$", re.S)
_AUTOTUNE_CALL = re.compile(r"\btriton\.autotune\(")


def autotuner_class():
    """Triton's ``Autotuner`` class, or None without Triton."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # Triton is optional: without it there is nothing to tune
        return None
    return Autotuner


def autotuned_modules() -> list[str]:
    """The modules of :mod:`dslab.kernels` whose source calls ``triton.autotune``, found by reading
    the files, so that a new kernel module needs no list kept here."""
    root = Path(__file__).resolve().parent
    names = []
    for path in sorted(root.rglob("*.py")):
        if _AUTOTUNE_CALL.search(path.read_text()):
            names.append(".".join((KERNELS_PACKAGE, *path.relative_to(root).with_suffix("").parts)))
    return names


def is_literal(value: Any) -> bool:
    """Whether ``value`` is a JSON literal that reads back equal: None, bool, int, str, finite float."""
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (bool, int, str))


def as_autotuner(value: Any) -> tuple[Any, bool]:
    """``(autotuner, wrapped)`` when ``value`` is a Triton autotuner, or wraps one (dslab's
    ``CachedLaunch`` as ``.autotuned``, ``triton.heuristics`` as ``.fn``); ``(None, False)`` else."""
    autotuner = autotuner_class()
    from triton.runtime import KernelInterface

    wrapped = False
    for _ in range(4):
        if isinstance(value, autotuner):
            return value, wrapped
        try:
            inner = getattr(value, "autotuned", None) if not isinstance(value, type) else None
        except Exception:  # a module attribute whose __getattr__ raises something else: not a kernel
            inner = None
        if inner is None and isinstance(value, KernelInterface):
            inner = getattr(value, "fn", None)
        if inner is None:
            break
        value, wrapped = inner, True
    return None, False


def _cache_items(function: Any) -> list[tuple[Any, Any]] | None:
    """The entries of an unbounded ``functools.cache`` (its dict, reached through the garbage
    collector's view of the wrapper, or the closure of the pure-Python one); None for anything else."""
    parameters = getattr(function, "cache_parameters", None)
    if not callable(parameters) or not hasattr(function, "__wrapped__") or parameters().get("maxsize") is not None:
        return None
    own = getattr(function, "__dict__", None)
    if isinstance(function, types.FunctionType):  # the pure-Python functools: the dict is in the closure
        holders = [cell.cell_contents for cell in function.__closure__ or () if _has_contents(cell)]
    else:
        holders = gc.get_referents(function)
    for held in holders:
        if isinstance(held, dict) and held is not own:
            return list(held.items())
    return None


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _call_arguments(cache_key: Any) -> tuple[tuple, dict] | None:
    """The arguments a ``functools.cache`` key was made from, or None when they are not literals.
    A lone int or str argument is its own key; otherwise the key is the positional arguments,
    then a marker object and the keyword arguments as name, value pairs."""
    if type(cache_key) in (int, str):
        return (cache_key,), {}
    if not isinstance(cache_key, (tuple, list)):
        return None
    items = list(cache_key)
    marks = [i for i, item in enumerate(items) if type(item) is object]
    positional, named = (items[:marks[0]], items[marks[0] + 1:]) if marks else (items, [])
    if len(named) % 2 or not all(is_literal(v) for v in positional + named):
        return None
    return tuple(positional), dict(zip(named[0::2], named[1::2]))


def _format_call(args: tuple, kwargs: dict) -> str:
    return ", ".join([repr(a) for a in args] + [f"{name}={value!r}" for name, value in kwargs.items()])


def _module_autotuners(module) -> tuple[list[tuple[tuple, str, Any]], list[str]]:
    """``[(rank, kernel key, autotuner)]`` of one module, and the names of factory entries whose
    arguments JSON cannot hold (their autotuners cannot be replayed)."""
    found, unreachable = [], []
    for attr, value in list(vars(module).items()):
        autotuner, wrapped = as_autotuner(value)
        if autotuner is not None:
            found.append((_rank(module, autotuner, wrapped, attr), f"{module.__name__}:{attr}", autotuner))
            continue
        items = _cache_items(value) if getattr(value, "__module__", None) == module.__name__ else None
        for cache_key, result in items or ():
            autotuner, wrapped = as_autotuner(result)
            if autotuner is None:
                continue
            call = _call_arguments(cache_key)
            if call is None:
                if autotuner.cache:
                    unreachable.append(f"{module.__name__}:{attr}")
                continue
            key = f"{module.__name__}:{attr}({_format_call(*call)})"
            found.append((_rank(module, autotuner, wrapped, key), key, autotuner))
    return found, unreachable


def _rank(module, autotuner, wrapped: bool, key: str) -> tuple:
    """The order in which names of one autotuner are preferred: in its kernel's own module, held
    directly rather than through a wrapper, then by name."""
    base = getattr(autotuner, "base_fn", None) or getattr(autotuner, "fn", None)
    return (getattr(base, "__module__", None) != module.__name__, wrapped, key)


def scan(load: bool, modules: Iterable[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """``({kernel key: autotuner}, [factories whose autotuners have no key])`` of the loaded
    :mod:`dslab.kernels` modules and ``modules`` (see :func:`autotuned_kernels`)."""
    if autotuner_class() is None:
        return {}, []
    names = set(modules) | {name for name in sys.modules if name.startswith(KERNELS_PACKAGE + ".")}
    if load:
        names.update(autotuned_modules())
    found, unreachable = [], []
    for name in sorted(names):
        if name in sys.modules and sys.modules[name] is None:  # a failed import's placeholder
            continue
        module = sys.modules.get(name) or importlib.import_module(name)
        more, missed = _module_autotuners(module)
        found += more
        unreachable += missed
    chosen, seen = {}, set()
    for _, key, autotuner in sorted(found, key=lambda item: item[0]):
        if id(autotuner) not in seen:
            seen.add(id(autotuner))
            chosen[key] = autotuner
    return dict(sorted(chosen.items())), sorted(set(unreachable))


def autotuned_kernels(load: bool = True, modules: Iterable[str] = ()) -> dict[str, Any]:
    """Every Triton autotuner of dslab's kernel modules that exists now, by kernel key
    (``"module:name"`` or ``"module:factory(args)"``, module docstring); each autotuner once, under
    its preferred name. ``load`` imports the modules that call ``triton.autotune`` first (a factory's
    autotuners exist only once it was called); ``modules`` adds other modules to read. Empty
    without Triton."""
    return scan(load, modules)[0]


def json_key(cache_key: Any) -> tuple[bool, Any]:
    """``(JSON can hold it, the key as JSON)`` of an autotuner cache key: a tuple as a list, a
    scalar as itself."""
    if isinstance(cache_key, tuple):
        return all(is_literal(v) for v in cache_key), list(cache_key)
    return is_literal(cache_key), cache_key


def config_dict(config: Any) -> dict | None:
    """A ``triton.Config`` as JSON: kwargs, num_warps, num_stages, and num_ctas, maxnreg and
    ir_override where the installed Triton has them and they are set; None when a kwarg is not a
    JSON literal."""
    kwargs = dict(getattr(config, "kwargs", None) or {})
    if not all(isinstance(name, str) and is_literal(value) for name, value in kwargs.items()):
        return None
    out = {"kwargs": kwargs, "num_warps": getattr(config, "num_warps", None),
           "num_stages": getattr(config, "num_stages", None)}
    for name in ("num_ctas", "maxnreg", "ir_override"):
        value = getattr(config, name, None)
        if value is not None:
            out[name] = value
    return out


def normalized_config(config: dict) -> dict:
    """A :func:`config_dict` with Triton's defaults filled in, for comparing configs recorded by
    Triton versions that do or do not have ``num_ctas``, ``maxnreg`` and ``ir_override``."""
    return {"kwargs": config.get("kwargs") or {}, "num_warps": config.get("num_warps"),
            "num_stages": config.get("num_stages"), "num_ctas": config.get("num_ctas", 1),
            "maxnreg": config.get("maxnreg"), "ir_override": config.get("ir_override")}


def chosen_config(value: Any) -> Any:
    """The config of an autotuner cache entry: the Config itself (Triton 2.x and 3.x), or the
    first item of a tuple holding it."""
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    return value if hasattr(value, "kwargs") else None


def parse_kernel_key(kernel_key: str) -> tuple[str, str, tuple | None, dict]:
    """``(module, attribute, factory args or None, factory kwargs)`` of a kernel key; ValueError
    when it is not one or its arguments are not literals (they are evaluated as literals only)."""
    match = KERNEL_KEY.match(kernel_key)
    if match is None:
        raise ValueError(f"{kernel_key!r} is not 'module:name' or 'module:factory(args)'")
    module, name, inner = match.groups()
    if inner is None:
        return module, name, None, {}
    try:
        call = ast.parse(f"f({inner})", mode="eval").body
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.func.id != "f":
            raise ValueError("not one call's arguments")
        if any(k.arg is None for k in call.keywords):
            raise ValueError("** arguments")
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"{kernel_key!r}: the factory's arguments are not literals ({err})") from None
    return module, name, args, kwargs


def resolve(kernel_key: str):
    """The autotuner a kernel key names in this process (calling its factory when it names one)."""
    module_name, name, args, kwargs = parse_kernel_key(kernel_key)
    target = getattr(importlib.import_module(module_name), name)
    if args is not None:
        target = target(*args, **kwargs)
    autotuner, _ = as_autotuner(target)
    if autotuner is None:
        raise ValueError(f"{kernel_key} is not a Triton autotuner here")
    return module_name, autotuner


def matching_config(autotuner, recorded: dict):
    """The candidate config of ``autotuner`` equal to a recorded one (its own object, pre-hook
    included), or None when it has none such."""
    wanted = normalized_config(recorded)
    for config in autotuner.configs:
        as_dict = config_dict(config)
        if as_dict is not None and normalized_config(as_dict) == wanted:
            return config
    return None
