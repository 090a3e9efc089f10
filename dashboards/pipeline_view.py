"""The Pipeline tab of a run with pipeline-parallel arms (``report.profilers["pipeline"]``, written
by :class:`dslab.engine.pipe_engine.PipelineEngine`): per case, each stage's busy and idle time
against the 1F1B bubble, and the latest batch's forwards and backwards per stage.

A stage's idle fraction is ``1 - busy / wall`` over the measured batches, busy being the time its
forwards and backwards ran (CUDA events on a GPU), wall the whole batch including the optimizer
step. The bubble ``(p - 1) / (m + p - 1)`` is what 1F1B leaves idle with equal stage times and free
transfers; idle above it is time lost to imbalance between stages, transfers, or the step.
"""

from __future__ import annotations

import plotly.graph_objects as go

from dslab.report import RunReport

TEMPLATE = "plotly_white"
MARGIN = {"l": 70, "r": 20, "t": 50, "b": 50}
COLOURS = {"forward": "#1f77b4", "backward": "#ff7f0e"}
NOTE = ("Idle: 1 - busy/wall over the measured batches of the stage, busy being its forwards and backwards "
        "(CUDA events), wall the whole batch with the optimizer step. The bubble (p-1)/(m+p-1) is what the 1F1B "
        "schedule leaves idle with equal stage times and free transfers; idle above it is imbalance between "
        "stages, transfers or the step. The timeline is each stage's latest batch from that stage's own start "
        "(F3: forward of micro-batch 3, B3 its backward); the gaps are waits.")


def records(report: RunReport) -> dict[str, dict]:
    """``{case key: pipeline record}`` of the report (empty without pipeline arms)."""
    data = report.profilers.get("pipeline")
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("per_stage"), list)}


def has_pipeline(report: RunReport) -> bool:
    return bool(records(report))


def _stages(record: dict) -> list[dict]:
    return sorted((s for s in record["per_stage"] if isinstance(s, dict) and isinstance(s.get("stage"), int)),
                  key=lambda s: s["stage"])


def utilisation_rows(record: dict) -> list[dict]:
    """One row per stage: busy and wall ms, idle and bubble (%), idle beyond the bubble (points)."""
    bubble = record.get("bubble_fraction")
    rows = []
    for s in _stages(record):
        wall, busy = s.get("wall_ms") or 0.0, s.get("busy_ms") or 0.0
        idle = (1 - busy / wall) if wall > 0 else None
        rows.append({"stage": s["stage"], "batches": len(s.get("batches") or []), "busy_ms": round(busy, 2),
                     "wall_ms": round(wall, 2),
                     "idle_pct": None if idle is None else round(100 * idle, 1),
                     "bubble_pct": None if bubble is None else round(100 * bubble, 1),
                     "over_bubble_pts": None if idle is None or bubble is None else round(100 * (idle - bubble), 1)})
    return rows


def utilisation_figure(record: dict, title: str) -> go.Figure:
    """Busy and idle percent per stage as stacked bars, the bubble as a dashed line."""
    rows = [r for r in utilisation_rows(record) if r["idle_pct"] is not None]
    stages = [f"stage {r['stage']}" for r in rows]
    fig = go.Figure([
        go.Bar(name="busy", x=stages, y=[round(100 - r["idle_pct"], 1) for r in rows], marker_color="#2ca02c"),
        go.Bar(name="idle", x=stages, y=[r["idle_pct"] for r in rows], marker_color="#d62728"),
    ])
    bubble = record.get("bubble_fraction")
    if bubble is not None:
        fig.add_hline(y=100 * (1 - bubble), line_dash="dash", line_color="#555",
                      annotation_text=f"1F1B bubble {100 * bubble:.1f}%")
    fig.update_layout(barmode="stack", template=TEMPLATE, margin=MARGIN, title=title,
                      yaxis_title="% of the batch", yaxis_range=[0, 100])
    return fig


def timeline_figure(record: dict, title: str) -> go.Figure:
    """The latest batch of each stage: one row per stage, a bar per forward and backward."""
    fig = go.Figure()
    for kind in ("forward", "backward"):
        ys, bases, widths, labels = [], [], [], []
        for s in _stages(record):
            batches = [b for b in s.get("batches") or [] if isinstance(b, dict) and b.get("timeline")]
            if not batches:
                continue
            for k, micro, start, end in batches[-1]["timeline"]:
                if k == kind:
                    ys.append(f"stage {s['stage']}")
                    bases.append(start)
                    widths.append(end - start)
                    labels.append(f"{'F' if kind == 'forward' else 'B'}{micro}")
        if ys:
            fig.add_trace(go.Bar(name=kind, y=ys, x=widths, base=bases, orientation="h", text=labels,
                                 textposition="inside", marker_color=COLOURS[kind]))
    fig.update_layout(barmode="overlay", template=TEMPLATE, margin=MARGIN, title=title,
                      xaxis_title="ms from the stage's batch start", yaxis_autorange="reversed")
    return fig
