"""One CUDA collective's timing for the comms logger: its CUDA events, and the op queued ahead
of it on the same NCCL stream; and the reference that puts those events on the wall clock.

The logger's start event is recorded on the issuing stream when it reaches the op: the moment
the op could begin as far as the issuer is concerned. NCCL runs a process group's collectives
on one stream of its own, in issue order, so an op issued while an earlier one of the same group
still runs waits behind it: a reduce-scatter issued right after the previous one (ZeRO's gradient
buckets at the end of a graphed backward), or the parameter all-gathers issued back to back after
a step. Timed from its start event, each such op would carry the time of every op ahead of it, and
its bus bandwidth would read as a fraction of the link's.

So each timing keeps the one issued just before it on the same stream (:func:`stream_key`), and
:meth:`CudaTiming.began` is the later of its start event and that op's end: the op ran from
``began()`` to its end. What is left in the latency is the op's own run and its wait for the
other ranks to arrive (the straggler analysis's subject), as nccl-tests would see it. Ops with a
stream of their own per peer (send, recv) are not chained.
"""

from __future__ import annotations

import time

import torch

#: ops ProcessGroupNCCL runs on a stream per peer, not on the group's collective stream
PER_PEER_OPS = frozenset({"send", "recv"})


def stream_key(op: str, group: str, device: int) -> tuple | None:
    """The NCCL stream a collective of ``op`` on process group ``group`` (its name) runs on, on
    CUDA device ``device``; None for per-peer ops, which are not chained."""
    if op in PER_PEER_OPS:
        return None
    return (group, device)


class CudaTiming:
    """``record``'s start and end CUDA events, the clock reference ``ref`` the logger puts its
    arrival on the wall clock with, and ``behind``: the timing of the op issued before it on the
    same stream (None: the first, or not chained)."""

    __slots__ = ("record", "start", "end", "ref", "behind", "_began")

    def __init__(self, record: dict, start, ref, behind: "CudaTiming | None" = None):
        self.record, self.start, self.end, self.ref = record, start, None, ref
        self.behind = behind
        self._began = None

    def began(self):
        """The event the op began running at: its start event, or the end event of the op ahead
        of it on the stream when that fired later (and before this op's end). Call once this op's end has fired (the op
        ahead has then ended too). Drops the link to the op ahead, so a chain of timings does not
        outlive the ones still unread."""
        if self._began is None:
            began = self.start
            ahead = self.behind
            # The op ahead's end event of an async op is recorded on a pool stream that waits for
            # its completion, so it can fire a few microseconds after this op's own end when this
            # op is tiny; then the two cannot be told apart and the start event stands.
            if (ahead is not None and ahead.end is not None and self.start.elapsed_time(ahead.end) > 0
                    and ahead.end.elapsed_time(self.end) > 0):
                began = ahead.end
            self._began = began
            self.behind = None
        return self._began

    def latency_ms(self) -> float:
        """Milliseconds from :meth:`began` to the end event (which must have fired)."""
        return self.began().elapsed_time(self.end)


class CudaClock:
    """Per CUDA device, a reference ``(event, wall_ns)``: an event recorded on an idle private
    stream and the wall-clock time it fired, the midpoint of the tightest of three host brackets
    around it. An event's wall time is ``wall_ns + ref_event.elapsed_time(event)``."""

    def __init__(self):
        self._refs: dict[int, tuple] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}

    def reference(self, device: int) -> tuple:
        """Device ``device``'s reference, taken on first use."""
        ref = self._refs.get(device)
        if ref is None:
            ref = self._refs[device] = self._calibrate(device)
        return ref

    def recalibrate(self) -> None:
        """Take every device's reference again (the device and host clocks drift apart)."""
        for device in list(self._refs):
            self._refs[device] = self._calibrate(device)

    def _calibrate(self, device: int) -> tuple:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        best = None
        for _ in range(3):
            event = torch.cuda.Event(enable_timing=True)
            before = time.time_ns()
            event.record(stream)
            event.synchronize()
            after = time.time_ns()
            if best is None or after - before < best[2]:
                best = (event, (before + after) // 2, after - before)
        return best[0], best[1]
