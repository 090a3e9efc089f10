"""Phase timers for ``wall_clock_breakdown``.

On CUDA each interval is a pair of events recorded on the current stream; intervals are resolved
only when asked (:meth:`PhaseTimers.collect`), and only those whose end event has completed, so
timing never adds a device synchronisation to the step. On CPU, where work is synchronous, the host
clock is exact.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from dslab.profilers.base import Profiler


def mark(cuda: bool):
    """A time mark: a CUDA event recorded on the current stream, or the host clock on a CPU."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_ms(cuda: bool, start, end) -> float:
    """Milliseconds between two :func:`mark` results (the end event must have completed)."""
    return start.elapsed_time(end) if cuda else (end - start) * 1e3


class PhaseTimers:
    """Named intervals (forward, backward, step, ...) measured without stalling the device."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self._open: dict[str, object] = {}
        self._pending: list[tuple[str, object, object]] = []
        self._done: dict[str, list[float]] = defaultdict(list)

    def start(self, name: str) -> None:
        if not self.enabled:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[name] = event
        else:
            self._open[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if not self.enabled or name not in self._open:
            return
        begin = self._open.pop(name)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((name, begin, end))
        else:
            self._done[name].append((time.perf_counter() - begin) * 1e3)

    def _resolve(self, wait: bool) -> None:
        still = []
        for name, begin, end in self._pending:
            if wait:
                end.synchronize()
            if end.query():
                self._done[name].append(begin.elapsed_time(end))
            else:
                still.append((name, begin, end))
        self._pending = still

    def collect(self, wait: bool = False) -> dict[str, list[float]]:
        """Milliseconds per completed interval since the last collect, by name, then forget them.

        ``wait=True`` waits for the outstanding intervals (one synchronisation, for a final report).
        """
        self._resolve(wait)
        done, self._done = dict(self._done), defaultdict(list)
        return done


class WallClockBreakdown(Profiler):
    """``wall_clock_breakdown``: forward, backward and optimizer-step times of every micro-step
    (CUDA events on GPU, resolved lazily), for the monitor and the run report."""

    section = "wall_clock"

    def __init__(self, device: torch.device):
        self.timers = PhaseTimers(device, enabled=True)
        self._history: dict[str, list[float]] = defaultdict(list)

    def on_forward_begin(self) -> None:
        self.timers.start("forward")

    def on_forward_end(self) -> None:
        self.timers.stop("forward")

    def on_backward_begin(self) -> None:
        self.timers.start("backward")

    def on_backward_end(self) -> None:
        self.timers.stop("backward")

    def on_optimizer_step_begin(self) -> None:
        self.timers.start("step")

    def on_optimizer_step_end(self) -> None:
        self.timers.stop("step")

    def collect(self, wait: bool = False) -> dict[str, list[float]]:
        """Intervals completed since the last collect (ms by phase); also kept for records()."""
        done = self.timers.collect(wait)
        for name, times in done.items():
            self._history[name].extend(times)
        return done

    def records(self) -> dict:
        self.collect(wait=True)
        out = {}
        for name, times in self._history.items():
            if times:
                ordered = sorted(times)
                out[name] = {"count": len(times), "mean_ms": sum(times) / len(times),
                             "median_ms": ordered[len(ordered) // 2], "min_ms": ordered[0], "max_ms": ordered[-1]}
        return {"phases": out, "timing": "CUDA events on the current stream" if self.timers.cuda else "host clock"}
