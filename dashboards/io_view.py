"""The I/O page's tables and figure, from a run report's ``profilers["io"][case]`` records.

Two producers write that section (:mod:`dslab.io`):

- ``dslab nvme-tune`` (``"kind": "tune"``): ``configs`` (one row per configuration and
  direction: the five handle parameters, ``GBps`` median, ``spread_pct``, ``trials``, the
  ``round`` it reached and ``dropped_after_round``), ``best``, ``fio`` (``read``/``write``
  medians of its 1M/iodepth-32 job and ``matched`` runs beside the best configurations) and
  ``recommended_aio``.
- an engine run (``"kind": "engine"``): ``operations`` (per kind: ``swap_in``, ``swap_out``,
  ``checkpoint_write``; count, bytes, seconds, GB/s, the time the step waited) and ``events``.

Everything here reads plain data and raises ValueError naming the field that is malformed.
"""

from __future__ import annotations

import plotly.graph_objects as go

OP_COLOURS = {"read": "#1f77b4", "write": "#ff7f0e"}
PARAMETERS = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")


def _rows(record: dict, key: str) -> list[dict]:
    rows = record.get(key)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"io.{key} should be a list of objects")
    return rows


def config_rows(record: dict) -> list[dict]:
    """Configuration x GB/s: one row per configuration and direction, finalists first."""
    out = []
    for row in _rows(record, "configs"):
        out.append({"op": row.get("op"), "configuration": row.get("label"),
                    **{k: row.get(k) for k in PARAMETERS},
                    "GBps": row.get("GBps"), "spread_pct": row.get("spread_pct"),
                    "trials": len(row.get("trials") or []), "round": row.get("round"),
                    "dropped_after_round": row.get("dropped_after_round")})
    return out


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


def operation_rows(record: dict) -> list[dict]:
    """An engine run's swaps and checkpoint writes by kind."""
    return [{"kind": r.get("kind"), "count": r.get("count"), "bytes": r.get("bytes"),
             "seconds": r.get("seconds"), "GBps": r.get("GBps"), "median_GBps": r.get("median_GBps"),
             "min_GBps": r.get("min_GBps"), "max_GBps": r.get("max_GBps"),
             "waited_s": r.get("wait_s")} for r in _rows(record, "operations")]


def event_rows(record: dict, limit: int = 500) -> list[dict]:
    """The last ``limit`` events of an engine run, newest last."""
    events = _rows(record, "events") if "events" in record else []
    return [{"kind": e.get("kind"), "step": e.get("step"), "bytes": e.get("nbytes"),
             "seconds": e.get("seconds"), "GBps": e.get("GBps"), "waited_s": e.get("wait_s"),
             "path": e.get("path")} for e in events[-limit:]]


def config_figure(record: dict, case: str) -> go.Figure:
    """GB/s of every configuration that reached the last round, read and write side by side,
    with the spread as error bars and fio's 1M/iodepth-32 job as dashed lines."""
    rows = [r for r in config_rows(record) if r["dropped_after_round"] is None]
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
