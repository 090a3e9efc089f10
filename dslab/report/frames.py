"""Run reports as pandas DataFrames, and their export to CSV, Parquet or JSON files.

Every function takes a :class:`RunReport`, a path (a run directory or its ``run.json``), a
report's parsed JSON, or a list of any of those, and returns one DataFrame over all of them, its
rows in the order of the reports given and, within a report, in the report's own order. A report
that lacks a section gives no rows; a frame with no rows still has its documented columns.
Malformed records (not an object, a field of the wrong type) are skipped or read as missing.

The frames of a profiler section (every frame but ``runs``, ``trials`` and ``results``;
``rank_memory`` reads the trials too) take two keyword arguments: ``case`` keeps that case's rows
only, and ``strict=True`` raises ValueError naming the key (``flops.modules should be a list, not
str``, ``memory.steps[0] should be an object, not int``) where a container or a record has the
wrong type, instead of skipping it: the dashboard draws what it can and says what it could not. A
field of the wrong type is read as missing either way.

Column types are fixed, so a frame reads back equal from any of the formats:

- text: pandas' ``"string"`` dtype; an empty string is read as missing (CSV cannot tell them
  apart, so frames never hold one: the flops profile's model itself, named ``""`` in the report,
  has a missing ``name`` and depth 0);
- integers: ``"Int64"`` (nullable), flags: ``"boolean"`` (nullable), other numbers: ``float64``;
- ``created`` and ``finished`` stay ISO-8601 text (``pandas.to_datetime`` parses them).

``trials`` and ``results`` add one ``float64`` column per metric the report holds, after their
fixed columns: the metrics of :data:`METRIC_DIRECTIONS` in that order, then the others by name
(:func:`metric_names`). :func:`records` gives a frame's rows as plain Python values.

:func:`export` writes each non-empty frame as ``<name>.csv`` (missing = empty field),
``<name>.parquet`` (needs pyarrow) or ``<name>.json`` (a list of records, missing = null), each
atomically; :func:`read_exported` reads them back with the same column types.
"""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from dslab.report.schema import METRIC_DIRECTIONS, RATIO_ARM, RunReport, report_from_dict
from dslab.report.store import atomic_write_bytes, read_report

FORMATS = ("csv", "parquet", "json")
DTYPES = {"str": "string", "int": "Int64", "float": "float64", "bool": "boolean"}
_INT64_MAX = 2**63 - 1


def _spec(text: str) -> dict[str, str]:
    """``"a b:int c:float"`` -> ``{"a": "str", "b": "int", "c": "float"}``."""
    return dict((item.split(":") + ["str"])[:2] for item in text.split())


# The fixed columns of each frame and their kinds (see DTYPES).
COLUMNS: dict[str, dict[str, str]] = {
    "runs": _spec("run_id suite status created finished schema_version:int hardware gpu_count:int "
                  "torch_version cuda_version dslab_version git_commit git_dirty:bool source_digest "
                  "scale precision trials:int steps:int warmup_steps:int world_size:int zero_stage:int"),
    "trials": _spec("run_id suite case arm status trial:int step_count:int"),
    "results": _spec("run_id suite case arm status error trial_count:int dslab_over_arm:float best_plain:bool"),
    "flops_modules": _spec("run_id case name type depth:int params:int forward_flops:int backward_flops:int "
                           "macs:int elementwise_flops:int calls:int forward_latency_ms:float "
                           "backward_latency_ms:float forward_device_ms:float backward_device_ms:float "
                           "device_tflops:float"),
    "comms_calls": _spec("run_id case rank:int op group group_size:int seq:int bytes:int dtype async:bool "
                         "step:int arrival_ns:int host_arrival_ns:int latency_ms:float clock_offset_ns:int"),
    "comms_ops": _spec("run_id case rank:int op size_bytes:int count:int timed_count:int avg_latency_ms:float "
                       "min_latency_ms:float max_latency_ms:float total_latency_ms:float algbw_GBps:float "
                       "busbw_GBps:float"),
    "stragglers": _spec("run_id case rank:int straggler:bool collectives:int times_last:int last_fraction:float "
                        "total_wait_ms:float mean_wait_ms:float max_wait_ms:float caused_wait_ms:float "
                        "mean_caused_wait_ms:float"),
    "memory_timeline": _spec("run_id case step:int peak_allocated:int peak_reserved:int"),
    "memory_activations": _spec("run_id case module bytes:int shared_bytes:int tensors:int storages:int"),
    "rank_memory": _spec("run_id suite case arm trial:int rank:int kind peak_bytes:int model_state_bytes:int"),
    "telemetry_timeline": _spec("run_id case gpu_uuid gpu_index:int gpu_name t:float util_gpu:float "
                                "util_mem:float sm_clock_mhz:float mem_used_bytes:int power_w:float "
                                "temp_c:float throttle"),
    "wall_clock": _spec("run_id case phase count:int mean_ms:float median_ms:float min_ms:float max_ms:float"),
    "io_records": _spec("run_id case kind record op label block_size:int queue_depth:int "
                        "intra_op_parallelism:int single_submit:bool overlap_events:bool GBps:float "
                        "spread_pct:float trials:int trials_GBps round:int dropped_after_round:int count:int "
                        "bytes:int seconds:float median_GBps:float min_GBps:float max_GBps:float wait_s:float "
                        "step:int path"),
}
# Frames whose rows carry metrics: one float64 column per metric, after the fixed columns.
METRIC_FRAMES = ("trials", "results")

ReportLike = RunReport | str | Path | dict


def load(reports: ReportLike | list[ReportLike] | tuple) -> list[RunReport]:
    """The reports ``reports`` names: a RunReport, a run directory or ``run.json`` path, a parsed
    report, or a list of those."""
    items = list(reports) if isinstance(reports, (list, tuple)) else [reports]
    out = []
    for item in items:
        if isinstance(item, RunReport):
            out.append(item)
        elif isinstance(item, dict):
            out.append(report_from_dict(item))
        elif isinstance(item, (str, Path)):
            out.append(read_report(item))
        else:
            raise TypeError(f"expected a RunReport, a path or a report dict, not {type(item).__name__}")
    return out


def _coerce(value: Any, kind: str) -> Any:
    """``value`` as a value of column kind ``kind``, or None when it is missing or not one."""
    if value is None or value is pd.NA:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str":
        if isinstance(value, (dict, list)):
            return json.dumps(value, sort_keys=True)
        return str(value) if value != "" else None
    if kind == "bool":
        return value if isinstance(value, bool) else None
    if kind == "int":
        if number and not (isinstance(value, float) and not value.is_integer()) and abs(value) <= _INT64_MAX:
            return int(value)
        return None
    return float(value) if number and not (isinstance(value, float) and math.isnan(value)) else None


def _metric_order(names: set[str]) -> list[str]:
    known = [m for m in METRIC_DIRECTIONS if m in names]
    return known + sorted(names - set(known))


def _frame(name: str, rows: list[dict]) -> pd.DataFrame:
    """Frame ``name`` of ``rows`` with its fixed columns (and metric columns) and their dtypes."""
    kinds = dict(COLUMNS[name])
    if name in METRIC_FRAMES:
        extra = {key for row in rows for key in row} - set(kinds)
        kinds.update({metric: "float" for metric in _metric_order(extra)})
    return pd.DataFrame({column: pd.Series([_coerce(row.get(column), kind) for row in rows],
                                           dtype=DTYPES[kind])
                         for column, kind in kinds.items()})


def _section(report: RunReport, name: str, case: str | None = None, strict: bool = False) -> list[tuple[str, dict]]:
    """``[(case, record)]`` of profiler section ``name`` (only ``case``'s when given); records
    that are not objects skipped, or ValueError when ``strict``."""
    raw = report.profilers.get(name) if isinstance(report.profilers, dict) else None
    out = []
    for key, record in _dict(raw, f"profilers.{name}", strict).items():
        if case is not None and str(key) != case:
            continue
        if isinstance(record, dict):
            out.append((str(key), record))
        elif strict and record is not None:
            raise ValueError(f"profilers.{name}.{key} should be an object, not {type(record).__name__}")
    return out


def _objects(value: Any, where: str = "", strict: bool = False) -> list[dict]:
    """The objects of list ``value``; with ``strict``, ValueError naming ``where`` when ``value``
    is not a list (and not missing) or holds something else."""
    if not isinstance(value, list):
        if strict and value is not None:
            raise ValueError(f"{where} should be a list, not {type(value).__name__}")
        return []
    if strict:
        for i, v in enumerate(value):
            if not isinstance(v, dict):
                raise ValueError(f"{where}[{i}] should be an object, not {type(v).__name__}")
    return [v for v in value if isinstance(v, dict)]


def _dict(value: Any, where: str = "", strict: bool = False) -> dict:
    """``value`` if it is an object, else ``{}``; with ``strict``, ValueError naming ``where`` when
    it is something else than an object or missing."""
    if isinstance(value, dict):
        return value
    if strict and value is not None:
        raise ValueError(f"{where} should be an object, not {type(value).__name__}")
    return {}


def _hardware(env: dict) -> tuple[str | None, int | None]:
    """``(label, GPU count)`` of an environment record: ``"2x NVIDIA H100 80GB HBM3"`` for GPUs of
    one name, the names comma-separated for mixed ones, ``"CPU"`` when it records CUDA without a
    GPU; ``(None, None)`` when it has no CUDA record."""
    cuda = env.get("cuda")
    if not isinstance(cuda, dict):
        return None, None
    names = [str(g.get("name", "?")) for g in _objects(cuda.get("gpus"))]
    if not names:
        return "CPU", 0
    if len(set(names)) == 1:
        return (names[0] if len(names) == 1 else f"{len(names)}x {names[0]}"), len(names)
    return ", ".join(names), len(names)


def runs(reports) -> pd.DataFrame:
    """One row per run. Columns: run_id, suite, status, created, finished, schema_version,
    hardware (``"NVIDIA H100 80GB HBM3"``, ``"2x NVIDIA H100 80GB HBM3"``, the names
    comma-separated for GPUs of several kinds, or ``CPU``; missing when the environment does not
    record CUDA), gpu_count, torch_version, cuda_version, dslab_version, git_commit, git_dirty,
    source_digest (of the package's source, missing in reports from before it was recorded), and
    from the config: scale, precision, trials, steps, warmup_steps, world_size, zero_stage."""
    rows = []
    for r in load(reports):
        env, cfg = _dict(r.environment), _dict(r.config)
        hardware, gpu_count = _hardware(env)
        torch_env, dslab_env = _dict(env.get("torch")), _dict(env.get("dslab"))
        rows.append({"run_id": r.run_id, "suite": r.suite, "status": r.status, "created": r.created,
                     "finished": r.finished, "schema_version": r.schema_version,
                     "hardware": hardware, "gpu_count": gpu_count, "torch_version": torch_env.get("version"),
                     "cuda_version": torch_env.get("cuda"), "dslab_version": dslab_env.get("version"),
                     "git_commit": dslab_env.get("git_commit"), "git_dirty": dslab_env.get("git_dirty"),
                     "source_digest": dslab_env.get("source_digest"),
                     **{k: cfg.get(k) for k in ("scale", "precision", "trials", "steps", "warmup_steps",
                                                "world_size", "zero_stage")}})
    return _frame("runs", rows)


def trials(reports) -> pd.DataFrame:
    """One row per (run, case, arm, trial): run_id, suite, case, arm, status (the arm's), trial,
    step_count (timed steps recorded), then every metric the trials hold (step_time_ms,
    samples_per_s, tokens_per_s, model_tflops, mfu_measured, peak_memory_bytes, ...)."""
    rows = []
    for r in load(reports):
        for res in r.results:
            for t in res.trials:
                rows.append({**t.metrics, "run_id": r.run_id, "suite": r.suite, "case": res.case, "arm": res.arm,
                             "status": res.status, "trial": t.trial, "step_count": len(t.step_times_ms)})
    return _frame("trials", rows)


def results(reports) -> pd.DataFrame:
    """One row per (run, case, arm): run_id, suite, case, arm, status, error, trial_count,
    dslab_over_arm (the report's ratio of the dslab arm's samples/s over this arm's,
    ``ratios[case]["dslab/<arm>"]``), best_plain (True on the case's best plain-PyTorch arm, see
    :meth:`RunReport.best_plain_ratio`), then the summary metrics (medians over trials)."""
    rows = []
    for r in load(reports):
        best = {case: r.best_plain_ratio(case) for case in r.cases()}
        for res in r.results:
            ratios = _dict(_dict(r.ratios).get(res.case))
            rows.append({**res.metrics, "run_id": r.run_id, "suite": r.suite, "case": res.case, "arm": res.arm,
                         "status": res.status, "error": res.error, "trial_count": len(res.trials),
                         "dslab_over_arm": ratios.get(f"{RATIO_ARM}/{res.arm}"),
                         "best_plain": best[res.case] is not None and best[res.case][0] == res.arm})
    return _frame("results", rows)


def metric_names(frame: pd.DataFrame, name: str) -> list[str]:
    """The metric columns of frame ``name`` (``trials`` or ``results``): those after its fixed
    columns, in their order."""
    return [c for c in frame.columns if c not in COLUMNS[name]]


def flops_modules(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """One row per module of each case's flops profile (``profilers["flops"][case]["modules"]``,
    parents before children): run_id, case, name (missing for the model itself), type, depth,
    params, forward_flops, backward_flops, macs, elementwise_flops, calls, forward_latency_ms,
    backward_latency_ms, forward_device_ms, backward_device_ms, device_tflops."""
    rows = [{**m, "run_id": r.run_id, "case": c}
            for r in load(reports) for c, record in _section(r, "flops", case, strict)
            for m in _objects(record.get("modules"), "flops.modules", strict)]
    return _frame("flops_modules", rows)


def comms_calls(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """One row per collective call of every rank (``profilers["comms"][case]["per_rank"]``):
    run_id, case, rank, op, group (its ranks, comma-separated), group_size, seq (per group and
    op), bytes, dtype, async, step, arrival_ns, host_arrival_ns (both on the rank's clock),
    latency_ms, clock_offset_ns (the rank's clock minus the reference clock,
    ``comms[case]["clock_offsets_ns"]``: ``arrival_ns - clock_offset_ns`` is on the reference clock)."""
    rows = []
    for r in load(reports):
        for c, record in _section(r, "comms", case, strict):
            offsets = _dict(record.get("clock_offsets_ns"))
            for rank, calls in _dict(record.get("per_rank"), "comms.per_rank", strict).items():
                number = _rank(rank)
                if number is None and strict:
                    raise ValueError(f"comms.per_rank has a rank {rank!r} that is not an integer")
                rows.extend({**call, "run_id": r.run_id, "case": c, "rank": number,
                             "clock_offset_ns": offsets.get(str(rank))}
                            for call in _objects(calls, f"comms.per_rank.{rank}", strict))
    return _frame("comms_calls", rows)


def comms_ops(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """The comms logger's summary of the reporting rank, one row per (op, message size)
    (``profilers["comms"][case]["ops"]``): run_id, case, rank (the reporting rank), op,
    size_bytes, count, timed_count, avg_latency_ms, min_latency_ms, max_latency_ms,
    total_latency_ms, algbw_GBps, busbw_GBps (1e9 bytes/s, nccl-tests' definitions)."""
    rows = [{**row, "run_id": r.run_id, "case": c, "rank": record.get("rank")}
            for r in load(reports) for c, record in _section(r, "comms", case, strict)
            for row in _objects(record.get("ops"), "comms.ops", strict)]
    return _frame("comms_ops", rows)


def _rank(key: Any) -> int | None:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


def stragglers(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """One row per rank of each case's straggler analysis (``comms[case]["straggler"]["ranks"]``):
    run_id, case, rank, straggler (named one), collectives, times_last, last_fraction,
    total_wait_ms, mean_wait_ms, max_wait_ms, caused_wait_ms, mean_caused_wait_ms."""
    rows = []
    for r in load(reports):
        for c, record in _section(r, "comms", case, strict):
            analysis = _dict(record.get("straggler"), "comms.straggler", strict)
            named = analysis.get("stragglers", record.get("stragglers"))
            named = {_rank(s) for s in named} if isinstance(named, list) else set()
            for rank, stats in _dict(analysis.get("ranks"), "comms.straggler.ranks", strict).items():
                _dict(stats, f"comms.straggler.ranks.{rank}", strict)
                if isinstance(stats, dict):
                    rows.append({**stats, "run_id": r.run_id, "case": c, "rank": _rank(rank),
                                 "straggler": _rank(rank) in named})
    return _frame("stragglers", rows)


def memory_timeline(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """One row per recorded step of each case's memory profile (``memory[case]["steps"]``):
    run_id, case, step (the record's, else its position), peak_allocated, peak_reserved (bytes)."""
    rows = [{**s, "step": s["step"] if s.get("step") is not None else i, "run_id": r.run_id, "case": c}
            for r in load(reports) for c, record in _section(r, "memory", case, strict)
            for i, s in enumerate(_objects(record.get("steps"), "memory.steps", strict))]
    return _frame("memory_timeline", rows)


def memory_activations(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """The bytes each module saved for backward, in the order of the forward pass
    (``memory[case]["activations"]``): run_id, case, module, bytes (charged to it), shared_bytes
    (storage it shares with an earlier module's, not charged again), tensors, storages."""
    rows = [{**a, "run_id": r.run_id, "case": c}
            for r in load(reports) for c, record in _section(r, "memory", case, strict)
            for a in _objects(record.get("activations"), "memory.activations", strict)]
    return _frame("memory_activations", rows)


# A trial's per-rank peak metrics (dslab.bench.training.gather_trial) and the kind each one is.
RANK_PEAK_METRICS = {"peak_memory_bytes": "cuda_peak", "peak_rss_bytes": "host_rss"}
# The arm whose profiler records the bench runner keeps.
PROFILED_ARM = RATIO_ARM
_RANK_METRIC = re.compile(r"(peak_memory_bytes|peak_rss_bytes)_rank(\d+)")


def _model_states_per_rank(record: dict, strict: bool) -> dict[int, Any]:
    """``{rank: model-state bytes}`` of a memory record's ``model_states_per_rank`` (a list by
    rank, each the rank's ``model_states`` or null); with ``strict``, ValueError naming the key
    where the list or an entry has the wrong type."""
    per_rank = record.get("model_states_per_rank")
    if not isinstance(per_rank, list):
        if strict and per_rank is not None:
            raise ValueError(f"memory.model_states_per_rank should be a list, not {type(per_rank).__name__}")
        return {}
    out = {}
    for rank, states in enumerate(per_rank):
        if isinstance(states, dict):
            out[rank] = states.get("total")
        elif strict and states is not None:
            raise ValueError(f"memory.model_states_per_rank[{rank}] should be an object, not {type(states).__name__}")
    return out


def rank_memory(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """Each rank's peak memory in every trial of a multi-process run, one row per (run, case,
    arm, trial, rank), ranks in order: run_id, suite, case, arm, trial, rank, kind, peak_bytes,
    model_state_bytes.

    From the trial's metrics ``peak_memory_bytes_rank<r>`` (kind ``cuda_peak``: the CUDA
    allocator's peak over the trial plus what the arm's CUDA-graph pools hold beyond it) or
    ``peak_rss_bytes_rank<r>`` (kind ``host_rss``: the process's largest resident set so far); a
    trial records one kind for all its ranks (were both there, the CUDA peak is kept).
    model_state_bytes is the ``total`` of the rank's model states (parameters, gradients and
    optimizer states, each storage counted once) as the memory tracer recorded them in
    ``memory[case]["model_states_per_rank"]``: on the dslab arm's rows only, the arm the profilers
    trace; missing elsewhere. A single-process run has no rows."""
    rows = []
    for r in load(reports):
        states = {c: _model_states_per_rank(record, strict) for c, record in _section(r, "memory", case, strict)}
        for res in r.results:
            if case is not None and res.case != case:
                continue
            for t in res.trials:
                peaks: dict[int, tuple[str, float]] = {}
                for metric, value in t.metrics.items():
                    match = _RANK_METRIC.fullmatch(metric)
                    if match is None:
                        continue
                    kind, rank = RANK_PEAK_METRICS[match.group(1)], int(match.group(2))
                    if rank not in peaks or kind == "cuda_peak":
                        peaks[rank] = (kind, value)
                model_states = states.get(res.case, {}) if res.arm == PROFILED_ARM else {}
                rows.extend({"run_id": r.run_id, "suite": r.suite, "case": res.case, "arm": res.arm,
                             "trial": t.trial, "rank": rank, "kind": kind, "peak_bytes": value,
                             "model_state_bytes": model_states.get(rank)}
                            for rank, (kind, value) in sorted(peaks.items()))
    return _frame("rank_memory", rows)


def telemetry_timeline(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """One row per NVML sample of each GPU (``telemetry[case]["gpus"][uuid]["samples"]``):
    run_id, case, gpu_uuid, gpu_index, gpu_name, t (seconds from the start), util_gpu, util_mem,
    sm_clock_mhz, mem_used_bytes, power_w, temp_c, throttle (the reasons, comma-separated;
    missing when none)."""
    rows = []
    for r in load(reports):
        for c, record in _section(r, "telemetry", case, strict):
            for uuid, gpu in _dict(record.get("gpus"), "telemetry.gpus", strict).items():
                gpu = _dict(gpu, f"telemetry.gpus.{uuid}", strict)
                for s in _objects(gpu.get("samples"), f"telemetry.gpus.{uuid}.samples", strict):
                    throttle = s.get("throttle")
                    rows.append({**s, "run_id": r.run_id, "case": c, "gpu_uuid": uuid,
                                 "gpu_index": gpu.get("index"), "gpu_name": gpu.get("name"),
                                 "throttle": ",".join(map(str, throttle)) if isinstance(throttle, list) else throttle})
    return _frame("telemetry_timeline", rows)


def wall_clock(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """One row per phase of each case's wall-clock timers (``wall_clock[case]["phases"]``):
    run_id, case, phase, count, mean_ms, median_ms, min_ms, max_ms."""
    rows = []
    for r in load(reports):
        for c, record in _section(r, "wall_clock", case, strict):
            for phase, stats in _dict(record.get("phases"), "wall_clock.phases", strict).items():
                _dict(stats, f"wall_clock.phases.{phase}", strict)
                if isinstance(stats, dict):
                    rows.append({**stats, "run_id": r.run_id, "case": c, "phase": phase})
    return _frame("wall_clock", rows)


def io_records(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """The ``io`` section (``profilers["io"][case]``), one row per record, ``kind`` the producer
    (``tune`` or ``engine``) and ``record`` the row's sort:

    - ``config`` (``dslab nvme-tune``): op, label, block_size, queue_depth, intra_op_parallelism,
      single_submit, overlap_events, GBps (median), spread_pct, trials (their count), trials_GBps
      (their GB/s as a JSON list), round, dropped_after_round;
    - ``operation`` (an engine run, per kind of swap or checkpoint write): op (the kind), count,
      bytes, seconds, GBps, median_GBps, min_GBps, max_GBps, wait_s;
    - ``event`` (an engine run's kept events): op (the kind), bytes, seconds, GBps, wait_s, step, path.

    Columns: run_id, case, kind, record, then the union of the above."""
    rows = []
    for r in load(reports):
        for c, record in _section(r, "io", case, strict):
            base = {"run_id": r.run_id, "case": c, "kind": record.get("kind")}
            for config in _objects(record.get("configs"), "io.configs", strict):
                values = config.get("trials") if isinstance(config.get("trials"), list) else None
                rows.append({**config, **base, "record": "config",
                             "trials": len(values) if values is not None else None,
                             "trials_GBps": json.dumps(values) if values is not None else None})
            for o in _objects(record.get("operations"), "io.operations", strict):
                rows.append({**o, **base, "record": "operation", "op": o.get("kind")})
            for e in _objects(record.get("events"), "io.events", strict):
                rows.append({**e, **base, "record": "event", "op": e.get("kind"), "bytes": e.get("nbytes")})
    return _frame("io_records", rows)


FRAMES: dict[str, Callable[..., pd.DataFrame]] = {
    "runs": runs, "trials": trials, "results": results, "flops_modules": flops_modules,
    "comms_calls": comms_calls, "comms_ops": comms_ops, "stragglers": stragglers,
    "memory_timeline": memory_timeline, "memory_activations": memory_activations, "rank_memory": rank_memory,
    "telemetry_timeline": telemetry_timeline, "wall_clock": wall_clock, "io_records": io_records,
}


def records(frame: pd.DataFrame) -> list[dict]:
    """``frame``'s rows as dicts of plain Python values (str, int, float, bool), None where a
    value is missing."""
    columns = {c: [None if v is pd.NA or (isinstance(v, float) and math.isnan(v)) else v for v in frame[c].tolist()]
               for c in frame.columns}
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def all_frames(reports) -> dict[str, pd.DataFrame]:
    """Every frame of :data:`FRAMES` over ``reports`` (read once), by name."""
    loaded = load(reports)
    return {name: build(loaded) for name, build in FRAMES.items()}


def check_format(fmt: str) -> str:
    """``fmt`` when it is one of :data:`FORMATS`; else ValueError naming them."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    return fmt


def _require_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ValueError("the parquet format needs pyarrow, which is not installed "
                         "(pip install pyarrow), or export as csv or json") from None


def _restore(name: str, frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with the dtypes of frame ``name``'s columns (metrics: float64) and a fresh index."""
    kinds = COLUMNS.get(name, {})
    frame = frame.astype({c: DTYPES[kinds.get(c, "float")] for c in frame.columns})
    return frame.reset_index(drop=True)


def _encode(frame: pd.DataFrame, fmt: str) -> bytes:
    if fmt == "csv":
        return frame.to_csv(index=False, na_rep="").encode()
    if fmt == "parquet":
        buffer = io.BytesIO()
        frame.to_parquet(buffer, index=False, engine="pyarrow")
        return buffer.getvalue()
    return (json.dumps(records(frame), indent=None) + "\n").encode()


def _decode(name: str, path: Path, fmt: str) -> pd.DataFrame:
    kinds = COLUMNS.get(name, {})
    if fmt == "csv":
        header = pd.read_csv(path, nrows=0).columns
        dtypes = {c: DTYPES[kinds.get(c, "float")] for c in header}
        return _restore(name, pd.read_csv(path, dtype=dtypes, keep_default_na=False, na_values=[""]))
    if fmt == "parquet":
        return _restore(name, pd.read_parquet(path, engine="pyarrow"))
    records = json.loads(path.read_text())
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path} is not a JSON list of records")
    columns = list(records[0]) if records else list(kinds)
    return pd.DataFrame({c: pd.Series([_coerce(r.get(c), kinds.get(c, "float")) for r in records],
                                      dtype=DTYPES[kinds.get(c, "float")]) for c in columns})


def export(reports, out_dir: str | Path, fmt: str = "csv") -> list[Path]:
    """Write each non-empty frame of ``reports`` to ``<out_dir>/<name>.<fmt>`` (``fmt`` one of
    :data:`FORMATS`), each atomically (a temp file in ``out_dir``, then a rename); returns the
    paths written. ValueError for an unknown format, or parquet without pyarrow."""
    check_format(fmt)
    if fmt == "parquet":
        _require_pyarrow()
    out = Path(out_dir)
    written = []
    for name, frame in all_frames(reports).items():
        if frame.empty:
            continue
        path = out / f"{name}.{fmt}"
        atomic_write_bytes(path, _encode(frame, fmt))
        written.append(path)
    return written


def read_exported(out_dir: str | Path, fmt: str = "csv") -> dict[str, pd.DataFrame]:
    """The frames :func:`export` wrote to ``out_dir`` in format ``fmt``, by name, with their
    dtypes restored; frames without a file are left out."""
    check_format(fmt)
    if fmt == "parquet":
        _require_pyarrow()
    out = Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"no exported frames at {out}")
    return {name: _decode(name, out / f"{name}.{fmt}", fmt)
            for name in FRAMES if (out / f"{name}.{fmt}").is_file()}


COLUMNS["flops_series"] = _spec("run_id case step:int step_ms:float window_steps:int achieved_tflops:float "
                                "mfu_measured:float mfu_datasheet:float busy_ms:float timer host_lead:bool "
                                "name depth:int forward_ms:float backward_ms:float error")


def flops_series(reports, *, case: str | None = None, strict: bool = False) -> pd.DataFrame:
    """The continuous profile over the run (``flops[case]["continuous"]["profiles"]``, written
    with ``flops_profiler.every_n_steps``), one row per kept module of each profile, the model's
    own row first (name missing, depth 0): run_id, case, step, then the profile's step_ms,
    window_steps, achieved_tflops, mfu_measured, mfu_datasheet, busy_ms, timer ("kernels" or
    "events") and host_lead (whether an events profile's host queued the whole step ahead of the
    device) on each of its rows, and the module's name, depth, forward_ms, backward_ms (device
    time of the profiled step). A
    profile whose timing failed is one row with its ``error``. Not in :data:`FRAMES`: a report
    without the series would export no file for it."""
    rows = []
    for r in load(reports):
        for c, record in _section(r, "flops", case, strict):
            series = _dict(record.get("continuous"), "flops.continuous", strict)
            for p in _objects(series.get("profiles"), "flops.continuous.profiles", strict):
                mfu = _dict(p.get("mfu"), "flops.continuous.profiles.mfu", strict)
                base = {**{k: p.get(k) for k in ("step", "step_ms", "window_steps", "achieved_tflops", "busy_ms",
                                                 "timer", "host_lead", "error")},
                        "run_id": r.run_id, "case": c, "mfu_measured": mfu.get("measured"),
                        "mfu_datasheet": mfu.get("datasheet")}
                modules = _objects(p.get("modules"), "flops.continuous.profiles.modules", strict)
                rows.extend([{**m, **base} for m in modules] or [base])
    return _frame("flops_series", rows)
