"""The comms logger: every collective dslab issues, with its size, group, latency and bandwidth,
and who made whom wait. DeepSpeed's ``comms_logger`` section, measured without stalling the device.

It observes :mod:`dslab.comm` (``before(call)`` just before an op is issued on the current stream,
``after(call, work)`` right after, ``replayed(call)`` after a replay of a CUDA graph that holds it)
and never synchronises per op.

Latency of one call
    CUDA (NCCL). A start event is recorded on the current stream in ``before()``; NCCL's stream
    waits on the current stream before the kernel runs, so the start marks when the op could
    begin. The end event:

    * blocking op: when ``torch.distributed`` returns, the current stream already waits on NCCL's
      stream, so an end event recorded on the current stream in ``after()`` fires with the op;
    * async op: the current stream must not be made to wait (that would undo the overlap the
      caller asked for), and ``work.wait()`` on a private stream is unsafe: it releases the
      tensors ProcessGroupNCCL stashes for allocator safety, so memory the caller drops before its
      own ``wait()`` could be reused under the running kernel. The end event is recorded inside
      ``work.get_future().then(...)`` instead: torch runs that callback with a pool stream set
      current that waits on the op's completion events (``torch.futures.Future.then``), and
      NCCL's future is complete at launch, so the callback runs at once on this thread and the
      event fires when the op completes. Only that pool stream waits.

    The latency runs from the later of the start event and the end of the op issued before it on
    the same NCCL stream (the same process group), so an op that queued behind another is not
    charged with the other's time (:mod:`dslab.profilers.comms_timing`).

    Events are read later: completed ones at ``on_step_end`` (``query()``, non-blocking), the
    rest at ``records()`` / ``log_summary()``, which wait for those end events only.

    CUDA graphs. A call issued while a CUDA graph is captured has not run and is not counted.
    It is counted, untimed, at each replay of the graph that the graph's owner announces
    (:func:`dslab.comm.announce_replay`; the inference engine's decode step does), as a record
    with ``graph_replay: true``, its arrival the host's clock at the announcement and, with
    ``debug``, its caller the replay's.

    CPU (gloo). Host clock: a blocking op is timed around the call; an async op's completion is
    stamped by a callback on ``work.get_future()``. gloo's reduce_scatter has no future and writes
    its output inside its issuer's ``wait()``, where a second waiter would write it again, so the
    comm layer hands it out as :class:`dslab.comm.IssuerWaitedWork`, whose future completes when
    the issuer's wait returns: its latency runs to the moment its output exists. gloo's send and
    recv stay untimed.

Arrival (for straggler analysis)
    Host ops: ``time.time_ns()`` in ``before()``. CUDA ops: when the issuing stream reached the
    op (the start event), put on the wall clock through a reference event recorded on an idle
    private stream (bracketed by two host stamps, the tightest of three tries; re-taken at every
    ``records()`` / ``log_summary()``). Ranks' clocks are aligned when the records are gathered:
    a few barriers, each rank stamping ``time.time_ns()`` on leaving each, and
    :func:`~dslab.profilers.comms_analysis.clock_offsets` (precision: the barrier's release
    skew, tens of microseconds on one host).

Matching across ranks
    Each record carries ``seq``, this process's count of calls of that op on that group (the
    group named by its global ranks) since the logger started. Members of a group issue its
    collectives in the same order, so ``(group, op, seq)`` names the same collective on every
    rank. (``CollectiveCall.seq`` counts all of a process's calls on all groups, so it differs
    between ranks that belong to different groups.) Two distinct process groups with the same
    ranks share a counter.

Gradient overlap (``records()["overlap"]``)
    Collectives the engine tags with a gradient bucket (``bucket=`` in :mod:`dslab.comm`) are
    also kept as spans of their micro-step, beside the step's phase marks (forward, backward,
    optimizer; CUDA events on the compute stream, or the host clock on a CPU), for the last
    micro-step that ran the optimizer; :mod:`dslab.profilers.comms_overlap` says what each figure
    is. Every rank's goes in the records.

Memory: the summary table is kept as running figures (exact for every call); raw records, used
for straggler analysis and the run report, are kept for the last ``max_records`` calls per rank.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist
from pydantic import Field, field_validator, model_validator

from dslab import comm
from dslab.config_base import ConfigSection, closest_key, parse_section
from dslab.profilers.base import Profiler
from dslab.profilers.comms_analysis import (
    DEFINITIONS,
    Summary,
    analyze_stragglers,
    bandwidth,
    clock_offsets,
    op_label,
    summary_rows,
)
from dslab.profilers.comms_format import format_call, format_stragglers, format_summary
from dslab.profilers.comms_overlap import OVERLAP_DEFINITIONS, BucketSpan, StepMarks
from dslab.profilers.comms_timing import CudaClock, CudaTiming, stream_key

#: the ops dslab.comm issues
COMM_OPS = ("all_gather", "all_gather_object", "all_reduce", "all_to_all", "barrier", "broadcast",
            "reduce_scatter", "send", "recv")
#: DeepSpeed's names for them, accepted in ``prof_ops``
DEEPSPEED_OP_NAMES = {
    "all_gather_into_tensor": "all_gather",
    "allgather_fn": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "inference_all_reduce": "all_reduce",
    "isend": "send",
    "irecv": "recv",
}
#: barrier rounds used to align the ranks' clocks when records are gathered
CLOCK_SYNC_ROUNDS = 5
#: the file of the verbose per-call lines in a profile output directory
TEXT_FILE = "comms_calls.txt"
#: modules skipped when ``debug`` looks for the caller of a collective
_CALLER_SKIP = ("dslab.comm", "dslab.engine", "dslab.profilers.comms")


class CommsLoggerConfig(ConfigSection):
    """DeepSpeed's ``comms_logger`` section.

    ``prof_all`` logs every collective; with ``prof_all: false`` only the ops named in
    ``prof_ops`` (dslab's names, or DeepSpeed's such as ``all_gather_into_tensor``). ``verbose``
    prints each call once its latency is known (on CUDA: at the end of the step it ran in); with
    a profile output directory set (a benchmark run) the lines go to its ``comms_calls.txt``
    instead, which the records name as ``text_file`` once a line went there.
    ``debug`` records the caller of each collective (file:line and function of the first frame
    outside dslab.comm and dslab.engine) and splits the summary by caller.
    """

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = Field(default_factory=list)
    debug: bool = False

    @field_validator("prof_ops")
    @classmethod
    def _known_ops(cls, ops: list[str]) -> list[str]:
        canonical = []
        for op in ops:
            name = DEEPSPEED_OP_NAMES.get(op, op)
            if name not in COMM_OPS:
                hint = closest_key(op, list(COMM_OPS) + list(DEEPSPEED_OP_NAMES))
                suggestion = f"; did you mean {hint!r}?" if hint else ""
                raise ValueError(f"unknown op {op!r}; dslab's collectives are "
                                 f"{', '.join(COMM_OPS)}{suggestion}")
            if name not in canonical:
                canonical.append(name)
        return canonical

    @model_validator(mode="after")
    def _logs_something(self) -> "CommsLoggerConfig":
        if self.enabled and not self.prof_all and not self.prof_ops:
            raise ValueError("config key 'comms_logger.prof_ops': empty while prof_all is false, "
                             "so nothing would be logged; name the ops to log or set prof_all")
        return self


def _caller() -> str:
    """``file:line (function)`` of the first frame outside dslab.comm, dslab.engine and this
    logger; the file relative to the working directory when under it."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not any(name == p or name.startswith(p + ".") for p in _CALLER_SKIP):
            path = frame.f_code.co_filename
            try:
                rel = os.path.relpath(path)
                path = path if rel.startswith("..") else rel
            except ValueError:
                pass
            return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "unknown"


class CommsLogger(Profiler):
    """Logs the collectives issued through :mod:`dslab.comm` (see the module docstring for how
    each figure is measured). Registers itself as an observer and as the provider behind
    :func:`dslab.comm.log_summary` on construction; :meth:`close` undoes both."""

    section = "comms"

    def __init__(self, config: CommsLoggerConfig, max_records: int = 10_000):
        if not isinstance(config, CommsLoggerConfig):
            raise ValueError(f"config must be a CommsLoggerConfig (got {type(config).__name__})")
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1 (got {max_records})")
        self.config = config
        self._ops = None if config.prof_all else frozenset(config.prof_ops)
        self._lock = threading.Lock()
        self._records: deque[dict] = deque(maxlen=max_records)
        self._dropped = 0
        self._summary = Summary()
        self._group_seq: dict[tuple[str, str], int] = defaultdict(int)
        self._open: dict[int, object] = {}
        self._cuda_pending: list[CudaTiming] = []
        self._last_on_stream: dict[tuple, CudaTiming] = {}  # the newest timing per NCCL stream
        self._host_pending: list = []
        self._clock = CudaClock()  # each device's reference event on the wall clock
        self._cuda_backend: bool | None = None
        self._rank: int | None = None
        self._step: int | None = None
        self._suspended = False
        self._text_file = None  # the file the verbose lines went to, once one went there
        self._marks_on_cuda = False  # phase marks as CUDA events (the model is on a GPU)
        self._marks: StepMarks | None = None  # the current micro-step's
        self._profiled: StepMarks | None = None  # the last micro-step that ran the optimizer
        comm.add_observer(self)
        comm.set_summary_provider(self.log_summary)

    @classmethod
    def from_config(cls, cfg) -> "CommsLogger | None":
        """The logger for a ``comms_logger`` section (a :class:`CommsLoggerConfig` or its dict),
        or None when it is not enabled: then nothing observes the comm layer."""
        if cfg is None:
            return None
        if not isinstance(cfg, CommsLoggerConfig):
            cfg = parse_section(CommsLoggerConfig, cfg, "comms_logger")
        return cls(cfg) if cfg.enabled else None

    # ----------------------------------------------------------------------------- observing --

    def _logs(self, call: comm.CollectiveCall) -> bool:
        return not self._suspended and (self._ops is None or call.op in self._ops)

    def _record(self, call: comm.CollectiveCall) -> dict:
        """The record of one call that runs now, its per-(group, op) ``seq`` taken; arrival on
        the host's clock (a CUDA call's is put on the device's when its events are read)."""
        if self._rank is None:
            self._rank = comm.get_rank()
        group = ",".join(str(r) for r in call.group_ranks)
        key = (group, call.op)
        seq = self._group_seq[key]
        self._group_seq[key] = seq + 1
        now = time.time_ns()
        record = {"op": call.op, "group": group, "group_size": call.group_size, "seq": seq,
                  "bytes": call.nbytes, "dtype": str(call.dtype).removeprefix("torch."),
                  "async": call.async_op, "step": self._step, "arrival_ns": now,
                  "host_arrival_ns": now, "latency_ms": None}
        if call.bucket is not None:
            record["bucket"] = call.bucket
        if self.config.debug:
            record["caller"] = _caller()
        return record

    def _keep(self, record: dict) -> None:
        with self._lock:
            if len(self._records) == self._records.maxlen:
                self._dropped += 1
            self._records.append(record)

    def before(self, call: comm.CollectiveCall) -> None:
        if not self._logs(call):
            return
        on_cuda = self._on_cuda(call)
        if on_cuda and torch.cuda.is_current_stream_capturing():
            return  # it runs at the graph's replays, which its owner announces (replayed())
        record = self._record(call)
        issued = time.perf_counter_ns()
        if on_cuda:
            device = torch.cuda.current_device()
            ref = self._clock.reference(device)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            key = stream_key(call.op, call.group_name or record["group"], device)
            timing = CudaTiming(record, start, ref, self._last_on_stream.get(key))
            if key is not None:
                self._last_on_stream[key] = timing
            self._open[call.seq] = timing
            self._span(call, record, issued, timing)
        else:
            self._open[call.seq] = (record, issued, self._span(call, record, issued, None))

    def _span(self, call: comm.CollectiveCall, record: dict, issued: int, timing) -> BucketSpan | None:
        """A gradient bucket's span in the current step's marks (None for any other call, or
        when its clock is not the marks' clock)."""
        marks = self._marks
        if call.bucket is None or marks is None or marks.cuda != (timing is not None):
            return None
        span = BucketSpan(record, issued, timing)
        marks.spans.append(span)
        return span

    def after(self, call: comm.CollectiveCall, work) -> None:
        timing = self._open.pop(call.seq, None)
        if timing is None:
            return
        record = timing.record if isinstance(timing, CudaTiming) else timing[0]
        self._keep(record)
        if isinstance(timing, CudaTiming):
            self._end_cuda(timing, call, work)
        elif work is None:
            end = time.perf_counter_ns()
            if timing[2] is not None:
                timing[2].end_ns = end
            self._finish(record, (end - timing[1]) / 1e6)
        else:
            self._end_host_async(record, timing[1], work, timing[2])

    def replayed(self, call: comm.CollectiveCall) -> None:
        """``call``, captured in a CUDA graph, ran: its owner replayed the graph. Counted as any
        call (every rank replays the same graph, so the per-group ``seq`` still matches across
        ranks), untimed: its kernel runs inside the graph's launch, which no event brackets."""
        if not self._logs(call):
            return
        record = self._record(call)
        record["graph_replay"] = True
        self._keep(record)
        self._finish(record, None)

    def _end_cuda(self, timing: CudaTiming, call, work) -> None:
        if work is None or not call.async_op:
            timing.end = torch.cuda.Event(enable_timing=True)
            timing.end.record()
        else:
            def record_end(_future):
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                timing.end = end
            try:
                work.get_future().then(record_end)
            except RuntimeError:
                pass  # a backend without futures: the call stays untimed (resolved as None)
        with self._lock:
            self._cuda_pending.append(timing)

    def _end_host_async(self, record: dict, start_ns: int, work, span: BucketSpan | None = None) -> None:
        # a handle whose future completes at its issuer's wait (comm.IssuerWaitedWork: gloo's
        # reduce_scatter) may still be unwaited when the records are read: it is given up on
        # then (untimed), and its stamp, should the issuer wait later, is dropped
        issuer_waited = isinstance(work, comm.IssuerWaitedWork)
        settled = [False]

        def claim() -> bool:
            with self._lock:
                if settled[0]:
                    return False
                settled[0] = True
                return True

        def stamp(future):
            end = time.perf_counter_ns()
            if not claim():
                return
            if issuer_waited and future.value() is False:  # the op failed; its issuer's wait() raised
                self._finish(record, None)
                return
            if span is not None:
                span.end_ns = end
            self._finish(record, (end - start_ns) / 1e6)

        def give_up() -> None:
            if claim():
                self._finish(record, None)

        try:
            future = work.get_future()
        except RuntimeError:  # gloo's send/recv: no future, and a second waiter never returns
            self._finish(record, None)
            return
        done = future.then(stamp)
        with self._lock:
            self._host_pending.append((done, give_up if issuer_waited else None))

    def _finish(self, record: dict, latency_ms: float | None) -> None:
        """The call's latency is known: into the record and the running summary."""
        record["latency_ms"] = latency_ms
        label = op_label(record, self.config.debug)
        with self._lock:
            self._summary.add(label, record["op"], record["bytes"], record["group_size"], latency_ms)
        if self.config.verbose:
            algbw, busbw = bandwidth(record["op"], record["bytes"], latency_ms, record["group_size"])
            self._text_file = self.write_text(TEXT_FILE, format_call(self._rank or 0, label, record["bytes"],
                                                                     latency_ms, algbw, busbw))

    def _on_cuda(self, call) -> bool:
        """Whether the call runs on a CUDA device: the call's ``device`` when the comm layer
        gives it, else whether the default process group's backend is NCCL."""
        device = getattr(call, "device", None) or call.extra.get("device")
        if device is not None:
            return torch.device(device).type == "cuda"
        if self._cuda_backend is None:
            self._cuda_backend = torch.cuda.is_available() and "nccl" in str(dist.get_backend())
        return self._cuda_backend

    # -------------------------------------------------------------------------- CUDA clocks --

    def _resolve(self, wait: bool) -> None:
        """Read the CUDA events that have completed (all of them with ``wait``: a wait on each
        outstanding end event, nothing else) and, with ``wait``, the outstanding host callbacks."""
        with self._lock:
            pending, self._cuda_pending = self._cuda_pending, []
            host = self._host_pending
        still = []
        for t in pending:
            if t.end is not None and wait:
                t.end.synchronize()
            if t.end is not None and t.end.query():
                ref_event, ref_wall = t.ref
                t.record["arrival_ns"] = ref_wall + int(ref_event.elapsed_time(t.start) * 1e6)
                self._finish(t.record, t.latency_ms())
            elif wait:
                self._finish(t.record, None)
            else:
                still.append(t)
        if wait:
            for done, give_up in host:
                if give_up is None:
                    done.wait()
                elif not done.done():  # its issuer has not waited on it yet
                    give_up()
            self._clock.recalibrate()
        with self._lock:
            self._cuda_pending = still + self._cuda_pending
            self._host_pending = [entry for entry in self._host_pending if not entry[0].done()]

    # -------------------------------------------------------------------------- engine hooks --

    def attach(self, model, optimizer=None) -> None:
        """Phase marks are CUDA events when the model's parameters are on a GPU."""
        self._marks_on_cuda = any(p.is_cuda for p in model.parameters())

    def on_step_begin(self, step: int) -> None:
        self._step = step
        self._marks = StepMarks(step, self._marks_on_cuda)

    def _mark(self, phase: str) -> None:
        if self._marks is not None:
            self._marks.mark(phase)

    def on_forward_begin(self) -> None:
        self._mark("forward_begin")

    def on_backward_begin(self) -> None:
        self._mark("backward_begin")

    def on_mark(self, phase: str) -> None:
        """The engine's marks inside a hook-delimited phase: ``backward_compute_end`` (autograd's
        backward returned; the gradient reductions are not yet waited for)."""
        if phase == "backward_compute_end":
            self._mark("backward_end")

    def on_backward_end(self) -> None:
        self._mark("backward_end")  # without a gradient reducer the engine marks nothing before

    def on_optimizer_step_begin(self) -> None:
        self._mark("optimizer_begin")

    def on_step_end(self, step: int) -> None:
        marks, self._marks = self._marks, None
        if marks is not None:
            marks.mark("step_end")
            if marks.complete:
                self._profiled = marks
        self._resolve(wait=False)

    def overlap(self) -> dict | None:
        """This rank's gradient overlap of the profiled step (see
        :mod:`dslab.profilers.comms_overlap`), None before a step reduced a tagged bucket."""
        self._resolve(wait=True)
        return None if self._profiled is None else self._profiled.resolve()

    # ------------------------------------------------------------------------------- results --

    def summary(self) -> dict[str, dict[int, dict]]:
        """This rank's figures so far: ``{op: {size_bytes: {count, total_latency_ms,
        avg_latency_ms, algbw_gbps, busbw_gbps, ...}}}`` (see
        :meth:`~dslab.profilers.comms_analysis.SizeStats.as_dict`); waits for outstanding calls."""
        self._resolve(wait=True)
        with self._lock:
            return self._summary.as_dict()

    def local_records(self) -> list[dict]:
        """This rank's retained per-call records (oldest first), latencies resolved."""
        self._resolve(wait=True)
        with self._lock:
            return [dict(r) for r in self._records]

    def gather(self) -> tuple[dict[int, list[dict]], dict[int, int]]:
        """Every rank's records and clock offset: ``({rank: records}, {rank: offset_ns})``.

        A collective when distributed (every rank must call it); the logger's own barriers and
        gather are not logged."""
        per_rank, offsets, _ = self._gather_all()
        return per_rank, offsets

    def _gather_all(self) -> tuple[dict[int, list[dict]], dict[int, int], dict[int, dict | None]]:
        """:meth:`gather` plus every rank's :meth:`overlap` (``{rank: overlap or None}``)."""
        records = self.local_records()  # reads every event the overlap needs
        overlap = None if self._profiled is None else self._profiled.resolve()
        if not comm.is_initialized() or comm.get_world_size() == 1:
            rank = comm.get_rank()
            return {rank: records}, {rank: 0}, {rank: overlap}
        self._suspended = True
        try:
            stamps = []
            for _ in range(CLOCK_SYNC_ROUNDS):
                comm.barrier()
                stamps.append(time.time_ns())
            everyone = comm.all_gather_object({"rank": comm.get_rank(), "stamps": stamps,
                                               "records": records, "overlap": overlap})
        finally:
            self._suspended = False
        per_rank = {e["rank"]: e["records"] for e in everyone}
        overlaps = {e["rank"]: e["overlap"] for e in everyone}
        return per_rank, clock_offsets({e["rank"]: e["stamps"] for e in everyone}), overlaps

    def log_summary(self, show_straggler: bool = False, return_dict: bool = False):
        """DeepSpeed's ``log_summary``: print this rank's table on rank 0 and, with
        ``show_straggler``, the straggler tables (a collective: every rank must call it, as with
        DeepSpeed).

        With ``return_dict``, returns ``{op: {size_bytes: {...}}}`` (see :meth:`summary`) plus
        ``"stragglers"`` (ranks named, see
        :func:`~dslab.profilers.comms_analysis.analyze_stragglers`) and ``"straggler"`` (its full
        result: per-rank and per-op waits); both None without ``show_straggler``.
        """
        summary = self.summary()
        analysis = None
        if show_straggler:
            analysis = analyze_stragglers(*self.gather())
        if comm.get_rank() == 0:
            print(format_summary(summary), flush=True)
            if analysis is not None:
                print(format_stragglers(analysis, rank=0), flush=True)
        if not return_dict:
            return None
        result: dict = dict(summary)
        result["stragglers"] = analysis["stragglers"] if analysis is not None else None
        result["straggler"] = analysis
        return result

    def records(self, gather: bool = True) -> dict:
        """For ``report.profilers["comms"]``: ``{"ops": [summary rows of this rank], "per_rank":
        {rank: [records]}, "stragglers": [...], "straggler": {...}, "definitions": str, ...}``,
        and ``"overlap": {"per_rank": {rank: overlap}, "definitions": str}`` once a step reduced
        gradient buckets (:meth:`overlap`).

        With ``gather`` (the default) and a process group, this is a collective: every rank must
        call it. Rank keys are strings (JSON)."""
        if gather:
            per_rank, offsets, overlaps = self._gather_all()
        else:
            rank = comm.get_rank()
            per_rank, offsets, overlaps = {rank: self.local_records()}, {rank: 0}, {rank: self.overlap()}
        analysis = analyze_stragglers(per_rank, offsets)
        with self._lock:
            rows = summary_rows(self._summary.as_dict())
            dropped = self._dropped
        out = {
            "rank": comm.get_rank(),
            "ops": rows,
            "per_rank": {str(r): recs for r, recs in sorted(per_rank.items())},
            "stragglers": analysis["stragglers"],
            "straggler": _string_keys(analysis),
            "clock_offsets_ns": {str(r): o for r, o in sorted(offsets.items())},
            "dropped_records": dropped,
            "definitions": DEFINITIONS,
            "text_file": None if self._text_file is None else str(self._text_file),
        }
        overlaps = {str(r): o for r, o in sorted(overlaps.items()) if o is not None}
        if overlaps:
            out["overlap"] = {"per_rank": overlaps, "definitions": OVERLAP_DEFINITIONS}
        return out

    def close(self) -> None:
        comm.remove_observer(self)
        if getattr(comm, "_summary_provider", None) == self.log_summary:
            comm.set_summary_provider(None)


def _string_keys(value):
    """``value`` with every dict key a string (JSON objects)."""
    if isinstance(value, dict):
        return {str(k): _string_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_string_keys(v) for v in value]
    return value


#: the module-level door, as the engine's profiler builder calls it
from_config = CommsLogger.from_config
