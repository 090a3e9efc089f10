"""The Memory tab's tables and figures: the allocator's peaks per step with the trials, warm-ups
and profiled steps marked, the profiled step phase by phase, activation memory as a module tree,
the model states beside their estimate, each rank's peak, and where the step's wall time went.

Pure functions over one case's ``memory_timeline``, ``memory_activations``, ``rank_memory`` and
``wall_clock`` frames (:mod:`dslab.report.frames`), the case's memory record
(``report.profilers["memory"][case]``) and the run's config and results, plus the plotly figures
drawn from them.

Marks on the timeline. The memory tracer records its steps by the engine's step number and
nothing else about them; the bench runs the profiled arm's trials one after another on one
engine, trial 0 after ``warmup_steps`` untimed steps and each later trial after a few settle
steps (the bench's constant, inferred here from the number of steps recorded), each for ``steps``
timed steps. So a step's trial, and whether it was warm-up, follows from the run's config and the
arm's trial count, and is drawn only when that arithmetic accounts for every recorded step. The
memory tracer's profiled step (phase deltas, activations) and the flops profile's step are drawn
as lines. Where the CUDA graph was captured, and where forward, backward and the optimizer ran
inside a step, the records do not say; the profiled step's phases are drawn on their own axis.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import TYPE_CHECKING

import pandas as pd

from dashboards.figure_base import empty_figure, laid_out, plotly_go
from dashboards.folding import fold_tree, folds_any
from dashboards.views import _dict, _number
from dslab.report import RunReport, frames

if TYPE_CHECKING:
    import plotly.graph_objects as go

MARGIN = {"l": 70, "r": 20, "t": 60, "b": 50}
ROOT = "(root)"
OUTSIDE = "(outside modules)"
TOP_MODULES = 25
PHASE_HOOKS = (("forward_begin", "forward begins"), ("forward_end", "forward ends"),
               ("backward_begin", "backward begins"), ("backward_end", "backward ends"),
               ("optimizer_begin", "optimizer step begins"), ("optimizer_end", "optimizer step ends"))
PHASES = (("forward", "forward"), ("backward", "backward"), ("optimizer", "optimizer step"))
WALL_CLOCK_PHASES = {"forward": "forward", "backward": "backward", "step": "optimizer step"}
PHASE_COLOURS = {"forward": "#1f77b4", "backward": "#ff7f0e", "optimizer step": "#2ca02c",
                 "rest of the measured step": "#9ca3af"}

ACTIVATION_COLUMNS = [
    ("module", "module"), ("instances", "instances"), ("mib", "MiB (with children)"), ("own_mib", "own MiB"),
    ("per_instance_mib", "MiB per instance"), ("share_pct", "% of all"), ("shared_mib", "shared MiB"),
    ("path", "path"),
]
PHASE_COLUMNS = [("phase", "phase"), ("begin_gib", "allocated at begin (GiB)"),
                 ("end_gib", "allocated at end (GiB)"), ("delta_mib", "change (MiB)")]
PEAK_SITE_COLUMNS = [("site", "allocated at (the innermost dslab line)"), ("gib", "GiB at the peak"),
                     ("blocks", "blocks"), ("share_pct", "% of the peak")]
PEAK_SITE_NOTE = ("The blocks live at the profiled step's highest point in the CUDA allocator's trace, "
                  "summed by the dslab line that allocated them (the largest sites); blocks from before "
                  "the step (parameters, optimizer states) are one row. Recorded with memory_tracer.snapshot.")
WALL_CLOCK_COLUMNS = [
    ("phase", "phase"), ("count", "intervals"), ("per_step", "per optimizer step"), ("median_ms", "median (ms)"),
    ("mean_ms", "mean (ms)"), ("min_ms", "min (ms)"), ("max_ms", "max (ms)"), ("step_ms", "ms per step"),
    ("share_pct", "% of the measured step"),
]
ACTIVATION_NOTE = (
    "Bytes each module saved for backward on the profiled step, a storage charged once, to the first "
    "module that saved it (shared: storage it saved that an earlier module was charged for). A parent holds "
    "its children. The treemap and the table fold the numbered blocks of a module list into one (layers.* is "
    "every layers.N, their bytes summed); the treemap holds every folded module, three levels at a time "
    "(click a box to open it), the table the largest rows by bytes with their parents."
)
TIMELINE_NOTE = (
    "Peaks since each step began, of the profiled arm only (the other arms run between its trials, so the "
    "reserved pool can grow at a trial's start). Shaded: each trial's warm-up (grey) and timed steps (blue), "
    "from the run's config and the arm's trials; lines: the memory tracer's profiled step and the flops "
    "profile's step. The records hold no CUDA-graph capture step and no phase times within a step."
)
WALL_CLOCK_NOTE = (
    "wall_clock_breakdown: the engine's forward, backward and optimizer-step intervals over every step of "
    "the arm, warm-up included (CUDA events on the current stream on a GPU, the host clock on a CPU). Per "
    "step: the median interval times the intervals per optimizer step (micro-steps of gradient "
    "accumulation). The rest is the arm's median measured step time minus those: data, hooks, and waiting."
)


def _go():
    return plotly_go()


def _layout(fig: go.Figure, title: str, **kwargs) -> go.Figure:
    return laid_out(fig, title, MARGIN, **kwargs)


def _empty(title: str, message: str) -> go.Figure:
    return empty_figure(title, message, MARGIN)


# -- timeline ---------------------------------------------------------------------------------


def memory_timeline(steps: pd.DataFrame) -> dict:
    """``{"step", "peak_allocated", "peak_reserved"}`` lists (bytes) over the steps of one case's
    ``memory_timeline`` frame."""
    rows = frames.records(steps)
    return {key: [r[key] for r in rows] for key in ("step", "peak_allocated", "peak_reserved")}


def profiled_result(report: RunReport, key: str):
    """The result of the arm whose profiler records are ``profilers[section][key]``: the dslab
    arm of case ``key``, or the arm a data-parallel run names in its key (``"355m-n4
    dslab-zero2"``); None when neither is in the report."""
    result = report.result(key, frames.PROFILED_ARM)
    if result is not None:
        return result
    return next((r for r in report.results if f"{r.case} {r.arm}" == key), None)


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def timeline_marks(report: RunReport, key: str, steps: list[int], data: dict) -> dict:
    """What the memory timeline of case ``key`` marks (module docstring): ``{"arm", "trials":
    [{"trial", "warmup": (first, last) or None, "timed": (first, last)}], "profile_step"`` (the
    memory tracer's, when it recorded phases or activations), ``"flops_step"`` (the flops
    profile's), ``"note"`` (why there are no trial marks, else None)``}``."""
    data = _dict(data, "memory")
    profiled = bool(data.get("activations")) or any(
        _number((data.get("phases") or {}).get(f"{p}_delta")) is not None for p, _ in PHASES)
    flops = (report.profilers.get("flops") or {}).get(key) if isinstance(report.profilers.get("flops"), dict) else None
    marks = {"arm": None, "trials": [], "note": None,
             "profile_step": _count(data.get("profile_step")) if profiled else None,
             "flops_step": _count(flops.get("profile_step")) if isinstance(flops, dict) and flops.get("profiled") else None}
    result = profiled_result(report, key)
    config = report.config if isinstance(report.config, dict) else {}
    warmup, timed = _count(config.get("warmup_steps")), _count(config.get("steps"))
    if not steps or result is None or not result.trials or warmup is None or not timed:
        marks["note"] = "no trial marks: the run's config or the profiled arm's trials are missing"
        return marks
    marks["arm"] = result.arm
    trials, first = len(result.trials), min(steps)
    total = max(steps) - first + 1
    if trials == 1:
        settle, fits = 0, total == warmup + timed
    else:
        later, remainder = divmod(total - warmup - timed, trials - 1)
        settle = later - timed
        fits = remainder == 0 and 0 <= settle <= warmup
    if not fits:
        marks["note"] = (f"no trial marks: {total} steps recorded, not {trials} trials of {timed} timed steps "
                         f"after {warmup} warm-up steps")
        return marks
    start = first
    for t in range(trials):
        ahead = warmup if t == 0 else settle
        marks["trials"].append({"trial": t, "warmup": (start, start + ahead - 1) if ahead else None,
                                "timed": (start + ahead, start + ahead + timed - 1)})
        start += ahead + timed
    return marks


# -- the profiled step ------------------------------------------------------------------------


def phase_rows(data: dict) -> list[dict]:
    """The memory tracer's phase deltas of the profiled step (``memory[case]["phases"]``), keyed
    as :data:`PHASE_COLUMNS`: per phase, the allocated bytes at its begin and end hooks (GiB) and
    the change (MiB); ``[]`` when the tracer recorded none (a CPU run)."""
    data = _dict(data, "memory")
    phases = data.get("phases") if isinstance(data.get("phases"), dict) else {}
    allocated = phases.get("allocated") if isinstance(phases.get("allocated"), dict) else {}
    rows = []
    for key, label in PHASES:
        delta = _number(phases.get(f"{key}_delta"))
        if delta is None:
            continue
        begin, end = _number(allocated.get(f"{key}_begin")), _number(allocated.get(f"{key}_end"))
        rows.append({"phase": label, "begin_gib": begin / 2**30 if begin is not None else None,
                     "end_gib": end / 2**30 if end is not None else None, "delta_mib": delta / 2**20})
    return rows


def phase_levels(data: dict) -> list[tuple[str, float]]:
    """``[(hook, allocated GiB)]`` at each of the profiled step's hooks the tracer recorded, in
    the order they run (:data:`PHASE_HOOKS`)."""
    data = _dict(data, "memory")
    phases = data.get("phases") if isinstance(data.get("phases"), dict) else {}
    allocated = phases.get("allocated") if isinstance(phases.get("allocated"), dict) else {}
    return [(label, allocated[key] / 2**30) for key, label in PHASE_HOOKS if _number(allocated.get(key)) is not None]


def profiled_step_figure(levels: list[tuple[str, float]], step_peak_gib: float | None, step: int | None,
                         case: str) -> go.Figure:
    """The allocated memory at each hook of the profiled step, with the step's allocator peak."""
    go = _go()
    fig = go.Figure(go.Scatter(x=[h for h, _ in levels], y=[v for _, v in levels], mode="lines+markers+text",
                               name="allocated", line={"shape": "hv"}, text=[f"{v:.2f}" for _, v in levels],
                               textposition="top center"))
    if step_peak_gib is not None:
        fig.add_hline(y=step_peak_gib, line_dash="dash", line_color="#d62728",
                      annotation_text=f"peak allocated in step {step}: {step_peak_gib:.2f} GiB")
    fig.update_yaxes(title="GiB allocated", rangemode="tozero")
    return _layout(fig, f"{case}: the profiled step (step {step}), phase by phase", height=340, showlegend=False)


# -- activations ------------------------------------------------------------------------------


def _parent_of(name: str) -> str:
    if name in (ROOT, OUTSIDE):
        return ""
    return name.rsplit(".", 1)[0] if "." in name else ROOT


def activation_tree(activations: pd.DataFrame) -> list[dict]:
    """One case's ``memory_activations`` frame as a module tree, parents before children: per
    node ``{"id"`` (the dotted name; ``(root)`` the model, ``(outside modules)`` what the caller
    saved outside it), ``"parent"`` (``""`` at the top), ``"label"``, ``"depth"``, ``"own_bytes"``
    (charged to it), ``"bytes"`` (it and every module below), ``"shared_bytes"}``. Modules that
    saved nothing but hold one that did (``layers`` above ``layers.0``) are added with no bytes of
    their own."""
    own: dict[str, dict] = {}
    for a in frames.records(activations):
        name = a["module"] or ROOT
        node = own.setdefault(name, {"own_bytes": 0, "shared_bytes": 0})
        node["own_bytes"] += a["bytes"] or 0
        node["shared_bytes"] += a["shared_bytes"] or 0
    if not own:
        return []
    names = set(own)
    for name in list(names):
        parent = _parent_of(name)
        while parent and parent not in names:
            names.add(parent)
            parent = _parent_of(parent)
    children: dict[str, list[str]] = defaultdict(list)
    for name in names:
        children[_parent_of(name)].append(name)
    out: list[dict] = []

    def visit(name: str, depth: int) -> int:
        node = {"id": name, "parent": _parent_of(name), "label": name.rsplit(".", 1)[-1], "depth": depth,
                "own_bytes": own.get(name, {}).get("own_bytes", 0), "shared_bytes": own.get(name, {}).get("shared_bytes", 0)}
        out.append(node)
        node["bytes"] = node["own_bytes"] + sum(visit(c, depth + 1) for c in sorted(children[name], key=_natural))
        return node["bytes"]

    for top in sorted(children[""], key=lambda n: (n != ROOT, n)):
        visit(top, 0)
    return out


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _pattern(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def activation_top_rows(nodes: list[dict], top: int = TOP_MODULES) -> list[dict]:
    """The ``top`` largest rows of :func:`activation_tree` with the numbered blocks of a module
    list folded into one row (``layers.*``), plus their parents, as an indented tree (children
    after their parent, largest first), keyed as :data:`ACTIVATION_COLUMNS`."""
    total = sum(n["bytes"] for n in nodes if n["parent"] == "")
    folded: dict[str, dict] = {}
    for n in nodes:
        path = _pattern(n["id"])
        row = folded.setdefault(path, {"path": path, "parent": _pattern(n["parent"]) if n["parent"] else "",
                                       "label": ".".join(path.split(".")[-2:]) if path.endswith(".*") else n["label"],
                                       "depth": n["depth"], "instances": 0,
                                       "bytes": 0, "own_bytes": 0, "shared_bytes": 0})
        row["instances"] += 1
        for key in ("bytes", "own_bytes", "shared_bytes"):
            row[key] += n[key]
    chosen = set(sorted(folded, key=lambda p: -folded[p]["bytes"])[:top])
    for path in list(chosen):
        parent = folded[path]["parent"]
        while parent and parent not in chosen:
            chosen.add(parent)
            parent = folded[parent]["parent"]
    children: dict[str, list[str]] = defaultdict(list)
    for path in chosen:
        children[folded[path]["parent"]].append(path)
    rows: list[dict] = []

    def visit(path: str) -> None:
        r = folded[path]
        rows.append({"module": "\u00a0" * 4 * r["depth"] + r["label"], "instances": r["instances"],
                     "mib": r["bytes"] / 2**20, "own_mib": r["own_bytes"] / 2**20,
                     "per_instance_mib": r["bytes"] / r["instances"] / 2**20,
                     "share_pct": 100 * r["bytes"] / total if total else None,
                     "shared_mib": r["shared_bytes"] / 2**20, "path": path, "depth": r["depth"]})
        for child in sorted(children[path], key=lambda p: (-folded[p]["bytes"], p)):
            visit(child)

    for path in sorted(children[""], key=lambda p: (-folded[p]["bytes"], p)):
        visit(path)
    return rows


def folded_activation_nodes(nodes: list[dict]) -> list[dict]:
    """:func:`activation_tree`'s ``nodes`` with the numbered blocks of each module list folded
    into one node (:func:`dashboards.folding.fold_tree`: ``layers.*`` holds every ``layers.N``,
    its bytes the blocks' sum, ``count`` how many), as the treemap draws them; the table
    (:func:`activation_top_rows`) folds them the same way."""
    return fold_tree(nodes, ("bytes", "own_bytes", "shared_bytes"), "bytes")


def activation_treemap(nodes: list[dict], case: str) -> go.Figure:
    """The modules of :func:`activation_tree` (or :func:`folded_activation_nodes`) sized by the
    bytes they and their children saved for backward, three levels shown at a time (click to
    zoom); a node that folds several modules says how many, and the title that blocks are folded."""
    go = _go()
    if not nodes or not any(n["bytes"] for n in nodes):
        return _empty(f"{case}: activation memory", "no activations recorded")
    fig = go.Figure(go.Treemap(
        ids=[n["id"] for n in nodes], labels=[n["label"] for n in nodes], parents=[n["parent"] for n in nodes],
        values=[n["bytes"] for n in nodes], branchvalues="total", maxdepth=3,
        customdata=[[n["bytes"] / 2**20, n["own_bytes"] / 2**20, n["shared_bytes"] / 2**20, n.get("count", 1)]
                    for n in nodes],
        hovertemplate="%{id}<br>%{customdata[0]:.4g} MiB with children<br>%{customdata[1]:.4g} MiB its own"
                      "<br>%{customdata[2]:.4g} MiB shared with an earlier module<br>%{customdata[3]} module(s)"
                      "<extra></extra>"))
    title = f"{case}: activation memory by module (size: bytes saved for backward)"
    if folds_any(nodes):
        title += "<br><sup>numbered blocks folded into one box (layers.* is every layers.N, bytes summed)</sup>"
    return _layout(fig, title, height=520)


# -- model states and ranks -------------------------------------------------------------------


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


# -- wall clock -------------------------------------------------------------------------------


def wall_clock_rows(phases: pd.DataFrame, step_time_ms: float | None) -> list[dict]:
    """One case's ``wall_clock`` frame per phase (forward, backward, optimizer step, then any
    other), keyed as :data:`WALL_CLOCK_COLUMNS`, and a last row for the rest of ``step_time_ms``
    (the arm's median measured step) that the phases do not cover; ``[]`` without phases."""
    records = {r["phase"]: r for r in frames.records(phases) if r["phase"]}
    if not records:
        return []
    steps = (records.get("step") or {}).get("count") or None
    rows = []
    for phase in sorted(records, key=lambda p: (list(WALL_CLOCK_PHASES).index(p) if p in WALL_CLOCK_PHASES else 9, p)):
        r = records[phase]
        per_step = r["count"] / steps if steps and r["count"] else 1.0
        step_ms = r["median_ms"] * per_step if r["median_ms"] is not None else None
        rows.append({"phase": WALL_CLOCK_PHASES.get(phase, phase), "count": r["count"], "per_step": per_step,
                     "median_ms": r["median_ms"], "mean_ms": r["mean_ms"], "min_ms": r["min_ms"], "max_ms": r["max_ms"],
                     "step_ms": step_ms})
    if step_time_ms:
        rows.append({"phase": "rest of the measured step", "count": None, "per_step": None, "median_ms": None,
                     "mean_ms": None, "min_ms": None, "max_ms": None,
                     "step_ms": step_time_ms - sum(r["step_ms"] or 0.0 for r in rows)})
    for r in rows:
        r["share_pct"] = 100 * r["step_ms"] / step_time_ms if step_time_ms and r["step_ms"] is not None else None
    return rows


def wall_clock_bar(rows: list[dict], step_time_ms: float | None, case: str) -> go.Figure:
    """The step's time per phase (:func:`wall_clock_rows`) as one stacked bar; a rest below zero
    (phases longer than the measured median step) is left out of the bar and named in the title."""
    go = _go()
    fig = go.Figure()
    for r in rows:
        if r["step_ms"] is None or r["step_ms"] < 0:
            continue
        fig.add_trace(go.Bar(y=["step"], x=[r["step_ms"]], orientation="h", name=r["phase"],
                             marker_color=PHASE_COLOURS.get(r["phase"]), text=[f"{r['phase']} {r['step_ms']:.3g} ms"],
                             textposition="inside", hovertemplate=f"{r['phase']}: %{{x:.4g}} ms<extra></extra>"))
    title = f"{case}: where the step's wall time went"
    if step_time_ms:
        title += f" (measured step, median: {step_time_ms:.4g} ms)"
    short = [r for r in rows if r["step_ms"] is not None and r["step_ms"] < 0]
    if short:
        title += f"<br><sup>the phases add up to {-short[0]['step_ms']:.3g} ms more than the measured step</sup>"
    fig.update_xaxes(title="ms per optimizer step", rangemode="tozero")
    return _layout(fig, title, barmode="stack", height=240, legend={"orientation": "h", "y": -0.4, "traceorder": "normal"})


def peak_site_rows(data: dict) -> list[dict]:
    """The memory tracer's ``peak_sites`` as table rows (GiB, share of the traced peak); none when
    the run recorded no snapshot."""
    sites = (data or {}).get("peak_sites") or {}
    peak = _number(sites.get("peak_bytes"))
    rows = []
    for row in sites.get("sites") or []:
        size = _number(row.get("bytes"))
        if size is None:
            continue
        rows.append({"site": str(row.get("site", "?")), "gib": round(size / 2**30, 3),
                     "blocks": row.get("blocks"),
                     "share_pct": round(100.0 * size / peak, 1) if peak else None})
    return rows
