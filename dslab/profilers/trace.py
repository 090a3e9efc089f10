"""Perfetto trace of a run report: ``trace.pftrace`` beside the run's ``run.json``.

Built from the saved report alone: ``dslab bench`` writes it after every run's report
(:mod:`dslab.bench.trace_step`), ``dslab trace RUN`` for an older run. Written with the
``perfetto`` package's trace builder (``perfetto.trace_builder.proto_builder.TraceProtoBuilder``,
TrackEvent protobufs). Open the file at https://ui.perfetto.dev.

Layout, per case of the run (``report.profilers[section][case]``):

- one process track per rank, ``"<case> rank <r>"`` (the ranks the comms log saw; rank 0 without
  one), holding
  - ``collectives``: one slice per collective the rank issued, at its arrival (on the reference
    rank's clock: ``arrival_ns - clock_offsets_ns[rank]``) and lasting its measured latency, with
    ``bytes``, ``algbw_GBps``, ``busbw_GBps`` (:func:`dslab.profilers.comms_analysis.bandwidth`),
    ``group``, ``seq``, ``step`` and ``wait_ms`` (last arrival - own arrival) as arguments.
    Overlapping (async) calls go to extra lanes, ``collectives (lane 2)``, ...
  - on the reporting rank only, as that rank measured them:
    ``profiled step``: the flops profile's step as phases (forward, backward, optimizer) with the
    module spans nested inside (:func:`dslab.report.timeline.step_spans`, which the dashboard's
    Trace tab draws too): each lasts the device time of the module's kernels where the profile has
    device-time records, else the CUDA events' latency around its calls (the phase's ``timed_by``
    says which). The profile records durations, not start times, so modules are laid out one after
    another in ``named_modules`` order in forward and in reverse order in backward (a child is
    clipped to its parent's remaining time).
    ``measured steps``: every trial's step times of the dslab arm, laid end to end.
    Counters ``memory peak allocated`` / ``memory peak reserved`` (bytes): the memory tracer's step
    entries in order, one at the start of each measured step (entries beyond them follow at the
    step spacing; the tracer's steps include warm-up steps, so the pairing is by order only), and
    ``activations saved`` (bytes, cumulative over the profiled forward, rising at the end of each
    module that saved tensors).
- one process track ``"<case> GPUs"`` with a counter per GPU and NVML field (utilisation, power,
  SM clock, memory used, temperature) at ``started_at_unix + t``.
- for a pipeline run, one process track ``"<case> pipeline"`` with a track per stage: the
  latest batch's forwards and backwards (``F3``, ``B3``) from the pipeline engine's ``pipeline``
  section, each stage from its own batch start; the gaps are the bubble and the transfers.

Timestamps are nanoseconds on the wall clock; the tracks without a wall-clock time of their own
(profiled and measured steps, memory counters) start at the case's first collective, else its
first telemetry sample, else the report's creation time.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from dslab.profilers.comms_analysis import bandwidth
from dslab.report import RunReport, read_report
from dslab.report.store import REPORT_FILE, atomic_write_bytes
from dslab.report.timeline import (
    NS_PER_MS, TRACE_FILE, case_records, clock_offset, clock_offsets, collective_ns, collective_waits, lanes, number,
    profiled_step, rank_collectives, reporting_rank, step_spans, step_timing,
)

SEQUENCE_ID = 1
TELEMETRY_COUNTERS = (("util_gpu", "GPU utilisation (%)"), ("power_w", "power (W)"),
                      ("sm_clock_mhz", "SM clock (MHz)"), ("mem_used_bytes", "memory used (bytes)"),
                      ("temp_c", "temperature (C)"))


def _builder():
    try:
        from perfetto.trace_builder.proto_builder import TraceProtoBuilder
    except ImportError as err:
        raise ValueError(f"writing a Perfetto trace needs the perfetto package ({err}); "
                         "install it with: pip install 'dslab[dashboard]'") from None
    return TraceProtoBuilder()


class _Writer:
    """Track descriptors and track events on one packet sequence."""

    def __init__(self):
        self.builder = _builder()
        self._uuid = 0
        self._pid = 0
        self._first = True
        self._events: list[tuple] = []  # (timestamp, 0 for a slice end, order added, event)

    def _packet(self):
        packet = self.builder.add_packet()
        packet.trusted_packet_sequence_id = SEQUENCE_ID
        if self._first:
            packet.sequence_flags = packet.SEQ_INCREMENTAL_STATE_CLEARED
            self._first = False
        return packet

    def _next(self) -> int:
        self._uuid += 1
        return self._uuid

    def process(self, name: str) -> int:
        uuid = self._next()
        self._pid += 1
        track = self._packet().track_descriptor
        track.uuid = uuid
        track.process.pid = self._pid
        track.process.process_name = name
        return uuid

    def track(self, parent: int, name: str, counter_unit: str | None = None) -> int:
        uuid = self._next()
        track = self._packet().track_descriptor
        track.uuid = uuid
        track.parent_uuid = parent
        track.name = name
        if counter_unit is not None:
            track.counter.unit_name = counter_unit
            if counter_unit == "bytes":
                track.counter.unit = track.counter.UNIT_SIZE_BYTES
        return uuid

    def slice(self, track: int, name: str, start_ns: int, duration_ns: int, args: dict | None = None) -> None:
        start = max(0, int(start_ns))
        args = {k: v for k, v in (args or {}).items() if v is not None}
        self._events.append((start, 1, len(self._events), ("begin", track, name, args)))
        self._events.append((start + max(1, int(duration_ns)), 0, len(self._events), ("end", track)))

    def counter(self, track: int, t_ns: int, value: float) -> None:
        self._events.append((max(0, int(t_ns)), 1, len(self._events), ("counter", track, float(value))))

    def serialize(self) -> bytes:
        """Descriptors, then the events in time order: at one timestamp slice ends come before
        begins, and begins in the order they were added (a parent before its children)."""
        for t, _, _, event in sorted(self._events):
            packet = self._packet()
            packet.timestamp = t
            kind, track = event[0], event[1]
            packet.track_event.track_uuid = track
            if kind == "end":
                packet.track_event.type = packet.track_event.TYPE_SLICE_END
            elif kind == "counter":
                packet.track_event.type = packet.track_event.TYPE_COUNTER
                packet.track_event.double_counter_value = event[2]
            else:
                packet.track_event.type = packet.track_event.TYPE_SLICE_BEGIN
                packet.track_event.name = event[2]
                for key, value in (event[3] or {}).items():
                    _annotate(packet.track_event.debug_annotations.add(), key, value)
        self._events = []
        return self.builder.serialize()


def _annotate(annotation, key: str, value) -> None:
    annotation.name = key
    if isinstance(value, (bool, str)):
        annotation.string_value = str(value)
    elif isinstance(value, int):
        annotation.int_value = value
    else:
        annotation.double_value = float(value)


def _origin_ns(report: RunReport, per_rank: dict, offsets: dict, telemetry: dict | None) -> int:
    arrivals = [r["arrival_ns"] - clock_offset(offsets, rank) for rank, rs in per_rank.items() for r in rs]
    if arrivals:
        return int(min(arrivals))
    started = number((telemetry or {}).get("started_at_unix"))
    if started is not None:
        return int(started * 1e9)
    try:
        return int(datetime.datetime.fromisoformat(report.created).timestamp() * 1e9) if report.created else 0
    except ValueError:
        return 0


def _collectives(w: _Writer, process: int, rank: int, records: list[dict], offset: int, waits: dict) -> None:
    ordered = sorted(records, key=lambda r: r["arrival_ns"])
    calls = [(r["arrival_ns"] - offset, collective_ns(r)) for r in ordered]
    tracks: list[int] = []
    for r, (start, duration), lane in zip(ordered, calls, lanes(calls)):
        if lane == len(tracks):
            tracks.append(w.track(process, "collectives" if not tracks else f"collectives (lane {lane + 1})"))
        latency = number(r.get("latency_ms"))
        nbytes = int(number(r.get("bytes")) or 0)
        algbw, busbw = bandwidth(r["op"], nbytes, latency, int(number(r.get("group_size")) or 1))
        w.slice(tracks[lane], r["op"], start, duration, {
            "bytes": nbytes, "algbw_GBps": algbw, "busbw_GBps": busbw, "latency_ms": latency,
            "group": str(r.get("group", "")), "seq": r.get("seq") if isinstance(r.get("seq"), int) else None,
            "step": r.get("step") if isinstance(r.get("step"), int) else None,
            "wait_ms": waits.get((str(r.get("group", "")), r["op"], r.get("seq"), rank)),
        })


def _profiled_step(w: _Writer, track: int, flops: dict, start: int, activations: list, act_track: int | None) -> None:
    """The step's phases with the module spans nested inside (:func:`dslab.report.timeline.step_spans`)
    on ``track`` from ``start``, and the activations saved, cumulative, at the end of each forward
    module that saved some."""
    timing = "device kernels" if step_timing(flops) == "device" else "CUDA events around each call"
    spans = step_spans(flops)
    for s in spans:
        if s["module"] is None:
            args = {"latency_ms": s["phase_ms"], "timed_by": timing, "step": profiled_step(flops)}
        else:
            args = {"type": s["type"], "flops": s["flops"], "params": s["params"], "calls": s["calls"]}
        w.slice(track, s["name"], start + s["start_ns"], s["duration_ns"], args)
    if act_track is None:
        return
    saved: dict[str, float] = {}
    for a in activations:
        if isinstance(a, dict) and number(a.get("bytes")):
            saved[str(a.get("module"))] = saved.get(str(a.get("module")), 0.0) + a["bytes"]
    cumulative = 0.0
    forward = [s for s in spans if s["phase"] == "forward" and s["module"] is not None and s["module"] in saved]
    for s in sorted(forward, key=lambda s: (s["start_ns"] + s["duration_ns"], -s["depth"])):
        cumulative += saved[s["module"]]
        w.counter(act_track, start + s["start_ns"] + s["duration_ns"], cumulative)


def _reporting_rank(w: _Writer, process: int, report: RunReport, case: str, origin: int) -> None:
    flops = case_records(report, "flops").get(case)
    memory = case_records(report, "memory").get(case)
    activations = (memory or {}).get("activations") if isinstance((memory or {}).get("activations"), list) else []
    if flops:
        track = w.track(process, "profiled step")
        act_track = w.track(process, "activations saved", "bytes") if activations else None
        _profiled_step(w, track, flops, origin, activations, act_track)
    result = report.result(case, "dslab")
    starts = []
    if result is not None and result.trials:
        track = w.track(process, "measured steps")
        cursor = origin
        for trial in result.trials:
            for i, ms in enumerate(trial.step_times_ms):
                starts.append(cursor)
                w.slice(track, f"trial {trial.trial} step {i}", cursor, int(ms * NS_PER_MS), {"step_time_ms": ms})
                cursor += int(ms * NS_PER_MS)
            cursor += 10 * NS_PER_MS
    steps = (memory or {}).get("steps") if isinstance((memory or {}).get("steps"), list) else []
    if steps:
        spacing = int((starts[1] - starts[0]) if len(starts) > 1 else 10 * NS_PER_MS)
        last = starts[-1] if starts else origin - spacing
        at = [starts[i] if i < len(starts) else last + (i - len(starts) + 1) * spacing for i in range(len(steps))]
        for key in ("peak_allocated", "peak_reserved"):
            track = w.track(process, f"memory {key.replace('_', ' ')}", "bytes")
            for t, s in zip(at, steps):
                if isinstance(s, dict) and number(s.get(key)) is not None:
                    w.counter(track, t, s[key])


def _telemetry(w: _Writer, case: str, data: dict) -> None:
    gpus = data.get("gpus") if isinstance(data.get("gpus"), dict) else {}
    started = number(data.get("started_at_unix")) or 0.0
    if not gpus:
        return
    process = w.process(f"{case} GPUs")
    for uuid, gpu in gpus.items():
        samples = [s for s in gpu.get("samples") or [] if isinstance(s, dict)] if isinstance(gpu, dict) else []
        label = f"GPU {gpu.get('index', '?')}" if isinstance(gpu, dict) else str(uuid)
        for key, title in TELEMETRY_COUNTERS:
            points = [(s["t"], s[key]) for s in samples
                      if number(s.get("t")) is not None and number(s.get(key)) is not None]
            if points:
                track = w.track(process, f"{label} {title}", "bytes" if key == "mem_used_bytes" else None)
                for t, value in points:
                    w.counter(track, int((started + t) * 1e9), value)


def _pipeline(w: _Writer, case: str, data: dict, origin: int) -> None:
    """A process ``"<case> pipeline"`` with a track per stage: the latest batch's forwards and
    backwards (``F<i>`` / ``B<i>``), each stage from its own batch start, laid at ``origin``;
    where a stage has no slice it was waiting (the bubble, transfers)."""
    stages = [s for s in data.get("per_stage") or [] if isinstance(s, dict)]
    timelines = []
    for stage in stages:
        batches = [b for b in stage.get("batches") or [] if isinstance(b, dict) and b.get("timeline")]
        if batches:
            timelines.append((stage.get("stage"), batches[-1]))
    if not timelines:
        return
    process = w.process(f"{case} pipeline")
    for stage, batch in sorted(timelines, key=lambda t: t[0]):
        track = w.track(process, f"stage {stage}")
        for kind, micro, start_ms, end_ms in batch["timeline"]:
            label = f"{'F' if kind == 'forward' else 'B'}{micro}"
            w.slice(track, label, origin + int(start_ms * NS_PER_MS), int((end_ms - start_ms) * NS_PER_MS),
                    {"micro_batch": micro, "kind": kind, "step": batch.get("step")})


def build_trace(report: RunReport) -> bytes:
    """The serialized Perfetto trace (a ``perfetto.protos...Trace``) of ``report``."""
    w = _Writer()
    comms_by_case = case_records(report, "comms")
    telemetry_by_case = case_records(report, "telemetry")
    pipeline_by_case = case_records(report, "pipeline")
    cases = list(dict.fromkeys([*report.cases(), *(c for s in ("flops", "memory", "comms", "telemetry", "pipeline")
                                                    for c in case_records(report, s))]))
    for case in cases:
        comms = comms_by_case.get(case)
        per_rank = rank_collectives(comms)
        offsets = clock_offsets(comms)
        origin = _origin_ns(report, per_rank, offsets, telemetry_by_case.get(case))
        reporting = reporting_rank(comms)
        waits = collective_waits(per_rank, offsets)
        for rank in sorted(set(per_rank) | {reporting}):
            process = w.process(f"{case} rank {rank}")
            if rank == reporting:
                _reporting_rank(w, process, report, case, origin)
            if per_rank.get(rank):
                _collectives(w, process, rank, per_rank[rank], clock_offset(offsets, rank), waits)
        if case in telemetry_by_case:
            _telemetry(w, case, telemetry_by_case[case])
        if case in pipeline_by_case:
            _pipeline(w, case, pipeline_by_case[case], origin)
    return w.serialize()


def write_trace(run: str | Path, force: bool = False) -> Path:
    """``trace.pftrace`` in the run directory ``run`` (or beside its ``run.json``), written
    atomically unless it is there already (``force`` rewrites it); returns its path."""
    run = Path(run)
    folder = run.parent if run.name == REPORT_FILE else run
    path = folder / TRACE_FILE
    if path.is_file() and not force:
        return path
    atomic_write_bytes(path, build_trace(read_report(folder)))
    return path
