"""What dslab's storage I/O did, as events to observers: the bytes and seconds of every optimizer
swap and checkpoint file write, as :mod:`dslab.comm` reports collectives.

Producers (ZeRO's NVMe offload, the checkpoint writer) call :func:`emit` once per operation; an
observer registered with :func:`add_observer` gets ``on_io(event)``, from whichever thread
finished the operation. :class:`IoRecorder` is the observer behind the run report's
``profilers["io"]`` section of an engine run.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import asdict, dataclass, field

# Kinds of operation the engine emits.
SWAP_IN = "swap_in"          # optimizer states read from NVMe into pinned memory
SWAP_OUT = "swap_out"        # optimizer states written from pinned memory to NVMe
CHECKPOINT_WRITE = "checkpoint_write"  # one checkpoint file written through a handle

_observers: list = []
_lock = threading.Lock()


@dataclass
class IoEvent:
    """One operation: ``nbytes`` moved in ``seconds`` (submission to completion) to or from
    ``path``. ``wait_s`` is how long the caller blocked on it (a prefetch hidden behind compute
    shows a ``wait_s`` near 0); ``step`` the optimizer step when there is one."""

    kind: str
    path: str
    nbytes: int
    seconds: float
    wait_s: float | None = None
    step: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else None


def add_observer(observer) -> None:
    """Call ``observer.on_io(event)`` for every event from now on."""
    with _lock:
        _observers.append(observer)


def remove_observer(observer) -> None:
    with _lock:
        if observer in _observers:
            _observers.remove(observer)


def emit(event: IoEvent) -> None:
    with _lock:
        observers = list(_observers)
    for observer in observers:
        observer.on_io(event)


class IoRecorder:
    """Keeps every event (the last ``keep_events`` of them in full) and sums them by kind."""

    def __init__(self, keep_events: int = 2000):
        self.keep_events = keep_events
        self._events: list[IoEvent] = []
        self._totals: dict[str, dict] = {}
        self._lock = threading.Lock()

    def on_io(self, event: IoEvent) -> None:
        with self._lock:
            total = self._totals.setdefault(event.kind, {"count": 0, "bytes": 0, "seconds": 0.0,
                                                         "wait_s": 0.0, "gbps": []})
            total["count"] += 1
            total["bytes"] += event.nbytes
            total["seconds"] += event.seconds
            total["wait_s"] += event.wait_s or 0.0
            if event.gbps is not None:
                total["gbps"].append(event.gbps)
            self._events.append(event)
            if len(self._events) > self.keep_events:
                del self._events[0]

    def records(self) -> dict:
        """``{"operations": [per kind: count, bytes, seconds, GBps (bytes over summed
        seconds), median_GBps, min_GBps, max_GBps, wait_s], "events": [each kept event with its
        GBps]}``, JSON-serialisable, for ``report.profilers["io"][case]``."""
        with self._lock:
            operations = []
            for kind, total in self._totals.items():
                rates = sorted(total["gbps"])
                operations.append({
                    "kind": kind, "count": total["count"], "bytes": total["bytes"],
                    "seconds": total["seconds"],
                    "GBps": total["bytes"] / total["seconds"] / 1e9 if total["seconds"] > 0 else None,
                    "median_GBps": statistics.median(rates) if rates else None,
                    "min_GBps": rates[0] if rates else None,
                    "max_GBps": rates[-1] if rates else None,
                    "wait_s": total["wait_s"]})
            events = [dict(asdict(e), GBps=e.gbps) for e in self._events]
        return {"kind": "engine", "operations": operations, "events": events}
