"""The Expert load tab of a mixture-of-experts run (``report.profilers["moe"][case]``, written by
``dslab.bench`` for the dslab arm's last timed step): the layer x expert routing table, the dropped
assignments, each arm's expert TFLOP/s (from the run's ``results`` frame) and the ``all_to_all``
rows of expert parallelism. No frame holds the routing records, so they are read here, each
malformed one raising ValueError naming its key, which the page turns into a warning.
"""

from __future__ import annotations

import pandas as pd

from dashboards.views import _dict, _list, _number
from dslab.report import RunReport, frames

EXPERT_LOAD_NOTE = (
    "Routing of the dslab arm's last timed step (rank 0's tokens): each cell is the share of the layer's "
    "(token, expert) assignments that chose the expert, before capacity dropping; a uniform router gives "
    "1 / experts in every cell. Dropped: assignments past their expert's capacity (none when dropless). "
    "Expert TFLOP/s: the arm's expert flops per step over its step time (12 x hidden x ffn per kept "
    "assignment and MoE layer; the hf arm's gated experts do three matrices)."
)


def has_moe(report: RunReport) -> bool:
    """Whether the report holds MoE records (``profilers["moe"]`` with a case)."""
    raw = report.profilers.get("moe") if isinstance(report.profilers, dict) else None
    return isinstance(raw, dict) and any(isinstance(v, dict) for v in raw.values())


def expert_load(data: dict) -> dict:
    """One case's MoE record (``profilers["moe"][case]``) as a layer x expert table.

    Returns ``{"layers": ["layer 1", ...], "experts": ["expert 0", ...], "counts": [[int]],
    "share_pct": [[% of the layer's assignments]], "rows": [per layer: "layer", "assignments",
    "dropped", "dropped_pct", "max_over_mean", "capacity"], "dropped_pct": over every layer,
    "num_experts", "k", "tokens_per_step", "drop_tokens"}``. Raises ValueError when the record
    has no layers or a layer's counts are not a list of numbers of one length."""
    data = _dict(data, "moe")
    layers = _list(data.get("layers"), "moe.layers")
    if not layers:
        raise ValueError("moe.layers is empty")
    labels, counts, shares, rows = [], [], [], []
    width = None
    for i, layer in enumerate(layers):
        layer = _dict(layer, f"moe.layers[{i}]")
        values = _list(layer.get("exp_counts"), f"moe.layers[{i}].exp_counts")
        if not values or any(_number(v) is None for v in values):
            raise ValueError(f"moe.layers[{i}].exp_counts should be a list of numbers")
        if width is not None and len(values) != width:
            raise ValueError(f"moe.layers[{i}].exp_counts has {len(values)} experts, the first layer {width}")
        width = len(values)
        total = sum(values)
        dropped = _number(layer.get("dropped")) or 0.0
        labels.append(f"layer {layer.get('layer', i)}")
        counts.append([int(v) for v in values])
        shares.append([100 * v / total if total else 0.0 for v in values])
        rows.append({"layer": labels[-1], "assignments": total, "dropped": dropped,
                     "dropped_pct": 100 * dropped / total if total else 0.0,
                     "max_over_mean": max(values) * len(values) / total if total else None,
                     "capacity": _number(layer.get("capacity"))})
    fraction = _number(data.get("dropped_fraction"))
    if fraction is None:
        assigned = sum(r["assignments"] for r in rows)
        fraction = sum(r["dropped"] for r in rows) / assigned if assigned else 0.0
    def count(key):
        value = _number(data.get(key))
        return None if value is None else int(value)

    return {"layers": labels, "experts": [f"expert {e}" for e in range(width)], "counts": counts,
            "share_pct": shares, "rows": rows, "dropped_pct": 100 * fraction,
            "num_experts": count("num_experts") or width, "k": count("k"),
            "tokens_per_step": count("tokens_per_step"), "drop_tokens": data.get("drop_tokens")}


def expert_tflops_rows(results: pd.DataFrame, case: str, data: dict | None = None) -> list[dict]:
    """Per arm of ``case`` in a run's ``results`` frame: its expert flops per step (from the MoE
    record ``data``, where it has them), median step time and expert TFLOP/s (median over trials)."""
    flops = (data or {}).get("expert_flops_per_step") if isinstance((data or {}).get("expert_flops_per_step"),
                                                                      dict) else {}
    return [{"arm": r["arm"], "status": r["status"],
             "expert_gflops_per_step": _number(flops.get(r["arm"])) / 1e9 if _number(flops.get(r["arm"])) else None,
             "step_time_ms": r.get("step_time_ms"), "expert_tflops": r.get("expert_tflops")}
            for r in frames.records(results[(results["case"] == case).fillna(False)])]


def all_to_all_rows(data: dict) -> list[dict]:
    """The MoE record's ``all_to_all`` rows (expert parallelism), in the comms table's columns."""
    raw = _dict(data, "moe").get("all_to_all")
    if raw is None:
        return []
    rows = []
    for i, row in enumerate(_list(raw, "moe.all_to_all")):
        row = _dict(row, f"moe.all_to_all[{i}]")
        rows.append({"op": str(row.get("op", "?")), "size_bytes": _number(row.get("size_bytes")),
                     "count": _number(row.get("count")), "avg_latency_ms": _number(row.get("avg_latency_ms")),
                     "algbw_GBps": _number(row.get("algbw_GBps")), "busbw_GBps": _number(row.get("busbw_GBps"))})
    return rows
