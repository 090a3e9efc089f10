"""Per-module device time: the time the device spent in the kernels each module ran, forward and
backward, read from the device's own activity records rather than from timers around the host's
calls.

Why: timers around a module's call (CUDA events recorded by its hooks) measure the stream's time
between the two marks, and on a step the host cannot keep ahead of (an eager step with hooks and
Python-launched kernels) that time is mostly the device waiting for the host. Two layers of the
same shape then read 5 ms and 10 ms, and a model at 41% MFU in its steady state reads 7%. The
kernels' own durations do not depend on how late they were launched.

How (:class:`ModuleDeviceTimer`): one step runs under ``torch.profiler`` (CUPTI activity on CUDA)
with a ``record_function`` range around every module's forward (pushed and popped by forward
hooks) and one around the optimizer step. Each kernel is traced back to the host call that
launched it (the profiler's correlation ids), and charged:

* in the forward, to every module whose range encloses the launch;
* in the backward, through the autograd node whose ``evaluate_function`` range encloses the launch:
  the node's sequence number names the forward op that created it, and that op's place in the
  forward's module ranges names the modules (the same attribution as the flops profiler's);
* to the optimizer, inside its range; everything else is ``unattributed`` (the loss outside any
  module, gradient accumulation into ``.grad``, copies issued by the engine).

On a CPU the "kernels" are the host ops' self times (an op's duration less its children's, without
the Python between ops), so the same code runs and is tested without a GPU.

What it cannot do: the hooks make a model that replays CUDA graphs run eagerly for the timed step
(the graph's kernels carry no module), so the figures are those of the eager kernels. The records
say so (``mode``), and put the step's busy time beside the steady-state step time where the caller
knows it, so the reader sees how far the timed step is from the steady state.

Kineto writes a line to the process's standard error at every profiler start and stop
(``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start``), past ``sys.stderr``, and the only
``KINETO_LOG_LEVEL`` that hides them hides its errors too. The timer starts and stops the profiler
with file descriptor 2 sent to a temporary file and writes back every line but those two.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn

MODULE_RANGE = "dslab.module::"
KINETO_MARKER = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$")
PHASE_RANGE = "dslab.phase::"
BACKWARD_RANGE = "autograd::engine::evaluate_function: "


@dataclass(frozen=True)
class Activity:
    """One timed record from the profiler, reduced to what attribution needs.

    ``kind``: ``"range"`` (a host-side op, annotation or autograd node: ``tid``, ``start_ns``,
    ``end_ns``, ``name``, ``sequence_nr``, ``fwd_tid``, ``op_id``), ``"launch"`` (a CUDA runtime
    or driver call: ``tid``, ``start_ns``, ``correlation``) or ``"work"`` (a kernel, copy or set on
    the device, or an innermost op on a CPU: ``start_ns``, ``end_ns``, and how to find its launch:
    ``op_id`` of the enclosing host op, else ``correlation`` of the runtime call, else its own
    ``tid`` and ``start_ns``)."""

    kind: str
    name: str = ""
    tid: int = 0
    start_ns: int = 0
    end_ns: int = 0
    sequence_nr: int = -1
    fwd_tid: int = 0
    op_id: int = 0
    correlation: int = 0


class _Nest:
    """Properly nested intervals of one thread; :meth:`enclosing` lists those containing a time,
    innermost first."""

    def __init__(self, intervals: list[tuple[int, int, object]]):
        intervals = sorted(intervals, key=lambda iv: (iv[0], -iv[1]))
        self.starts = [iv[0] for iv in intervals]
        self.intervals = intervals
        self.parent: list[int] = []
        stack: list[int] = []
        for i, (start, end, _) in enumerate(intervals):
            while stack and intervals[stack[-1]][1] < end:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def enclosing(self, t: int) -> list[object]:
        i = bisect.bisect_right(self.starts, t) - 1
        found = []
        while i >= 0:
            start, end, payload = self.intervals[i]
            if start <= t <= end:
                found.append(payload)
            i = self.parent[i]
        return found


def _by_thread(items: list[tuple[int, int, int, object]]) -> dict[int, _Nest]:
    grouped: dict[int, list] = defaultdict(list)
    for tid, start, end, payload in items:
        grouped[tid].append((start, end, payload))
    return {tid: _Nest(intervals) for tid, intervals in grouped.items()}


def _union_ms(intervals: list[tuple[int, int]]) -> float:
    busy, cursor = 0, None
    for start, end in sorted(intervals):
        if cursor is None or start > cursor:
            busy += end - start
            cursor = end
        elif end > cursor:
            busy += end - cursor
            cursor = end
    return busy / 1e6


def attribute(activities: list[Activity], serial: bool = False) -> dict:
    """Charge every work record to modules, phases or ``unattributed`` (module docstring).

    Returns ``{"modules": {name: {"forward_ms", "backward_ms"}}, "optimizer_ms",
    "unattributed_ms": {"forward", "backward"}, "work_ms", "busy_ms", "span_ms", "records"}``:
    module figures are inclusive of their submodules; ``work_ms`` sums every record's duration,
    ``busy_ms`` is the time at least one ran (overlaps counted once), ``span_ms`` runs from the
    first start to the last end. ``serial`` (a CPU's self-time records, whose intervals are not
    where the work ran) makes ``busy_ms`` the sum of the records."""
    ranges = [a for a in activities if a.kind == "range"]
    ops_by_id = {a.op_id: a for a in ranges if a.op_id}
    launches = {a.correlation: a for a in activities if a.kind == "launch" and a.correlation}
    work = [a for a in activities if a.kind == "work"]

    modules = _by_thread([(a.tid, a.start_ns, a.end_ns, a.name[len(MODULE_RANGE):])
                          for a in ranges if a.name.startswith(MODULE_RANGE)])
    phases = _by_thread([(a.tid, a.start_ns, a.end_ns, a.name[len(PHASE_RANGE):])
                         for a in ranges if a.name.startswith(PHASE_RANGE)])
    nodes = _by_thread([(a.tid, a.start_ns, a.end_ns, a) for a in ranges if a.name.startswith(BACKWARD_RANGE)])
    # Where each forward op that recorded an autograd node ran: (its thread, its sequence number).
    anchors: dict[tuple[int, int], int] = {}
    for a in ranges:
        if a.sequence_nr < 0 or a.name.startswith(BACKWARD_RANGE):
            continue
        nest = nodes.get(a.tid)
        if nest is not None and nest.enclosing(a.start_ns):
            continue  # an op inside a backward node (double backward, recomputation)
        anchors.setdefault((a.tid, a.sequence_nr), a.start_ns)

    per_module: dict[str, dict[str, float]] = defaultdict(lambda: {"forward_ms": 0.0, "backward_ms": 0.0})
    optimizer_ns = 0
    unattributed = {"forward": 0, "backward": 0}
    for w in work:
        duration = w.end_ns - w.start_ns
        origin = ops_by_id.get(w.op_id) if w.op_id else None
        if origin is None and w.correlation:
            origin = launches.get(w.correlation)
        tid, t = (origin.tid, origin.start_ns) if origin is not None else (w.tid, w.start_ns)
        phase = phases.get(tid)
        if phase is not None and "optimizer" in phase.enclosing(t):
            optimizer_ns += duration
            continue
        node_nest = nodes.get(tid)
        node_hits = node_nest.enclosing(t) if node_nest is not None else []
        if node_hits:
            node = node_hits[-1]  # the outermost: the node the engine is evaluating
            anchor = anchors.get((node.fwd_tid, node.sequence_nr)) if node.sequence_nr >= 0 else None
            nest = modules.get(node.fwd_tid)
            names = nest.enclosing(anchor) if anchor is not None and nest is not None else []
            key, bucket = "backward_ms", "backward"
        else:
            nest = modules.get(tid)
            names = nest.enclosing(t) if nest is not None else []
            key, bucket = "forward_ms", "forward"
        if not names:
            unattributed[bucket] += duration
        for name in set(names):
            per_module[name][key] += duration / 1e6

    intervals = [(w.start_ns, w.end_ns) for w in work]
    return {
        "modules": {name: dict(v) for name, v in per_module.items()},
        "optimizer_ms": optimizer_ns / 1e6,
        "unattributed_ms": {k: v / 1e6 for k, v in unattributed.items()},
        "work_ms": sum(e - s for s, e in intervals) / 1e6,
        "busy_ms": sum(e - s for s, e in intervals) / 1e6 if serial else _union_ms(intervals),
        "span_ms": (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e6 if intervals else 0.0,
        "records": len(work),
    }


_RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...


def _activity_kind(e) -> str:
    """``cpu_op``, ``user_annotation``, ``cuda_runtime``, ``kernel`` or ``gpu_user_annotation``:
    the event's own ``activity_type()`` where torch has it, else read from its device, annotation
    flag and name (torch 2.11's events have no ``activity_type``)."""
    kind = getattr(e, "activity_type", None)
    if kind is not None:
        return kind()
    annotation = bool(getattr(e, "is_user_annotation", lambda: False)())
    if e.device_type() != torch.autograd.DeviceType.CPU:
        return "gpu_user_annotation" if annotation else "kernel"
    if annotation:
        return "user_annotation"
    return "cuda_runtime" if _RUNTIME_CALL.match(e.name()) else "cpu_op"


def activities_from_profile(events, device_type: str) -> list[Activity]:
    """:class:`Activity` records from ``torch.profiler``'s kineto events (``prof.profiler.
    kineto_results.events()``). ``device_type`` "cuda" takes the device records as work; "cpu"
    takes each host op's self time (see :func:`_self_times`)."""
    activities: list[Activity] = []
    host_ops: list = []
    _collect(events, device_type, activities, host_ops)
    if device_type == "cpu":
        activities.extend(_self_times(host_ops))
    return activities


def _collect(events, device_type: str, activities: list[Activity], host_ops: list) -> None:
    """:func:`activities_from_profile`'s pass over ``events``, appending to ``activities`` (and the
    host ops, for their self times on a CPU, to ``host_ops``)."""
    for e in events:
        kind = _activity_kind(e)
        if kind in ("cpu_op", "user_annotation"):
            host_ops.append(e)
            activities.append(Activity(
                "range", e.name(), e.start_thread_id(), e.start_ns(), e.end_ns(), e.sequence_nr(),
                e.fwd_thread_id(), e.correlation_id(),
            ))
        elif kind in ("cuda_runtime", "cuda_driver"):
            if device_type == "cuda":
                activities.append(Activity("launch", e.name(), e.start_thread_id(), e.start_ns(), e.end_ns(),
                                           correlation=e.correlation_id()))
        elif device_type == "cuda" and kind in ("kernel", "gpu_memcpy", "gpu_memset"):
            activities.append(Activity("work", e.name(), 0, e.start_ns(), e.end_ns(),
                                       op_id=e.linked_correlation_id(), correlation=e.correlation_id()))


def _self_times(host_ops) -> list[Activity]:
    """Every host op's self time (its duration less its direct children's) as a work record at
    its start: what a CPU spent in each op, without the Python between ops."""
    ops = [e for e in host_ops if _activity_kind(e) == "cpu_op"]
    by_thread: dict[int, list] = defaultdict(list)
    for e in ops:
        by_thread[e.start_thread_id()].append(e)
    work = []
    for tid, items in by_thread.items():
        items.sort(key=lambda e: (e.start_ns(), -e.end_ns()))
        children_ns = [0] * len(items)
        stack: list[int] = []
        for i, e in enumerate(items):
            while stack and items[stack[-1]].end_ns() <= e.start_ns():
                stack.pop()
            if stack:
                children_ns[stack[-1]] += e.end_ns() - e.start_ns()
            stack.append(i)
        for e, inner in zip(items, children_ns):
            own = max(0, e.end_ns() - e.start_ns() - inner)
            work.append(Activity("work", e.name(), tid, e.start_ns(), e.start_ns() + own, op_id=e.correlation_id()))
    return work


@contextlib.contextmanager
def without_kineto_markers():
    """Run the block with file descriptor 2 sent to a temporary file, then write back to it every
    line written there but kineto's profiler start/stop markers (:data:`KINETO_MARKER`)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no descriptor 2 to borrow: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().splitlines(keepends=True) if not KINETO_MARKER.match(line)]
            if kept:
                os.write(2, b"".join(kept))


@dataclass
class ModuleDeviceTimer:
    """Times one stretch of work on ``model`` (a training step) by device activity.

    ``start()`` hooks every module and starts ``torch.profiler``; ``phase("optimizer")`` /
    ``phase(None)`` bracket the optimizer step; ``stop()`` stops both and returns
    :func:`attribute`'s figures (module names as in ``named_modules``, the root ``""``).
    ``hooks=False`` adds no hooks: the step runs as every unprofiled step does (CUDA graphs
    replayed), and only the totals (``busy_ms``, ``work_ms``, ``span_ms``) mean anything."""

    model: nn.Module
    hooks: bool = True
    _handles: list = field(default_factory=list)
    _open: list = field(default_factory=list)
    _phase = None
    _profile = None

    def start(self) -> None:
        if self._profile is not None:
            raise RuntimeError("ModuleDeviceTimer.start called twice without stop")
        device = next((t.device for t in (*self.model.parameters(), *self.model.buffers())), torch.device("cpu"))
        self.device_type = "cuda" if device.type == "cuda" else "cpu"
        for name, module in self.model.named_modules() if self.hooks else ():
            self._handles.append(module.register_forward_pre_hook(self._enter(MODULE_RANGE + name)))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(device)
        self._profile = torch.profiler.profile(activities=activities)
        with without_kineto_markers():
            self._profile.__enter__()

    def _enter(self, label: str):
        def pre_hook(module, args):
            if not torch._C._autograd._profiler_enabled():
                return
            fn = torch.autograd.profiler.record_function(label)
            fn.__enter__()
            self._open.append(fn)
        return pre_hook

    def _exit(self, module, args, output):
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def phase(self, name: str | None) -> None:
        if self._profile is None:
            return
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None
        if name is not None:
            self._phase = torch.autograd.profiler.record_function(PHASE_RANGE + name)
            self._phase.__enter__()

    @property
    def running(self) -> bool:
        return self._profile is not None

    def stop(self) -> dict:
        """Stop profiling and remove the hooks (whatever happens), then attribute."""
        return self.attribute_profile(self.stop_profiling())

    def stop_profiling(self):
        """Stop profiling and remove the hooks (whatever happens); returns the stopped profile
        for :meth:`attribute_profile`, which may run later and on another thread (the
        profiler must be stopped on the thread that started it)."""
        if self._profile is None:
            raise RuntimeError("ModuleDeviceTimer.stop called before start")
        try:
            self.phase(None)
            while self._open:
                self._open.pop().__exit__(None, None, None)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            profile, self._profile = self._profile, None
            if self.device_type == "cuda":
                torch.cuda.synchronize()
            with without_kineto_markers():
                profile.__exit__(None, None, None)
        return profile

    def attribute_profile(self, profile) -> dict:
        """:func:`attribute`'s figures of a profile :meth:`stop_profiling` returned: a Python pass
        over every record (~70 ms of host time for a GPT-2 124M step's ~7,000 records)."""
        steps = self.attribution_steps(profile)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def attribution_steps(self, profile, chunk: int = 256):
        """:meth:`attribute_profile` in pieces: a generator that yields after reading the
        records and after each ``chunk`` of them (a few milliseconds each), and returns the
        figures, so that a caller can spread the work over the host's idle time."""
        events = profile.profiler.kineto_results.events()
        activities: list[Activity] = []
        host_ops: list = []
        for start in range(0, len(events), chunk):
            yield
            _collect(events[start:start + chunk], self.device_type, activities, host_ops)
        yield
        if self.device_type == "cpu":
            activities.extend(_self_times(host_ops))
        return attribute(activities, serial=self.device_type == "cpu")
