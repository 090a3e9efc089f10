"""Building blocks every dashboard page uses: sections that turn a failure into a warning,
graphs, sortable tables and key/value tables, and the per-case links of a run's tab.

Tables are AG Grids (sortable, filterable) whose column widths are set here from the longest
text of each column (:func:`column_widths`), not measured in the browser: AG Grid's ``autoSize``
lays out every rendered cell of every column to find its width, which took a few hundred
milliseconds of a page with three grids. A table that is small by nature, or whose order is its
meaning, and a key/value table are plain HTML tables, each one component (:func:`plain_table`,
:func:`key_value`)."""

from __future__ import annotations

import logging
import math
import re
from html import escape
from urllib.parse import quote

import dash_ag_grid as dag
from dash import dcc, html

logger = logging.getLogger("dashboards.pages")

GRAPH_CONFIG = {"displaylogo": False, "responsive": True}
PAGE_SIZE = 25
# Column widths from text lengths, fitted to what AG Grid's autoSize chose in Chromium with the
# default (quartz) theme: ~7.3 px a character, plus the cell's padding, or the header's padding,
# sort icon and menu. A column is at most COLUMN_MAX_PX wide; a longer text is cut with an
# ellipsis and shown whole in the cell's tooltip.
CHAR_PX = 7.3
CELL_PAD_PX = 30
HEADER_PAD_PX = 52
COLUMN_MIN_PX = 60
COLUMN_MAX_PX = 480
MARKDOWN_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")


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


def _figure_height(figure) -> int | None:
    """The height (px) that ``figure`` (a plotly figure or its dict) sets in its layout, if any."""
    layout = figure.get("layout") if isinstance(figure, dict) else getattr(figure, "layout", None)
    height = layout.get("height") if isinstance(layout, dict) else getattr(layout, "height", None)
    return height if isinstance(height, (int, float)) and not isinstance(height, bool) and height > 0 else None


def graph(graph_id: str, figure) -> dcc.Graph:
    """``figure`` as a responsive graph (it follows its container's width). A figure with a
    height gets a box of that height: a responsive graph's box otherwise fills its container,
    and one beside a taller neighbour (the two graphs of a ``pair``) was drawn, stretched, and
    drawn again at the new height."""
    height = _figure_height(figure)
    return dcc.Graph(id=graph_id, figure=figure, config=GRAPH_CONFIG, className="graph",
                     **({"style": {"height": f"{height:g}px"}} if height else {}))


def display_rows(rows: list[dict]) -> list[dict]:
    """``rows`` with floats rounded to 4 significant digits, for a table."""
    def shown(v):
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
            return int(v)
        return float(f"{v:.4g}") if isinstance(v, float) else v

    return [{k: shown(v) for k, v in row.items()} for row in rows]


def _shown_text(value) -> str:
    """The text a cell shows for ``value`` (a markdown link shows its label)."""
    return "" if value is None else MARKDOWN_LINK.sub(r"\1", str(value))


def column_widths(rows: list[dict], columns: list[tuple[str, str]]) -> dict[str, int]:
    """``{field: width in px}`` that fits each column's header and its longest cell of ``rows``
    (rows as the grid shows them: :func:`display_rows`), between :data:`COLUMN_MIN_PX` and
    :data:`COLUMN_MAX_PX`."""
    widths = {}
    for key, name in columns:
        cell = max((len(_shown_text(row.get(key))) for row in rows), default=0)
        width = max(CHAR_PX * len(name) + HEADER_PAD_PX, CHAR_PX * cell + CELL_PAD_PX)
        widths[key] = int(min(COLUMN_MAX_PX, max(COLUMN_MIN_PX, math.ceil(width))))
    return widths


def column_defs(rows: list[dict], columns: list[tuple[str, str]], **extra) -> list[dict]:
    """AG Grid column definitions of ``columns`` (``(field, header)``) with the widths of
    :func:`column_widths` and a tooltip on a column whose text may be cut; ``extra[field]`` is
    merged into that field's definition."""
    widths = column_widths(rows, columns)
    defs = []
    for key, name in columns:
        cut = widths[key] >= COLUMN_MAX_PX
        defs.append({"field": key, "headerName": name, "width": widths[key],
                     **({"tooltipField": key} if cut else {}), **extra.get(key, {})})
    return defs


def table(table_id: str, rows: list[dict], columns: list[tuple[str, str]] | None = None,
          page_size: int = 50, filters: bool = False) -> dag.AgGrid:
    """An AG Grid of ``rows`` (sortable; ``filters`` adds a filter box under each header); a
    ``link`` column holds markdown links. Column widths: :func:`column_widths`."""
    columns = columns or [(k, k) for k in (rows[0] if rows else {})]
    shown = display_rows(rows)
    defs = column_defs(shown, columns, link={"cellRenderer": "markdown", "linkTarget": "_self"})
    return dag.AgGrid(
        id=table_id, rowData=shown, columnDefs=defs,
        defaultColDef={"sortable": True, "resizable": True, "filter": filters, "floatingFilter": filters},
        dashGridOptions={"pagination": len(rows) > page_size, "paginationPageSize": page_size,
                         "domLayout": "autoHeight", "enableCellTextSelection": True},
        style={"height": None})


def _html_table(class_name: str, head: list[tuple[str, str]] | None, rows: list[list[tuple[str, object]]],
                row_headers: bool = False, **props) -> dcc.Markdown:
    """One table as HTML in a :class:`dcc.Markdown` (one component however many cells): ``head``
    and each row a list of ``(field, value)``, the first cell of a row a header with
    ``row_headers``; text escaped (a line break as ``<br>``, so the HTML is one line), each cell
    carrying its field (``data-field``), numbers classed ``num``."""
    def cell(tag: str, field: str, value) -> str:
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        text = escape("" if value is None else str(value), quote=False).replace("\n", "<br>")
        return f'<{tag} data-field="{escape(field)}"' + (' class="num">' if numeric else ">") + f"{text}</{tag}>"

    def row_html(row: list[tuple[str, object]]) -> str:
        return "<tr>" + "".join(cell("th" if row_headers and i == 0 else "td", field, value)
                                for i, (field, value) in enumerate(row)) + "</tr>"

    thead = "<thead><tr>" + "".join(cell("th", f, v) for f, v in head) + "</tr></thead>" if head else ""
    body = "".join(row_html(row) for row in rows)
    # one line, no blank line: Markdown reads it as one block of HTML and leaves its text alone
    return dcc.Markdown(f'<table class="{escape(class_name)}">{thead}<tbody>{body}</tbody></table>',
                        dangerously_allow_html=True, **props)


def plain_table(table_id: str, rows: list[dict], columns: list[tuple[str, str]]) -> dcc.Markdown:
    """``rows`` as a plain HTML table, for a table that is small by nature (the phases of a step,
    the parts of a breakdown, the ops of a run) or whose order is its meaning (a tree, indented,
    or the steps of a run): sorting adds nothing there, and an AG Grid cost ~0.1 s of a page load
    in the browser. The table is one component (:func:`_html_table`): as Dash components (a
    ``Td`` per cell) the ~500 cells of the Comms tab took ~0.4 s to render. Values as
    :func:`display_rows` shows them, numbers right-aligned."""
    return _html_table("plain", list(columns), [[(key, row.get(key)) for key, _ in columns]
                                                for row in display_rows(rows)], id=table_id)


def key_value(rows: list[tuple[str, str]], class_name: str = "kv") -> dcc.Markdown:
    """``(key, value)`` rows as a two-column table, the keys as row headers (:func:`_html_table`)."""
    return _html_table(class_name, None, [[("key", k), ("value", v)] for k, v in rows], row_headers=True)


def case_links(suite: str, run_id: str, tab: str, cases: list[str], chosen: str | None) -> html.Div:
    if len(cases) < 2:
        return html.Div()
    return html.Div(["case: "] + [dcc.Link(c, href=f"/run/{quote(suite)}/{quote(run_id)}/{tab}?case={quote(c)}",
                                           className="tab current" if c == chosen else "tab") for c in cases],
                    className="tabs")
