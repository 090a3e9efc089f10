"""The Dash app: ``dslab dashboard [--reports DIR] [--host 127.0.0.1] [--port 8050]``.

Routes (all read-only, all under the reports directory):

- ``/``: Runs - the filterable run table, throughput over time per suite, compare two runs.
- ``/run/<suite>/<run_id>[/<tab>][?case=<case>]``: one run; tabs flops, comms, memory, telemetry, io,
  experts (the expert load of a mixture-of-experts run), inference (an inference suite's run),
  scaling (a data-parallel run's cases ``<model case>-n<N>``; ``?case=`` picks the model case),
  pipeline (a run with pipeline-parallel arms: stage utilisation and timelines) and trace (the
  profiled step and its collectives per rank, :mod:`dashboards.trace_view`). The navigation shows
  the tabs with records for the run; every tab's address answers. The Run tab of an autotuning run
  (suite ``autotune``, or any run with ``profilers["autotuning"]``) is the tuner's experiments,
  :mod:`dashboards.autotune_view`.
- ``/compare?a=<suite>/<run_id>&b=<suite>/<run_id>``: two runs side by side.
- ``/trace/<suite>/<run_id>``: the run's ``trace.pftrace`` (``dslab bench`` writes it with the run;
  ``dslab trace`` for an older one).

Suite and run ids from URLs are validated by :func:`dashboards.data.resolve_run`; a bad one is a
"not found" page, never a read outside the reports directory. Page building is wrapped so that a
report that cannot be drawn shows an error on its page and the app keeps serving. A run page is
drawn once per version of its report and trace and then served from
:meth:`dashboards.data.RunStore.page`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import parse_qs, unquote

import dash
from dash import Input, Output, dcc, html

from dashboards import pages, runs_page
from dashboards.components import display_rows
from dashboards.data import RunStore, parse_ref

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8050

STYLE = """
body { font-family: -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; color: #222; }
.top { background: #1f2937; color: white; padding: 10px 20px; }
.top a { color: white; margin-right: 18px; text-decoration: none; font-weight: bold; }
.page { padding: 10px 24px 40px; }
.warning { background: #fff4ce; border: 1px solid #e0b100; padding: 6px 10px; margin: 6px 0; }
.error { background: #fde2e1; border: 1px solid #d62728; padding: 8px 12px; margin: 10px 0; }
.note { color: #555; font-size: 13px; max-width: 1100px; }
.filters { display: grid; grid-template-columns: repeat(4, minmax(160px, 1fr)); gap: 8px; margin: 8px 0 12px; }
.tabs { margin: 10px 0; }
.tab { display: inline-block; padding: 4px 12px; margin-right: 6px; border: 1px solid #ccc; border-radius: 4px;
       text-decoration: none; color: #1f2937; }
.tab.current { background: #1f2937; color: white; }
.button { display: inline-block; padding: 6px 14px; background: #1f77b4; color: white; border-radius: 4px;
          text-decoration: none; align-self: center; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
table.kv { border-collapse: collapse; font-size: 13px; }
table.kv th { text-align: left; padding: 2px 14px 2px 0; font-weight: normal; color: #555; }
table.kv td { padding: 2px 0; font-family: monospace; }
table.plain { border-collapse: collapse; font-size: 13px; margin: 4px 0 10px; }
table.plain th { text-align: left; font-weight: 600; padding: 5px 12px; border-bottom: 2px solid #d1d5db; }
table.plain td { padding: 4px 12px; border-bottom: 1px solid #eceef1; white-space: nowrap; }
table.plain td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre.kv-text { font-size: 12px; line-height: 1.45; margin: 4px 0; white-space: pre-wrap; }
"""

INDEX = """<!DOCTYPE html>
<html>
  <head>{%metas%}<title>{%title%}</title>{%favicon%}{%css%}<style>""" + STYLE + """</style>{preloads}</head>
  <body>{%app_entry%}<footer>{%config%}{%scripts%}{%renderer%}</footer></body>
</html>"""
# The scripts a page's first graph waits for, which Dash fetches only once the page's layout has
# arrived and a graph is in it (plotly.js is 4.8 MB): preloaded with the page, so that the fetch
# runs while the app starts. The paths are those Dash's renderer asks for (checked by the page
# speed test, which finds plotly.js fetched once, by the preload).
PRELOADED_SCRIPTS = ("_dash-component-suites/plotly/package_data/plotly.min.js",
                     "_dash-component-suites/dash/dcc/async-graph.js")


def index_string(prefix: str = "/") -> str:
    """The page around the app, with :data:`PRELOADED_SCRIPTS` under the app's path ``prefix``."""
    links = "".join(f'<link rel="preload" href="{prefix}{path}" as="script">' for path in PRELOADED_SCRIPTS)
    return INDEX.replace("{preloads}", links)


def _route(store: RunStore, pathname: str | None, search: str | None) -> list:
    parts = [unquote(p) for p in (pathname or "/").split("/") if p]
    query = {k: v[0] for k, v in parse_qs((search or "").lstrip("?")).items()}
    if not parts:
        return runs_page.runs_page(store)
    if parts[0] == "run" and len(parts) in (3, 4):
        return pages.run_page(store, parts[1], parts[2], parts[3] if len(parts) == 4 else "", query.get("case"))
    if parts[0] == "compare" and len(parts) == 1:
        return runs_page.compare_page(store, parse_ref(query.get("a", "")), parse_ref(query.get("b", "")))
    raise FileNotFoundError(f"no page at {pathname}")


def render(store: RunStore, pathname: str | None, search: str | None = None) -> list:
    """The components of the page at ``pathname?search``; an error box for a bad address or a
    report that cannot be read, never an exception."""
    try:
        return _route(store, pathname, search)
    except FileNotFoundError as err:
        return [html.H2("Not found"), html.Div(str(err), className="error"), dcc.Link("back to the runs", href="/")]
    except ValueError as err:
        return [html.H2("Cannot show this"), html.Div(str(err), className="error"),
                dcc.Link("back to the runs", href="/")]
    except Exception as err:  # the app must keep serving whatever a report holds
        logger.exception("page %s failed", pathname)
        return [html.H2("This page could not be drawn"),
                html.Div(f"{type(err).__name__}: {err}", className="error"), dcc.Link("back to the runs", href="/")]


def create_app(reports: str | Path = "reports") -> dash.Dash:
    """The dashboard over the run reports under ``reports``."""
    store = RunStore(reports)
    app = dash.Dash(__name__, title="dslab dashboard", suppress_callback_exceptions=True,
                    update_title=None)
    app.index_string = index_string(app.config.requests_pathname_prefix)
    app.layout = html.Div([
        dcc.Location(id="url"),
        html.Div([dcc.Link("dslab", href="/"), dcc.Link("Runs", href="/"),
                  html.Span(f"reports: {Path(reports).resolve()}", style={"fontSize": "12px"})], className="top"),
        html.Div(id="page", className="page"),
    ])

    @app.callback(Output("page", "children"), Input("url", "pathname"), Input("url", "search"))
    def _page(pathname, search):
        return render(store, pathname, search)

    @app.callback(Output("runs-table", "rowData"), Output("runs-graphs", "children"),
                  Input("filter-suite", "value"), Input("filter-arm", "value"),
                  Input("filter-gpu", "value"), Input("filter-commit", "value"), prevent_initial_call=True)
    def _filter(suites, arms, gpus, commits):
        chosen = runs_page.filter_summaries(store.summaries(), suites, arms, gpus, commits)
        return display_rows(runs_page.run_rows(chosen)), runs_page.history_graphs(store, chosen, arms)

    @app.callback(Output("compare-link", "href"), Input("compare-a", "value"), Input("compare-b", "value"))
    def _compare(a, b):
        return runs_page.compare_href(a, b)

    @app.server.route("/trace/<suite>/<run_id>")
    def _trace(suite, run_id):
        import flask

        try:
            path = store.trace_file(suite, run_id)
        except (ValueError, FileNotFoundError):
            path = None
        if path is None:
            flask.abort(404)
        return flask.send_file(path, as_attachment=True, download_name=f"{run_id}.pftrace",
                               mimetype="application/octet-stream")

    return app


def run(reports: str | Path = "reports", host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """Serve the dashboard until interrupted (127.0.0.1 unless told otherwise)."""
    app = create_app(reports)
    print(f"dslab dashboard on http://{host}:{port}/ over {Path(reports).resolve()} (Ctrl-C stops it)")
    app.run(host=host, port=port, debug=False)
