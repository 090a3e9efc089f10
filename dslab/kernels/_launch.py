"""Launching a plain ``@triton.jit`` kernel without Triton's per-call Python.

Triton's launch path binds the arguments, computes each one's specialisation, builds the cache
key and looks the compiled kernel up on every call: ~80 us of host time per launch on a lent H100
host (torch 2.11, Triton 3.6), where calling the compiled kernel's launcher directly takes ~13 us
(:class:`dslab.kernels.attention.attention_triton.CachedLaunch`, which does this for autotuned
kernels). An eager step of short kernels is then host-bound: a Llama-3.2-1B prefill of 512 tokens
on one H200 issued 231 kernels in 11.5 ms for 2.2 ms of device work, its RMSNorm, rope and SwiGLU
launches taking ~80-120 us each.

:class:`FastJit` wraps a kernel and is indexed like it (``FAST[grid](*args, **kwargs)``, the same
arguments). The first call of each *specialisation key* goes through Triton; the compiled kernel is
then kept and later calls with that key launch it directly. The key holds what Triton specialises
a compiled kernel on, never less: the current device; each tensor's dtype and whether its address
is a multiple of 16; each int's width class (int32, int64, uint64), whether it is 1 and whether it
is a multiple of 16 (so that sizes and strides that differ only in value share the kernel, as in
Triton's own cache); bools, floats and None by kind; constexprs and launch options (``num_warps``,
``num_stages``) by value. Two calls with one key compile to one kernel in Triton as well, so the
kept kernel is the one Triton would have launched.

Calls go through Triton as before when the first tensor argument is not on a CUDA device (the
interpreter, CPU tensors), while a launch hook (a profiler such as Proton) is installed, and with
Triton versions whose compiled kernels lack the launcher interface (then for good).
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
from triton.runtime.jit import JITFunction

from dslab.kernels.dispatch import interpreting

CACHE_SIZE = 512
_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


def launch_hooks_active() -> bool:
    """Whether a Triton launch hook (a profiler such as Proton) is installed: launches then take
    Triton's own path, which calls the hooks."""
    if _RUNTIME_KNOBS is None:  # Triton before 3.4 kept the hooks on CompiledKernel
        return getattr(triton.compiler.CompiledKernel, "launch_enter_hook", None) is not None
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(_RUNTIME_KNOBS, name, None)
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def specialisation(value) -> object:
    """What of a runtime (non-constexpr) argument's value Triton may specialise a kernel on
    (module docstring): equal for two values only when Triton treats them alike."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if value is None:
        return None
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        width = 32 if _INT32[0] <= value <= _INT32[1] else 64 if _INT64[0] <= value <= _INT64[1] else 65
        return width, value == 1, value % 16 == 0
    if isinstance(value, float):
        return float
    return type(value), value


class FastJit:
    """A plain ``@triton.jit`` kernel, indexed and called as the kernel is (module docstring)."""

    instances: list["FastJit"] = []

    def __init__(self, kernel):
        if not hasattr(kernel, "__getitem__") or not hasattr(kernel, "arg_names"):
            raise TypeError(f"FastJit wraps a plain @triton.jit kernel, got {type(kernel).__name__}")
        self.kernel = kernel
        # Under TRITON_INTERPRET=1 triton.jit makes an interpreted function: always Triton's path.
        self.enabled = isinstance(kernel, JITFunction)
        self.names = list(kernel.arg_names)
        params = getattr(kernel, "params", None)
        if params:
            self.constexpr = [param.is_constexpr for param in params]
            self.defaults = {param.name: param.default for param in params if param.has_default}
        else:  # the interpreter's function: read the annotations of the kernel's Python function
            signature = inspect.signature(kernel.fn).parameters.values()
            self.constexpr = ["constexpr" in str(param.annotation) for param in signature]
            self.defaults = {param.name: param.default for param in signature if param.default is not param.empty}
        self.index = {name: i for i, name in enumerate(self.names)}
        self.entries: dict = {}
        FastJit.instances.append(self)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        constexpr = self.constexpr
        parts = [value if constexpr[i] else specialisation(value) for i, value in enumerate(args)]
        for name, value in kwargs.items():
            i = self.index.get(name)
            parts.append((name, value if i is None or constexpr[i] else specialisation(value)))
        return torch.cuda.current_device(), *parts

    def _launch(self, grid, *args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if not self.enabled or first is None or not first.is_cuda:
            return self.kernel[grid](*args, **kwargs)
        key = self._key(args, kwargs)
        entry = self.entries.get(key)
        if entry is None or launch_hooks_active():
            compiled = self.kernel[grid](*args, **kwargs)
            if entry is None and not interpreting():
                self._remember(key, compiled)
            return compiled
        run, function, metadata, stream = entry
        values = list(args)
        for name in self.names[len(args):]:
            values.append(kwargs[name] if name in kwargs else self.defaults[name])
        if callable(grid):
            grid = grid({name: value for name, value, is_constexpr in zip(self.names, values, self.constexpr)
                         if is_constexpr})
        grid_x = grid[0]
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        run(grid_x, grid_y, grid_z, stream(torch.cuda.current_device()), function, metadata, None, None, None,
            *values)
        return None

    def _remember(self, key: tuple, compiled) -> None:
        try:
            entry = (compiled.run, compiled.function, compiled.packed_metadata,
                     triton.runtime.driver.active.get_current_stream)
        except AttributeError:  # a Triton without this launcher interface: Triton's path from now on
            self.enabled = False
            return
        if len(self.entries) >= CACHE_SIZE:
            self.entries.clear()
        self.entries[key] = entry


def clear_fast_launch_caches() -> None:
    """Empty every :class:`FastJit`'s cache, so that the next call of each key goes through
    Triton's launch path again."""
    for launcher in FastJit.instances:
        launcher.entries.clear()
