"""Perfetto trace of a run report: ``trace.pftrace`` beside the run's ``run.json``.

Built from the saved report alone (``dslab trace RUN``), with the ``perfetto`` package's trace
builder (``perfetto.trace_builder.proto_builder.TraceProtoBuilder``, TrackEvent protobufs). Open the
file at https://ui.perfetto.dev.

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
    module spans nested inside, each lasting its measured latency. The profile records durations,
    not start times, so modules are laid out one after another in ``named_modules`` order in
    forward and in reverse order in backward (a child is clipped to its parent's remaining time).
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

TRACE_FILE = "trace.pftrace"
SEQUENCE_ID = 1
TELEMETRY_COUNTERS = (("util_gpu", "GPU utilisation (%)"), ("power_w", "power (W)"),
                      ("sm_clock_mhz", "SM clock (MHz)"), ("mem_used_bytes", "memory used (bytes)"),
                      ("temp_c", "temperature (C)"))
_MS = 1_000_000


def _builder():
    try:
        from perfetto.trace_builder.proto_builder import TraceProtoBuilder
    except ImportError as err:
        raise ValueError(f"writing a Perfetto trace needs the perfetto package ({err}); "
                         "install it with: pip install 'dslab[dashboard]'") from None
    return TraceProtoBuilder()


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


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


def _case_data(report: RunReport, section: str) -> dict[str, dict]:
    raw = report.profilers.get(section)
    return {case: data for case, data in raw.items() if isinstance(data, dict)} if isinstance(raw, dict) else {}


def _per_rank(comms: dict | None) -> dict[int, list[dict]]:
    per_rank = (comms or {}).get("per_rank")
    out = {}
    for key, records in per_rank.items() if isinstance(per_rank, dict) else ():
        if str(key).lstrip("-").isdigit() and isinstance(records, list):
            out[int(key)] = [{**r, "arrival_ns": int(r["arrival_ns"])} for r in records if isinstance(r, dict)
                             and _number(r.get("arrival_ns")) is not None and isinstance(r.get("op"), str)]
    return dict(sorted(out.items()))


def _offset(offsets: dict, rank: int) -> int:
    """The rank's clock offset in integer ns (wall-clock ns exceed a float's exact range)."""
    value = offsets.get(str(rank))
    return int(value) if _number(value) is not None else 0


def _origin_ns(report: RunReport, per_rank: dict, offsets: dict, telemetry: dict | None) -> int:
    arrivals = [r["arrival_ns"] - _offset(offsets, rank) for rank, rs in per_rank.items() for r in rs]
    if arrivals:
        return int(min(arrivals))
    started = _number((telemetry or {}).get("started_at_unix"))
    if started is not None:
        return int(started * 1e9)
    try:
        return int(datetime.datetime.fromisoformat(report.created).timestamp() * 1e9) if report.created else 0
    except ValueError:
        return 0


def _collectives(w: _Writer, process: int, rank: int, records: list[dict], offset: int, waits: dict) -> None:
    lanes: list[tuple[int, int]] = []  # (track uuid, end of its last slice)
    for r in sorted(records, key=lambda r: r["arrival_ns"]):
        start = r["arrival_ns"] - offset
        latency = _number(r.get("latency_ms"))
        duration = int(latency * _MS) if latency else 1_000
        lane = next((i for i, (_, end) in enumerate(lanes) if end <= start), None)
        if lane is None:
            lanes.append((w.track(process, "collectives" if not lanes else f"collectives (lane {len(lanes) + 1})"), 0))
            lane = len(lanes) - 1
        lanes[lane] = (lanes[lane][0], start + duration)
        nbytes = int(_number(r.get("bytes")) or 0)
        algbw, busbw = bandwidth(r["op"], nbytes, latency, int(_number(r.get("group_size")) or 1))
        w.slice(lanes[lane][0], r["op"], start, duration, {
            "bytes": nbytes, "algbw_GBps": algbw, "busbw_GBps": busbw, "latency_ms": latency,
            "group": str(r.get("group", "")), "seq": r.get("seq") if isinstance(r.get("seq"), int) else None,
            "step": r.get("step") if isinstance(r.get("step"), int) else None,
            "wait_ms": waits.get((str(r.get("group", "")), r["op"], r.get("seq"), rank)),
        })


def _waits(per_rank: dict, offsets: dict) -> dict:
    """``(group, op, seq, rank) -> ms`` the rank waited for the last member to arrive."""
    groups: dict[tuple, dict[int, float]] = {}
    for rank, records in per_rank.items():
        for r in records:
            key = (str(r.get("group", "")), r["op"], r.get("seq"))
            groups.setdefault(key, {})[rank] = r["arrival_ns"] - _offset(offsets, rank)
    out = {}
    for key, arrivals in groups.items():
        if len(arrivals) > 1:
            last = max(arrivals.values())
            out.update({(*key, rank): (last - t) / _MS for rank, t in arrivals.items()})
    return out


def _module_spans(w: _Writer, track: int, flops: dict, start: int, activations: list, act_track: int | None) -> int:
    """Phases with nested module spans on ``track``; returns the step's end."""
    modules = [m for m in flops.get("modules") or [] if isinstance(m, dict) and isinstance(m.get("name"), str)]
    names = {m["name"] for m in modules}
    children: dict[str, list[dict]] = {}
    for m in modules:
        parts = m["name"].split(".")
        parent = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in names),
                      "" if m["name"] else None)
        if parent is not None and parent in names:
            children.setdefault(parent, []).append(m)
    saved = {}
    for a in activations:
        if isinstance(a, dict) and _number(a.get("bytes")):
            saved[str(a.get("module"))] = saved.get(str(a.get("module")), 0.0) + a["bytes"]
    cumulative = [0.0]

    def lay(module: dict, begin: int, limit: int, key: str, reverse: bool) -> None:
        duration = min(int((_number(module.get(f"{key}_latency_ms")) or 0) * _MS), limit - begin)
        if duration <= 0:
            return
        w.slice(track, module["name"] or str(module.get("type", "model")), begin, duration, {
            "type": str(module.get("type", "")), "flops": int(_number(module.get(f"{key}_flops")) or 0),
            "params": int(_number(module.get("params")) or 0), "calls": module.get("calls")})
        cursor = begin
        for child in reversed(children.get(module["name"], [])) if reverse else children.get(module["name"], []):
            lay(child, cursor, begin + duration, key, reverse)
            cursor += min(int((_number(child.get(f"{key}_latency_ms")) or 0) * _MS), begin + duration - cursor)
        if key == "forward" and act_track is not None and module["name"] in saved:
            cumulative[0] += saved[module["name"]]
            w.counter(act_track, begin + duration, cumulative[0])

    roots = [m for m in modules if m["name"] == ""] or children.get("", [])
    cursor = start
    for phase, key in (("forward", "forward"), ("backward", "backward"), ("optimizer", None)):
        ms = _number(flops.get(f"{phase}_latency_ms"))
        if not ms:
            continue
        duration = int(ms * _MS)
        w.slice(track, phase, cursor, duration, {"latency_ms": ms})
        if key is not None:
            inner = cursor
            for root in roots:
                lay(root, inner, cursor + duration, key, key == "backward")
                inner += int((_number(root.get(f"{key}_latency_ms")) or 0) * _MS)
        cursor += duration
    return cursor


def _reporting_rank(w: _Writer, process: int, report: RunReport, case: str, origin: int) -> None:
    flops = _case_data(report, "flops").get(case)
    memory = _case_data(report, "memory").get(case)
    activations = (memory or {}).get("activations") if isinstance((memory or {}).get("activations"), list) else []
    if flops:
        track = w.track(process, "profiled step")
        act_track = w.track(process, "activations saved", "bytes") if activations else None
        _module_spans(w, track, flops, origin, activations, act_track)
    result = report.result(case, "dslab")
    starts = []
    if result is not None and result.trials:
        track = w.track(process, "measured steps")
        cursor = origin
        for trial in result.trials:
            for i, ms in enumerate(trial.step_times_ms):
                starts.append(cursor)
                w.slice(track, f"trial {trial.trial} step {i}", cursor, int(ms * _MS), {"step_time_ms": ms})
                cursor += int(ms * _MS)
            cursor += 10 * _MS
    steps = (memory or {}).get("steps") if isinstance((memory or {}).get("steps"), list) else []
    if steps:
        spacing = int((starts[1] - starts[0]) if len(starts) > 1 else 10 * _MS)
        last = starts[-1] if starts else origin - spacing
        at = [starts[i] if i < len(starts) else last + (i - len(starts) + 1) * spacing for i in range(len(steps))]
        for key in ("peak_allocated", "peak_reserved"):
            track = w.track(process, f"memory {key.replace('_', ' ')}", "bytes")
            for t, s in zip(at, steps):
                if isinstance(s, dict) and _number(s.get(key)) is not None:
                    w.counter(track, t, s[key])


def _telemetry(w: _Writer, case: str, data: dict) -> None:
    gpus = data.get("gpus") if isinstance(data.get("gpus"), dict) else {}
    started = _number(data.get("started_at_unix")) or 0.0
    if not gpus:
        return
    process = w.process(f"{case} GPUs")
    for uuid, gpu in gpus.items():
        samples = [s for s in gpu.get("samples") or [] if isinstance(s, dict)] if isinstance(gpu, dict) else []
        label = f"GPU {gpu.get('index', '?')}" if isinstance(gpu, dict) else str(uuid)
        for key, title in TELEMETRY_COUNTERS:
            points = [(s["t"], s[key]) for s in samples
                      if _number(s.get("t")) is not None and _number(s.get(key)) is not None]
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
            w.slice(track, label, origin + int(start_ms * _MS), int((end_ms - start_ms) * _MS),
                    {"micro_batch": micro, "kind": kind, "step": batch.get("step")})


def build_trace(report: RunReport) -> bytes:
    """The serialized Perfetto trace (a ``perfetto.protos...Trace``) of ``report``."""
    w = _Writer()
    comms_by_case = _case_data(report, "comms")
    telemetry_by_case = _case_data(report, "telemetry")
    pipeline_by_case = _case_data(report, "pipeline")
    cases = list(dict.fromkeys([*report.cases(), *(c for s in ("flops", "memory", "comms", "telemetry", "pipeline")
                                                    for c in _case_data(report, s))]))
    for case in cases:
        comms = comms_by_case.get(case)
        per_rank = _per_rank(comms)
        offsets = (comms or {}).get("clock_offsets_ns")
        offsets = offsets if isinstance(offsets, dict) else {}
        origin = _origin_ns(report, per_rank, offsets, telemetry_by_case.get(case))
        reporting = int(_number((comms or {}).get("rank")) or 0)
        waits = _waits(per_rank, offsets)
        for rank in sorted(set(per_rank) | {reporting}):
            process = w.process(f"{case} rank {rank}")
            if rank == reporting:
                _reporting_rank(w, process, report, case, origin)
            if per_rank.get(rank):
                _collectives(w, process, rank, per_rank[rank], _offset(offsets, rank), waits)
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
