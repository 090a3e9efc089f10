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
