"""Autotuned Triton kernels for ``test_pinning.py``, held as dslab's kernel modules hold theirs: a
module attribute (:data:`scale`) and an unbounded ``functools.cache`` factory
(:func:`scale_for`).

Under the interpreter there is no device to time configs on, so the autotuners benchmark with
:func:`scripted_bench`: it runs the config's launch and returns the next time of :data:`TIMES`
(in candidate order), so that a test decides which config wins, and it counts its calls in
:data:`BENCH_CALLS`. Every config computes the same ``y = x * factor``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

TIMES: list[float] = []
BENCH_CALLS: list[float] = []


def scripted_bench(kernel_call, quantiles):
    kernel_call()
    time_ms = TIMES.pop(0)
    BENCH_CALLS.append(time_ms)
    return [time_ms] * len(quantiles)


@triton.jit
def _scale_kernel(X, Y, n, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(Y + offsets, tl.load(X + offsets, mask=inside) * factor, mask=inside)


scale = triton.autotune(
    configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)],
    key=["n"], do_bench=scripted_bench,
)(_scale_kernel)


@functools.cache
def scale_for(width: int, wide_warps: bool = False):
    """An autotuner over a 16-wide block and a ``width``-wide one, made once per arguments."""
    configs = [triton.Config({"BLOCK": 16}, num_warps=1),
               triton.Config({"BLOCK": width}, num_warps=4 if wide_warps else 2)]
    return triton.autotune(configs=configs, key=["n"], do_bench=scripted_bench)(_scale_kernel)


def run(kernel, x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor`` by ``kernel`` (one of the autotuners above)."""
    y = torch.empty_like(x)
    kernel[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel(), factor)
    return y


def reset() -> None:
    """Forget every choice and scripted time (a test's own start)."""
    scale.cache.clear()
    scale_for.cache_clear()
    TIMES.clear()
    BENCH_CALLS.clear()
