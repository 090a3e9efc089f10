"""A run report as the plain tables and series the dashboard and the PNG figures draw.

Pure functions over a :class:`dslab.report.RunReport` (or one profiler section of it): no Dash,
no plotly, no matplotlib. Each raises ValueError naming the key when a section's data has the wrong
shape, so a page can show a warning for that section and draw the rest. Profiler sections are
stored per case (``report.profilers[section][case]``, see ``dslab.bench.runner``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from dslab.report import RunReport
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


def arm_rows(report: RunReport) -> list[dict]:
    """One row per (case, arm): medians over trials, the spread of step time over trials (half
    the range, % of the median), ``dslab/arm`` from the report's ratios, and ``best_plain``
    (True on the case's best plain-PyTorch arm, see :func:`best_plain_rows`); ``expert_tflops``
    is None outside MoE runs."""
    rows = []
    for r in report.results:
        m = r.metrics
        steps = r.trial_values("step_time_ms")
        spread = None
        if len(steps) > 1 and m.get("step_time_ms"):
            spread = (max(steps) - min(steps)) / 2 / m["step_time_ms"] * 100
        ratios = report.ratios.get(r.case) if isinstance(report.ratios.get(r.case), dict) else {}
        best = report.best_plain_ratio(r.case)
        rows.append({
            "case": r.case, "arm": r.arm, "status": r.status, "trials": len(r.trials),
            "samples_per_s": m.get("samples_per_s"), "tokens_per_s": m.get("tokens_per_s"),
            "step_time_ms": m.get("step_time_ms"), "spread_pct": spread,
            "model_tflops": m.get("model_tflops"), "expert_tflops": m.get("expert_tflops"),
            "mfu_pct": 100 * mfu if (mfu := m.get("mfu_measured", m.get("mfu_datasheet"))) is not None else None,
            "peak_gib": m["peak_memory_bytes"] / 2**30 if m.get("peak_memory_bytes") is not None else None,
            "dslab_over_arm": _number(ratios.get(f"dslab/{r.arm}")),
            "best_plain": best is not None and best[0] == r.arm,
            "error": (r.error or "").splitlines()[0][:200] if r.error else None,
        })
    return rows


def best_plain_rows(report: RunReport) -> list[dict]:
    """Per case, dslab against the case's best plain-PyTorch arm (the fastest ok arm other than
    dslab, as the report stores it; a schema-1 report gets it derived on reading):
    ``{"case", "best_plain_arm", "dslab_samples_per_s", "best_plain_samples_per_s",
    "dslab_over_best_plain"}``. Cases without one (no dslab result, no ok plain arm, a run cut
    short before its ratios) are left out."""
    rows = []
    for case in report.cases():
        best = report.best_plain_ratio(case)
        if best is None:
            continue
        arm, ratio = best
        dslab, plain = report.result(case, "dslab"), report.result(case, arm)
        rows.append({"case": case, "best_plain_arm": arm,
                     "dslab_samples_per_s": dslab.metrics.get("samples_per_s") if dslab else None,
                     "best_plain_samples_per_s": plain.metrics.get("samples_per_s") if plain else None,
                     "dslab_over_best_plain": ratio})
    return rows


def best_plain_compare_rows(a: RunReport, b: RunReport) -> list[dict]:
    """Per case of either run, dslab over its best plain arm in run A and in run B:
    ``{"case", "A_arm", "A", "B_arm", "B", "B_over_A"}`` (None where a run has no such ratio)."""
    rows = []
    for case in dict.fromkeys(a.cases() + b.cases()):
        best_a, best_b = a.best_plain_ratio(case), b.best_plain_ratio(case)
        if best_a is None and best_b is None:
            continue
        rows.append({"case": case,
                     "A_arm": best_a[0] if best_a else None, "A": best_a[1] if best_a else None,
                     "B_arm": best_b[0] if best_b else None, "B": best_b[1] if best_b else None,
                     "B_over_A": best_b[1] / best_a[1] if best_a and best_b and best_a[1] else None})
    return rows


def trial_spread(report: RunReport, metric: str = "samples_per_s") -> dict[str, dict[str, list[float]]]:
    """``{case: {arm: [metric of each trial]}}`` for results that have trials."""
    out: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for r in report.results:
        values = r.trial_values(metric)
        if values:
            out[r.case][r.arm] = values
    return dict(out)


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


def flops_tree(data: dict) -> list[dict]:
    """The flops profile's modules as tree nodes, parents before children.

    Each node: ``id`` (the module's dotted name, ``(root)`` for the model), ``parent`` (``""`` at
    the top), ``label``, ``type``, ``depth``, ``params``, ``flops`` (forward + backward, raised to
    the sum of its children where a record is below it, so a treemap's sizes add up),
    ``own_flops`` (as recorded), ``latency_ms`` (forward + backward: the device time of the
    module's kernels where the profile has it, else the CUDA-event spans of the counted step),
    ``timing`` (``"device"`` or ``"events"``) and ``tflops`` (achieved: own flops / latency; None
    without a latency)."""
    modules = _list(_dict(data, "flops").get("modules"), "flops.modules")
    records = {}
    for i, m in enumerate(modules):
        m = _dict(m, f"flops.modules[{i}]")
        name = m.get("name")
        if not isinstance(name, str) or name in records:
            continue
        records[name] = m
    names = set(records)
    nodes = {}
    for name, m in records.items():
        fwd, bwd = _number(m.get("forward_flops")) or 0.0, _number(m.get("backward_flops")) or 0.0
        timing = "device" if _number(m.get("forward_device_ms")) is not None else "events"
        prefix = "device" if timing == "device" else "latency"
        latency = (_number(m.get(f"forward_{prefix}_ms")) or 0.0) + (_number(m.get(f"backward_{prefix}_ms")) or 0.0)
        parent = _parent(name, names)
        nodes[name] = {
            "id": name or ROOT_ID, "name": name, "parent": "" if parent is None else (parent or ROOT_ID),
            "label": name.rsplit(".", 1)[-1] if name else ROOT_ID, "type": str(m.get("type", "?")),
            "depth": int(m.get("depth", name.count(".") + 1 if name else 0)),
            "params": _number(m.get("params")) or 0.0, "own_flops": fwd + bwd, "flops": fwd + bwd,
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


def step_breakdown(data: dict) -> list[dict]:
    """Where the device-timed step's time went, against the steady-state step: one row each for
    the model's top-level submodules together, the model's own ops outside them (a functional
    LM head, the loss), the optimizer step, work outside the model, and the rest of the steady
    step (the device idle, or waiting on the host). ``[]`` without device times."""
    data = _dict(data, "flops")
    device = data.get("device_time") if isinstance(data.get("device_time"), dict) else {}
    if _number(device.get("forward_ms")) is None:
        return []
    modules = [m for m in _list(data.get("modules"), "flops.modules") if isinstance(m, dict)]
    root = next((m for m in modules if m.get("name") == ""), None)

    def device_ms(m) -> float:
        return (_number(m.get("forward_device_ms")) or 0.0) + (_number(m.get("backward_device_ms")) or 0.0)

    model_ms = (_number(device.get("forward_ms")) or 0.0) + (_number(device.get("backward_ms")) or 0.0)
    children_ms = sum(device_ms(m) for m in modules if m.get("depth") == 1)
    unattributed = device.get("unattributed_ms") if isinstance(device.get("unattributed_ms"), dict) else {}
    steady = data.get("steady_state") if isinstance(data.get("steady_state"), dict) else {}
    step_ms = _number(steady.get("step_ms"))
    rows = [
        ("top-level submodules (forward + backward)", children_ms if root is not None else model_ms),
        ("the model's own ops outside them", model_ms - children_ms if root is not None else 0.0),
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


def roofline_points(nodes: list[dict], memory_data: dict | None, precision: str | None) -> list[dict]:
    """Per module with flops and a latency: ``{"module", "type", "intensity"`` (flop/byte),
    ``"tflops"``, ``"bytes"}``; bytes are the estimate of :data:`ROOFLINE_NOTE`."""
    per_elem = PARAM_BYTES.get(str(precision), 4)
    activations = []
    if isinstance(memory_data, dict) and isinstance(memory_data.get("activations"), list):
        activations = [(str(a.get("module", "")), _number(a.get("bytes")) or 0.0)
                       for a in memory_data["activations"] if isinstance(a, dict)]
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


def comms_op_rows(data: dict) -> list[dict]:
    """The comms logger's per (op, message size) summary rows of the reporting rank."""
    rows = []
    for i, row in enumerate(_list(_dict(data, "comms").get("ops", []), "comms.ops")):
        row = _dict(row, f"comms.ops[{i}]")
        rows.append({"op": str(row.get("op", "?")), "size_bytes": _number(row.get("size_bytes")),
                     "count": _number(row.get("count")), "avg_latency_ms": _number(row.get("avg_latency_ms")),
                     "algbw_GBps": _number(row.get("algbw_GBps")), "busbw_GBps": _number(row.get("busbw_GBps"))})
    return rows


def comms_records(data: dict) -> dict[int, list[dict]]:
    """``{rank: [record]}`` of every rank's collectives, records without an op or bytes left out."""
    per_rank = _dict(_dict(data, "comms").get("per_rank", {}), "comms.per_rank")
    out = {}
    for key, records in per_rank.items():
        try:
            rank = int(key)
        except ValueError:
            raise ValueError(f"comms.per_rank has a rank {key!r} that is not an integer") from None
        out[rank] = [r for r in _list(records, f"comms.per_rank.{key}")
                     if isinstance(r, dict) and isinstance(r.get("op"), str) and _number(r.get("bytes")) is not None]
    return dict(sorted(out.items()))


def bandwidth_points(data: dict) -> list[dict]:
    """One point per timed call with a payload: ``{"rank", "op", "bytes", "algbw_GBps"}``
    (algbw = bytes / latency, 1e9 bytes/s)."""
    points = []
    for rank, records in comms_records(data).items():
        for r in records:
            latency = _number(r.get("latency_ms"))
            if latency and latency > 0 and r["bytes"] > 0:
                points.append({"rank": rank, "op": r["op"], "bytes": r["bytes"],
                               "algbw_GBps": r["bytes"] / (latency * 1e-3) / 1e9})
    return points


def straggler_matrix(data: dict, limit: int = 120) -> dict:
    """Straggler wait per rank and collective: ``{"ranks", "labels", "wait_ms"[rank][col]}``.

    Collectives are matched across ranks by ``(group, op, seq)`` as the comms analysis does; a
    rank's wait is the last arrival minus its own (arrivals on the reference clock, minus
    ``clock_offsets_ns``); None where the rank is not in the group. The last ``limit``
    collectives by time are kept. ``stragglers`` are the ranks the comms analysis named."""
    data = _dict(data, "comms")
    offsets = data.get("clock_offsets_ns") if isinstance(data.get("clock_offsets_ns"), dict) else {}
    per_rank = comms_records(data)
    collectives: dict[tuple, dict[int, float]] = defaultdict(dict)
    for rank, records in per_rank.items():
        offset = _number(offsets.get(str(rank))) or 0.0
        for r in records:
            arrival = _number(r.get("arrival_ns"))
            if arrival is not None:
                collectives[(str(r.get("group", "")), r["op"], r.get("seq"))][rank] = arrival - offset
    columns = []
    for (group, op, seq), arrivals in collectives.items():
        members = {int(x) for x in group.split(",") if x.strip().isdigit()} or set(arrivals)
        if len(members) < 2 or set(arrivals) != members:
            continue
        last = max(arrivals.values())
        columns.append((min(arrivals.values()), f"{op} #{seq}", {r: (last - t) / 1e6 for r, t in arrivals.items()}))
    columns.sort(key=lambda c: c[0])
    columns = columns[-limit:]
    ranks = sorted(per_rank)
    stragglers = data.get("stragglers") if isinstance(data.get("stragglers"), list) else []
    return {"ranks": ranks, "labels": [c[1] for c in columns],
            "wait_ms": [[c[2].get(rank) for c in columns] for rank in ranks],
            "stragglers": [s for s in stragglers if isinstance(s, int)]}


# -- memory -----------------------------------------------------------------------------------


def memory_timeline(data: dict) -> dict:
    """``{"step", "peak_allocated", "peak_reserved"}`` lists (bytes) over steps."""
    steps = _list(_dict(data, "memory").get("steps", []), "memory.steps")
    out = {"step": [], "peak_allocated": [], "peak_reserved": []}
    for i, s in enumerate(steps):
        s = _dict(s, f"memory.steps[{i}]")
        out["step"].append(_number(s.get("step")) if s.get("step") is not None else i)
        out["peak_allocated"].append(_number(s.get("peak_allocated")))
        out["peak_reserved"].append(_number(s.get("peak_reserved")))
    return out


def activation_rows(data: dict) -> list[dict]:
    """Bytes saved for backward per module, in the order of the forward pass."""
    rows = []
    for i, a in enumerate(_list(_dict(data, "memory").get("activations", []), "memory.activations")):
        a = _dict(a, f"memory.activations[{i}]")
        rows.append({"module": str(a.get("module", "?")), "bytes": _number(a.get("bytes")) or 0.0,
                     "shared_bytes": _number(a.get("shared_bytes")) or 0.0})
    return rows


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


# -- telemetry --------------------------------------------------------------------------------


def telemetry_series(data: dict) -> list[dict]:
    """Per GPU: ``{"gpu": label, "t": [s], field: [value]}`` for each of :data:`TELEMETRY_FIELDS`."""
    gpus = _dict(_dict(data, "telemetry").get("gpus", {}), "telemetry.gpus")
    out = []
    for uuid, gpu in gpus.items():
        gpu = _dict(gpu, f"telemetry.gpus.{uuid}")
        samples = [s for s in _list(gpu.get("samples", []), f"telemetry.gpus.{uuid}.samples") if isinstance(s, dict)]
        series = {"gpu": f"GPU {gpu.get('index', '?')} {gpu.get('name', '')}".strip(), "uuid": uuid,
                  "t": [_number(s.get("t")) for s in samples]}
        for name, _ in TELEMETRY_FIELDS:
            series[name] = [_number(s.get(name)) for s in samples]
        out.append(series)
    return out


# -- experts (MoE) ----------------------------------------------------------------------------

EXPERT_LOAD_NOTE = (
    "Routing of the dslab arm's last timed step (rank 0's tokens): each cell is the share of the layer's "
    "(token, expert) assignments that chose the expert, before capacity dropping; a uniform router gives "
    "1 / experts in every cell. Dropped: assignments past their expert's capacity (none when dropless). "
    "Expert TFLOP/s: the arm's expert flops per step over its step time (12 x hidden x ffn per kept "
    "assignment and MoE layer; the hf arm's gated experts do three matrices)."
)


def has_moe(report: RunReport) -> bool:
    """Whether the report holds MoE records (``profilers["moe"]`` with a case)."""
    raw = report.profilers.get("moe") if isinstance(report.profilers, dict) else None
    return isinstance(raw, dict) and any(isinstance(v, dict) for v in raw.values())


def expert_load(data: dict) -> dict:
    """One case's MoE record (``profilers["moe"][case]``) as a layer x expert table.

    Returns ``{"layers": ["layer 1", ...], "experts": ["expert 0", ...], "counts": [[int]],
    "share_pct": [[% of the layer's assignments]], "rows": [per layer: "layer", "assignments",
    "dropped", "dropped_pct", "max_over_mean", "capacity"], "dropped_pct": over every layer,
    "num_experts", "k", "tokens_per_step", "drop_tokens"}``. Raises ValueError when the record
    has no layers or a layer's counts are not a list of numbers of one length."""
    data = _dict(data, "moe")
    layers = _list(data.get("layers"), "moe.layers")
    if not layers:
        raise ValueError("moe.layers is empty")
    labels, counts, shares, rows = [], [], [], []
    width = None
    for i, layer in enumerate(layers):
        layer = _dict(layer, f"moe.layers[{i}]")
        values = _list(layer.get("exp_counts"), f"moe.layers[{i}].exp_counts")
        if not values or any(_number(v) is None for v in values):
            raise ValueError(f"moe.layers[{i}].exp_counts should be a list of numbers")
        if width is not None and len(values) != width:
            raise ValueError(f"moe.layers[{i}].exp_counts has {len(values)} experts, the first layer {width}")
        width = len(values)
        total = sum(values)
        dropped = _number(layer.get("dropped")) or 0.0
        labels.append(f"layer {layer.get('layer', i)}")
        counts.append([int(v) for v in values])
        shares.append([100 * v / total if total else 0.0 for v in values])
        rows.append({"layer": labels[-1], "assignments": total, "dropped": dropped,
                     "dropped_pct": 100 * dropped / total if total else 0.0,
                     "max_over_mean": max(values) * len(values) / total if total else None,
                     "capacity": _number(layer.get("capacity"))})
    fraction = _number(data.get("dropped_fraction"))
    if fraction is None:
        assigned = sum(r["assignments"] for r in rows)
        fraction = sum(r["dropped"] for r in rows) / assigned if assigned else 0.0
    def count(key):
        value = _number(data.get(key))
        return None if value is None else int(value)

    return {"layers": labels, "experts": [f"expert {e}" for e in range(width)], "counts": counts,
            "share_pct": shares, "rows": rows, "dropped_pct": 100 * fraction,
            "num_experts": count("num_experts") or width, "k": count("k"),
            "tokens_per_step": count("tokens_per_step"), "drop_tokens": data.get("drop_tokens")}


def expert_tflops_rows(report: RunReport, case: str, data: dict | None = None) -> list[dict]:
    """Per arm of ``case``: its expert flops per step (from the MoE record, where it has them),
    median step time and expert TFLOP/s (median over trials)."""
    flops = (data or {}).get("expert_flops_per_step") if isinstance((data or {}).get("expert_flops_per_step"),
                                                                      dict) else {}
    rows = []
    for r in report.results:
        if r.case != case:
            continue
        rows.append({"arm": r.arm, "status": r.status,
                     "expert_gflops_per_step": _number(flops.get(r.arm)) / 1e9 if _number(flops.get(r.arm)) else None,
                     "step_time_ms": r.metrics.get("step_time_ms"), "expert_tflops": r.metrics.get("expert_tflops")})
    return rows


def all_to_all_rows(data: dict) -> list[dict]:
    """The record's ``all_to_all`` rows (expert parallelism), in the comms table's columns."""
    raw = _dict(data, "moe").get("all_to_all")
    if raw is None:
        return []
    return comms_op_rows({"ops": _list(raw, "moe.all_to_all")})
