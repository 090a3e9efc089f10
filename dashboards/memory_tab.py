"""The Memory tab of a run: the memory tracer's timeline, activation memory per module, the
measurement beside the estimate and each rank's peak."""

from __future__ import annotations

from dash import html

from dashboards import figures, views
from dashboards.components import case_links, graph, guarded, table
from dslab.report import frames


def rank_memory_section(report, case: str | None) -> list:
    """Each rank's peak memory in ``case`` (``frames.rank_memory``) as a table and a bar per rank;
    nothing for a run of one rank."""
    if case is None or views.rank_count(frames.rank_memory(report, case=case)) < 2:
        return []

    def build():
        rows = views.rank_memory_rows(frames.rank_memory(report, case=case, strict=True))
        return [table("memory-ranks", rows, [
                    ("arm", "arm"), ("rank", "rank"), ("kind", "memory"), ("trials", "trials"),
                    ("peak_gib", "peak GiB"), ("peak_over_mean", "peak / mean"),
                    ("model_states_gib", "model states GiB")]),
                graph("memory-ranks-bar", figures.rank_memory_bar(rows, case)),
                html.P(views.RANK_MEMORY_NOTE, className="note")]

    return guarded("Memory per rank", build)


def memory_tab(report, suite, run_id, case) -> list:
    cases, chosen, data = views.section(report, "memory", case)
    if data is None:
        cases = report.cases()
        chosen = case if case in cases else (cases[0] if cases else None)
        ranks = rank_memory_section(report, chosen)
        return [html.P("no memory trace in this run (memory_tracer off)"),
                *([case_links(suite, run_id, "memory", cases, chosen), *ranks] if ranks else [])]
    out = [case_links(suite, run_id, "memory", cases, chosen)]
    if data.get("note"):
        out.append(html.P(str(data["note"]), className="note"))
    out += guarded("Timeline", lambda: graph("memory-timeline", figures.memory_timeline(
        views.memory_timeline(frames.memory_timeline(report, case=chosen, strict=True)), chosen)))
    out += guarded("Activation memory per module", lambda: graph("memory-activations", figures.activations_bar(
        views.activation_rows(frames.memory_activations(report, case=chosen, strict=True)), chosen)))
    out += guarded("Measured beside the estimate", lambda: graph(
        "memory-estimate", figures.measured_vs_estimate(views.memory_measured_vs_estimate(data), chosen)))
    out += rank_memory_section(report, chosen)
    return out
