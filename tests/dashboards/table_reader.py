"""Reads the HTML tables of the dashboard's pages (:func:`dashboards.components.plain_table` and
:func:`~dashboards.components.key_value`: a table in a ``dcc.Markdown``) back into headers and
rows, for the tests that check what a page shows without a browser."""

from __future__ import annotations

from html.parser import HTMLParser


class PlainTable(HTMLParser):
    """``headers``: ``[(field, header)]`` of the table's head; ``rows``: ``[{field: text}]`` of its
    body (a row header included); ``numeric``: per row, the fields whose cell is a number."""

    def __init__(self):
        super().__init__()
        self.headers: list[tuple[str, str]] = []
        self.rows: list[dict[str, str]] = []
        self.numeric: list[set[str]] = []
        self._in_body = False
        self._cell: tuple[str, bool] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.rows.append({})
            self.numeric.append(set())
        elif tag in ("th", "td"):
            self._cell = (attrs.get("data-field", ""), attrs.get("class") == "num")
            self._text = []
        elif tag == "br" and self._cell is not None:
            self._text.append("\n")

    def handle_data(self, data):
        if self._cell is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag not in ("th", "td") or self._cell is None:
            return
        field, numeric = self._cell
        text = "".join(self._text)
        if not self._in_body:
            self.headers.append((field, text))
        else:
            self.rows[-1][field] = text
            if numeric:
                self.numeric[-1].add(field)
        self._cell = None


def read_plain_table(component) -> PlainTable:
    """The table of a plain or key/value table component, read."""
    table = PlainTable()
    table.feed(component.children)
    return table
