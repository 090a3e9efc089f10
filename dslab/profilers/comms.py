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

    Events are read later: completed ones at ``on_step_end`` (``query()``, non-blocking), the
    rest at ``records()`` / ``log_summary()``, which wait for those end events only.

    CUDA graphs. A call issued while a CUDA graph is captured has not run and is not counted.
    It is counted, untimed, at each replay of the graph that the graph's owner announces
    (:func:`dslab.comm.announce_replay`; the inference engine's decode step does), as a record
    with ``graph_replay: true``, its arrival the host's clock at the announcement and, with
    ``debug``, its caller the replay's.

    CPU (gloo). Host clock: a blocking op is timed around the call; an async op's completion is
    stamped by a callback on ``work.get_future()``.

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


class _CudaTiming:
    __slots__ = ("record", "start", "end", "ref")

    def __init__(self, record, start, ref):
        self.record, self.start, self.end, self.ref = record, start, None, ref


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
        self._cuda_pending: list[_CudaTiming] = []
        self._host_pending: list = []
        self._refs: dict[int, tuple] = {}
        self._calib_streams: dict[int, torch.cuda.Stream] = {}
        self._cuda_backend: bool | None = None
        self._rank: int | None = None
        self._step: int | None = None
        self._suspended = False
        self._text_file = None  # the file the verbose lines went to, once one went there
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
        if on_cuda:
            device = torch.cuda.current_device()
            ref = self._reference(device)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._open[call.seq] = _CudaTiming(record, start, ref)
        else:
            self._open[call.seq] = (record, time.perf_counter_ns())

    def after(self, call: comm.CollectiveCall, work) -> None:
        timing = self._open.pop(call.seq, None)
        if timing is None:
            return
        record = timing.record if isinstance(timing, _CudaTiming) else timing[0]
        self._keep(record)
        if isinstance(timing, _CudaTiming):
            self._end_cuda(timing, call, work)
        elif work is None:
            self._finish(record, (time.perf_counter_ns() - timing[1]) / 1e6)
        else:
            self._end_host_async(record, timing[1], work)

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

    def _end_cuda(self, timing: _CudaTiming, call, work) -> None:
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

    def _end_host_async(self, record: dict, start_ns: int, work) -> None:
        def stamp(_future):
            self._finish(record, (time.perf_counter_ns() - start_ns) / 1e6)
        try:
            done = work.get_future().then(stamp)
        except RuntimeError:
            self._finish(record, None)
            return
        with self._lock:
            self._host_pending.append(done)

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

    def _reference(self, device: int):
        ref = self._refs.get(device)
        if ref is None:
            ref = self._refs[device] = self._calibrate(device)
        return ref

    def _calibrate(self, device: int) -> tuple:
        """``(event, wall_ns)``: an event on an idle private stream and the wall-clock time it
        fired, the midpoint of the tightest of three host brackets around it."""
        stream = self._calib_streams.get(device)
        if stream is None:
            stream = self._calib_streams[device] = torch.cuda.Stream(device=device)
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
                self._finish(t.record, t.start.elapsed_time(t.end))
            elif wait:
                self._finish(t.record, None)
            else:
                still.append(t)
        if wait:
            for done in host:
                done.wait()
            for device in list(self._refs):
                self._refs[device] = self._calibrate(device)
        with self._lock:
            self._cuda_pending = still + self._cuda_pending
            self._host_pending = [f for f in self._host_pending if not f.done()]

    # -------------------------------------------------------------------------- engine hooks --

    def on_step_begin(self, step: int) -> None:
        self._step = step

    def on_step_end(self, step: int) -> None:
        self._resolve(wait=False)

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
        records = self.local_records()
        if not comm.is_initialized() or comm.get_world_size() == 1:
            return {comm.get_rank(): records}, {comm.get_rank(): 0}
        self._suspended = True
        try:
            stamps = []
            for _ in range(CLOCK_SYNC_ROUNDS):
                comm.barrier()
                stamps.append(time.time_ns())
            everyone = comm.all_gather_object({"rank": comm.get_rank(), "stamps": stamps,
                                               "records": records})
        finally:
            self._suspended = False
        per_rank = {e["rank"]: e["records"] for e in everyone}
        return per_rank, clock_offsets({e["rank"]: e["stamps"] for e in everyone})

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
        {rank: [records]}, "stragglers": [...], "straggler": {...}, "definitions": str, ...}``.

        With ``gather`` (the default) and a process group, this is a collective: every rank must
        call it. Rank keys are strings (JSON)."""
        if gather:
            per_rank, offsets = self.gather()
        else:
            per_rank, offsets = {comm.get_rank(): self.local_records()}, {comm.get_rank(): 0}
        analysis = analyze_stragglers(per_rank, offsets)
        with self._lock:
            rows = summary_rows(self._summary.as_dict())
            dropped = self._dropped
        return {
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
