"""Shared pieces of the kernel benchmark: the case description and the timer.

Each ``bench_<op>.py`` beside this file defines ``cases(device) -> list[Case]``; ``run.py`` measures
the device's ceilings once, times every case's dslab and PyTorch callables interleaved, and prints
one table.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Case:
    """One benchmark row.

    ``dslab`` and ``torch`` are zero-argument callables doing the same work (forward, or forward and
    backward) with dslab's op and with the PyTorch equivalent. ``bytes_moved`` is the fewest bytes
    the work must read and write (for GB/s against the copy bandwidth); ``flops`` the floating-point
    operations it must do (for TFLOP/s against the matmul peak). ``target`` is the ratio
    torch_time / dslab_time the issue asks for. ``check_memory`` records each side's peak extra
    memory during one call.
    """

    op: str
    shape: str
    dslab: Callable[[], object]
    torch: Callable[[], object]
    bytes_moved: int | None = None
    flops: int | None = None
    target: float | None = None
    check_memory: bool = False
    notes: str = ""
    extra: dict = field(default_factory=dict)


def time_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 50) -> list[float]:
    """Per-call times in ms from CUDA events around each call (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def peak_extra_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak memory allocated during one call of ``fn`` beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return peak - before


def graph_time_ms(fn: Callable[[], object], iters: int = 30) -> list[float] | None:
    """Per-replay times in ms of ``fn`` captured once in a CUDA graph: the device time of its
    kernels without the host's launch overhead. None when ``fn`` cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # not capturable (host syncs, CPU-side state): no graph figure
        torch.cuda.synchronize()
        return None
    times = time_ms(graph.replay, warmup=3, iters=iters)
    del graph
    return times
