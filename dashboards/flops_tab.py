"""The Flops tab of a run: the per-module flops treemap beside every module's figures (DeepSpeed's
flops profile as a sortable, filterable table), MFU, where the step's device time went, the module
types per depth and the roofline. A case whose profile never ran shows why, and nothing else."""

from __future__ import annotations

import dash_ag_grid as dag
from dash import html

from dashboards import figures, flops_view, views
from dashboards.components import case_links, column_defs, display_rows, graph, guarded, key_value, plain_table
from dslab.report import frames

TREE_HEIGHT = "520px"


def modules_grid(rows: list[dict]) -> dag.AgGrid:
    """Every module's row of :func:`dashboards.flops_view.module_rows` in one scrolling grid as
    tall as the treemap beside it: sortable, each column with a filter (a number filter on the
    numeric ones, so ``depth = 3`` picks one depth), the module's name pinned on the left."""
    text = {"module", "type", "timed_by"}
    shown = display_rows(rows)
    extra = {key: {"filter": "agTextColumnFilter" if key in text else "agNumberColumnFilter",
                   **({"pinned": "left"} if key == "module" else {})} for key, _ in flops_view.MODULE_COLUMNS}
    defs = column_defs(shown, flops_view.MODULE_COLUMNS, **extra)
    return dag.AgGrid(
        id="flops-modules", rowData=shown, columnDefs=defs,
        defaultColDef={"sortable": True, "resizable": True, "floatingFilter": True},
        dashGridOptions={"enableCellTextSelection": True}, style={"height": TREE_HEIGHT})


def flops_tab(report, suite, run_id, case) -> list:
    cases, chosen, data = views.section(report, "flops", case)
    reason = flops_view.why_no_profile(report, data)
    out = [case_links(suite, run_id, "flops", cases, chosen)] if cases else []
    if reason is not None:
        return out + [html.P(reason, id="flops-no-profile", className="warning")]
    nodes = []

    def tree():
        nodes.extend(flops_view.flops_tree(frames.flops_modules(report, case=chosen, strict=True)))
        return [html.Div([
            html.Div(graph("flops-treemap", figures.flops_treemap(flops_view.folded_treemap_nodes(nodes), chosen)),
                     style={"minWidth": 0}),
            html.Div([modules_grid(flops_view.module_rows(nodes)), html.P(flops_view.MODULES_NOTE, className="note")],
                     style={"minWidth": 0}),
        ], className="pair")]

    out += guarded("Flops by module", tree)
    out += guarded("MFU", lambda: key_value(flops_view.mfu_rows(data)))

    def breakdown():
        rows = flops_view.step_breakdown(data, frames.flops_modules(report, case=chosen, strict=True))
        if not rows:
            return [html.P("this profile has no device times (recorded before dslab timed modules by their "
                           "kernels, or the timing failed)", id="flops-breakdown-empty")]
        return [plain_table("flops-breakdown", rows, flops_view.BREAKDOWN_COLUMNS)]

    out += guarded("Where the step went (device time)", breakdown)
    out += guarded("Module types per depth",
                   lambda: plain_table("flops-types", flops_view.type_rows(nodes), flops_view.TYPE_COLUMNS))

    def roof():
        activations = frames.memory_activations(report, case=chosen)
        points = flops_view.roofline_points(nodes, activations, report.config.get("precision"))
        return [graph("flops-roofline", figures.roofline(points, flops_view.ceilings(report, data), chosen)),
                html.P(flops_view.ROOFLINE_NOTE, className="note")]

    out += guarded("Roofline", roof)
    from dashboards import continuous_view  # the profile over the run (flops_profiler.every_n_steps)

    out += continuous_view.section(report, chosen, data)
    return out
