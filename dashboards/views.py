"""A run report as the plain tables and series the dashboard and the PNG figures draw.

Pure functions over the DataFrames of :mod:`dslab.report.frames` (a run's ``results``, its
``trials``, one case's ``flops_modules``, ``comms_calls``, ...): no Dash, no plotly, no
matplotlib, and no walking of the report's layout, which the frames own. The pages build those
frames with ``strict=True``, so a section whose data has the wrong shape raises ValueError naming
the key, and the page shows a warning for that section and draws the rest. What no frame holds (a
profile's headline figures: MFU, the device-time step, the roofline's peaks, the memory estimate)
is read from the case's record, ``report.profilers[section][case]`` (:func:`section`). The
Expert load tab's tables are in :mod:`dashboards.experts_view`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pandas as pd

from dslab.report import RunReport, frames
from dslab.report.hardware import lookup_gpu

ROOT_ID = "(root)"
# Bytes per parameter element by the suite's precision, for the roofline's traffic estimate.
PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
TELEMETRY_FIELDS = (
    ("util_gpu", "GPU utilisation (%)"),
    ("power_w", "power (W)"),
    ("sm_clock_mhz", "SM clock (MHz)"),
    ("mem_used_bytes", "memory used (GiB)"),
    ("temp_c", "temperature (C)"),
)
ROOFLINE_NOTE = (
    "Arithmetic intensity = the module's counted flops (forward + backward) / the bytes it moves. "
    "The flops profile records no bytes per module, so the bytes are estimated: parameters read in "
    "forward and backward and their gradients written (3 x params x bytes per element of the "
    "suite's precision) plus the activations it saved for backward, written once and read once "
    "(2 x the memory tracer's bytes of its subtree). Achieved TFLOP/s = flops / (forward + backward "
    "time: the device time of the module's kernels where the profile has it, else the counted "
    "step's latency). Ceilings: the matmul peak and copy bandwidth measured on the device (solid), "
    "the datasheet's (dashed)."
)


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _dict(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} should be an object, not {type(value).__name__}")
    return value


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where} should be a list, not {type(value).__name__}")
    return value


def section(report: RunReport, name: str, case: str | None = None) -> tuple[list[str], str | None, Any]:
    """``(cases with data, chosen case, its data)`` of profiler section ``name``.

    The chosen case is ``case`` when it has data, else the first; ``(.., None, None)`` when the
    section is absent. Raises ValueError when the section is not ``{case: object}``."""
    raw = report.profilers.get(name)
    if raw is None:
        return [], None, None
    raw = _dict(raw, f"profilers.{name}")
    cases = [c for c, v in raw.items() if v is not None]
    for c in cases:
        _dict(raw[c], f"profilers.{name}.{c}")
    if not cases:
        return [], None, None
    chosen = case if case in cases else cases[0]
    return cases, chosen, raw[chosen]


# -- run --------------------------------------------------------------------------------------


def _rows_by_arm(frame: pd.DataFrame) -> dict[tuple[str, str], list[dict]]:
    """The rows (plain values) of a ``results`` or ``trials`` frame by ``(case, arm)``, in the
    frame's order."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in frames.records(frame):
        groups[(row["case"], row["arm"])].append(row)
    return dict(groups)


def trial_spread(trials: pd.DataFrame, metric: str = "samples_per_s") -> dict[str, dict[str, list[float]]]:
    """``{case: {arm: [metric of each trial]}}`` of a run's ``trials`` frame, for the arms whose
    trials have it."""
    out: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for (case, arm), rows in _rows_by_arm(trials).items():
        values = [r[metric] for r in rows if r.get(metric) is not None]
        if values:
            out[case][arm] = values
    return dict(out)


def best_plain_of(results: pd.DataFrame, case: str) -> tuple[str, float] | None:
    """``(best plain arm, dslab over it)`` of ``case`` in a run's ``results`` frame, or None when
    the report names none (see :meth:`dslab.report.RunReport.best_plain_ratio`)."""
    for r in frames.records(results[(results["case"] == case).fillna(False)]):
        if r["best_plain"] and r["dslab_over_arm"] is not None:
            return r["arm"], r["dslab_over_arm"]
    return None


def arm_rows(results: pd.DataFrame, trials: pd.DataFrame) -> list[dict]:
    """One row per (case, arm) of a run's ``results`` frame: medians over trials, the spread of
    step time over ``trials`` (half the range, % of the median), ``dslab/arm`` from the report's
    ratios, and ``best_plain`` (True on the case's best plain-PyTorch arm, see
    :func:`best_plain_rows`); ``expert_tflops`` is None outside MoE runs."""
    steps = trial_spread(trials, "step_time_ms")
    rows = []
    for m in frames.records(results):
        values = steps.get(m["case"], {}).get(m["arm"], [])
        spread = None
        if len(values) > 1 and m.get("step_time_ms"):
            spread = (max(values) - min(values)) / 2 / m["step_time_ms"] * 100
        mfu = m.get("mfu_measured")
        mfu = m.get("mfu_datasheet") if mfu is None else mfu
        rows.append({
            "case": m["case"], "arm": m["arm"], "status": m["status"], "trials": m["trial_count"],
            "samples_per_s": m.get("samples_per_s"), "tokens_per_s": m.get("tokens_per_s"),
            "step_time_ms": m.get("step_time_ms"), "spread_pct": spread,
            "model_tflops": m.get("model_tflops"), "expert_tflops": m.get("expert_tflops"),
            "mfu_pct": 100 * mfu if mfu is not None else None,
            "peak_gib": m["peak_memory_bytes"] / 2**30 if m.get("peak_memory_bytes") is not None else None,
            "dslab_over_arm": m["dslab_over_arm"], "best_plain": bool(m["best_plain"]),
            "error": m["error"].splitlines()[0][:200] if m["error"] else None,
        })
    return rows


def best_plain_rows(results: pd.DataFrame) -> list[dict]:
    """Per case of a run's ``results`` frame, dslab against the case's best plain-PyTorch arm (the
    fastest ok arm other than dslab, as the report stores it; a schema-1 report gets it derived on
    reading): ``{"case", "best_plain_arm", "dslab_samples_per_s", "best_plain_samples_per_s",
    "dslab_over_best_plain"}``. Cases without one (no dslab result, no ok plain arm, a run cut
    short before its ratios) are left out."""
    by_arm = {key: rows[0] for key, rows in _rows_by_arm(results).items()}
    rows = []
    for case in dict.fromkeys(results["case"]):
        best = best_plain_of(results, case)
        if best is None:
            continue
        arm, ratio = best
        dslab, plain = by_arm.get((case, "dslab")), by_arm.get((case, arm))
        rows.append({"case": case, "best_plain_arm": arm,
                     "dslab_samples_per_s": dslab.get("samples_per_s") if dslab else None,
                     "best_plain_samples_per_s": plain.get("samples_per_s") if plain else None,
                     "dslab_over_best_plain": ratio})
    return rows


def best_plain_compare_rows(a: pd.DataFrame, b: pd.DataFrame) -> list[dict]:
    """Per case of either run (their ``results`` frames), dslab over its best plain arm in run A
    and in run B: ``{"case", "A_arm", "A", "B_arm", "B", "B_over_A"}`` (None where a run has no
    such ratio)."""
    rows = []
    for case in dict.fromkeys(list(a["case"]) + list(b["case"])):
        best_a, best_b = best_plain_of(a, case), best_plain_of(b, case)
        if best_a is None and best_b is None:
            continue
        rows.append({"case": case,
                     "A_arm": best_a[0] if best_a else None, "A": best_a[1] if best_a else None,
                     "B_arm": best_b[0] if best_b else None, "B": best_b[1] if best_b else None,
                     "B_over_A": best_b[1] / best_a[1] if best_a and best_b and best_a[1] else None})
    return rows


COMPARED_METRICS = ("samples_per_s", "tokens_per_s", "step_time_ms", "model_tflops")


def compare_rows(a: pd.DataFrame, b: pd.DataFrame, metrics: tuple[str, ...] = COMPARED_METRICS) -> list[dict]:
    """Each (case, arm) of run A's ``results`` frame that run B has too, one row per metric of
    ``metrics`` both measured: ``{"case", "arm", "metric", "A", "B", "B_over_A"}``."""
    theirs = {key: rows[0] for key, rows in _rows_by_arm(b).items()}
    rows = []
    for mine in frames.records(a):
        other = theirs.get((mine["case"], mine["arm"]))
        if other is None:
            continue
        for m in metrics:
            if mine.get(m) is not None and other.get(m) is not None:
                rows.append({"case": mine["case"], "arm": mine["arm"], "metric": m, "A": mine[m], "B": other[m],
                             "B_over_A": other[m] / mine[m] if mine[m] else None})
    return rows


def flatten(prefix: str, value) -> list[tuple[str, str]]:
    """Nested objects (and lists of objects) as ``(dotted key, value)`` rows."""
    rows: list[tuple[str, str]] = []
    if isinstance(value, dict) and value:
        for k, v in value.items():
            rows += flatten(f"{prefix}.{k}" if prefix else str(k), v)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            rows += flatten(f"{prefix}[{i}]", v)
    else:
        rows.append((prefix, "-" if value is None else str(value)))
    return rows


def environment_rows(report: RunReport) -> list[tuple[str, str]]:
    """The environment, config and measured peaks flattened to ``(dotted key, value)`` rows."""
    return (flatten("environment", report.environment) + flatten("config", report.config)
            + flatten("peaks", report.peaks))


# -- flops ------------------------------------------------------------------------------------


def _parent(name: str, names: set[str]) -> str | None:
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in names:
            return candidate
    return "" if name and "" in names else None


def flops_tree(modules: pd.DataFrame) -> list[dict]:
    """One case's ``flops_modules`` frame as tree nodes, parents before children.

    Each node: ``id`` (the module's dotted name, ``(root)`` for the model), ``parent`` (``""`` at
    the top), ``label``, ``type``, ``depth``, ``params``, ``flops`` (forward + backward, raised to
    the sum of its children where a record is below it, so a treemap's sizes add up),
    ``own_flops`` (as recorded), ``latency_ms`` (forward + backward: the device time of the
    module's kernels where the profile has it, else the CUDA-event spans of the counted step),
    ``timing`` (``"device"`` or ``"events"``) and ``tflops`` (achieved: own flops / latency; None
    without a latency). A module named twice is taken once, its first record."""
    records = {}
    for m in frames.records(modules):
        name = m["name"] or ""  # the model itself has no name
        records.setdefault(name, m)
    names = set(records)
    nodes = {}
    for name, m in records.items():
        fwd, bwd = float(m["forward_flops"] or 0), float(m["backward_flops"] or 0)
        timing = "device" if m["forward_device_ms"] is not None else "events"
        prefix = "device" if timing == "device" else "latency"
        latency = (m[f"forward_{prefix}_ms"] or 0.0) + (m[f"backward_{prefix}_ms"] or 0.0)
        parent = _parent(name, names)
        nodes[name] = {
            "id": name or ROOT_ID, "name": name, "parent": "" if parent is None else (parent or ROOT_ID),
            "label": name.rsplit(".", 1)[-1] if name else ROOT_ID, "type": m["type"] or "?",
            "depth": m["depth"] if m["depth"] is not None else (name.count(".") + 1 if name else 0),
            "params": float(m["params"] or 0), "own_flops": fwd + bwd, "flops": fwd + bwd,
            "latency_ms": latency, "timing": timing,
            "tflops": (fwd + bwd) / (latency * 1e-3) / 1e12 if latency > 0 else None,
        }
    children: dict[str, list[str]] = defaultdict(list)
    for name, node in nodes.items():
        if node["parent"]:
            children[node["parent"]].append(node["id"])
    by_id = {node["id"]: node for node in nodes.values()}
    for node in sorted(nodes.values(), key=lambda n: -(n["name"].count(".") + 1) if n["name"] else 0):
        below = sum(by_id[c]["flops"] for c in children.get(node["id"], ()))
        node["flops"] = max(node["flops"], below)
    return sorted(nodes.values(), key=lambda n: n["depth"])


def top_modules(nodes: list[dict], per_depth: int = 5) -> list[dict]:
    """The ``per_depth`` modules with the most flops at each depth, with their share of the
    model's flops."""
    total = sum(n["flops"] for n in nodes if n["parent"] == "")
    rows = []
    by_depth: dict[int, list[dict]] = defaultdict(list)
    for n in nodes:
        by_depth[n["depth"]].append(n)
    for depth in sorted(by_depth):
        ranked = sorted(by_depth[depth], key=lambda n: -n["flops"])[:per_depth]
        for n in ranked:
            rows.append({"depth": depth, "module": n["id"], "type": n["type"], "gflops": n["flops"] / 1e9,
                         "share_pct": 100 * n["flops"] / total if total else None,
                         "latency_ms": n["latency_ms"], "tflops": n["tflops"]})
    return rows


def mfu_rows(data: dict) -> list[tuple[str, str]]:
    """The flops profile's headline figures, with the peaks MFU divides by. The model's achieved
    TFLOP/s and MFU are the steady state's (counted flops over the run's step time) where the
    profile has one; the counted step's own figure is shown apart and labelled: its time includes
    the counting's host work."""
    data = _dict(data, "flops")
    mfu = data.get("mfu") if isinstance(data.get("mfu"), dict) else {}
    peaks = data.get("peaks") if isinstance(data.get("peaks"), dict) else {}
    steady = data.get("steady_state") if isinstance(data.get("steady_state"), dict) else {}
    steady_mfu = steady.get("mfu") if isinstance(steady.get("mfu"), dict) else {}
    device = data.get("device_time") if isinstance(data.get("device_time"), dict) else {}

    def pct(value):
        return "n/a" if _number(value) is None else f"{100 * value:.2f}%"

    def num(value, spec):
        return "n/a" if _number(value) is None else format(value, spec)

    rows = [("total flops per GPU (counted)", num(data.get("total_flops"), ",.0f"))]
    if steady:
        rows += [
            ("achieved TFLOP/s (steady state)", num(steady.get("achieved_tflops"), ".4g")),
            ("MFU (measured peak)", pct(steady_mfu.get("measured"))),
            ("MFU (datasheet peak)", pct(steady_mfu.get("datasheet"))),
            ("steady-state step (ms)", num(steady.get("step_ms"), ".2f") + f" ({steady.get('source', '?')})"),
        ]
    else:
        rows.append(("steady state", "not in this report: the figures below are the counted step's"))
    if device.get("error"):
        rows.append(("module times", f"CUDA-event spans on the counted step: the device timing of step "
                                     f"{device.get('step', '?')} failed ({device['error']})"))
    elif device:
        rows += [
            ("module times", f"device time of the kernels each module ran on step {device.get('step', '?')}"),
            ("device-timed step ran", str(device.get("mode", "-"))),
            ("device busy time of that step (ms)", num(device.get("busy_ms"), ".2f")),
        ]
        if _number(steady.get("device_busy_over_step")) is not None:
            rows.append(("busy time / steady-state step", f"{steady['device_busy_over_step']:.3f}"))
    else:
        rows.append(("module times", "CUDA-event spans on the counted step (host gaps included)"))
    if _number(device.get("steady_busy_ms")) is not None:
        how = {True: "another profiler's hooks: eager", False: "no hooks"}.get(device.get("steady_busy_hooked"),
                                                                               "hooks not recorded")
        rows.append((f"device busy in step {device.get('steady_busy_step', '?')} ({how}) (ms)",
                     num(device["steady_busy_ms"], ".2f")))
        if _number(steady.get("steady_busy_over_step")) is not None:
            rows.append(("busy share of a steady-state step", f"{steady['steady_busy_over_step']:.3f}"))
    rows += [
        ("counted step: TFLOP/s (with counting)" if steady else "achieved TFLOP/s",
         num(data.get("achieved_tflops"), ".4g")),
        ("counted step: MFU (measured peak)" if steady else "MFU (measured peak)", pct(mfu.get("measured"))),
        ("counted step: MFU (datasheet peak)" if steady else "MFU (datasheet peak)", pct(mfu.get("datasheet"))),
        ("peak measured on the device (TFLOP/s)", num(peaks.get("measured_tflops"), ".1f")),
        ("datasheet peak (TFLOP/s)", num(peaks.get("datasheet_tflops"), ".1f")
         + (f" ({peaks['datasheet_gpu']})" if peaks.get("datasheet_gpu") else "")),
        ("peak note", str(peaks.get("note") or "-")),
        ("timing", str(data.get("timing", "-"))),
        ("counting", str(data.get("counting", "-"))),
    ]
    return rows


def step_breakdown(data: dict, modules: pd.DataFrame) -> list[dict]:
    """Where the device-timed step's time went, against the steady-state step: one row each for
    the model's top-level submodules together (from the case's ``flops_modules`` frame), the
    model's own ops outside them (a functional LM head, the loss), the optimizer step, work
    outside the model, and the rest of the steady step (the device idle, or waiting on the host).
    The step's figures come from the profile's record ``data``. ``[]`` without device times."""
    data = _dict(data, "flops")
    device = data.get("device_time") if isinstance(data.get("device_time"), dict) else {}
    if _number(device.get("forward_ms")) is None:
        return []
    top = modules[(modules["depth"] == 1).fillna(False)]
    has_root = bool(modules["name"].isna().any())  # the model itself, named "" in the report
    model_ms = (_number(device.get("forward_ms")) or 0.0) + (_number(device.get("backward_ms")) or 0.0)
    children_ms = float(top["forward_device_ms"].fillna(0).sum() + top["backward_device_ms"].fillna(0).sum())
    unattributed = device.get("unattributed_ms") if isinstance(device.get("unattributed_ms"), dict) else {}
    steady = data.get("steady_state") if isinstance(data.get("steady_state"), dict) else {}
    step_ms = _number(steady.get("step_ms"))
    rows = [
        ("top-level submodules (forward + backward)", children_ms if has_root else model_ms),
        ("the model's own ops outside them", model_ms - children_ms if has_root else 0.0),
        ("optimizer step", _number(device.get("optimizer_ms")) or 0.0),
        ("outside the model and the optimizer", sum(v for v in unattributed.values() if _number(v) is not None)),
    ]
    busy = _number(device.get("busy_ms"))
    if step_ms is not None and busy is not None:
        rows.append(("rest of the steady-state step (device idle or overlapping work)", step_ms - busy))
    return [{"part": part, "device_ms": ms, "share_of_step_pct": 100 * ms / step_ms if step_ms else None}
            for part, ms in rows]


def model_tflops(data: dict) -> float | None:
    """The whole model's achieved TFLOP/s the Flops page shows: the steady state's where the
    profile has one, else the counted step's."""
    data = _dict(data, "flops")
    steady = data.get("steady_state") if isinstance(data.get("steady_state"), dict) else {}
    value = _number(steady.get("achieved_tflops"))
    return value if value is not None else _number(data.get("achieved_tflops"))


def ceilings(report: RunReport, flops_data: dict | None) -> dict:
    """Roofline ceilings: ``measured_tflops`` / ``measured_gbps`` (the run's matmul and copy
    benchmarks) and ``datasheet_tflops`` / ``datasheet_gbps`` (the GPU's datasheet); None where
    unknown."""
    peaks = report.peaks if isinstance(report.peaks, dict) else {}
    fpeaks = (flops_data or {}).get("peaks") if isinstance((flops_data or {}).get("peaks"), dict) else {}
    out = {
        "measured_tflops": _number(peaks.get("bf16_matmul_tflops")) or _number(fpeaks.get("measured_tflops")),
        "measured_gbps": _number(peaks.get("copy_gbps")),
        "datasheet_tflops": _number(fpeaks.get("datasheet_tflops")) or _number(peaks.get("datasheet_bf16_tflops")),
        "datasheet_gbps": None,
    }
    gpus = ((report.environment.get("cuda") or {}).get("gpus") or []) if isinstance(report.environment, dict) else []
    if gpus and isinstance(gpus[0], dict):
        spec = lookup_gpu(str(gpus[0].get("name", "")))
        if spec is not None:
            out["datasheet_gbps"] = spec.memory_bandwidth_tbs * 1e3
            out["datasheet_tflops"] = out["datasheet_tflops"] or spec.bf16_tflops
    return out


def roofline_points(nodes: list[dict], activations: pd.DataFrame | None, precision: str | None) -> list[dict]:
    """Per module of :func:`flops_tree`'s ``nodes`` with flops and a latency: ``{"module", "type",
    "intensity"`` (flop/byte), ``"tflops"``, ``"bytes"}``; bytes are the estimate of
    :data:`ROOFLINE_NOTE`, the activations from the case's ``memory_activations`` frame (None
    without a memory trace)."""
    per_elem = PARAM_BYTES.get(str(precision), 4)
    activations = [(a["module"] or "", a["bytes"] or 0) for a in frames.records(activations)] \
        if activations is not None else []
    points = []
    for n in nodes:
        if not n["own_flops"] or not n["tflops"]:
            continue
        name = n["name"]
        saved = sum(b for module, b in activations
                    if not name or module == name or module.startswith(name + "."))
        nbytes = 3 * n["params"] * per_elem + 2 * saved
        if nbytes <= 0:
            continue
        points.append({"module": n["id"], "type": n["type"], "intensity": n["own_flops"] / nbytes,
                       "tflops": n["tflops"], "bytes": nbytes, "depth": n["depth"]})
    return points


# -- comms ------------------------------------------------------------------------------------


def comms_op_rows(ops: pd.DataFrame) -> list[dict]:
    """The comms logger's per (op, message size) summary rows of the reporting rank, from one
    case's ``comms_ops`` frame."""
    return [{"op": r["op"] or "?", "size_bytes": r["size_bytes"], "count": r["count"],
             "avg_latency_ms": r["avg_latency_ms"], "algbw_GBps": r["algbw_GBps"], "busbw_GBps": r["busbw_GBps"]}
            for r in frames.records(ops)]


def _timed(calls: pd.DataFrame) -> list[dict]:
    """The calls of a ``comms_calls`` frame that name their op and payload, as plain rows."""
    return frames.records(calls[calls["op"].notna() & calls["bytes"].notna() & calls["rank"].notna()])


def bandwidth_points(calls: pd.DataFrame) -> list[dict]:
    """One point per timed call with a payload in one case's ``comms_calls`` frame: ``{"rank",
    "op", "bytes", "algbw_GBps"}`` (algbw = bytes / latency, 1e9 bytes/s)."""
    points = []
    for r in _timed(calls):
        latency = r["latency_ms"]
        if latency and latency > 0 and r["bytes"] > 0:
            points.append({"rank": r["rank"], "op": r["op"], "bytes": r["bytes"],
                           "algbw_GBps": r["bytes"] / (latency * 1e-3) / 1e9})
    return points


def straggler_matrix(calls: pd.DataFrame, stragglers: pd.DataFrame, limit: int = 120) -> dict:
    """Straggler wait per rank and collective of one case: ``{"ranks", "labels",
    "wait_ms"[rank][col], "stragglers"}`` from its ``comms_calls`` and ``stragglers`` frames.

    Collectives are matched across ranks by ``(group, op, seq)`` as the comms analysis does; a
    rank's wait is the last arrival minus its own (arrivals on the reference clock:
    ``arrival_ns - clock_offset_ns``); None where the rank is not in the group. The last
    ``limit`` collectives by time are kept. ``stragglers`` are the ranks the comms analysis named."""
    collectives: dict[tuple, dict[int, int]] = defaultdict(dict)
    for r in _timed(calls):
        if r["arrival_ns"] is not None:
            key = (r["group"] or "", r["op"], r["seq"])
            collectives[key][r["rank"]] = r["arrival_ns"] - (r["clock_offset_ns"] or 0)
    columns = []
    for (group, op, seq), arrivals in collectives.items():
        members = {int(x) for x in group.split(",") if x.strip().isdigit()} or set(arrivals)
        if len(members) < 2 or set(arrivals) != members:
            continue
        last = max(arrivals.values())
        columns.append((min(arrivals.values()), f"{op} #{seq}", {r: (last - t) / 1e6 for r, t in arrivals.items()}))
    columns.sort(key=lambda c: c[0])
    columns = columns[-limit:]
    ranks = sorted(int(r) for r in calls["rank"].dropna().unique())
    named = stragglers[stragglers["straggler"].fillna(False).astype(bool)]["rank"].dropna()
    return {"ranks": ranks, "labels": [c[1] for c in columns],
            "wait_ms": [[c[2].get(rank) for c in columns] for rank in ranks],
            "stragglers": sorted(int(r) for r in named)}


# -- memory -----------------------------------------------------------------------------------


def memory_timeline(steps: pd.DataFrame) -> dict:
    """``{"step", "peak_allocated", "peak_reserved"}`` lists (bytes) over the steps of one case's
    ``memory_timeline`` frame."""
    rows = frames.records(steps)
    return {key: [r[key] for r in rows] for key in ("step", "peak_allocated", "peak_reserved")}


def activation_rows(activations: pd.DataFrame) -> list[dict]:
    """Bytes saved for backward per module, in the order of the forward pass, from one case's
    ``memory_activations`` frame."""
    return [{"module": a["module"] or "?", "bytes": a["bytes"] or 0, "shared_bytes": a["shared_bytes"] or 0}
            for a in frames.records(activations)]


def memory_measured_vs_estimate(data: dict) -> dict:
    """Model states measured (params, grads, optimizer states, optimizer params) beside the
    ZeRO stage-0 estimate, plus activations and the allocator's peak (bytes; None if unknown)."""
    data = _dict(data, "memory")
    states = data.get("model_states") if isinstance(data.get("model_states"), dict) else {}
    peak = data.get("peak") if isinstance(data.get("peak"), dict) else {}
    return {
        "measured": {k: _number(states.get(k)) or 0.0
                     for k in ("params", "grads", "optimizer_states", "optimizer_params")},
        "estimate": _number(states.get("estimate")),
        "estimate_note": states.get("estimate_note") or states.get("estimate_formula"),
        "activation_bytes": _number(data.get("activation_bytes")),
        "peak_allocated": _number(peak.get("allocated")),
        "note": data.get("note"),
    }


RANK_MEMORY_KINDS = {"cuda_peak": "CUDA peak", "host_rss": "host RSS"}
RANK_MEMORY_NOTE = (
    "Each rank's largest peak over the arm's trials. CUDA peak: the allocator's peak over a trial plus "
    "what the arm's CUDA graph pools hold beyond it. Host RSS (a CPU run): the process's largest "
    "resident set since it started, the interpreter and libraries included, so it never falls from one "
    "trial to the next. Model states: the rank's parameters, gradients and optimizer states as the "
    "memory tracer measured them (dslab arm only). Peak / mean: the rank's peak over the mean of its "
    "arm's ranks."
)


def rank_count(ranks: pd.DataFrame) -> int:
    """How many ranks a ``rank_memory`` frame has peaks of."""
    return int(ranks["rank"].dropna().nunique())


def rank_memory_rows(ranks: pd.DataFrame) -> list[dict]:
    """Per (arm, rank) of one case's ``rank_memory`` frame, in its order: ``{"arm", "rank",
    "kind"`` (:data:`RANK_MEMORY_KINDS`' label), ``"trials"``, ``"peak_gib"`` (the largest over
    the trials), ``"model_states_gib"`` (None where the tracer has none), ``"peak_over_mean"``
    (the peak over the mean of the arm's ranks' peaks)``}``."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in frames.records(ranks):
        if row["rank"] is not None and row["peak_bytes"] is not None:
            groups[(row["arm"], row["rank"])].append(row)
    rows = []
    for (arm, rank), trials in groups.items():
        states = next((t["model_state_bytes"] for t in trials if t["model_state_bytes"] is not None), None)
        rows.append({"arm": arm, "rank": rank, "kind": RANK_MEMORY_KINDS.get(trials[0]["kind"], trials[0]["kind"]),
                     "trials": len(trials), "peak_gib": max(t["peak_bytes"] for t in trials) / 2**30,
                     "model_states_gib": states / 2**30 if states is not None else None})
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        mean = sum(r["peak_gib"] for r in mine) / len(mine)
        for r in mine:
            r["peak_over_mean"] = r["peak_gib"] / mean if mean else None
    return rows


# -- telemetry --------------------------------------------------------------------------------


def telemetry_series(samples: pd.DataFrame) -> list[dict]:
    """Per GPU of one case's ``telemetry_timeline`` frame: ``{"gpu": label, "uuid", "t": [s],
    field: [value]}`` for each of :data:`TELEMETRY_FIELDS`."""
    out: dict[str, dict] = {}
    for s in frames.records(samples):
        series = out.get(s["gpu_uuid"])
        if series is None:
            index = "?" if s["gpu_index"] is None else s["gpu_index"]
            series = out[s["gpu_uuid"]] = {"gpu": f"GPU {index} {s['gpu_name'] or ''}".strip(), "uuid": s["gpu_uuid"],
                                           "t": [], **{name: [] for name, _ in TELEMETRY_FIELDS}}
        series["t"].append(s["t"])
        for name, _ in TELEMETRY_FIELDS:
            series[name].append(s[name])
    return list(out.values())
