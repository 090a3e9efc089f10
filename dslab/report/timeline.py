"""A run's profiled step as plain spans, read from its report: what the Perfetto trace writer
(:mod:`dslab.profilers.trace`) writes and what the dashboard's Trace tab draws, so the two show
the same step.

Sources, per case (``report.profilers[section][case]``):

- ``flops``: the profiled step's phases (forward, backward, optimizer) and its modules. A profile
  with device-time records (``device_time`` and the modules' ``forward_device_ms`` /
  ``backward_device_ms``, :mod:`dslab.profilers.device_time`) is laid out by the device time of
  each module's kernels (``timing == "device"``); an older profile by the CUDA events around each
  module's calls (``forward_latency_ms``, ``timing == "timers"``). The profile records durations,
  not start times, so :func:`step_spans` lays the modules one after another in ``named_modules``
  order in the forward and in reverse order in the backward, each inside its parent (a child is
  clipped to its parent's remaining time). With device times a span is busy time: the device's
  idle gaps are not in it.
- ``comms``: every collective of every rank (``per_rank``), at its arrival on the reference
  rank's clock (``arrival_ns - clock_offsets_ns[rank]``), lasting its measured latency
  (:func:`rank_collectives`, :func:`collective_waits`).

Also here: the trace file's name (``trace.pftrace``, beside ``run.json``) and the note ``dslab
bench`` adds to a report whose trace it could not write (:func:`trace_problem`).
"""

from __future__ import annotations

from dslab.report.schema import RunReport

TRACE_FILE = "trace.pftrace"
# The start of the note a report carries when ``dslab bench`` could not write its trace.
TRACE_NOT_WRITTEN = "the Perfetto trace (trace.pftrace) was not written: "
NS_PER_MS = 1_000_000
PHASES = ("forward", "backward", "optimizer")


def number(value) -> float | None:
    """``value`` as a float when it is a number (not a bool), else None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def case_records(report: RunReport, section: str) -> dict[str, dict]:
    """``{case: record}`` of profiler section ``section``, the records that are objects only."""
    raw = report.profilers.get(section)
    return {case: data for case, data in raw.items() if isinstance(data, dict)} if isinstance(raw, dict) else {}


def trace_problem(report: RunReport) -> str | None:
    """Why ``dslab bench`` could not write the run's trace (its note), None when it did not say."""
    for note in report.notes:
        if isinstance(note, str) and note.startswith(TRACE_NOT_WRITTEN):
            return note[len(TRACE_NOT_WRITTEN):]
    return None


# -- the profiled step ------------------------------------------------------------------------


def step_timing(flops: dict | None) -> str | None:
    """``"device"`` when the profile has device times per module, ``"timers"`` when it has only
    the timers' latencies, None when it has neither (no profile, or one that never ran)."""
    if not isinstance(flops, dict):
        return None
    device = flops.get("device_time")
    modules = flops.get("modules") if isinstance(flops.get("modules"), list) else []
    if isinstance(device, dict) and number(device.get("forward_ms")) and any(
            isinstance(m, dict) and number(m.get("forward_device_ms")) is not None for m in modules):
        return "device"
    if number(flops.get("forward_latency_ms")):
        return "timers"
    return None


def profiled_step(flops: dict | None) -> int | None:
    """The engine step the spans come from: the device-timed step (``device_time.step``) for
    device timing, else the profile's counted step."""
    timing = step_timing(flops)
    if timing == "device" and isinstance(flops["device_time"].get("step"), int):
        return flops["device_time"]["step"]
    step = (flops or {}).get("profile_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _phase_ms(flops: dict, phase: str, timing: str) -> float | None:
    if timing == "device":
        return number(flops["device_time"].get(f"{phase}_ms"))
    return number(flops.get(f"{phase}_latency_ms"))


def _module_ns(module: dict, phase: str, timing: str) -> int:
    key = f"{phase}_device_ms" if timing == "device" else f"{phase}_latency_ms"
    return int((number(module.get(key)) or 0) * NS_PER_MS)


def step_spans(flops: dict | None) -> list[dict]:
    """The profiled step as spans, in ns from the step's start, parents before their children.

    Each span: ``name`` (the module's name, ``type`` for the root, or the phase), ``module`` (None
    for a phase), ``phase``, ``depth`` (0 for a phase, 1 for the model, ...), ``start_ns``,
    ``duration_ns``, ``type``, ``flops`` (the phase's flops of the module), ``params``, ``calls``,
    ``leaf`` (a module without profiled children), ``phase_ms`` (a phase's measured time).
    Empty without a profile (:func:`step_timing`). See the module docstring for the layout."""
    timing = step_timing(flops)
    if timing is None:
        return []
    modules = [m for m in flops.get("modules") or [] if isinstance(m, dict) and isinstance(m.get("name"), str)]
    names = {m["name"] for m in modules}
    children: dict[str, list[dict]] = {}
    for m in modules:
        parts = m["name"].split(".")
        parent = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in names),
                      "" if m["name"] else None)
        if parent is not None and parent in names:
            children.setdefault(parent, []).append(m)
    spans: list[dict] = []

    def lay(module: dict, begin: int, limit: int, phase: str, depth: int) -> None:
        duration = min(_module_ns(module, phase, timing), limit - begin)
        if duration <= 0:
            return
        kids = children.get(module["name"], [])
        spans.append({"name": module["name"] or str(module.get("type", "model")), "module": module["name"],
                      "phase": phase, "depth": depth, "start_ns": begin, "duration_ns": duration,
                      "type": str(module.get("type", "")), "flops": int(number(module.get(f"{phase}_flops")) or 0),
                      "params": int(number(module.get("params")) or 0), "calls": module.get("calls"),
                      "leaf": not kids})
        cursor = begin
        for child in reversed(kids) if phase == "backward" else kids:
            lay(child, cursor, begin + duration, phase, depth + 1)
            cursor += min(_module_ns(child, phase, timing), begin + duration - cursor)

    roots = [m for m in modules if m["name"] == ""] or children.get("", [])
    cursor = 0
    for phase in PHASES:
        ms = _phase_ms(flops, phase, timing)
        if not ms:
            continue
        duration = int(ms * NS_PER_MS)
        spans.append({"name": phase, "module": None, "phase": phase, "depth": 0, "start_ns": cursor,
                      "duration_ns": duration, "type": "", "flops": int(number(flops.get(f"{phase}_flops")) or 0),
                      "params": 0, "calls": None, "leaf": False, "phase_ms": ms})
        if phase != "optimizer":
            inner = cursor
            for root in roots:
                lay(root, inner, cursor + duration, phase, 1)
                inner += _module_ns(root, phase, timing)
        cursor += duration
    return spans


# -- collectives --------------------------------------------------------------------------------


def rank_collectives(comms: dict | None) -> dict[int, list[dict]]:
    """``{rank: [call]}`` from the comms log's ``per_rank``, ranks in order; a call is kept when
    it has an ``op`` and a numeric ``arrival_ns`` (made an int: wall-clock ns exceed a float's
    exact range)."""
    per_rank = (comms or {}).get("per_rank")
    out = {}
    for key, records in per_rank.items() if isinstance(per_rank, dict) else ():
        if str(key).lstrip("-").isdigit() and isinstance(records, list):
            out[int(key)] = [{**r, "arrival_ns": int(r["arrival_ns"])} for r in records if isinstance(r, dict)
                             and number(r.get("arrival_ns")) is not None and isinstance(r.get("op"), str)]
    return dict(sorted(out.items()))


def clock_offsets(comms: dict | None) -> dict:
    """The comms log's ``clock_offsets_ns`` (``{}`` without one)."""
    offsets = (comms or {}).get("clock_offsets_ns")
    return offsets if isinstance(offsets, dict) else {}


def clock_offset(offsets: dict, rank: int) -> int:
    """Rank ``rank``'s clock offset from the reference rank, integer ns (0 when unknown)."""
    value = offsets.get(str(rank))
    return int(value) if number(value) is not None else 0


def reporting_rank(comms: dict | None) -> int:
    """The rank whose profilers wrote the case's flops and memory records (0 when unsaid)."""
    return int(number((comms or {}).get("rank")) or 0)


def collective_waits(per_rank: dict[int, list[dict]], offsets: dict) -> dict:
    """``(group, op, seq, rank) -> ms`` the rank waited for the last member of the call to arrive,
    for calls that two or more ranks logged."""
    groups: dict[tuple, dict[int, float]] = {}
    for rank, records in per_rank.items():
        for r in records:
            key = (str(r.get("group", "")), r["op"], r.get("seq"))
            groups.setdefault(key, {})[rank] = r["arrival_ns"] - clock_offset(offsets, rank)
    out = {}
    for key, arrivals in groups.items():
        if len(arrivals) > 1:
            last = max(arrivals.values())
            out.update({(*key, rank): (last - t) / NS_PER_MS for rank, t in arrivals.items()})
    return out


def collective_ns(record: dict) -> int:
    """A call's duration: its measured latency, 1 us when it has none."""
    latency = number(record.get("latency_ms"))
    return int(latency * NS_PER_MS) if latency else 1_000


def lanes(calls: list[tuple[int, int]]) -> list[int]:
    """The lane of each ``(start, duration)`` call, in the order given (sorted by start): the
    first lane whose last call has ended, a new one when none has, so overlapping (async) calls
    never share a lane."""
    ends: list[int] = []
    out = []
    for start, duration in calls:
        lane = next((i for i, end in enumerate(ends) if end <= start), None)
        if lane is None:
            ends.append(0)
            lane = len(ends) - 1
        ends[lane] = start + duration
        out.append(lane)
    return out


def step_collectives(comms: dict | None, step: int | None) -> tuple[int | None, list[dict]]:
    """``(step shown, calls)``: every rank's collectives of engine step ``step`` (the last step
    with any when ``step`` has none or is None), each a dict with ``rank``, ``lane``, ``op``,
    ``start_ms`` (from the step's first arrival on any rank, on the reference clock),
    ``latency_ms``, ``bytes``, ``group``, ``group_size``, ``seq`` and ``wait_ms``."""
    per_rank = rank_collectives(comms)
    steps = {r.get("step") for records in per_rank.values() for r in records if isinstance(r.get("step"), int)}
    if not steps:
        return None, []
    shown = step if step in steps else max(steps)
    offsets = clock_offsets(comms)
    chosen = {rank: [r for r in records if r.get("step") == shown] for rank, records in per_rank.items()}
    waits = collective_waits(chosen, offsets)
    origin = min(r["arrival_ns"] - clock_offset(offsets, rank) for rank, rs in chosen.items() for r in rs)
    out = []
    for rank, records in chosen.items():
        ordered = sorted(records, key=lambda r: r["arrival_ns"])
        starts = [(r["arrival_ns"] - clock_offset(offsets, rank) - origin, collective_ns(r)) for r in ordered]
        for r, (start, duration), lane in zip(ordered, starts, lanes(starts)):
            out.append({"rank": rank, "lane": lane, "op": r["op"], "start_ms": start / NS_PER_MS,
                        "latency_ms": duration / NS_PER_MS, "bytes": int(number(r.get("bytes")) or 0),
                        "group": str(r.get("group", "")), "group_size": int(number(r.get("group_size")) or 1),
                        "seq": r.get("seq"), "wait_ms": waits.get((str(r.get("group", "")), r["op"], r.get("seq"), rank))})
    return shown, out
