"""The Comms tab of a run: per-op figures of the reporting rank, bandwidth against message
size and the straggler wait of every rank."""

from __future__ import annotations

from dash import html

from dashboards import figures, views
from dashboards.components import case_links, graph, guarded, table
from dslab.report import frames


def comms_tab(report, suite, run_id, case) -> list:
    cases, chosen, data = views.section(report, "comms", case)
    if data is None:
        return [html.P("no comms log in this run (comms_logger off)")]
    out = [case_links(suite, run_id, "comms", cases, chosen)]

    def ops():
        return views.comms_op_rows(frames.comms_ops(report, case=chosen, strict=True))

    def calls():
        return frames.comms_calls(report, case=chosen, strict=True)

    out += guarded("Per op (reporting rank)", lambda: table("comms-ops", ops()))
    out += guarded("Bandwidth against message size", lambda: graph(
        "comms-bandwidth", figures.comms_bandwidth(ops(), views.bandwidth_points(calls()), chosen)))
    out += guarded("Straggler wait", lambda: graph("comms-stragglers", figures.straggler_heatmap(
        views.straggler_matrix(calls(), frames.stragglers(report, case=chosen, strict=True)), chosen)))
    if isinstance(data.get("definitions"), str):
        out.append(html.P(data["definitions"], className="note"))
    return out
