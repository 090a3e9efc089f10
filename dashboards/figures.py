"""Plotly figures of the dashboard, drawn from :mod:`dashboards.views`' tables and the run's
frames (:mod:`dslab.report.frames`)."""

from __future__ import annotations

import pandas as pd
import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboards import comms_view, views
from dslab.report import frames

TEMPLATE = "plotly_white"
MARGIN = {"l": 60, "r": 20, "t": 50, "b": 50}
UNTIMED_COLOUR = "#d1d5db"
ARM_COLOURS = {"dslab": "#1f77b4", "best_plain": "#ff7f0e", "other": "#9ca3af"}


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
    """The module tree sized by flops (forward + backward) and coloured by achieved TFLOP/s
    (:func:`dashboards.flops_view.treemap_nodes`: each parent's own ops are a named child, so the
    sizes add up with ``branchvalues="total"``); a node without a time (an own-ops node of a profile
    timed by CUDA events around modules) is grey, not the bottom of the scale. Nodes that fold
    several modules (:func:`dashboards.flops_view.folded_treemap_nodes`, ``count``) say how many
    in their hover, and the title says that the blocks are folded."""
    if not nodes:
        return empty(f"{case}: flops by module", "the flops profile has no modules")

    def shown(value, spec: str, unit: str) -> str:
        return "n/a" if value is None else f"{value:{spec}} {unit}"

    def folded(n) -> str:
        count = n.get("count", 1)
        return f"{count} modules, summed" if count > 1 else "one module"

    known = [n["tflops"] for n in nodes if n["tflops"] is not None]
    top = max(known, default=0.0) or 1.0
    colours = [UNTIMED_COLOUR if n["tflops"] is None else
               plotly.colors.sample_colorscale("Viridis", [min(1.0, n["tflops"] / top)])[0] for n in nodes]
    fig = go.Figure(go.Treemap(
        ids=[n["id"] for n in nodes], labels=[n["label"] for n in nodes], parents=[n["parent"] for n in nodes],
        values=[n["flops"] for n in nodes], branchvalues="total", marker={"colors": colours},
        customdata=[[n["type"], f"{n['flops'] / 1e9:.4g} GFLOP", shown(n["tflops"], ".4g", "TFLOP/s"),
                     shown(n["latency_ms"], ".3g", "ms fwd + bwd"), folded(n)] for n in nodes],
        hovertemplate="%{id}<br>%{customdata[0]}<br>%{customdata[1]}<br>%{customdata[2]}"
                      "<br>%{customdata[3]}<br>%{customdata[4]}<extra></extra>",
        maxdepth=4))
    # the colour bar of the scale above, on an invisible point (a treemap given colours has none)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", showlegend=False, hoverinfo="skip", marker={
        "colorscale": "Viridis", "cmin": 0.0, "cmax": top, "color": [0.0], "showscale": True,
        "colorbar": {"title": "achieved TFLOP/s<br>(grey: not timed)"}}))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(modebar={"remove": ["zoom", "pan", "select", "lasso", "zoomIn", "zoomOut", "autoScale",
                                          "resetScale"]})
    title = f"{case}: flops by module (size: flops fwd + bwd, colour: achieved TFLOP/s)"
    if any(n.get("count", 1) > 1 for n in nodes):
        title += ("<br><sup>numbered blocks folded into one box (layers.* is every layers.N: flops and time "
                  "summed); the table lists every module</sup>")
    return _layout(fig, title, height=520)


def roofline(points: list[dict], ceilings: dict, case: str) -> go.Figure:
    """Each module's arithmetic intensity against its achieved TFLOP/s under the ceilings, one
    legend entry (and colour) per depth in the model."""
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
        if peak and bw:  # the ceilings in greys, so the depths' colours are the modules' alone
            fig.add_trace(go.Scatter(x=grid, y=[min(peak, ai * bw / 1e3) for ai in grid], mode="lines",
                                     name=f"{kind}: {peak:.0f} TFLOP/s, {bw:.0f} GB/s",
                                     line={"dash": dash, "color": "#444444" if kind == "measured" else "#999999"}))
        elif peak:
            fig.add_hline(y=peak, line_dash=dash, annotation_text=f"{kind} peak {peak:.0f} TFLOP/s")
    palette = plotly.colors.qualitative.Plotly
    for depth in sorted({p["depth"] for p in points}):
        mine = [p for p in points if p["depth"] == depth]
        fig.add_trace(go.Scatter(
            x=[p["intensity"] for p in mine], y=[p["tflops"] for p in mine], mode="markers",
            name="the model (depth 0)" if depth == 0 else f"modules at depth {depth}",
            text=[p["module"] for p in mine], marker={"size": 9, "color": palette[depth % len(palette)]},
            hovertemplate="%{text}<br>%{x:.3g} FLOP/byte<br>%{y:.4g} TFLOP/s<extra></extra>"))
    fig.update_xaxes(type="log", title="arithmetic intensity (FLOP/byte, estimated)")
    fig.update_yaxes(type="log", title="achieved TFLOP/s (fwd + bwd)")
    return _layout(fig, f"{case}: roofline", height=460, legend={"title": {"text": "ceilings and modules"}})


def comms_bandwidth(points: list[dict], reference: dict | None, case: str) -> go.Figure:
    """Bus bandwidth of every collective against its message size on log-log axes, one trace per
    op (:func:`dashboards.comms_view.bandwidth_points`), with the measured bus-bandwidth curve of
    ``benchmarks/comms_busbw.py`` dashed where the run has one
    (:func:`dashboards.comms_view.reference_busbw`). Above
    :data:`dashboards.comms_view.BANDWIDTH_POINTS_MAX` collectives, one marker per op and message
    size (:func:`dashboards.comms_view.bandwidth_by_size`: the median, whiskers to the min and
    max), as the title says."""
    if not points:
        return empty(f"{case}: bus bandwidth", "no timed collectives with a payload on two or more ranks")
    fig = go.Figure()
    by_size = len(points) > comms_view.BANDWIDTH_POINTS_MAX
    for op in sorted({p["op"] for p in points}):
        mine = [p for p in points if p["op"] == op]
        if by_size:
            sizes = comms_view.bandwidth_by_size(mine)
            fig.add_trace(go.Scatter(
                x=[s["bytes"] for s in sizes], y=[s["busbw_GBps"] for s in sizes], mode="markers", name=op,
                error_y={"type": "data", "symmetric": False,
                         "array": [s["busbw_max_GBps"] - s["busbw_GBps"] for s in sizes],
                         "arrayminus": [s["busbw_GBps"] - s["busbw_min_GBps"] for s in sizes]},
                customdata=[[s["count"], s["busbw_min_GBps"], s["busbw_max_GBps"], s["latency_ms"]] for s in sizes],
                hovertemplate="%{x} bytes<br>median busbw %{y:.4g} GB/s of %{customdata[0]} collectives"
                              "<br>min %{customdata[1]:.4g}, max %{customdata[2]:.4g} GB/s<br>median latency "
                              "%{customdata[3]:.4g} ms<extra>" + op + "</extra>"))
            continue
        fig.add_trace(go.Scatter(
            x=[p["bytes"] for p in mine], y=[p["busbw_GBps"] for p in mine], mode="markers", name=op,
            customdata=[[p["latency_ms"], p["rank"], p["group_size"], p["step"]] for p in mine],
            hovertemplate="%{x} bytes<br>busbw %{y:.4g} GB/s<br>%{customdata[0]:.4g} ms (rank %{customdata[1]}), "
                          "%{customdata[2]} ranks, step %{customdata[3]}<extra>" + op + "</extra>"))
    if reference is not None and reference["points"]:
        fig.add_trace(go.Scatter(x=[p["size_bytes"] for p in reference["points"]],
                                 y=[p["busbw_GBps"] for p in reference["points"]], mode="lines+markers",
                                 name=reference["label"], line={"dash": "dash", "color": "#444444"}))
    fig.update_xaxes(type="log", title="message bytes")
    fig.update_yaxes(type="log", title="bus bandwidth (GB/s)")
    title = f"{case}: bus bandwidth per collective against message size"
    if by_size:
        title = (f"{case}: bus bandwidth against message size<br><sup>{len(points)} collectives: the median per op "
                 "and message size, whiskers to the slowest and the fastest</sup>")
    return _layout(fig, title, height=420)


def straggler_heatmap(matrix: dict, case: str) -> go.Figure:
    """Ranks x collectives (:func:`dashboards.comms_view.straggler_matrix`), each cell how late
    the rank arrived after the first (ms), so the late rank is the dark row; the colour range ends
    at the matrix's robust maximum (cells beyond it at full colour), a cross marks each
    collective's last arrival, and the named stragglers are labelled on the axis and in the title."""
    if not matrix["labels"]:
        return empty(f"{case}: lateness", "no collective matched across two or more ranks")
    named = set(matrix["stragglers"])
    rows = {r: f"rank {r} (straggler)" if r in named else f"rank {r}" for r in matrix["ranks"]}
    columns = list(range(len(matrix["labels"])))
    fig = go.Figure(go.Heatmap(
        z=matrix["lateness_ms"], x=columns, y=[rows[r] for r in matrix["ranks"]], colorscale="Reds",
        zmin=0, zmax=matrix["colour_max_ms"], colorbar={"title": "late by (ms)"},
        customdata=[matrix["labels"]] * len(matrix["ranks"]), name="lateness",
        hovertemplate="%{y}<br>%{customdata}<br>arrived %{z:.3f} ms after the first<extra></extra>"))
    fig.add_trace(go.Scatter(x=columns, y=[rows[r] for r in matrix["last"]], mode="markers", name="last to arrive",
                             marker={"symbol": "x-thin", "size": 8, "line": {"width": 2, "color": "#111111"}},
                             hoverinfo="skip"))
    title = (f"{case}: lateness per rank and collective (stragglers named: "
             f"{', '.join(f'rank {r}' for r in sorted(named)) or 'none'})"
             f"<br><sup>colour to {matrix['colour_max_ms']:.3g} ms")
    if matrix["clipped"]:
        title += f"; {matrix['clipped']} collective(s) later still, drawn at full colour"
    fig.update_xaxes(title="collective (in order of first arrival)")
    fig.update_yaxes(autorange="reversed", type="category")
    return _layout(fig, title + "</sup>", height=190 + 40 * len(matrix["ranks"]), showlegend=False)


def memory_timeline(series: dict, marks: dict, case: str) -> go.Figure:
    """The allocator's peak allocated and reserved GiB per step (:func:`dashboards.memory_view.memory_timeline`)
    with :func:`dashboards.memory_view.timeline_marks`: each trial's warm-up shaded grey and its
    timed steps blue, the memory tracer's profiled step and the flops profile's step as lines."""
    if not series["step"]:
        return empty(f"{case}: memory over steps", "no per-step allocator peaks (CPU run or tracer off)")
    fig = go.Figure()
    for key in ("peak_allocated", "peak_reserved"):
        fig.add_trace(go.Scatter(x=series["step"], y=[None if v is None else v / 2**30 for v in series[key]],
                                 mode="lines+markers", name=key.replace("_", " ")))
    for t in marks["trials"]:
        if t["warmup"] is not None:
            fig.add_vrect(x0=t["warmup"][0] - 0.5, x1=t["warmup"][1] + 0.5, fillcolor="#9ca3af", opacity=0.25,
                          line_width=0, name=f"trial {t['trial']} warm-up")
        fig.add_vrect(x0=t["timed"][0] - 0.5, x1=t["timed"][1] + 0.5, fillcolor="#1f77b4", opacity=0.08,
                      line_width=0, name=f"trial {t['trial']} timed", annotation_text=f"trial {t['trial']}",
                      annotation_position="top left")
    for key, label, colour, side in (("profile_step", "memory profile", "#d62728", "bottom right"),
                                     ("flops_step", "flops profile", "#2ca02c", "bottom left")):
        if marks.get(key) is not None:
            fig.add_vline(x=marks[key], line_dash="dot", line_color=colour, annotation_text=label,
                          annotation_position=side)
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="GiB", rangemode="tozero")
    arm = f" of the {marks['arm']} arm" if marks.get("arm") else ""
    return _layout(fig, f"{case}: allocator peaks per step{arm}", height=380)


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
    arm and rank, from :func:`dashboards.memory_view.rank_memory_rows`."""
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
