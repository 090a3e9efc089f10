"""The Trace tab of a run: its profiled step in the page, drawn from the spans the Perfetto trace
is written from (:mod:`dslab.report.timeline`), so a reader sees the step without leaving the
dashboard; the header links the full trace.

Per case, three sections:

- the profiled step of the reporting rank: its phases (forward, backward, optimizer) on one row
  and the modules nested in them one row per depth (the model, its blocks, their layers, ...),
  each bar as long as the device time of the module's kernels (busy time, laid end to end: the
  profile records no start times) or, for a profile without device times, the CUDA events around
  its calls;
- the modules that took the longest (the leaves of the module tree, forward and backward summed);
- the collectives of the same engine step on every rank, a row per rank, from the step's first
  arrival on any rank, on the reference rank's clock (the trace puts calls that overlap on lanes
  of their own; here they are drawn over each other, half transparent).
"""

from __future__ import annotations

import plotly.graph_objects as go
from dash import html

from dashboards.components import case_links, graph, guarded, table
from dslab.report import RunReport
from dslab.report.timeline import (
    NS_PER_MS, case_records, profiled_step, reporting_rank, step_collectives, step_spans, step_timing,
)

TEMPLATE = "plotly_white"
MARGIN = {"l": 90, "r": 20, "t": 60, "b": 50}
PHASE_COLOURS = {"forward": "#1f77b4", "backward": "#ff7f0e", "optimizer": "#2ca02c"}
OP_COLOURS = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#d62728")
TOP_MODULES = 15
LABEL_SHARE = 0.03
TIMED_BY = {"device": "its kernels' device time", "timers": "CUDA events around its calls"}
TIMING_NOTES = {"device": "each bar is the device time of the module's kernels (busy time: where the device idled "
                          "is not drawn)",
                "timers": "each bar is the time between CUDA events around the module's calls (this profile has "
                          "no device times)"}
STEP_NOTE = ("The profile records how long each module took, not when it started, so modules are laid one after "
             "another inside their parent: in named_modules order in the forward and in reverse in the backward "
             "(a child is clipped to what is left of its parent). The Perfetto trace holds the same spans.")
COLLECTIVES_NOTE = ("Each call starts at its arrival on the reference rank's clock (the rank's clock offset removed) and "
                    "lasts its measured latency; wait is how long the rank waited for the last member of the call. "
                    "Calls that overlap (async) are drawn over each other, half transparent; the Perfetto trace "
                    "puts them on lanes of their own.")


def cases(report: RunReport) -> list[str]:
    """The cases with a profiled step or a rank's collectives to draw, in the report's order."""
    flops, comms = case_records(report, "flops"), case_records(report, "comms")
    found = [c for c in flops if step_timing(flops[c]) is not None]
    found += [c for c in comms if c not in found and _has_collectives(comms[c])]
    order = {c: i for i, c in enumerate([*report.cases(), *flops, *comms])}
    return sorted(found, key=lambda c: order.get(c, len(order)))


def _has_collectives(comms: dict) -> bool:
    per_rank = comms.get("per_rank")
    return isinstance(per_rank, dict) and any(
        isinstance(records, list) and any(isinstance(r, dict) and "op" in r and "arrival_ns" in r for r in records)
        for records in per_rank.values())


def has_trace_view(report: RunReport) -> bool:
    return bool(cases(report))


def step_rows(spans: list[dict]) -> list[str]:
    """The figure's row of each span: ``"phases"``, ``"model"``, then ``"depth <d>"``."""
    return ["phases" if s["depth"] == 0 else "model" if s["depth"] == 1 else f"depth {s['depth']}" for s in spans]


def step_figure(spans: list[dict], title: str) -> go.Figure:
    """A bar per span (ms from the step's start), one trace per phase, a row per depth; the
    name is written on the bars of at least :data:`LABEL_SHARE` of the step (hovering names
    every bar: measuring hundreds of labels was most of the figure's drawing time)."""
    fig = go.Figure()
    rows = step_rows(spans)
    step_ns = sum(s["duration_ns"] for s in spans if s["depth"] == 0) or 1
    for phase, colour in PHASE_COLOURS.items():
        mine = [(s, row) for s, row in zip(spans, rows) if s["phase"] == phase]
        if not mine:
            continue
        fig.add_trace(go.Bar(
            name=phase, orientation="h", y=[row for _, row in mine], x=[s["duration_ns"] / NS_PER_MS for s, _ in mine],
            base=[s["start_ns"] / NS_PER_MS for s, _ in mine], marker_color=colour, marker_line_width=0.5,
            marker_line_color="white", hovertext=[s["name"] for s, _ in mine],
            text=[s["name"] if s["duration_ns"] >= LABEL_SHARE * step_ns else "" for s, _ in mine],
            textposition="inside", insidetextanchor="start", customdata=[[s["type"], s["flops"] / 1e9] for s, _ in mine],
            hovertemplate="%{hovertext} (%{customdata[0]})<br>%{x:.3f} ms from %{base:.3f} ms<br>"
                          "%{customdata[1]:.4g} GFLOP<extra>" + phase + "</extra>"))
    depth = max((s["depth"] for s in spans), default=0)
    fig.update_layout(barmode="overlay", template=TEMPLATE, margin=MARGIN, title=title,
                      height=max(260, 70 + 34 * (depth + 1)), uniformtext={"minsize": 8, "mode": "hide"},
                      xaxis_title="ms from the step's start", yaxis_autorange="reversed",
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"})
    return fig


def top_module_rows(spans: list[dict], limit: int = TOP_MODULES) -> list[dict]:
    """The leaf modules that took the longest, forward and backward spans summed: ``module``,
    ``type``, ``forward_ms``, ``backward_ms``, ``total_ms``, ``step_pct`` (of the step's phases),
    ``tflops`` (the module's forward + backward flops over its total time)."""
    step_ns = sum(s["duration_ns"] for s in spans if s["depth"] == 0)
    modules: dict[str, dict] = {}
    for s in spans:
        if s["module"] is None or not s["leaf"]:
            continue
        row = modules.setdefault(s["module"], {"module": s["module"], "type": s["type"], "forward_ms": 0.0,
                                               "backward_ms": 0.0, "flops": 0})
        row[f"{s['phase']}_ms"] += s["duration_ns"] / NS_PER_MS
        row["flops"] += s["flops"]
    rows = []
    for row in modules.values():
        total = row["forward_ms"] + row["backward_ms"]
        rows.append({"module": row["module"], "type": row["type"], "forward_ms": row["forward_ms"],
                     "backward_ms": row["backward_ms"], "total_ms": total,
                     "step_pct": 100 * total * NS_PER_MS / step_ns if step_ns else None,
                     "tflops": row["flops"] / (total * 1e-3) / 1e12 if total > 0 else None})
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:limit]


def collectives_figure(calls: list[dict], title: str) -> go.Figure:
    """A bar per collective, one trace per op, a row per rank; calls that overlap (async) are
    drawn over each other, half transparent."""
    fig = go.Figure()
    ranks = sorted({c["rank"] for c in calls})
    for i, op in enumerate(dict.fromkeys(c["op"] for c in calls)):
        mine = [c for c in calls if c["op"] == op]
        fig.add_trace(go.Bar(
            name=op, orientation="h", y=[f"rank {c['rank']}" for c in mine], x=[c["latency_ms"] for c in mine],
            base=[c["start_ms"] for c in mine], marker_color=OP_COLOURS[i % len(OP_COLOURS)], opacity=0.55,
            marker_line_width=0.5, marker_line_color="white",
            customdata=[[c["bytes"] / 2**20, c["group"], c["seq"], c["wait_ms"]] for c in mine],
            hovertemplate=op + " seq %{customdata[2]} on group %{customdata[1]}<br>%{customdata[0]:.2f} MiB, "
                               "%{x:.3f} ms from %{base:.3f} ms<br>wait %{customdata[3]:.3f} ms<extra></extra>"))
    fig.update_layout(barmode="overlay", template=TEMPLATE, margin=MARGIN, title=title,
                      height=max(220, 110 + 40 * len(ranks)), xaxis_title="ms from the step's first arrival",
                      yaxis={"categoryorder": "array", "categoryarray": [f"rank {r}" for r in ranks],
                             "autorange": "reversed"},
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"})
    return fig


def trace_tab(report, suite, run_id, case) -> list:
    found = cases(report)
    if not found:
        return [html.P("no profiled step and no rank's collectives in this run (flops_profiler and comms_logger off)",
                       id="trace-empty")]
    chosen = case if case in found else found[0]
    flops = case_records(report, "flops").get(chosen)
    comms = case_records(report, "comms").get(chosen)
    step, timing = profiled_step(flops), step_timing(flops)
    rank = reporting_rank(comms)
    out = [case_links(suite, run_id, "trace", found, chosen)]
    spans = []

    def profiled():
        if timing is None:
            return [html.P("this case has no profiled step (its flops profile did not run)", id="trace-no-step")]
        spans.extend(step_spans(flops))
        title = f"{chosen}: step {step} on rank {rank}, each module timed by {TIMED_BY[timing]}"
        return [graph("trace-step", step_figure(spans, title)),
                html.P(f"Phases and modules: {TIMING_NOTES[timing]}. {STEP_NOTE}", className="note")]

    out += guarded("The profiled step", profiled)
    if spans:
        out += guarded("Modules that took the longest", lambda: table("trace-top-modules", top_module_rows(spans), [
            ("module", "module"), ("type", "type"), ("forward_ms", "forward ms"), ("backward_ms", "backward ms"),
            ("total_ms", "total ms"), ("step_pct", "% of step"), ("tflops", "TFLOP/s")]))

    def collectives():
        shown, calls = step_collectives(comms, step)
        if not calls:
            return [html.P("no collectives logged in this case (one process, or comms_logger off)",
                           id="trace-no-collectives")]
        which = f"step {shown}" + ("" if step is None or shown == step else f" (step {step} logged none)")
        ranks = len({c["rank"] for c in calls})
        return [graph("trace-collectives", collectives_figure(
                    calls, f"{chosen}: collectives of {which}, {ranks} rank{'s' if ranks > 1 else ''}")),
                html.P(COLLECTIVES_NOTE, className="note")]

    out += guarded("Collectives of the step, per rank", collectives)
    return out
