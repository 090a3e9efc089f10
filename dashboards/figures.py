"""Plotly figures of the dashboard, drawn from :mod:`dashboards.views`' tables and the run's
frames (:mod:`dslab.report.frames`)."""

from __future__ import annotations

import datetime

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboards import views
from dashboards.data import RunSummary
from dslab.report import frames

TEMPLATE = "plotly_white"
MARGIN = {"l": 60, "r": 20, "t": 50, "b": 50}
ARM_COLOURS = {"dslab": "#1f77b4", "best_plain": "#ff7f0e", "other": "#9ca3af"}
VERDICT_STYLE = {"regression": ("triangle-down", "#d62728"), "improvement": ("triangle-up", "#2ca02c")}


def _layout(fig: go.Figure, title: str, **kwargs) -> go.Figure:
    fig.update_layout(title=title, template=TEMPLATE, margin=MARGIN, **kwargs)
    return fig


def empty(title: str, message: str) -> go.Figure:
    """A figure that says why there is nothing to draw."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, height=260)


def _when(summary: RunSummary):
    try:
        return datetime.datetime.fromisoformat(summary.created) if summary.created else None
    except ValueError:
        return None


def throughput_history(suite: str, runs: list[RunSummary], arms: set[str] | None,
                       baselines: list[dict], change_points: list[dict],
                       metric: str = "samples_per_s") -> go.Figure:
    """``metric`` of each (case, arm) over the suite's runs by creation time, with the commit of
    each run in its hover and under its marker; the gate's baseline bands (min to max of the
    baseline trials) and change points (regressions, improvements) where the gate wrote them."""
    fig = go.Figure()
    runs = [r for r in runs if r.suite == suite and r.error is None and _when(r) is not None]
    series: dict[tuple[str, str], list] = {}
    for r in runs:
        for (case, arm), metrics in r.metrics.items():
            if metric in metrics and (not arms or arm in arms):
                series.setdefault((case, arm), []).append((_when(r), metrics[metric], r))
    if not series:
        return empty(f"{suite}: {metric} over time", "no runs with this metric")
    x_range = [min(_when(r) for r in runs), max(_when(r) for r in runs)]
    for (case, arm), points in sorted(series.items()):
        fig.add_trace(go.Scatter(
            x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers", name=f"{case}/{arm}",
            customdata=[[p[2].run_id, p[2].commit] for p in points],
            hovertemplate="%{customdata[0]}<br>commit %{customdata[1]}<br>%{y:.4g}<extra>" + f"{case}/{arm}</extra>",
            visible=True if arm == "dslab" or arms else "legendonly"))
    for baseline in baselines:
        for result in baseline.get("results", []):
            if not isinstance(result, dict) or (result.get("case"), result.get("arm")) not in series:
                continue
            values = [v for v in (result.get("trials") or {}).get(metric, []) if isinstance(v, (int, float))]
            if not values:
                continue
            label = f"baseline {result['case']}/{result['arm']} ({baseline.get('label', baseline['_file'])})"
            fig.add_trace(go.Scatter(
                x=[x_range[0], x_range[1], x_range[1], x_range[0]],
                y=[min(values), min(values), max(values), max(values)],
                fill="toself", mode="none", fillcolor="rgba(31,119,180,0.12)", name=label, hoverinfo="name"))
    by_run = {r.run_id: r for r in runs}
    for kind, (symbol, colour) in VERDICT_STYLE.items():
        xs, ys, texts = [], [], []
        for p in change_points:
            run = by_run.get(p.get("run_id"))
            if p.get("kind") != kind or run is None or p.get("metric", metric) != metric:
                continue
            value = run.metrics.get((p.get("case"), p.get("arm")), {}).get(metric)
            if value is not None:
                xs.append(_when(run))
                ys.append(value)
                change = p.get("change")
                texts.append(f"{kind} {p.get('case')}/{p.get('arm')}"
                             + (f": x{change:.3f}" if isinstance(change, (int, float)) else ""))
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=f"gate: {kind}", text=texts,
                                     marker={"symbol": symbol, "size": 14, "color": colour}, hoverinfo="text"))
    commits = {}
    for r in runs:
        commits.setdefault(r.commit, _when(r))
    fig.update_xaxes(title="run created (UTC)")
    fig.update_yaxes(title=metric)
    _layout(fig, f"{suite}: {metric} over time ({len(runs)} runs, {len(commits)} commits)", height=380)
    return fig


def arms_bar(results: pd.DataFrame, trials: pd.DataFrame, case: str) -> go.Figure:
    """Median samples/s of each arm of ``case`` (a run's ``results`` frame), the whiskers spanning
    the ``trials``' min to max; dslab and the case's best plain-PyTorch arm in their own colours,
    dslab's ratio to that arm in the title."""
    spread = views.trial_spread(trials).get(case, {})
    measured = [r for r in frames.records(results) if r["case"] == case and r.get("samples_per_s") is not None]
    arms, medians = [r["arm"] for r in measured], [r["samples_per_s"] for r in measured]
    if not arms:
        return empty(f"{case}: arms", "no arm measured samples/s")
    best = views.best_plain_of(results, case)
    lows = [m - min(spread.get(arm, [m])) for arm, m in zip(arms, medians)]
    highs = [max(spread.get(arm, [m])) - m for arm, m in zip(arms, medians)]
    colours = [ARM_COLOURS["dslab"] if arm == "dslab" else
               ARM_COLOURS["best_plain"] if best is not None and arm == best[0] else ARM_COLOURS["other"]
               for arm in arms]
    fig = go.Figure(go.Bar(x=arms, y=medians, marker_color=colours,
                           error_y={"type": "data", "array": highs, "arrayminus": lows},
                           text=[f"{m:.4g}" for m in medians], textposition="outside"))
    fig.update_yaxes(title="samples/s (median of trials)")
    title = f"{case}: arms (whiskers: trial min-max)"
    if best is not None:
        title += f"<br><sup>dslab/best plain arm ({best[0]}): {best[1]:.3f}</sup>"
    return _layout(fig, title, height=360)


def trials_strip(trials: pd.DataFrame, case: str) -> go.Figure:
    """Every trial's samples/s per arm of ``case`` (a run's ``trials`` frame): the spread behind
    each median."""
    spread = views.trial_spread(trials).get(case, {})
    if not spread:
        return empty(f"{case}: trials", "no trials")
    fig = go.Figure()
    for arm, values in spread.items():
        fig.add_trace(go.Box(y=values, name=arm, boxpoints="all", jitter=0.3, pointpos=0))
    fig.update_yaxes(title="samples/s per trial")
    return _layout(fig, f"{case}: spread of trials", height=340, showlegend=False)


def flops_treemap(nodes: list[dict], case: str) -> go.Figure:
    """The module tree sized by flops (forward + backward) and coloured by achieved TFLOP/s."""
    if not nodes:
        return empty(f"{case}: flops by module", "the flops profile has no modules")
    fig = go.Figure(go.Treemap(
        ids=[n["id"] for n in nodes], labels=[n["label"] for n in nodes], parents=[n["parent"] for n in nodes],
        values=[n["flops"] for n in nodes], branchvalues="total",
        marker={"colors": [n["tflops"] or 0.0 for n in nodes], "colorscale": "Viridis",
                "colorbar": {"title": "TFLOP/s"}},
        customdata=[[n["type"], n["flops"] / 1e9, n["tflops"] or 0.0, n["latency_ms"]] for n in nodes],
        hovertemplate="%{id}<br>%{customdata[0]}<br>%{customdata[1]:.4g} GFLOP<br>%{customdata[2]:.4g} TFLOP/s"
                      "<br>%{customdata[3]:.3g} ms fwd+bwd<extra></extra>",
        maxdepth=4))
    return _layout(fig, f"{case}: flops by module (size: flops, colour: achieved TFLOP/s)", height=520)


def roofline(points: list[dict], ceilings: dict, case: str) -> go.Figure:
    """Each module's arithmetic intensity against its achieved TFLOP/s under the ceilings."""
    if not points:
        return empty(f"{case}: roofline", "no module has both flops and a latency")
    fig = go.Figure()
    xs = [p["intensity"] for p in points]
    lo, hi = min(xs) / 4, max(xs) * 4
    for kind in ("measured", "datasheet"):
        peak, bw = ceilings.get(f"{kind}_tflops"), ceilings.get(f"{kind}_gbps")
        if peak and bw:
            lo = min(lo, peak * 1e3 / bw / 4)  # show the ridge point
    grid = [lo * (hi / lo) ** (i / 60) for i in range(61)]
    for kind, dash in (("measured", "solid"), ("datasheet", "dash")):
        peak, bw = ceilings.get(f"{kind}_tflops"), ceilings.get(f"{kind}_gbps")
        if peak and bw:
            fig.add_trace(go.Scatter(x=grid, y=[min(peak, ai * bw / 1e3) for ai in grid], mode="lines",
                                     name=f"{kind}: {peak:.0f} TFLOP/s, {bw:.0f} GB/s", line={"dash": dash}))
        elif peak:
            fig.add_hline(y=peak, line_dash=dash, annotation_text=f"{kind} peak {peak:.0f} TFLOP/s")
    fig.add_trace(go.Scatter(
        x=xs, y=[p["tflops"] for p in points], mode="markers", name="modules", text=[p["module"] for p in points],
        marker={"size": 9, "color": [p["depth"] for p in points], "colorscale": "Plasma", "showscale": False},
        hovertemplate="%{text}<br>%{x:.3g} flop/byte<br>%{y:.4g} TFLOP/s<extra></extra>"))
    fig.update_xaxes(type="log", title="arithmetic intensity (flop / byte, estimated)")
    fig.update_yaxes(type="log", title="achieved TFLOP/s")
    return _layout(fig, f"{case}: roofline", height=460)


def comms_bandwidth(op_rows: list[dict], points: list[dict], case: str) -> go.Figure:
    """Bus bandwidth of each op against message size (the logger's per-size means), over every
    call's algorithm bandwidth on each rank."""
    if not op_rows and not points:
        return empty(f"{case}: bandwidth", "no timed collectives")
    fig = go.Figure()
    for op in sorted({p["op"] for p in points}):
        mine = [p for p in points if p["op"] == op]
        fig.add_trace(go.Scatter(x=[p["bytes"] for p in mine], y=[p["algbw_GBps"] for p in mine], mode="markers",
                                 name=f"{op} algbw per call", opacity=0.35, text=[f"rank {p['rank']}" for p in mine]))
    for op in sorted({r["op"] for r in op_rows}):
        rows = sorted((r for r in op_rows if r["op"] == op and r["busbw_GBps"] is not None),
                      key=lambda r: r["size_bytes"])
        if rows:
            fig.add_trace(go.Scatter(x=[r["size_bytes"] for r in rows], y=[r["busbw_GBps"] for r in rows],
                                     mode="lines+markers", name=f"{op} busbw (mean)"))
    fig.update_xaxes(type="log", title="message size (bytes)")
    fig.update_yaxes(title="GB/s")
    return _layout(fig, f"{case}: bandwidth against message size", height=420)


def straggler_heatmap(matrix: dict, case: str) -> go.Figure:
    """Ranks x collectives, each cell the rank's wait for the last arrival (ms)."""
    if not matrix["labels"]:
        return empty(f"{case}: straggler wait", "no collective matched across two or more ranks")
    fig = go.Figure(go.Heatmap(z=matrix["wait_ms"], x=list(range(len(matrix["labels"]))),
                               y=[f"rank {r}" for r in matrix["ranks"]], colorscale="Reds",
                               colorbar={"title": "wait (ms)"},
                               customdata=[matrix["labels"]] * len(matrix["ranks"]),
                               hovertemplate="%{y}<br>%{customdata}<br>waited %{z:.3f} ms<extra></extra>"))
    named = ", ".join(f"rank {r}" for r in matrix["stragglers"]) or "none"
    fig.update_xaxes(title="collective (in order of arrival)")
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, f"{case}: straggler wait per rank and collective (stragglers named: {named})",
                   height=160 + 40 * len(matrix["ranks"]))


def memory_timeline(series: dict, case: str) -> go.Figure:
    if not series["step"]:
        return empty(f"{case}: memory over steps", "no per-step allocator peaks (CPU run or tracer off)")
    fig = go.Figure()
    for key in ("peak_allocated", "peak_reserved"):
        fig.add_trace(go.Scatter(x=series["step"], y=[None if v is None else v / 2**30 for v in series[key]],
                                 mode="lines+markers", name=key.replace("_", " ")))
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="GiB")
    return _layout(fig, f"{case}: allocator peaks per step", height=360)


def activations_bar(rows: list[dict], case: str) -> go.Figure:
    if not rows:
        return empty(f"{case}: activations", "no activations recorded")
    fig = go.Figure()
    fig.add_trace(go.Bar(y=[r["module"] for r in rows], x=[r["bytes"] / 2**20 for r in rows], orientation="h",
                         name="charged (MiB)"))
    fig.add_trace(go.Bar(y=[r["module"] for r in rows], x=[r["shared_bytes"] / 2**20 for r in rows], orientation="h",
                         name="shared with an earlier module (MiB)"))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title="MiB saved for backward")
    return _layout(fig, f"{case}: activation memory per module", height=max(300, 22 * len(rows) + 120))


def measured_vs_estimate(data: dict, case: str) -> go.Figure:
    measured = data["measured"]
    fig = go.Figure()
    for key, value in measured.items():
        fig.add_trace(go.Bar(x=["measured model states"], y=[value / 2**30], name=key.replace("_", " ")))
    if data["estimate"] is not None:
        fig.add_trace(go.Bar(x=["ZeRO-0 estimate"], y=[data["estimate"] / 2**30], name="estimate"))
    if data["activation_bytes"] is not None:
        fig.add_trace(go.Bar(x=["activations"], y=[data["activation_bytes"] / 2**30], name="activations"))
    if data["peak_allocated"] is not None:
        fig.add_trace(go.Bar(x=["allocator peak"], y=[data["peak_allocated"] / 2**30], name="peak allocated"))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title="GiB")
    return _layout(fig, f"{case}: measured beside the estimate", height=380)


def rank_memory_bar(rows: list[dict], case: str) -> go.Figure:
    """Each rank's peak (and model states, where the tracer has them) side by side, one bar per
    arm and rank, from :func:`dashboards.views.rank_memory_rows`."""
    if not rows:
        return empty(f"{case}: memory per rank", "no per-rank peaks")
    fig = go.Figure()
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        ranks = [f"rank {r['rank']}" for r in mine]
        fig.add_trace(go.Bar(x=ranks, y=[r["peak_gib"] for r in mine], name=f"{arm}: {mine[0]['kind']}"))
        if any(r["model_states_gib"] is not None for r in mine):
            fig.add_trace(go.Bar(x=ranks, y=[r["model_states_gib"] for r in mine], name=f"{arm}: model states"))
    fig.update_layout(barmode="group")
    fig.update_yaxes(title="GiB")
    return _layout(fig, f"{case}: memory per rank", height=340)


def telemetry(series: list[dict], case: str) -> go.Figure:
    """One panel per NVML field, one line per GPU, over seconds since sampling began."""
    if not series:
        return empty(f"{case}: telemetry", "no GPU samples")
    fields = views.TELEMETRY_FIELDS
    fig = make_subplots(rows=len(fields), cols=1, shared_xaxes=True, subplot_titles=[t for _, t in fields],
                        vertical_spacing=0.05)
    for s in series:
        for row, (key, _) in enumerate(fields, start=1):
            scale = 1 / 2**30 if key == "mem_used_bytes" else 1.0
            fig.add_trace(go.Scatter(x=s["t"], y=[None if v is None else v * scale for v in s[key]], mode="lines",
                                     name=s["gpu"], legendgroup=s["uuid"], showlegend=row == 1), row=row, col=1)
    fig.update_xaxes(title="seconds since sampling began", row=len(fields), col=1)
    return _layout(fig, f"{case}: GPU telemetry (memory used in GiB)", height=180 * len(fields))


def compare_bar(a: pd.DataFrame, b: pd.DataFrame, metric: str = "samples_per_s") -> go.Figure:
    """``metric`` of every (case, arm) the two runs' ``results`` frames share, side by side."""
    rows = views.compare_rows(a, b, (metric,))
    if not rows:
        return empty("compare", f"the runs share no (case, arm) with {metric}")
    labels = [f"{r['case']}/{r['arm']}" for r in rows]
    fig = go.Figure()
    for side, results in (("A", a), ("B", b)):
        run = frames.records(results.head(1))[0]
        fig.add_trace(go.Bar(x=labels, y=[r[side] for r in rows], name=f"{run['suite']}/{run['run_id']}"))
    fig.update_layout(barmode="group")
    fig.update_yaxes(title=metric)
    return _layout(fig, f"{metric}: run A beside run B", height=380)


def expert_load_heatmap(load: dict, case: str) -> go.Figure:
    """MoE layers x experts, each cell the expert's share of the layer's assignments (%), the
    counts in the hover; the dropped share of assignments in the title."""
    fig = go.Figure(go.Heatmap(
        z=load["share_pct"], x=load["experts"], y=load["layers"], colorscale="Viridis", zmin=0,
        colorbar={"title": "% of the layer's<br>assignments"}, customdata=load["counts"],
        texttemplate="%{z:.1f}%", hovertemplate="%{y}, %{x}<br>%{customdata} assignments (%{z:.1f}%)<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    uniform = 100 / len(load["experts"]) if load["experts"] else 0.0
    title = (f"{case}: expert load (uniform: {uniform:.1f}% per expert)"
             f"<br><sup>dropped {load['dropped_pct']:.2f}% of the assignments</sup>")
    return _layout(fig, title, height=200 + 36 * len(load["layers"]))
