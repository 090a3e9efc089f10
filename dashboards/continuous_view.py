"""The profile over the run, in the Flops tab of a run whose flops profiler re-took its per-module
device-time profile every N steps (``flops_profiler.every_n_steps``; the records'
``continuous`` series, read through :func:`dslab.report.frames.flops_series`).

Three parts: MFU over the steps (the whole model's counted flops over the median unprofiled step
after each profile, against the measured and the datasheet peak; achieved TFLOP/s where the
report has no peak, as on a CPU), the forward + backward device time of the top modules over the
steps, and a table with one row per profile. A module's time is that of the profiled step, which
runs eagerly (module hooks keep a CUDA-graphed stack from replaying): the kernels it ran (timer
``kernels``, every profile of ``continuous_timer: "kernels"`` and the first of any run) or the
stream's time between its marks (timer ``events``, kernels and the gaps between them), with
whether the host had queued the whole step before the device began it (``host ahead``: when not,
the marks may include time the device waited for the host). A profile keeps the slowest
``top_modules`` modules of each depth, so a module missing from a profile was not among them
there (its line has a gap).
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from dash import html

from dashboards.components import graph, guarded, table
from dslab.report import RunReport, frames

TEMPLATE = "plotly_white"
MARGIN = {"l": 70, "r": 20, "t": 50, "b": 50}
MAX_MODULE_LINES = 12
PEAKS = (("mfu_measured", "MFU, measured peak"), ("mfu_datasheet", "MFU, datasheet peak"))
NOTE = ("Each point is one profile of one step, which runs eagerly with module hooks: timer 'kernels' attributes "
        "the kernels' own durations to modules (torch.profiler); timer 'events' reads the stream's time between "
        "marks at each module's forward and backward (the kernels and the gaps between them), true when the host "
        "was ahead of the device for the whole step ('host ahead'). MFU and TFLOP/s divide the flops counted at "
        "profile_step by the median of the unprofiled steps after the profile. Modules: the slowest of each "
        "depth in each profile, forward + backward device ms; a gap means the module was not among them.")


def has_series(data) -> bool:
    """Whether a case's flops record holds a continuous series."""
    return isinstance(data, dict) and isinstance(data.get("continuous"), dict)


def model_rows(series: pd.DataFrame) -> list[dict]:
    """One row per profile: step, step ms, TFLOP/s, MFU (%) against each peak, busy ms, the timer
    and whether the host was ahead (events on a GPU), and the error of a profile whose timing
    failed; in step order."""
    model = series[series["name"].isna()].sort_values("step", kind="stable")
    rows = []
    for r in frames.records(model):
        rows.append({"step": r["step"], "step_ms": r["step_ms"], "tflops": r["achieved_tflops"],
                     "mfu_measured_pct": None if r["mfu_measured"] is None else 100 * r["mfu_measured"],
                     "mfu_datasheet_pct": None if r["mfu_datasheet"] is None else 100 * r["mfu_datasheet"],
                     "device_ms": None if r["forward_ms"] is None else r["forward_ms"] + (r["backward_ms"] or 0.0),
                     "busy_ms": r["busy_ms"], "timer": r["timer"],
                     "host_ahead": None if r["host_lead"] is None else ("yes" if r["host_lead"] else "no"),
                     "error": r["error"]})
    return rows


def mfu_figure(series: pd.DataFrame, title: str) -> go.Figure:
    """MFU (%) over the steps against each peak the report has; achieved TFLOP/s when it has none."""
    rows = [r for r in model_rows(series) if r["error"] is None]
    steps = [r["step"] for r in rows]
    fig = go.Figure()
    for key, label in PEAKS:
        values = [r[f"{key}_pct"] for r in rows]
        if any(v is not None for v in values):
            fig.add_trace(go.Scatter(x=steps, y=values, name=label, mode="lines+markers"))
    if fig.data:
        fig.update_layout(yaxis_title="MFU (%)", yaxis_rangemode="tozero")
    else:
        fig.add_trace(go.Scatter(x=steps, y=[r["tflops"] for r in rows], name="achieved TFLOP/s",
                                 mode="lines+markers"))
        fig.update_layout(yaxis_title="achieved TFLOP/s (no peak in this report)", yaxis_rangemode="tozero")
    fig.update_layout(template=TEMPLATE, margin=MARGIN, title=title, xaxis_title="step")
    return fig


def top_modules(series: pd.DataFrame, limit: int = MAX_MODULE_LINES) -> list[str]:
    """The modules (not the model itself) of most forward + backward time summed over the
    profiles, at most ``limit``."""
    modules = series[series["name"].notna()]
    total = (modules["forward_ms"].fillna(0.0) + modules["backward_ms"].fillna(0.0)).groupby(modules["name"]).sum()
    return [str(name) for name in total.sort_values(ascending=False, kind="stable").index[:limit]]


def module_time_figure(series: pd.DataFrame, title: str, limit: int = MAX_MODULE_LINES) -> go.Figure:
    """Forward + backward device ms of each of :func:`top_modules` over the steps of the profiles
    that were timed, one line each (gaps where a profile did not keep the module)."""
    steps = sorted(int(s) for s in series.loc[series["error"].isna(), "step"].dropna().unique())
    fig = go.Figure()
    for name in top_modules(series, limit):
        rows = series[series["name"] == name]
        by_step = {int(s): f + b for s, f, b in zip(rows["step"], rows["forward_ms"].fillna(0.0),
                                                     rows["backward_ms"].fillna(0.0))}
        fig.add_trace(go.Scatter(x=steps, y=[by_step.get(s) for s in steps], name=name, mode="lines+markers",
                                 connectgaps=False))
    fig.update_layout(template=TEMPLATE, margin=MARGIN, title=title, xaxis_title="step",
                      yaxis_title="forward + backward device ms", yaxis_rangemode="tozero")
    return fig


def section(report: RunReport, case: str, data) -> list:
    """The Flops tab's "Over the run" section for ``case`` (``data``: its flops record); nothing
    when the run took no continuous profile."""
    if not has_series(data):
        return []
    every = data["continuous"].get("every_n_steps")

    def build():
        series = frames.flops_series(report, case=case, strict=True)
        if series.empty:
            return [html.P("no profile was taken yet (the run ended before the first device-timed step)",
                           id="flops-continuous-empty")]
        rows = model_rows(series)
        return [graph("flops-continuous-mfu", mfu_figure(series, f"{case}: MFU over the run")),
                graph("flops-continuous-modules", module_time_figure(series, f"{case}: top modules over the run")),
                table("flops-continuous", rows, [("step", "step"), ("step_ms", "step ms"), ("tflops", "TFLOP/s"),
                                                 ("mfu_measured_pct", "MFU % (measured)"),
                                                 ("mfu_datasheet_pct", "MFU % (datasheet)"),
                                                 ("device_ms", "fwd+bwd device ms"), ("busy_ms", "busy ms"),
                                                 ("timer", "timer"), ("host_ahead", "host ahead"),
                                                 ("error", "error")]),
                html.P(NOTE, className="note")]

    return guarded(f"Over the run (a profile every {every} steps)", build)
