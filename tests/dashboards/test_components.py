"""The page building blocks that keep a page fast (dashboards/components.py): grid columns sized
from their text on the server, plain tables as one escaped HTML component, and graphs in a box
of their figure's height."""

from __future__ import annotations

import plotly.graph_objects as go
from dash import dcc
from table_reader import read_plain_table

from dashboards import components


def test_a_column_fits_its_header_or_its_longest_cell_within_the_bounds():
    rows = [{"name": "layers.0.attention.qkv", "ms": 1.5, "link": "[20261128T212522Z-68abb2](/run/zero/x)"},
            {"name": "wte", "ms": 12345.25, "link": None}]
    columns = [("name", "module"), ("ms", "forward + backward time (ms)"), ("link", "run")]
    widths = components.column_widths(rows, columns)
    char, cell, head = components.CHAR_PX, components.CELL_PAD_PX, components.HEADER_PAD_PX
    assert widths["name"] >= char * len("layers.0.attention.qkv") + cell  # the cell is longer than "module"
    assert widths["ms"] >= char * len("forward + backward time (ms)") + head  # the header is longer
    assert widths["link"] < char * len("[20261128T212522Z-68abb2](/run/zero/x)")  # the link's label, not its URL
    assert widths["link"] >= char * len("20261128T212522Z-68abb2") + cell
    long = components.column_widths([{"error": "x" * 500}, {"n": 1}], [("error", "error"), ("n", "n")])
    assert long == {"error": components.COLUMN_MAX_PX, "n": components.COLUMN_MIN_PX}
    defs = components.column_defs([{"error": "x" * 500}], [("error", "error")])
    assert defs[0]["tooltipField"] == "error"  # a cut text is whole in its tooltip


def test_a_plain_table_is_one_component_with_every_value_escaped_in_order():
    rows = [{"phase": "<script>alert(1)</script>", "ms": 1.23456789, "n": 3},
            {"phase": "backward & optimizer\n\nstep", "ms": None, "n": 0}]
    table = components.plain_table("t", rows, [("phase", "phase <b>"), ("ms", "time (ms)"), ("n", "count")])
    assert isinstance(table, dcc.Markdown) and table.id == "t" and table.dangerously_allow_html
    assert "<script>" not in table.children and "<b>" not in table.children
    read = read_plain_table(table)
    assert read.headers == [("phase", "phase <b>"), ("ms", "time (ms)"), ("n", "count")]
    shown = components.display_rows(rows)
    assert read.rows == [{"phase": r["phase"], "ms": "" if r["ms"] is None else str(r["ms"]), "n": str(r["n"])}
                         for r in shown]
    assert read.rows[0]["ms"] == "1.235" and read.numeric == [{"ms", "n"}, {"n"}]  # numbers right-aligned
    assert "\n" not in table.children  # one block of HTML: Markdown leaves its text alone


def test_a_key_value_table_is_one_component_with_the_keys_as_row_headers():
    table = components.key_value([("peak <measured>", "989.4"), ("MFU", "41.2%")])
    assert isinstance(table, dcc.Markdown) and table.children.startswith('<table class="kv"><tbody><tr><th')
    assert read_plain_table(table).rows == [{"key": "peak <measured>", "value": "989.4"}, {"key": "MFU", "value": "41.2%"}]


def test_a_graph_sits_in_a_box_of_its_figures_height():
    tall = components.graph("g", go.Figure(layout={"height": 520}))
    assert tall.style == {"height": "520px"}
    assert components.graph("d", {"data": [], "layout": {"height": 240.5}}).style == {"height": "240.5px"}
    assert getattr(components.graph("free", go.Figure()), "style", None) is None  # no height: the default box
