"""The Comms tab of a run: the reporting rank's per-op summary, the stragglers (who arrived late
and whom it kept waiting), bus bandwidth against message size beside the measured curve, the
profiled step's gradient buckets against backward (where the record has ``overlap``), and one
step's collectives of a multi-rank run (:mod:`dashboards.comms_view`)."""

from __future__ import annotations

from dash import html

from dashboards import comms_view, figures, views
from dashboards.components import case_links, graph, guarded, plain_table
from dslab.report import frames


def _phase_medians(report, case: str) -> dict[str, float]:
    """The wall-clock breakdown's median ms per phase of ``case`` (empty without one)."""
    return {r["phase"]: r["median_ms"] for r in frames.records(frames.wall_clock(report, case=case))
            if r["median_ms"] is not None}


def _no_collectives(report, case: str) -> bool:
    """Whether ``case``'s comms record is well formed and holds no collective (one process);
    a malformed one is not: its sections say what is wrong."""
    try:
        return (frames.comms_calls(report, case=case, strict=True).empty
                and frames.comms_ops(report, case=case, strict=True).empty)
    except ValueError:
        return False


def comms_tab(report, suite, run_id, case) -> list:
    cases, chosen, data = views.section(report, "comms", case)
    if data is None:
        return [html.P("no comms log in this run (comms_logger off)")]
    out = [case_links(suite, run_id, "comms", cases, chosen)]
    if _no_collectives(report, chosen):
        return out + [html.P("no timed collectives in this case (one process issues none)", className="note")]

    def calls():
        return frames.comms_calls(report, case=chosen, strict=True)

    def stragglers():
        calls_frame, analysis = calls(), frames.stragglers(report, case=chosen, strict=True)
        matrix = comms_view.straggler_matrix(calls_frame, analysis)
        rows = comms_view.straggler_rows(analysis, matrix)
        return [plain_table("comms-stragglers-table", rows, comms_view.STRAGGLER_COLUMNS),
                graph("comms-caused-wait", comms_view.caused_wait_bar(rows, chosen)),
                graph("comms-stragglers", figures.straggler_heatmap(matrix, chosen)),
                html.P(comms_view.STRAGGLER_NOTE, className="note")]

    def bandwidth():
        return [graph("comms-bandwidth", figures.comms_bandwidth(
                    comms_view.bandwidth_points(calls()), comms_view.reference_busbw(report), chosen)),
                html.P(comms_view.BANDWIDTH_NOTE, className="note")]

    def overlap():
        ranks = comms_view.overlap_ranks(data)
        rank = comms_view.overlap_rank(ranks, data.get("rank"))
        shown = ranks[rank]
        others = [html.Li(comms_view.overlap_summary(o, r)) for r, o in ranks.items() if r != rank]
        return [html.P(comms_view.overlap_summary(shown, rank), id="comms-overlap-summary"),
                graph("comms-overlap", comms_view.overlap_timeline(shown, rank, chosen)),
                plain_table("comms-overlap-buckets", comms_view.overlap_rows(shown), comms_view.OVERLAP_COLUMNS),
                *([html.Ul(others, className="note")] if others else []),
                html.P(comms_view.OVERLAP_NOTE, className="note")]

    def one_step():
        rank = data.get("rank") if isinstance(data.get("rank"), int) else 0
        steps = comms_view.step_calls(calls(), rank)
        if not steps:
            return [html.P("no collective on a group of two or more ranks in this case", className="note")]
        rows = comms_view.step_rows(steps)
        step = comms_view.typical_step(rows)
        return [graph("comms-step", comms_view.step_timeline(steps, step, rank, chosen, _phase_medians(report, chosen))),
                plain_table("comms-steps", rows, comms_view.STEP_COLUMNS),
                html.P(comms_view.STEP_NOTE, className="note")]

    out += guarded("Per op (reporting rank)", lambda: plain_table(
        "comms-ops", comms_view.comms_op_rows(frames.comms_ops(report, case=chosen, strict=True)),
        comms_view.OP_COLUMNS))
    out += guarded("Stragglers", stragglers)
    out += guarded("Bus bandwidth against message size", bandwidth)
    if data.get("overlap") is not None:
        out += guarded("Gradient communication against backward (profiled step)", overlap)
    out += guarded("Collectives of one step (per gradient bucket)", one_step)
    if isinstance(data.get("definitions"), str):
        out.append(html.P(data["definitions"], className="note"))
    return out
