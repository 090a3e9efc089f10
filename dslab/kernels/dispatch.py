"""Run-time choice between an op's Triton kernel and its PyTorch reference.

The backend is one of:

- ``auto`` (default): Triton when Triton imports and every tensor is on a CUDA device, else the
  reference.
- ``torch``: always the reference. This is the ``torch`` arm of a benchmark.
- ``triton``: always Triton; on CPU tensors this needs ``TRITON_INTERPRET=1`` (the interpreter the
  CPU tests use) and is an error otherwise.

It is read from ``DSLAB_KERNELS`` at first use; :func:`set_backend` (the engine's ``kernels``
config field) and the :func:`kernel_backend` context manager override it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "DSLAB_KERNELS"

_override: str | None = None


def _validate(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}={name!r} is not a kernel backend; choose one of {', '.join(BACKENDS)}")
    return name


def backend() -> str:
    """The backend in force: the override if set, else ``DSLAB_KERNELS``, else ``auto``."""
    if _override is not None:
        return _override
    return _validate(os.environ.get(ENV_VAR, "auto") or "auto", ENV_VAR)


def set_backend(name: str | None) -> None:
    """Force a backend for the whole process (None goes back to ``DSLAB_KERNELS``)."""
    global _override
    _override = None if name is None else _validate(name, "kernels")


@contextlib.contextmanager
def kernel_backend(name: str):
    """Use ``name`` as the backend inside the block."""
    global _override
    previous = _override
    _override = _validate(name, "kernels")
    try:
        yield
    finally:
        _override = previous


_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_AVAILABLE


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel should run on these tensors."""
    chosen = backend()
    if chosen == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if chosen == "auto":
        return on_cuda and triton_available()
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton is not installed (pip install triton)")
    if not on_cuda and not interpreting():
        raise RuntimeError(
            f"{ENV_VAR}=triton on CPU tensors needs TRITON_INTERPRET=1 (the Triton interpreter)"
        )
    return True


def planned_backend(device: torch.device | str | None = None) -> str:
    """Which implementation ops will run on ``device`` ("triton" or "torch"), for ``dslab env``."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = backend()
    if chosen == "torch":
        return "torch"
    is_cuda = torch.device(device).type == "cuda"
    if chosen == "auto":
        return "triton" if is_cuda and triton_available() else "torch"
    return "triton" if triton_available() and (is_cuda or interpreting()) else "unavailable"


DEPENDENT_LAUNCH_ENV = "DSLAB_DEPENDENT_LAUNCH"
#: ``DSLAB_DEPENDENT_LAUNCH``'s values: on for every decode launch, off, or on for one-row launches
#: (batch-1 decode steps) only, the default.
DEPENDENT_LAUNCH_MODES = ("1", "0", "auto")
_dependent_override: bool | str | None = None
_dependent_supported: dict[int, bool] = {}


def set_dependent_launch(enabled: bool | str | None) -> None:
    """Turn programmatic dependent launch of the decode kernels on (True), off (False) or to
    one-row launches only (``"auto"``) for the whole process (None goes back to
    ``DSLAB_DEPENDENT_LAUNCH``)."""
    global _dependent_override
    if enabled not in (True, False, None, "auto"):
        raise ValueError(f"set_dependent_launch: give True, False, 'auto' or None, got {enabled!r}")
    _dependent_override = enabled


@contextlib.contextmanager
def dependent_launches(enabled: bool | str):
    """Programmatic dependent launch of the decode kernels on (or off, or ``"auto"``) inside the
    block; a CUDA graph captured inside keeps it."""
    global _dependent_override
    previous, _dependent_override = _dependent_override, enabled if enabled == "auto" else bool(enabled)
    try:
        yield
    finally:
        _dependent_override = previous


def _dependent_launch_wanted(rows: int | None = None) -> bool:
    """Whether a launch over ``rows`` rows (None: not known) is asked to be dependent: on, off, or
    ``auto``'s one row."""
    if _dependent_override is not None:
        mode = _dependent_override
    else:
        value = os.environ.get(DEPENDENT_LAUNCH_ENV, "auto") or "auto"
        if value not in DEPENDENT_LAUNCH_MODES:
            raise ValueError(f"{DEPENDENT_LAUNCH_ENV}={value!r}: give 1 (on), 0 (off) or auto (one-row launches)")
        mode = {"1": True, "0": False}.get(value, value)
    return rows == 1 if mode == "auto" else mode


def dependent_launch(device: torch.device, rows: int | None = None) -> bool:
    """Whether a decode kernel (:mod:`dslab.kernels.decode`) over ``rows`` rows on ``device``
    launches with programmatic dependent launch: asked for (``DSLAB_DEPENDENT_LAUNCH``,
    :func:`set_dependent_launch` or :func:`dependent_launches`: ``1`` on, ``0`` off, ``auto``, the
    default, on for one-row launches, the batch-1 decode step's), on a CUDA device of compute
    capability 9.0 or later (Hopper), with a Triton that has grid dependency control
    (``tl.extra.cuda.gdc_wait``), and not under the interpreter. Such a launch may start while the
    kernel before it on the stream still runs: each kernel then waits (``gdc_wait``) before it
    touches anything an earlier kernel writes, and may read what none writes (its weights) first.
    ``auto``'s choice is measured (``benchmarks/decode_profile.py --dependent-launch`` on an H200,
    Llama-3.2-1B): the batch-1 step of persistent one-row kernels is faster with it, the 8-row
    step of tensor-core tiles slower."""
    if not _dependent_launch_wanted(rows) or interpreting() or torch.device(device).type != "cuda":
        return False
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _dependent_supported:
        try:
            from triton.language.extra import cuda as triton_cuda
            has_gdc = hasattr(triton_cuda, "gdc_wait") and hasattr(triton_cuda, "gdc_launch_dependents")
        except ImportError:
            has_gdc = False
        _dependent_supported[index] = has_gdc and torch.cuda.get_device_capability(index)[0] >= 9
    return _dependent_supported[index]


def use_custom_op() -> bool:
    """True when a Triton op should go through its registered ``torch.library`` custom op rather
    than the leaner eager ``autograd.Function``: while ``torch.compile`` traces, and while a
    dispatch mode is active (the flops profiler counts ops at the dispatcher, where the eager
    Function's direct Triton launches would be invisible). One cheap check per call."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


# Open graphed_launches() blocks, in any thread: the warm-up runs and the capture of a CUDA graph
# run their backward on autograd's worker thread too.
_graphed_depth = 0


@contextlib.contextmanager
def graphed_launches():
    """Launches in this block go into a CUDA graph or rehearse one (:mod:`dslab.models.graphs`
    wraps the warm-up runs before a capture and the capture itself): a kernel whose launch plan
    trades the host's time for the device's picks the device's side, as
    :func:`launches_graphed` says, the same in the rehearsals (which autotune and compile it) as
    in the capture."""
    global _graphed_depth
    _graphed_depth += 1
    try:
        yield
    finally:
        _graphed_depth -= 1


def launches_graphed() -> bool:
    """Inside :func:`graphed_launches`, or while the current CUDA stream is capturing."""
    return _graphed_depth > 0 or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
