"""Kernel choices pinned per baseline: record what this process picked, replay it in another.

Two runs of the same code on one GPU can time differently because each process picks its kernels
afresh. Triton's autotuner benchmarks every candidate config of a kernel the first time it sees an
autotune key, in each process, and keeps the fastest *of that benchmark*: when two configs are
within the benchmark's noise, one process takes the first and the next the second, and the timed
steps differ by what the two configs differ (tens of percent on some dslab kernels). cuDNN and
cuBLAS choose their algorithms from process-wide flags. A regression gate that compares a
candidate with a baseline must let both run the same kernels, so the baseline records its choices
(:func:`record_kernel_choices`) and the candidate replays them (:func:`replay_kernel_choices`).

What is pinned, and how:

- **Triton autotune results**, exactly. Each autotuner's cache (autotune key -> chosen config) is
  recorded; replaying pre-fills the cache of the same autotuner with the same config object of its
  candidates, so Triton never benchmarks a recorded key. A key the baseline never saw is
  autotuned as usual and counted (:func:`pinning_misses`). dslab's autotuners are found by
  reading its kernel modules: a module attribute holding an autotuner (``"module:name"``), or an
  unbounded ``functools.cache`` factory that made one (``"module:factory(64, True)"``, replayed by
  calling the factory with those arguments, which creates the autotuner its later launches get
  from the cache). Autotuners held anywhere else (a closure, a bounded ``lru_cache``, a factory
  called with arguments JSON cannot hold) are not found.
- **cuDNN**: with ``torch.backends.cudnn.benchmark`` off, cuDNN's algorithm is its heuristics'
  pick, a function of the shapes, dtypes, the flags recorded here (``deterministic``,
  ``allow_tf32``), the cuDNN version and the device; the flags and the fingerprint pin it. With
  benchmark on, cuDNN times its algorithms in each process, which is exactly the per-process
  choice pinning removes, so replaying always turns ``cudnn.benchmark`` **off** (whatever the
  recording had; the summary says when that differs). A baseline recorded with benchmark on is
  therefore not reproduced by its replay: record baselines from runs with it off (any run that
  itself replayed pins has it off).
- **cuBLAS / cuBLASLt**: torch exposes no per-call algorithm choice. Their heuristic pick is a
  function of the shape, dtype, layout, workspace size and the flags recorded here (TF32, reduced
  precision reductions, fp16 accumulation, the preferred BLAS library, ``CUBLAS_WORKSPACE_CONFIG``,
  ``CUBLASLT_WORKSPACE_SIZE``, ``NVIDIA_TF32_OVERRIDE``). Pinning those flags pins the choice on one
  device and one library version, and only there: that is why the fingerprint must match. The
  environment variables are read when torch creates its first cuBLAS handle, so replaying them
  takes effect only in a process that has not run a matmul on the device yet (``dslab bench`` and
  the kernel benchmarks replay before anything runs).
- Not pinned: the algorithm choices of torch.compile's own autotuning (Inductor's max-autotune and
  its on-disk cache), NCCL's algorithm and protocol (``NCCL_ALGO``/``NCCL_PROTO``), and kernels
  chosen by rules over shapes (SDPA's backend), which need no pinning.

The choices are plain JSON (:data:`SCHEMA`)::

    {"schema": "dslab.kernel_choices", "schema_version": 1,
     "fingerprint": {"device_name": "NVIDIA H200", "torch": "2.13.0+cu128", "triton": "3.5.0",
                     "cuda": "12.8", "cudnn": 91002},
     "backends": {"cudnn.benchmark": false, "cudnn.deterministic": false, "cudnn.allow_tf32": true,
                  "cuda.matmul.allow_tf32": false, "float32_matmul_precision": "highest",
                  "preferred_blas_library": "cublas", "deterministic_algorithms": "off", ...,
                  "env": {"CUBLAS_WORKSPACE_CONFIG": null, ...}},
     "triton": {"dslab.kernels.attention.attention_triton:_fwd_kernel_for(64)": [
                  {"key": [512, 512, true, false, false, 1, "torch.bfloat16", ...],
                   "config": {"kwargs": {"BLOCK_M": 128, "BLOCK_N": 64}, "num_warps": 4,
                              "num_stages": 3, "num_ctas": 1}}]},
     "notes": []}

``key`` is the autotuner's cache key as the installed Triton builds it (Triton 3.x: the values of
the ``key`` arguments, then the dtype of every tensor argument, as a tuple; a JSON list here, and a
key that is not a tuple is kept as the scalar it is); a key or config with values JSON cannot hold
is left out and named in ``notes``. :func:`load_kernel_choices` also finds the choices inside a
baseline (``kernel_choices``), a run report (``profilers.kernel_choices._run``) and a
pytest-benchmark JSON (``machine_info.kernel_choices``). How the autotuners are found and named
is in :mod:`dslab.kernels._autotuners`.

``backends`` holds ``cudnn.enabled``, ``.benchmark``, ``.deterministic``, ``.allow_tf32``,
``cuda.matmul.allow_tf32``, the reduced-precision reductions of fp16 and bf16 matmuls, fp16
accumulation, ``float32_matmul_precision``, the newer ``fp32_precision`` switches, the preferred
BLAS library, deterministic algorithms (``"off"``, ``"on"`` or ``"warn"``) and, under ``env``, the
variables cuBLAS reads (:data:`ENV_VARIABLES`; null when unset). A flag the installed torch lacks,
or cannot read in its current mode, is left out: torch's legacy TF32 getters raise once the
``fp32_precision`` API was used in the process, and writing that API in a process that uses the
legacy one makes them raise, so :func:`set_backend_flags` writes an ``fp32_precision`` switch only
where the record lacks the legacy flag of the same library.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch

from dslab.kernels._autotuners import (
    KERNEL_KEY, autotuned_kernels, autotuned_modules, autotuner_class, chosen_config, config_dict, is_literal,
    json_key, matching_config, normalized_config, resolve, scan,
)

__all__ = ["SCHEMA", "REPORT_SECTION", "RUN_RECORD", "autotuned_kernels", "autotuned_modules", "backend_flags",
           "check_kernel_choices", "config_dict", "fingerprint", "fingerprint_differences", "load_kernel_choices",
           "merge_kernel_choices", "pinning_misses", "record_kernel_choices", "replay_kernel_choices",
           "set_backend_flags"]

SCHEMA = "dslab.kernel_choices"
SCHEMA_VERSION = 1
# Where a run report keeps the run's choices: profilers[REPORT_SECTION][RUN_RECORD].
REPORT_SECTION = "kernel_choices"
RUN_RECORD = "_run"
FINGERPRINT_FIELDS = ("device_name", "torch", "triton", "cuda", "cudnn")
ENV_VARIABLES = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "NVIDIA_TF32_OVERRIDE")
# Boolean attributes under torch.backends, recorded and replayed by their dotted path.
ATTRIBUTE_FLAGS = (
    "cudnn.enabled", "cudnn.benchmark", "cudnn.deterministic", "cudnn.allow_tf32", "cuda.matmul.allow_tf32",
    "cuda.matmul.allow_fp16_reduced_precision_reduction", "cuda.matmul.allow_bf16_reduced_precision_reduction",
    "cuda.matmul.allow_fp16_accumulation",
)
# torch's newer TF32 switches, each with the legacy flag that governs the same library.
FP32_PRECISION_FLAGS = {"cuda.matmul.fp32_precision": "cuda.matmul.allow_tf32",
                        "cudnn.conv.fp32_precision": "cudnn.allow_tf32", "cudnn.rnn.fp32_precision": "cudnn.allow_tf32"}
DETERMINISTIC_MODES = ("off", "on", "warn")

# What this process replayed: id(autotuner) -> (autotuner, the cache keys put there), and the
# modules named by replayed kernel keys (recorded again by later calls to record_kernel_choices).
_PINNED: dict[int, tuple[Any, set]] = {}
_PIN_MODULES: set[str] = set()


def fingerprint() -> dict:
    """The device and library versions kernel choices hold for: the current CUDA device's name
    (``"cpu"`` without one), torch, Triton (None when missing), CUDA and cuDNN (None on a CPU build)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }


def _backend_parent(path: str):
    """``(object, attribute)`` of a dotted path under ``torch.backends``."""
    parent = torch.backends
    *parents, name = path.split(".")
    for step in parents:
        parent = getattr(parent, step)
    return parent, name


def _blas_library() -> str:
    """The preferred BLAS library as ``torch.backends.cuda.preferred_blas_library`` takes it."""
    chosen = torch.backends.cuda.preferred_blas_library()
    return str(getattr(chosen, "name", chosen)).lower()


def _deterministic_mode() -> str:
    if not torch.are_deterministic_algorithms_enabled():
        return "off"
    return "warn" if torch.is_deterministic_algorithms_warn_only_enabled() else "on"


def _set_deterministic_mode(mode: str) -> None:
    torch.use_deterministic_algorithms(mode != "off", warn_only=mode == "warn")


def _flag_accessors() -> dict[str, tuple]:
    """Every recorded flag: name -> (getter, setter), in the order replay writes them."""
    accessors = {}
    for path in ("fp32_precision", *FP32_PRECISION_FLAGS, "float32_matmul_precision", *ATTRIBUTE_FLAGS):
        if path == "float32_matmul_precision":
            accessors[path] = (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision)
            continue

        def getter(path=path):
            parent, name = _backend_parent(path)
            return getattr(parent, name)

        def setter(value, path=path):
            parent, name = _backend_parent(path)
            setattr(parent, name, value)

        accessors[path] = (getter, setter)
    accessors["preferred_blas_library"] = (_blas_library, torch.backends.cuda.preferred_blas_library)
    accessors["deterministic_algorithms"] = (_deterministic_mode, _set_deterministic_mode)
    return accessors


def backend_flags() -> dict:
    """The process-wide flags that steer cuDNN's and cuBLAS's choices (module docstring), plus
    ``env``: the cuBLAS environment variables (None when unset). A flag this torch lacks, or
    cannot read in its current mode, is left out."""
    flags = {}
    for name, (getter, _) in _flag_accessors().items():
        try:
            value = getter()
        except (AttributeError, RuntimeError):  # missing in this torch, or a legacy getter refusing
            continue
        if is_literal(value):
            flags[name] = value
    flags["env"] = {name: os.environ.get(name) for name in ENV_VARIABLES}
    return flags


def set_backend_flags(flags: dict) -> dict:
    """Set the flags of a :func:`backend_flags` record that differ from this process's, and
    ``cudnn.benchmark`` off (module docstring); returns ``{flag: [before, after]}`` of what changed.
    The ``fp32_precision`` flags are written only where the record lacks their legacy flag, and
    ``float32_matmul_precision`` only with ``cuda.matmul.allow_tf32``. ValueError naming the flag
    when a value cannot be set here (a BLAS library this build lacks, say)."""
    changed = {}
    accessors = _flag_accessors()
    wanted = {name: value for name, value in flags.items() if name != "env"}
    legacy = {legacy_name for legacy_name in FP32_PRECISION_FLAGS.values() if legacy_name in wanted}
    for name in ("fp32_precision", *FP32_PRECISION_FLAGS):
        if FP32_PRECISION_FLAGS.get(name) in legacy or (name == "fp32_precision" and len(legacy) == 2):
            wanted.pop(name, None)
    if "cuda.matmul.allow_tf32" not in wanted:
        wanted.pop("float32_matmul_precision", None)
    wanted["cudnn.benchmark"] = False
    for name, (getter, setter) in accessors.items():
        if name not in wanted:
            continue
        try:
            before = getter()
        except (AttributeError, RuntimeError):
            before = None
        if before != wanted[name]:
            try:
                setter(wanted[name])
            except (TypeError, ValueError, RuntimeError, KeyError) as err:
                raise ValueError(f"backends.{name}: {wanted[name]!r} cannot be set here ({err})") from None
            changed[name] = [before, wanted[name]]
    for name, value in (flags.get("env") or {}).items():
        if name not in ENV_VARIABLES:
            raise ValueError(f"backends.env.{name} is not a variable kernel choices set ({', '.join(ENV_VARIABLES)})")
        before = os.environ.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        if before != value:
            changed[f"env.{name}"] = [before, value]
    return changed


def record_kernel_choices(modules: Iterable[str] = ()) -> dict:
    """This process's kernel choices (module docstring's layout): every autotuner's cache of the
    loaded kernel modules (and of ``modules``), the backend flags and the fingerprint."""
    triton_choices: dict[str, list] = {}
    kernels, unreachable = scan(False, set(modules) | _PIN_MODULES)
    notes = [f"{name}: autotuned through arguments JSON cannot hold; not recorded" for name in unreachable]
    for kernel_key, autotuner in kernels.items():
        entries = []
        for cache_key, chosen in list(autotuner.cache.items()):
            recordable, key = json_key(cache_key)
            config = chosen_config(chosen)
            config_json = config_dict(config) if config is not None else None
            if not recordable or config_json is None:
                notes.append(f"{kernel_key}: key {cache_key!r} or its config holds values JSON cannot; not recorded")
                continue
            entries.append({"key": key, "config": config_json})
        if entries:
            triton_choices[kernel_key] = sorted(entries, key=lambda entry: json.dumps(entry, sort_keys=True))
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "fingerprint": fingerprint(),
            "backends": backend_flags(), "triton": triton_choices, "notes": notes}


def _fail(where: str, message: str):
    raise ValueError(f"{where}: {message}")


def check_kernel_choices(choices: Any, where: str = "kernel choices") -> dict:
    """``choices`` when it has the layout of :func:`record_kernel_choices`; ValueError naming
    ``where`` and the offending key otherwise."""
    if not isinstance(choices, dict):
        _fail(where, f"kernel choices must be a JSON object, not {type(choices).__name__}")
    if choices.get("schema", SCHEMA) != SCHEMA:
        _fail(where, f"'schema' is {choices.get('schema')!r}, not {SCHEMA!r}")
    version = choices.get("schema_version", SCHEMA_VERSION)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        _fail(where, f"'schema_version' {version!r} is not one this reader knows")
    if not isinstance(choices.get("fingerprint"), dict):
        _fail(where, "'fingerprint' must be an object (the device and versions the choices were recorded on)")
    backends = choices.get("backends", {})
    if not isinstance(backends, dict):
        _fail(where, "'backends' must be an object")
    env = backends.get("env", {})
    if not isinstance(env, dict):
        _fail(where, "'backends.env' must be an object")
    for name, value in env.items():
        if name not in ENV_VARIABLES:
            _fail(where, f"'backends.env.{name}' is not a variable kernel choices set ({', '.join(ENV_VARIABLES)})")
        if value is not None and not isinstance(value, str):
            _fail(where, f"'backends.env.{name}' must be a string or null")
    mode = backends.get("deterministic_algorithms", "off")
    if mode not in DETERMINISTIC_MODES:
        _fail(where, f"'backends.deterministic_algorithms' is {mode!r}; choose from {', '.join(DETERMINISTIC_MODES)}")
    triton_choices = choices.get("triton", {})
    if not isinstance(triton_choices, dict):
        _fail(where, "'triton' must map kernel keys to lists of choices")
    for kernel_key, entries in triton_choices.items():
        if not KERNEL_KEY.match(str(kernel_key)):
            _fail(where, f"'triton' key {kernel_key!r} is not 'module:name' or 'module:factory(args)'")
        if not isinstance(entries, list):
            _fail(where, f"'triton.{kernel_key}' must be a list")
        for i, entry in enumerate(entries):
            at = f"'triton.{kernel_key}[{i}]'"
            if not isinstance(entry, dict) or "key" not in entry or not isinstance(entry.get("config"), dict):
                _fail(where, f"{at} needs 'key' and a 'config' object")
            config = entry["config"]
            if not isinstance(config.get("kwargs", {}), dict):
                _fail(where, f"{at}.config.kwargs must be an object")
            for field in ("num_warps", "num_stages"):
                if not isinstance(config.get(field), int):
                    _fail(where, f"{at}.config.{field} must be an integer")
    return choices


def load_kernel_choices(path: str | Path) -> dict:
    """The kernel choices in ``path``: a kernel-choices JSON, a dslab baseline (``kernel_choices``),
    a run report (``profilers.kernel_choices._run``) or a pytest-benchmark JSON
    (``machine_info.kernel_choices``). FileNotFoundError, or ValueError naming the file and what
    it lacks."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no kernel-choices file at {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON object was expected, not {type(data).__name__}")
    schema = data.get("schema")
    if schema == "dslab.baseline":
        choices, where = data.get("kernel_choices"), "its 'kernel_choices'"
    elif schema == "dslab.run":
        section = (data.get("profilers") or {}).get(REPORT_SECTION)
        choices = section.get(RUN_RECORD) if isinstance(section, dict) else None
        where = f"its 'profilers.{REPORT_SECTION}.{RUN_RECORD}'"
    elif isinstance(data.get("benchmarks"), list) and isinstance(data.get("machine_info"), dict):
        choices, where = data["machine_info"].get("kernel_choices"), "its 'machine_info.kernel_choices'"
    elif schema == SCHEMA:
        choices, where = data, "it"
    else:
        raise ValueError(f"{path} is neither kernel choices, a dslab baseline, a run report nor a "
                         f"pytest-benchmark JSON (schema {schema!r})")
    if choices is None:
        raise ValueError(f"{path} holds no kernel choices ({where} is missing): it was written before they were "
                         f"recorded, or by a run that recorded none")
    return check_kernel_choices(choices, str(path))


def fingerprint_differences(recorded: dict, here: dict | None = None) -> list[tuple[str, Any, Any]]:
    """``[(field, recorded value, this process's value)]`` of the fingerprint fields that differ."""
    here = fingerprint() if here is None else here
    return [(field, recorded.get(field), here.get(field)) for field in FINGERPRINT_FIELDS
            if recorded.get(field) != here.get(field)]


def replay_kernel_choices(choices: dict, strict: bool = True, source: str = "kernel choices") -> dict:
    """Replay recorded kernel choices in this process, before the kernels run.

    Refuses (ValueError naming ``source`` and the differing field) when the recording's
    fingerprint differs from this process's, unless ``strict`` is False (then the difference is
    in the summary). Sets the backend flags that differ and turns ``cudnn.benchmark`` off (cuDNN's
    benchmark mode times its algorithms in each process: the per-process choice this removes).
    Pre-fills each named autotuner's cache with its recorded configs, so that Triton never
    benchmarks those keys; keys seen later are autotuned as usual (:func:`pinning_misses`). An
    entry that cannot be replayed (its kernel is gone, or the config is no longer one of the
    kernel's candidates: the kernel changed, which is what a gate should measure) is skipped and
    listed in the summary's ``stale``.

    Returns ``{"source", "pinned": entries, "kernels": autotuners, "stale": [...],
    "fingerprint_differences": [...], "backends_changed": {flag: [before, after]},
    "cudnn_benchmark_recorded": bool or None}``."""
    check_kernel_choices(choices, source)
    differences = fingerprint_differences(choices["fingerprint"])
    if differences and strict:
        field, there, here = differences[0]
        raise ValueError(f"{source}: fingerprint.{field} is {json.dumps(there)} there and {json.dumps(here)} here; "
                         f"kernel choices hold only on the device and versions they were recorded with (record "
                         f"them again here, or refresh the baseline)")
    backends = choices.get("backends", {})
    changed = set_backend_flags(backends)
    stale, pinned, kernels = [], 0, 0
    for kernel_key, entries in sorted(choices.get("triton", {}).items()):
        if autotuner_class() is None:
            stale.append(f"{kernel_key}: Triton is not installed here")
            continue
        try:
            module_name, autotuner = resolve(kernel_key)
        except Exception as err:  # a kernel renamed, removed or failing to build here: reported, not fatal
            stale.append(f"{kernel_key}: {type(err).__name__}: {err}")
            continue
        _PIN_MODULES.add(module_name)
        keys = _PINNED.setdefault(id(autotuner), (autotuner, set()))[1]
        kernels += 1
        for entry in entries:
            raw_key = entry["key"]
            cache_key = tuple(raw_key) if isinstance(raw_key, list) else raw_key
            config = matching_config(autotuner, entry["config"])
            if config is None:
                config_text = json.dumps(entry["config"], sort_keys=True)
                stale.append(f"{kernel_key} {json.dumps(raw_key)}: config {config_text} is not one of its "
                             f"candidates here")
                continue
            autotuner.cache[cache_key] = config
            keys.add(cache_key)
            pinned += 1
    return {"source": source, "pinned": pinned, "kernels": kernels, "stale": stale,
            "fingerprint_differences": [list(d) for d in differences], "backends_changed": changed,
            "cudnn_benchmark_recorded": backends.get("cudnn.benchmark")}


def pinning_misses(modules: Iterable[str] = ()) -> dict[str, list]:
    """``{kernel key: [autotune keys]}`` of the autotuners' cache entries that no replay put there:
    the keys this process chose itself (by benchmarking, or as the one config left after pruning).
    Without a replay, every key of every autotuner."""
    misses = {}
    for kernel_key, autotuner in autotuned_kernels(load=False, modules=set(modules) | _PIN_MODULES).items():
        pinned = _PINNED.get(id(autotuner), (None, set()))[1]
        keys = [json_key(key)[1] for key in list(autotuner.cache) if key not in pinned]
        if keys:
            misses[kernel_key] = sorted(keys, key=repr)
    return misses


def merge_kernel_choices(records: list[dict]) -> dict:
    """One record of several processes' choices (the launches of a multi-process run): the first
    record's fingerprint and flags, the union of the Triton choices (the first record's config
    where two differ on a key, counted in ``notes``). ValueError when the fingerprints differ."""
    if not records:
        raise ValueError("no kernel choices to merge")
    merged = {**records[0], "triton": {}, "notes": list(records[0].get("notes") or [])}
    conflicts = 0
    for record in records:
        differences = fingerprint_differences(record.get("fingerprint") or {}, records[0].get("fingerprint") or {})
        if differences:
            raise ValueError(f"kernel choices of different machines cannot be merged: fingerprint.{differences[0][0]}")
        for kernel_key, entries in (record.get("triton") or {}).items():
            have = {json.dumps(e["key"]): e for e in merged["triton"].setdefault(kernel_key, [])}
            for entry in entries:
                known = have.get(json.dumps(entry["key"]))
                if known is None:
                    merged["triton"][kernel_key].append(entry)
                    have[json.dumps(entry["key"])] = entry
                elif normalized_config(known["config"]) != normalized_config(entry["config"]):
                    conflicts += 1
    if conflicts:
        merged["notes"].append(f"{conflicts} autotune key(s) chose different configs in different processes; "
                               f"the first process's choice is kept")
    return merged
