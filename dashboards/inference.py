"""The Inference tab of an inference suite's run (``report.inference``, run-report schema 3):
per case, each arm's prefill and per-token times, tokens/s and memory, and the greedy tokens of
each arm against the reference arm's. Tables from the report (:func:`arm_rows`,
:func:`greedy_rows`) and one figure (:func:`per_token_figure`); a malformed record raises
ValueError naming the key, which the page turns into a warning."""

from __future__ import annotations

import plotly.graph_objects as go

from dslab.report import RunReport

GIB = 2**30
NOTE = ("prefill: from the call's start to the first new token (the prompt's forward and the first choice); "
        "per token: the gap between consecutive new tokens (one decode step and its choice), p50 and p90 over every "
        "token of every timed call; tokens/s: new tokens per second of a whole call, median over trials. Peak memory "
        "is the allocator's peak during the arm's trial, the weights of every arm of the case included (they stay "
        "resident). The weights-read floor is the arm's weight bytes read once at the measured copy bandwidth's "
        "read half: what a batch-1 token costs at best.")


def has_inference(report: RunReport) -> bool:
    return isinstance(report.inference, dict) and bool(report.inference)


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def case_record(report: RunReport, case: str | None) -> tuple[list[str], str | None, dict | None]:
    """``(cases, chosen case, its record)``; the chosen case is ``case`` when the report has it,
    else the first. ValueError when a record is not an object with an ``arms`` object."""
    records = report.inference if isinstance(report.inference, dict) else {}
    cases = list(records)
    if not cases:
        return [], None, None
    chosen = case if case in records else cases[0]
    record = records[chosen]
    if not isinstance(record, dict) or not isinstance(record.get("arms"), dict):
        raise ValueError(f"inference.{chosen} should be an object with an 'arms' object")
    return cases, chosen, record


def arm_rows(record: dict) -> list[dict]:
    """One row per arm: times in ms, tokens/s, memory in GiB (None where the record has none)."""
    rows = []
    for arm, m in record["arms"].items():
        if not isinstance(m, dict):
            raise ValueError(f"inference arms.{arm} should be an object")

        def gib(key):
            value = _number(m.get(key))
            return value / GIB if value is not None else None

        rows.append({"arm": arm, "prefill_ms": _number(m.get("prefill_ms")),
                     "per_token_ms_p50": _number(m.get("per_token_ms_p50")),
                     "per_token_ms_p90": _number(m.get("per_token_ms_p90")),
                     "tokens_per_s": _number(m.get("tokens_per_s")), "weights_gib": gib("weights_bytes"),
                     "kv_cache_gib": gib("kv_cache_bytes"), "peak_gib": gib("peak_memory_bytes"),
                     "weights_read_floor_ms": _number(m.get("weights_read_floor_ms"))})
    return rows


def greedy_rows(record: dict) -> list[dict]:
    """One row per compared arm: equal or not, the first differing new token, the agreement."""
    greedy = record.get("greedy")
    if greedy is None:
        return []
    if not isinstance(greedy, dict) or not isinstance(greedy.get("arms"), dict):
        raise ValueError("inference greedy should be an object with an 'arms' object")
    rows = []
    for arm, g in greedy["arms"].items():
        if not isinstance(g, dict):
            raise ValueError(f"inference greedy.arms.{arm} should be an object")
        agreement = _number(g.get("agreement"))
        rows.append({"arm": arm, "reference": str(greedy.get("reference_arm", "?")),
                     "compared_tokens": greedy.get("compared_tokens"), "same_tokens": "yes" if g.get("equal") else "no",
                     "first_divergence": g.get("first_divergence"),
                     "agreement_pct": 100 * agreement if agreement is not None else None})
    return rows


def per_token_figure(rows: list[dict], case: str) -> go.Figure:
    """Per-token p50 (bars) and p90 (markers) of each arm, ms."""
    measured = [r for r in rows if r["per_token_ms_p50"] is not None]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=[r["arm"] for r in measured], y=[r["per_token_ms_p50"] for r in measured], name="p50",
                         text=[f"{r['per_token_ms_p50']:.3g}" for r in measured], textposition="outside"))
    fig.add_trace(go.Scatter(x=[r["arm"] for r in measured], y=[r["per_token_ms_p90"] for r in measured],
                             mode="markers", name="p90", marker={"symbol": "line-ew-open", "size": 24}))
    fig.update_yaxes(title="ms per new token")
    fig.update_layout(title=f"{case}: time per new token", template="plotly_white",
                      margin={"l": 60, "r": 20, "t": 50, "b": 50}, height=360)
    return fig
