"""The Flops tab of a run: the per-module flops treemap, MFU, where the step's device time went,
the top modules per depth and the roofline."""

from __future__ import annotations

from dash import html

from dashboards import figures, views
from dashboards.components import case_links, graph, guarded, key_value, table
from dslab.report import frames


def flops_tab(report, suite, run_id, case) -> list:
    cases, chosen, data = views.section(report, "flops", case)
    if data is None:
        return [html.P("no flops profile in this run (flops_profiler off)")]
    out = [case_links(suite, run_id, "flops", cases, chosen)]
    nodes = []

    def tree():
        nodes.extend(views.flops_tree(frames.flops_modules(report, case=chosen, strict=True)))
        return graph("flops-treemap", figures.flops_treemap(nodes, chosen))

    out += guarded("Flops by module", tree)
    out += guarded("MFU", lambda: key_value(views.mfu_rows(data)))

    def breakdown():
        rows = views.step_breakdown(data, frames.flops_modules(report, case=chosen, strict=True))
        if not rows:
            return [html.P("this profile has no device times (recorded before dslab timed modules by their "
                           "kernels, or the timing failed)", id="flops-breakdown-empty")]
        return [table("flops-breakdown", rows, [("part", "part"), ("device_ms", "device ms"),
                                                ("share_of_step_pct", "% of the steady step")])]

    out += guarded("Where the step went (device time)", breakdown)
    out += guarded("Top modules per depth", lambda: table("flops-top", views.top_modules(nodes)))

    def roof():
        activations = frames.memory_activations(report, case=chosen)
        points = views.roofline_points(nodes, activations, report.config.get("precision"))
        return [graph("flops-roofline", figures.roofline(points, views.ceilings(report, data), chosen)),
                html.P(views.ROOFLINE_NOTE, className="note")]

    out += guarded("Roofline", roof)
    return out
