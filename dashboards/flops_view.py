"""The Flops tab's tables and series: one case's flops profile as DeepSpeed's flops profiler lays
it out (every module with its params, MACs, flops, forward and backward time, achieved TFLOP/s
and share of the model; the module types summed per depth), the treemap's nodes, the headline
figures (MFU, the device-time step) and the roofline's points and ceilings.

Pure functions over one case's ``flops_modules`` frame (:mod:`dslab.report.frames`) and its record
``report.profilers["flops"][case]`` (:func:`dashboards.views.section`), like the rest of
:mod:`dashboards.views`: no Dash, no plotly. A record that holds no profile (the profiler was on
but never reached its step, or failed) is told apart by :func:`why_no_profile`, so the page says
why instead of drawing empty sections.
"""

from __future__ import annotations

from collections import defaultdict

import pandas as pd

from dashboards.folding import fold_tree
from dashboards.views import _dict, _number
from dslab.report import RunReport, frames
from dslab.report.hardware import lookup_gpu

ROOT_ID = "(root)"
OWN_OPS = "(own ops)"
# Bytes per parameter element by the suite's precision, for the roofline's traffic estimate.
PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
TIMED_BY = {"device": "device kernels", "events": "CUDA-event span"}
ROOFLINE_NOTE = (
    "Arithmetic intensity = the module's counted flops (forward + backward) / the bytes it moves. "
    "The flops profile records no bytes per module, so the bytes are estimated: parameters read in "
    "forward and backward and their gradients written (3 x params x bytes per element of the "
    "suite's precision) plus the activations it saved for backward, written once and read once "
    "(2 x the memory tracer's bytes of its subtree). Achieved TFLOP/s = flops / (forward + backward "
    "time: the device time of the module's kernels where the profile has it, else the counted "
    "step's latency). Ceilings: the matmul peak and copy bandwidth measured on the device (solid), "
    "the datasheet's (dashed). Colour: the module's depth in the model (the model itself is depth 0)."
)
MODULES_NOTE = (
    "Every module of the profile, in the model's order (sort or filter any column; depth takes a "
    "number filter). Flops and MACs are the ops the module ran, its submodules' included; fwd MACs "
    "= forward flops / 2, as DeepSpeed's profile prints them. Shares are of the whole model's flops "
    "and forward + backward time. Times: 'device kernels' is the device time of the kernels the "
    "module ran on the device-timed step; 'CUDA-event span' is the module's span on the counted "
    "step, host gaps included (a module the device timer saw no kernels of, or a profile without it). "
    "The treemap folds the numbered blocks of a module list into one box (layers.* is every layers.N: "
    "flops and time summed, its TFLOP/s that of the sums); this table keeps every module."
)
# (field, header) of the per-module table: DeepSpeed's detailed profile, one row per module.
MODULE_COLUMNS = [
    ("module", "module"), ("type", "type"), ("depth", "depth"), ("params_m", "params (M)"),
    ("fwd_gmacs", "fwd MACs (G)"), ("gflops", "flops fwd + bwd (GFLOP)"),
    ("flops_pct", "share of model flops (%)"), ("fwd_ms", "fwd time (ms)"), ("bwd_ms", "bwd time (ms)"),
    ("time_pct", "share of model time (%)"), ("tflops", "achieved TFLOP/s"), ("timed_by", "timed by"),
    ("calls", "calls"),
]
# (field, header) of the module types per depth: DeepSpeed's aggregated profile, every type.
TYPE_COLUMNS = [
    ("depth", "depth"), ("type", "type"), ("modules", "modules"), ("params_m", "params (M)"),
    ("gflops", "flops fwd + bwd (GFLOP)"), ("flops_pct", "share of model flops (%)"),
    ("time_ms", "fwd + bwd time (ms)"), ("time_pct", "share of model time (%)"),
    ("tflops", "achieved TFLOP/s"),
]
BREAKDOWN_COLUMNS = [("part", "part"), ("device_ms", "device time (ms)"),
                     ("share_of_step_pct", "share of the steady-state step (%)")]


def _profiler_on(config: dict) -> bool:
    """Whether the run's config switched the flops profiler on (the suite's engine section, or a
    top-level ``flops_profiler``)."""
    config = config if isinstance(config, dict) else {}
    for holder in (config.get("engine"), config):
        section = holder.get("flops_profiler") if isinstance(holder, dict) else None
        if isinstance(section, dict) and section.get("enabled"):
            return True
    return False


def why_no_profile(report: RunReport, data) -> str | None:
    """Why the chosen case's flops record ``data`` (None: the report has no flops section) holds
    no profile to draw, or None when it holds one.

    The engine's profiler records ``{"profiled": False, "profile_step": N}`` when step N never
    began while it was attached; a record may say why itself (``reason``, ``error``); a report
    whose profiler records failed to be gathered has no section, and a note saying so."""
    if data is None:
        if not _profiler_on(report.config):
            return "no flops profile in this run (flops_profiler off)"
        failed = [n for n in report.notes if isinstance(n, str) and "profiler records failed" in n]
        return ("the flops profiler was on (flops_profiler.enabled) but this report holds no profile"
                + (": " + "; ".join(failed) if failed else ""))
    said = next((str(data[k]) for k in ("reason", "error") if data.get(k)), None)
    if data.get("profiled") is False:
        if said:
            return f"the flops profiler was on but did not profile this case: {said}"
        return (f"the flops profiler was on but did not profile this case: step {data.get('profile_step', '?')} "
                "(flops_profiler.profile_step) never began while it was attached (the run had fewer steps)")
    if said and data.get("modules") is None:
        return f"the flops profile of this case failed: {said}"
    return None


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
    the top), ``label``, ``type``, ``depth``, ``order`` (its place in the frame: the model's
    ``named_modules`` order), ``params``, ``calls``, ``forward_flops`` and ``backward_flops`` (as
    recorded), ``flops`` (forward + backward, raised to the sum of its children where a record is
    below it, so a treemap's sizes add up), ``own_flops`` (forward + backward as recorded),
    ``forward_ms`` / ``backward_ms`` and their sum ``latency_ms`` (the device time of the module's
    kernels where the profile has it, else the CUDA-event spans of the counted step), ``timing``
    (``"device"`` or ``"events"``) and ``tflops`` (achieved: own flops / latency; None without a
    latency). A module named twice is taken once, its first record."""
    records = {}
    for m in frames.records(modules):
        name = m["name"] or ""  # the model itself has no name
        records.setdefault(name, m)
    names = set(records)
    nodes = {}
    for order, (name, m) in enumerate(records.items()):
        fwd, bwd = float(m["forward_flops"] or 0), float(m["backward_flops"] or 0)
        timing = "device" if m["forward_device_ms"] is not None else "events"
        prefix = "device" if timing == "device" else "latency"
        fwd_ms, bwd_ms = m[f"forward_{prefix}_ms"] or 0.0, m[f"backward_{prefix}_ms"] or 0.0
        latency = fwd_ms + bwd_ms
        parent = _parent(name, names)
        nodes[name] = {
            "id": name or ROOT_ID, "name": name, "parent": "" if parent is None else (parent or ROOT_ID),
            "label": name.rsplit(".", 1)[-1] if name else ROOT_ID, "type": m["type"] or "?",
            "depth": m["depth"] if m["depth"] is not None else (name.count(".") + 1 if name else 0),
            "order": order, "params": float(m["params"] or 0), "calls": m["calls"],
            "forward_flops": fwd, "backward_flops": bwd, "own_flops": fwd + bwd, "flops": fwd + bwd,
            "forward_ms": fwd_ms, "backward_ms": bwd_ms, "latency_ms": latency, "timing": timing,
            "tflops": (fwd + bwd) / (latency * 1e-3) / 1e12 if latency > 0 else None,
        }
    children = _children(nodes.values())
    by_id = {node["id"]: node for node in nodes.values()}
    for node in sorted(nodes.values(), key=lambda n: -(n["name"].count(".") + 1) if n["name"] else 0):
        below = sum(by_id[c]["flops"] for c in children.get(node["id"], ()))
        node["flops"] = max(node["flops"], below)
    return sorted(nodes.values(), key=lambda n: n["depth"])


def _children(nodes) -> dict[str, list[str]]:
    children: dict[str, list[str]] = defaultdict(list)
    for node in nodes:
        if node["parent"]:
            children[node["parent"]].append(node["id"])
    return children


def treemap_nodes(nodes: list[dict]) -> list[dict]:
    """:func:`flops_tree`'s ``nodes`` with, under each module whose flops exceed its children's,
    a child labelled :data:`OWN_OPS` holding the difference: the ops the module ran outside its
    submodules (a functional LM head and the loss in the model, the attention core in an
    attention block). Every parent's flops are then the sum of its children's, so a treemap drawn
    with ``branchvalues="total"`` leaves no area unnamed. The own ops' time is the module's device
    time less its children's, where the module has one (a child the device timer attributed no
    kernel to has none, and counts 0); None otherwise, as is their TFLOP/s."""
    by_id = {n["id"]: n for n in nodes}
    out = list(nodes)
    for parent_id, kids in _children(nodes).items():
        parent = by_id[parent_id]
        own = parent["flops"] - sum(by_id[k]["flops"] for k in kids)
        if own <= 0:
            continue
        timed = parent["timing"] == "device"
        own_ms = parent["latency_ms"] - sum(by_id[k]["latency_ms"] for k in kids if by_id[k]["timing"] == "device") \
            if timed else None
        out.append({
            "id": f"{parent_id} {OWN_OPS}", "name": None, "parent": parent_id, "label": OWN_OPS,
            "type": f"ops of {parent_id} outside its submodules", "depth": parent["depth"] + 1,
            "params": 0.0, "flops": own, "own_flops": own, "latency_ms": own_ms, "timing": "device" if timed else None,
            "tflops": own / (own_ms * 1e-3) / 1e12 if own_ms and own_ms > 0 else None,
        })
    return out


def folded_treemap_nodes(nodes: list[dict]) -> list[dict]:
    """:func:`treemap_nodes` of :func:`flops_tree`'s ``nodes`` with the numbered blocks of each
    module list folded into one node (:func:`dashboards.folding.fold_tree`: ``layers.*`` holds
    every ``layers.N``), as the treemap draws them. A folded node's flops, params and time are
    its modules' sums and ``count`` says how many; its achieved TFLOP/s is the flops of its
    modules that have a time over that time (None when none has one), so one block without a
    time does not dilute the others'."""
    prepared = []
    for n in treemap_nodes(nodes):
        timed = n["latency_ms"] is not None and n["latency_ms"] > 0
        prepared.append({**n, "timed_ms": n["latency_ms"] if timed else None,
                         "timed_flops": n["own_flops"] if timed else None})
    folded = fold_tree(prepared, ("flops", "own_flops", "params", "latency_ms", "timed_ms", "timed_flops"), "flops")
    for n in folded:
        n["tflops"] = n["timed_flops"] / (n["timed_ms"] * 1e-3) / 1e12 if n["timed_ms"] and n["timed_flops"] else None
        if n["label"] == OWN_OPS:
            n["type"] = f"ops of {n['parent']} outside its submodules"
    return folded


def _model_totals(nodes: list[dict]) -> tuple[float, float]:
    """The whole model's flops (forward + backward) and time (ms): its top-level nodes' sums."""
    top = [n for n in nodes if n["parent"] == ""]
    return sum(n["flops"] for n in top), sum(n["latency_ms"] for n in top)


def _pct(part: float, whole: float) -> float | None:
    return 100 * part / whole if whole else None


def module_rows(nodes: list[dict]) -> list[dict]:
    """One row per module of :func:`flops_tree`'s ``nodes``, in the model's order, with the fields
    of :data:`MODULE_COLUMNS`: DeepSpeed's detailed profile as a table. Shares are of the model's
    flops and time (:func:`_model_totals`)."""
    flops, time_ms = _model_totals(nodes)
    return [{
        "module": n["id"], "type": n["type"], "depth": n["depth"], "params_m": n["params"] / 1e6,
        "fwd_gmacs": n["forward_flops"] / 2 / 1e9, "gflops": n["flops"] / 1e9, "flops_pct": _pct(n["flops"], flops),
        "fwd_ms": n["forward_ms"], "bwd_ms": n["backward_ms"], "time_pct": _pct(n["latency_ms"], time_ms),
        "tflops": n["tflops"], "timed_by": TIMED_BY[n["timing"]], "calls": n["calls"],
    } for n in sorted(nodes, key=lambda n: n["order"])]


def type_rows(nodes: list[dict]) -> list[dict]:
    """Every module type at each depth, its modules summed (DeepSpeed's aggregated profile, with
    no cap on the types shown): the fields of :data:`TYPE_COLUMNS`, by depth and then by flops.
    Achieved TFLOP/s is the type's recorded flops over its modules' time."""
    flops, time_ms = _model_totals(nodes)
    groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for n in nodes:
        groups[(n["depth"], n["type"])].append(n)
    rows = []
    for (depth, type_), members in groups.items():
        total = sum(n["flops"] for n in members)
        own = sum(n["own_flops"] for n in members)
        ms = sum(n["latency_ms"] for n in members)
        rows.append({"depth": depth, "type": type_, "modules": len(members),
                     "params_m": sum(n["params"] for n in members) / 1e6, "gflops": total / 1e9,
                     "flops_pct": _pct(total, flops), "time_ms": ms, "time_pct": _pct(ms, time_ms),
                     "tflops": own / (ms * 1e-3) / 1e12 if ms > 0 else None})
    return sorted(rows, key=lambda r: (r["depth"], -r["gflops"]))


def top_modules(nodes: list[dict], per_depth: int = 5) -> list[dict]:
    """The ``per_depth`` modules with the most flops at each depth, with their share of the
    model's flops (the PNG figure's bars, :mod:`dashboards.plots`)."""
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
