"""The I/O page's tables and figure, from a run report's ``profilers["io"][case]`` records.

Two producers write that section (:mod:`dslab.io`):

- ``dslab nvme-tune`` (``"kind": "tune"``): ``configs`` (one row per configuration and
  direction: the five handle parameters, ``GBps`` median, ``spread_pct``, ``trials``, the
  ``round`` it reached and ``dropped_after_round``), ``best``, ``fio`` (``read``/``write``
  medians of its 1M/iodepth-32 job and ``matched`` runs beside the best configurations) and
  ``recommended_aio``.
- an engine run (``"kind": "engine"``): ``operations`` (per kind: ``swap_in``, ``swap_out``,
  ``checkpoint_write``; count, bytes, seconds, GB/s, the time the step waited) and ``events``.

The configurations, operations and events are rows of the case's ``io_records`` frame
(:mod:`dslab.report.frames`, built with ``strict=True`` so a malformed list raises ValueError
naming it); the tuner's ``best`` and ``fio`` figures are read from the record itself.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dslab.report import frames

OP_COLOURS = {"read": "#1f77b4", "write": "#ff7f0e"}
PARAMETERS = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")


def _rows(io: pd.DataFrame, record: str) -> list[dict]:
    """The rows of one sort (``config``, ``operation``, ``event``) of an ``io_records`` frame."""
    return frames.records(io[(io["record"] == record).fillna(False)])


def config_rows(io: pd.DataFrame) -> list[dict]:
    """Configuration x GB/s: one row per configuration and direction, finalists first."""
    return [{"op": row["op"], "configuration": row["label"], **{k: row[k] for k in PARAMETERS},
             "GBps": row["GBps"], "spread_pct": row["spread_pct"], "trials": row["trials"] or 0,
             "round": row["round"], "dropped_after_round": row["dropped_after_round"]}
            for row in _rows(io, "config")]


def comparison_rows(record: dict) -> list[dict]:
    """Per direction: the tuner's best beside fio's two jobs, and the best over fio's best."""
    best = record.get("best") or {}
    fio = record.get("fio") or {}
    if not isinstance(best, dict) or not isinstance(fio, dict):
        raise ValueError("io.best and io.fio should be objects")
    rows = []
    for op in ("read", "write"):
        mine = (best.get(op) or {}).get("GBps")
        plain = (fio.get(op) or {}).get("GBps")
        matched = (fio.get("matched") or {}).get(op) or {}
        fio_best = max((v for v in (plain, matched.get("GBps")) if isinstance(v, (int, float))),
                       default=None)
        rows.append({"op": op, "best_configuration": (best.get(op) or {}).get("label"),
                     "dslab_GBps": mine, "fio_1M_32_GBps": plain,
                     "dslab_beside_matched_GBps": (matched.get("dslab") or {}).get("GBps"),
                     "fio_matched_GBps": matched.get("GBps"),
                     "fio_matched_job": (f"bs {matched['bs']}, iodepth {matched['iodepth']}"
                                         if "bs" in matched else None),
                     "dslab_over_fio_best": mine / fio_best if mine and fio_best else None})
    return rows


def operation_rows(io: pd.DataFrame) -> list[dict]:
    """An engine run's swaps and checkpoint writes by kind."""
    return [{"kind": r["op"], "count": r["count"], "bytes": r["bytes"], "seconds": r["seconds"], "GBps": r["GBps"],
             "median_GBps": r["median_GBps"], "min_GBps": r["min_GBps"], "max_GBps": r["max_GBps"],
             "waited_s": r["wait_s"]} for r in _rows(io, "operation")]


def event_rows(io: pd.DataFrame, limit: int = 500) -> list[dict]:
    """The last ``limit`` events of an engine run, newest last."""
    return [{"kind": e["op"], "step": e["step"], "bytes": e["bytes"], "seconds": e["seconds"], "GBps": e["GBps"],
             "waited_s": e["wait_s"], "path": e["path"]} for e in _rows(io, "event")[-limit:]]


def config_figure(io: pd.DataFrame, record: dict, case: str) -> go.Figure:
    """GB/s of every configuration in the ``io_records`` frame ``io`` that reached the last round,
    read and write side by side, with the spread as error bars and fio's 1M/iodepth-32 job (from
    the tuner's ``record``) as dashed lines."""
    rows = [r for r in config_rows(io) if r["dropped_after_round"] is None]
    fig = go.Figure()
    for op, colour in OP_COLOURS.items():
        mine = [r for r in rows if r["op"] == op]
        fig.add_bar(name=f"dslab {op}", x=[r["configuration"] for r in mine],
                    y=[r["GBps"] for r in mine], marker_color=colour,
                    error_y={"type": "data", "array": [(r["GBps"] or 0) * (r["spread_pct"] or 0) / 100
                                                       for r in mine]})
        plain = ((record.get("fio") or {}).get(op) or {}).get("GBps")
        if isinstance(plain, (int, float)):
            fig.add_hline(y=plain, line_dash="dash", line_color=colour,
                          annotation_text=f"fio {op} (1M, iodepth 32)")
    fig.update_layout(title=f"{case}: finalists, GB/s (median of trials)", template="plotly_white",
                      barmode="group", yaxis_title="GB/s", xaxis_title="configuration",
                      margin={"l": 60, "r": 20, "t": 50, "b": 120}, height=460)
    return fig
