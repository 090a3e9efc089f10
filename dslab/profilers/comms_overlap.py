"""How much of one step's gradient communication backward hid: phase marks, per-bucket spans, and
the interval arithmetic over them (the comms logger's ``records["overlap"]``).

The comms logger takes, on each micro-step, the phase marks of the compute stream and a span for
every collective tagged with a gradient bucket (``bucket=`` in :mod:`dslab.comm`), and keeps the
last micro-step that ran the optimizer (the profiled step: warmed up, and the one whose gradients
the optimizer waited for).

Phase marks (:data:`PHASES`)
    ``forward_begin`` (the micro-step's first forward), ``backward_begin``, ``backward_end``
    (autograd's backward has returned; the engine has not yet waited for the gradient
    reductions), ``optimizer_begin`` (after that wait), ``step_end``. On CUDA each is an event
    recorded on the current (compute) stream plus a host stamp; on a CPU the host clock
    (``time.perf_counter_ns``). Events are read at ``records()``, never inside the step.

Spans of a tagged collective
    ``issue`` is the host clock when the engine issued it. ``start``/``end``: on CUDA the comms
    logger's own events (start on the issuing stream when it reached the op, which NCCL's stream
    waits for, or the end of the group's previous collective when the op queued behind it
    (:mod:`dslab.profilers.comms_timing`); end when the op completed); on a CPU (gloo) the host
    clock at the issue and when the work handle's future completed (a blocking call: when it
    returned), so there a collective queued behind an earlier one counts its queueing from the
    issue.

The arithmetic is pure (:func:`summarize_overlap`): the dashboard's tests build records by hand.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch

#: the phase marks of a step, in the order they are taken
PHASES = ("forward_begin", "backward_begin", "backward_end", "optimizer_begin", "step_end")

OVERLAP_DEFINITIONS = (
    "Gradient communication of one step (the last micro-step that ran the optimizer), per rank "
    "on that rank's clock, in ms since the step's forward began. Phases: forward from "
    "forward_begin, backward from backward_begin to backward_end (autograd done, before the "
    "engine waits for the reductions), optimizer from optimizer_begin to step_end. Per bucket: "
    "issue_ms = host clock at the issue; start_ms/end_ms = device clock (CUDA events: the issuing "
    "stream reaching the op, or the end of the group's previous collective when it queued behind "
    "that one, and its completion) or, on gloo, host clock at the issue and at the "
    "completion of the work handle; comm_ms = end - start; overlapped_ms = the part inside "
    "[backward_begin, backward_end]; exposed_ms = the rest (after backward_end: what the "
    "optimizer step waited for). Totals are over the union of the buckets' spans (spans that "
    "queue behind each other overlap on gloo), so they are at most the sums of the rows."
)


class BucketSpan:
    """One tagged collective of the current step: its record, host issue time, and start/end
    (host ``perf_counter_ns`` on a CPU; on CUDA ``timing`` holds the logger's start/end events)."""

    __slots__ = ("record", "issue_ns", "start_ns", "end_ns", "timing")

    def __init__(self, record: dict, issue_ns: int, timing=None):
        self.record, self.issue_ns, self.timing = record, issue_ns, timing
        self.start_ns = issue_ns if timing is None else None
        self.end_ns: int | None = None


class StepMarks:
    """The phase marks and bucket spans of one micro-step, as taken (read by :meth:`resolve`)."""

    __slots__ = ("step", "cuda", "host_ns", "events", "spans")

    def __init__(self, step: int | None, cuda: bool):
        self.step, self.cuda = step, cuda
        self.host_ns: dict[str, int] = {}
        self.events: dict[str, torch.cuda.Event] = {}
        self.spans: list[BucketSpan] = []

    def mark(self, phase: str) -> None:
        """Take ``phase``'s mark unless this step has it already (a step's first forward counts)."""
        if phase in self.host_ns:
            return
        self.host_ns[phase] = time.perf_counter_ns()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[phase] = event

    @property
    def complete(self) -> bool:
        """Whether the step ran backward and the optimizer, and reduced at least one bucket."""
        return bool(self.spans) and all(p in self.host_ns for p in ("backward_begin", "backward_end",
                                                                     "optimizer_begin"))

    def resolve(self) -> dict:
        """The overlap record (:func:`summarize_overlap`); on CUDA waits for the step's last
        phase event (call it at ``records()`` time, after the logger has read its own events)."""
        origin = min(self.host_ns, key=self.host_ns.get)
        host0 = self.host_ns[origin]
        host_ms = {p: (ns - host0) / 1e6 for p, ns in self.host_ns.items()}
        calls = []
        if self.cuda:
            last = max(self.events, key=lambda p: self.host_ns[p])
            self.events[last].synchronize()
            first = self.events[origin]
            phases_ms = {p: first.elapsed_time(e) for p, e in self.events.items()}
        else:
            phases_ms = dict(host_ms)
        for span in self.spans:
            start = end = None
            if span.timing is not None:
                if span.timing.end is not None and span.timing.end.query():
                    start = first.elapsed_time(span.timing.began())
                    end = first.elapsed_time(span.timing.end)
            elif span.end_ns is not None:
                start, end = (span.start_ns - host0) / 1e6, (span.end_ns - host0) / 1e6
            r = span.record
            calls.append({"bucket": r.get("bucket"), "op": r["op"], "bytes": r["bytes"], "group": r["group"],
                          "seq": r["seq"], "issue_ms": (span.issue_ns - host0) / 1e6,
                          "start_ms": start, "end_ms": end})
        return summarize_overlap(phases_ms, host_ms, calls, clock="cuda_events" if self.cuda else "host",
                                 step=self.step)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _inside(lo: float, hi: float, window: tuple[float, float]) -> float:
    return max(0.0, min(hi, window[1]) - max(lo, window[0]))


def summarize_overlap(phases_ms: Mapping[str, float], host_phases_ms: Mapping[str, float],
                      calls: Iterable[Mapping], clock: str, step: int | None = None) -> dict:
    """The overlap record of one step on one rank.

    ``phases_ms``: :data:`PHASES` marks on the clock the spans use (device, or host on a CPU);
    ``host_phases_ms``: the same marks on the host clock the issue times use; ``calls``: per
    tagged collective ``{"bucket", "op", "bytes", "group", "seq", "issue_ms", "start_ms",
    "end_ms"}`` (start/end None when untimed). Returns ``{"step", "clock", "phases_ms",
    "host_phases_ms", "buckets": [call + comm_ms, overlapped_ms, exposed_ms], "totals": {"buckets",
    "bytes", "comm_ms", "overlapped_ms", "exposed_ms", "backward_ms"}}``; see
    :data:`OVERLAP_DEFINITIONS`. Raises ValueError when a backward mark is missing.
    """
    missing = [p for p in ("backward_begin", "backward_end") if p not in phases_ms]
    if missing:
        raise ValueError(f"overlap: phase marks {', '.join(missing)} missing")
    window = (phases_ms["backward_begin"], phases_ms["backward_end"])
    buckets, spans = [], []
    for call in calls:
        row = dict(call)
        start, end = call.get("start_ms"), call.get("end_ms")
        if start is None or end is None:
            row.update(comm_ms=None, overlapped_ms=None, exposed_ms=None)
        else:
            comm_ms = max(0.0, end - start)
            overlapped = _inside(start, end, window)
            row.update(comm_ms=comm_ms, overlapped_ms=overlapped, exposed_ms=comm_ms - overlapped)
            spans.append((start, end))
        buckets.append(row)
    busy = _union(spans)
    comm_ms = sum(hi - lo for lo, hi in busy)
    overlapped = sum(_inside(lo, hi, window) for lo, hi in busy)
    return {
        "step": step,
        "clock": clock,
        "phases_ms": {p: phases_ms[p] for p in PHASES if p in phases_ms},
        "host_phases_ms": {p: host_phases_ms[p] for p in PHASES if p in host_phases_ms},
        "buckets": buckets,
        "totals": {"buckets": len(buckets), "bytes": sum(b["bytes"] for b in buckets),
                   "comm_ms": comm_ms, "overlapped_ms": overlapped, "exposed_ms": comm_ms - overlapped,
                   "backward_ms": window[1] - window[0]},
    }
