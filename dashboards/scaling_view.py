"""The Scaling tab of a multi-process run (``suites/zero``: cases named ``<model case>-n<N>``):
per model case, each arm's throughput against the number of processes, its weak-scaling
efficiency, its peak memory per GPU, and dslab's arms against the peers that shard the same way.

The numbers are :mod:`dslab.report.scaling`'s (:func:`~dslab.report.scaling.scaling_points`,
:func:`~dslab.report.scaling.peer_comparisons`), the ones ``dslab bench`` prints in its scaling
table; this module only groups them per model case into series and rows, and draws them. An arm
that failed or was skipped at some process count is no point of a figure: it is a row of the
tables, with its status (and error).
"""

from __future__ import annotations

import logging

import plotly.graph_objects as go
from plotly.colors import qualitative

from dslab.report import RunReport
from dslab.report.scaling import ScalingPoint, case_processes, peer_comparisons, report_peers, scaling_points

logger = logging.getLogger(__name__)

GIB = 2**30
TEMPLATE = "plotly_white"
MARGIN = {"l": 60, "r": 20, "t": 50, "b": 50}
PALETTE = qualitative.Plotly + qualitative.D3
NOTE = ("Weak scaling: every process steps the case's micro-batch, so N processes step N times the tokens. "
        "tokens/s counts every rank's tokens per (slowest rank's) step. Efficiency at N = tokens/s(N) / "
        "(N x tokens/s(1)) of the same arm, 1.0 being perfect scaling (none where the arm did not run on one "
        "process). Peak memory per GPU: the largest rank's (the CUDA allocator's peak over a trial plus the "
        "arm's graph pools; on a CPU the largest resident set). dslab against a peer: dslab's tokens/s over the "
        "peer's (above 1: dslab is faster) and its peak memory over the peer's (below 1: dslab needs less), in "
        "the same case; the peers of a dslab arm are the arms that shard model states the same way (ZeRO-0: DDP; "
        "ZeRO-1/2: DeepSpeed's same stage; ZeRO-3: FSDP2 with or without compiled blocks and DeepSpeed's stage 3). "
        "Failed and skipped arms are no points of the figures; the tables list them with their status.")


def points(report: RunReport) -> list[ScalingPoint]:
    """Every (model case, arm, process count) the report measured (``scaling_points``)."""
    return scaling_points(report)


def has_scaling(report: RunReport) -> bool:
    """Whether the report has cases with a process count (a data-parallel suite's run). Every run
    page's tab bar asks this, so a report it cannot read says no (the tab itself shows why)."""
    try:
        return bool(points(report))
    except Exception as err:  # the other tabs of the run must still be drawn
        logger.warning("scaling points of %s/%s: %s", report.suite, report.run_id, err, exc_info=True)
        return False


def model_cases(pts: list[ScalingPoint]) -> list[str]:
    """The model cases of ``pts``, in the report's order."""
    return list(dict.fromkeys(p.base_case for p in pts))


def chosen_model_case(report: RunReport, pts: list[ScalingPoint], case: str | None) -> str | None:
    """The model case to show for ``?case=``: ``case`` itself when it is a model case, the model
    case of ``case`` when it names one process count of it (``355m-n4``), else the first."""
    bases = model_cases(pts)
    if not bases:
        return None
    if case in bases:
        return case
    base = case_processes(report).get(case or "", (None, 0))[0]
    return base if base in bases else bases[0]


def process_counts(pts: list[ScalingPoint], base: str) -> list[int]:
    """The process counts the run measured of model case ``base``, ascending."""
    return sorted({p.nprocs for p in pts if p.base_case == base})


def series(pts: list[ScalingPoint], base: str) -> list[dict]:
    """Per arm of model case ``base`` (in the report's order) with at least one ``ok`` point:
    ``{"arm", "nprocs": [N ascending], "case": [case names], "tokens_per_s": [...],
    "efficiency": [... or None], "peak_gib": [... or None]}`` over its ``ok`` points only."""
    out = []
    for arm in dict.fromkeys(p.arm for p in pts if p.base_case == base):
        mine = sorted((p for p in pts if p.base_case == base and p.arm == arm and p.status == "ok"
                       and p.tokens_per_s is not None), key=lambda p: p.nprocs)
        if not mine:
            continue
        out.append({"arm": arm, "nprocs": [p.nprocs for p in mine], "case": [p.case for p in mine],
                    "tokens_per_s": [p.tokens_per_s for p in mine], "efficiency": [p.efficiency for p in mine],
                    "peak_gib": [None if p.peak_memory_bytes is None else p.peak_memory_bytes / GIB for p in mine]})
    return out


def point_rows(report: RunReport, pts: list[ScalingPoint], base: str) -> list[dict]:
    """Every arm and process count of model case ``base``, failed and skipped ones included:
    ``{"arm", "nprocs", "case", "status", "tokens_per_s", "efficiency", "peak_gib", "error"}``
    (the figures' numbers; None where the arm did not run ``ok``), by arm, then N."""
    arms = list(dict.fromkeys(p.arm for p in pts if p.base_case == base))
    rows = []
    for p in sorted((p for p in pts if p.base_case == base), key=lambda p: (arms.index(p.arm), p.nprocs)):
        result = report.result(p.case, p.arm)
        error = result.error if result is not None and p.status != "ok" else None
        rows.append({"arm": p.arm, "nprocs": p.nprocs, "case": p.case, "status": p.status,
                     "tokens_per_s": p.tokens_per_s, "efficiency": p.efficiency,
                     "peak_gib": None if p.peak_memory_bytes is None else p.peak_memory_bytes / GIB,
                     "error": str(error).splitlines()[0][:200] if error else None})
    return rows


def peer_rows(report: RunReport, pts: list[ScalingPoint], base: str | None = None) -> list[dict]:
    """dslab's arms against their peers (:func:`~dslab.report.scaling.report_peers`) in each case (of model case ``base``; every
    model case when None): ``{"case", "nprocs", "arm", "peer", "status", "speedup",
    "memory_ratio"}``. A pair where both ran ``ok`` carries ``peer_comparisons``' ratios and
    status ``"ok"``; a pair where either did not (a peer skipped because DeepSpeed does not
    import, an arm out of memory) is listed with that arm's status (``"<arm> <status>"``) and no
    ratios. Peers the run did not have are left out."""
    compared = {(c.case, c.arm, c.peer): c for c in peer_comparisons(report)}
    by_key = {(p.case, p.arm): p for p in pts}
    peers = report_peers(report)
    rows = []
    for (case, arm), mine in by_key.items():
        if arm not in peers or (base is not None and mine.base_case != base):
            continue
        for peer in peers[arm]:
            theirs = by_key.get((case, peer))
            if theirs is None:
                continue
            c = compared.get((case, arm, peer))
            if c is not None:
                status = "ok"
            else:
                status = "; ".join(f"{p.arm} {p.status if p.status != 'ok' else 'measured no tokens/s'}"
                                   for p in (mine, theirs) if p.status != "ok" or p.tokens_per_s is None)
            rows.append({"case": case, "nprocs": mine.nprocs, "arm": arm, "peer": peer, "status": status,
                         "speedup": c.speedup if c is not None else None,
                         "memory_ratio": c.memory_ratio if c is not None else None})
    return rows


# -- figures ----------------------------------------------------------------------------------


def _layout(fig: go.Figure, title: str, counts: list[int], **kwargs) -> go.Figure:
    fig.update_layout(title=title, template=TEMPLATE, margin=MARGIN, legend_title_text="arm", **kwargs)
    fig.update_xaxes(title="processes (N)")
    if counts:
        fig.update_xaxes(tickmode="array", tickvals=counts, ticktext=[str(n) for n in counts])
    return fig


def _empty(title: str, message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(title=title, template=TEMPLATE, margin=MARGIN, height=260)
    return fig


def arm_colours(report: RunReport) -> dict[str, str]:
    """One colour per arm of the run, the same in every figure and model case."""
    return {arm: PALETTE[i % len(PALETTE)] for i, arm in enumerate(report.arms())}


def _line(arm: str, colours: dict[str, str]) -> dict:
    """dslab's arms solid, the peers dotted."""
    return {"color": colours.get(arm), "dash": "solid" if arm.startswith("dslab") else "dot"}


def throughput_figure(rows: list[dict], base: str, counts: list[int], colours: dict[str, str]) -> go.Figure:
    """tokens/s (all ranks) against N, one line per arm of :func:`series`' ``rows``, a marker at
    each measured N."""
    if not rows:
        return _empty(f"{base}: tokens/s against processes", "no arm ran ok")
    fig = go.Figure()
    for s in rows:
        fig.add_trace(go.Scatter(x=s["nprocs"], y=s["tokens_per_s"], mode="lines+markers", name=s["arm"],
                                 line=_line(s["arm"], colours), marker={"size": 9}, customdata=s["case"],
                                 hovertemplate="%{customdata}<br>%{y:,.0f} tokens/s<extra>" + s["arm"] + "</extra>"))
    fig.update_yaxes(title="tokens/s (all ranks)", rangemode="tozero")
    return _layout(fig, f"{base}: tokens/s against processes", counts, height=400)


def efficiency_figure(rows: list[dict], base: str, counts: list[int], colours: dict[str, str]) -> go.Figure:
    """Weak-scaling efficiency against N, one line per arm that ran on one process (N=1 is 1.0 by
    definition), a dashed line at 1.0."""
    fig = go.Figure()
    drawn = 0
    for s in rows:
        kept = [(n, e, c) for n, e, c in zip(s["nprocs"], s["efficiency"], s["case"]) if e is not None]
        if not kept:
            continue
        drawn += 1
        fig.add_trace(go.Scatter(x=[k[0] for k in kept], y=[k[1] for k in kept], mode="lines+markers",
                                 name=s["arm"], line=_line(s["arm"], colours), marker={"size": 9},
                                 customdata=[k[2] for k in kept],
                                 hovertemplate="%{customdata}<br>efficiency %{y:.3f}<extra>" + s["arm"] + "</extra>"))
    if not drawn:
        return _empty(f"{base}: weak-scaling efficiency", "no arm ran ok on one process")
    fig.add_hline(y=1.0, line_dash="dash", line_color="#555", annotation_text="perfect scaling",
                  annotation_position="top left")
    top = max(1.1, max(y for t in fig.data for y in t.y) * 1.05)
    fig.update_yaxes(title="tokens/s(N) / (N x tokens/s(1))", range=[0, top])
    return _layout(fig, f"{base}: weak-scaling efficiency", counts, height=400)


def memory_figure(rows: list[dict], base: str, counts: list[int], colours: dict[str, str]) -> go.Figure:
    """Peak memory per GPU (GiB, the largest rank's), grouped bars: one group per N, one bar per arm."""
    fig = go.Figure()
    for s in rows:
        kept = [(n, g, c) for n, g, c in zip(s["nprocs"], s["peak_gib"], s["case"]) if g is not None]
        if kept:
            fig.add_trace(go.Bar(x=[k[0] for k in kept], y=[k[1] for k in kept], name=s["arm"],
                                 marker_color=colours.get(s["arm"]), customdata=[k[2] for k in kept],
                                 hovertemplate="%{customdata}<br>%{y:.2f} GiB<extra>" + s["arm"] + "</extra>"))
    if not fig.data:
        return _empty(f"{base}: peak memory per GPU", "no arm recorded its peak memory")
    fig.update_layout(barmode="group")
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=counts)
    fig.update_yaxes(title="GiB per GPU (largest rank)")
    return _layout(fig, f"{base}: peak memory per GPU", [], height=400)
