"""Building blocks every dashboard page uses: sections that turn a failure into a warning,
graphs, sortable tables and key/value tables, and the per-case links of a run's tab."""

from __future__ import annotations

import logging
from urllib.parse import quote

import dash_ag_grid as dag
from dash import dcc, html

logger = logging.getLogger("dashboards.pages")

GRAPH_CONFIG = {"displaylogo": False, "responsive": True}
PAGE_SIZE = 25


def warning(text: str) -> html.Div:
    return html.Div(text, className="warning")


def guarded(title: str, build) -> list:
    """``build()``'s components under an ``h3`` ``title``; a warning in their place if it fails."""
    try:
        body = build()
    except Exception as err:  # a malformed section must not take the page down
        logger.warning("section %r could not be drawn: %s", title, err, exc_info=True)
        body = [warning(f"{title}: could not be drawn from this report ({type(err).__name__}: {err})")]
    return [html.H3(title), *(body if isinstance(body, list) else [body])]


def graph(graph_id: str, figure) -> dcc.Graph:
    return dcc.Graph(id=graph_id, figure=figure, config=GRAPH_CONFIG, className="graph")


def display_rows(rows: list[dict]) -> list[dict]:
    """``rows`` with floats rounded to 4 significant digits, for a table."""
    def shown(v):
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
            return int(v)
        return float(f"{v:.4g}") if isinstance(v, float) else v

    return [{k: shown(v) for k, v in row.items()} for row in rows]


def table(table_id: str, rows: list[dict], columns: list[tuple[str, str]] | None = None,
          page_size: int = 50, filters: bool = False) -> dag.AgGrid:
    """An AG Grid of ``rows`` (sortable; ``filters`` adds a filter box under each header); a
    ``link`` column holds markdown links."""
    columns = columns or [(k, k) for k in (rows[0] if rows else {})]
    defs = [{"field": key, "headerName": name, **({"cellRenderer": "markdown", "linkTarget": "_self"}
                                                   if key == "link" else {})} for key, name in columns]
    return dag.AgGrid(
        id=table_id, rowData=display_rows(rows), columnDefs=defs, columnSize="autoSize",
        defaultColDef={"sortable": True, "resizable": True, "filter": filters, "floatingFilter": filters},
        dashGridOptions={"pagination": len(rows) > page_size, "paginationPageSize": page_size,
                         "domLayout": "autoHeight", "enableCellTextSelection": True},
        style={"height": None})


def key_value(rows: list[tuple[str, str]], class_name: str = "kv") -> html.Table:
    return html.Table([html.Tr([html.Th(k), html.Td(v)]) for k, v in rows], className=class_name)


def case_links(suite: str, run_id: str, tab: str, cases: list[str], chosen: str | None) -> html.Div:
    if len(cases) < 2:
        return html.Div()
    return html.Div(["case: "] + [dcc.Link(c, href=f"/run/{quote(suite)}/{quote(run_id)}/{tab}?case={quote(c)}",
                                           className="tab current" if c == chosen else "tab") for c in cases],
                    className="tabs")
