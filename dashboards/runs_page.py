"""The runs page (every run, filters, throughput history per suite) and the page comparing two
runs."""

from __future__ import annotations

from urllib.parse import quote

from dash import dcc, html

from dashboards import figures, views
from dashboards.components import PAGE_SIZE, graph, guarded, table, warning
from dashboards.data import RunStore, RunSummary, commit_label, gpu_label, source_label
from dslab.report import frames

HEADLINE_METRIC = "samples_per_s"


def run_rows(summaries: list[RunSummary]) -> list[dict]:
    rows = []
    for s in reversed(summaries):
        headline = next((m[HEADLINE_METRIC] for (case, arm), m in s.metrics.items()
                         if arm == "dslab" and HEADLINE_METRIC in m), None)
        rows.append({"suite": s.suite, "link": f"[{s.run_id}](/run/{quote(s.suite)}/{quote(s.run_id)})",
                     "status": s.status, "created": s.created or "-", "gpu": s.gpu, "commit": s.commit,
                     "source": s.source, "arms": ", ".join(s.arms), "dslab_samples_per_s": headline,
                     "warnings": s.error or "; ".join(s.warnings)})
    return rows


def filter_summaries(summaries: list[RunSummary], suites, arms, gpus, commits) -> list[RunSummary]:
    def keep(s: RunSummary) -> bool:
        return ((not suites or s.suite in suites) and (not gpus or s.gpu in gpus)
                and (not commits or s.commit in commits) and (not arms or bool(set(arms) & set(s.arms))))
    return [s for s in summaries if keep(s)]


def history_graphs(store: RunStore, summaries: list[RunSummary], arms) -> list:
    out = []
    for suite in sorted({s.suite for s in summaries}):
        out.extend(guarded(f"{suite}", lambda suite=suite: graph(
            f"history-{suite}", figures.throughput_history(suite, summaries, set(arms or ()),
                                                           store.baselines(suite), store.change_points(suite)))))
    return out or [html.P("no runs match the filters")]


def runs_page(store: RunStore) -> list:
    summaries = store.summaries()
    if not summaries:
        return [html.H2("Runs"), html.P(f"no run reports under {store.root}: run `dslab bench SUITE` first")]

    def options(values):
        return [{"label": v, "value": v} for v in sorted(set(values))]

    refs = [s.ref for s in reversed(summaries) if s.error is None]
    unreadable = [s for s in summaries if s.error]
    filters = html.Div([
        dcc.Dropdown(id="filter-suite", options=options(s.suite for s in summaries), multi=True, placeholder="suite"),
        dcc.Dropdown(id="filter-arm", options=options(a for s in summaries for a in s.arms), multi=True,
                     placeholder="arm"),
        dcc.Dropdown(id="filter-gpu", options=options(s.gpu for s in summaries), multi=True, placeholder="GPU"),
        dcc.Dropdown(id="filter-commit", options=options(s.commit for s in summaries), multi=True,
                     placeholder="commit"),
    ], className="filters")
    columns = [("suite", "suite"), ("link", "run"), ("status", "status"), ("created", "created"), ("gpu", "GPU"),
               ("commit", "commit"), ("source", "source digest"), ("arms", "arms"),
               ("dslab_samples_per_s", "dslab samples/s"),
               ("warnings", "warnings")]
    compare = html.Div([
        dcc.Dropdown(id="compare-a", options=refs, value=refs[1] if len(refs) > 1 else None, placeholder="run A"),
        dcc.Dropdown(id="compare-b", options=refs, value=refs[0] if refs else None, placeholder="run B"),
        dcc.Link("compare", id="compare-link", href=compare_href(refs[1] if len(refs) > 1 else None,
                                                                   refs[0] if refs else None), className="button"),
    ], className="filters")
    return [
        html.H2(f"Runs ({len(summaries)})"),
        *([warning(f"{len(unreadable)} run(s) could not be read: "
                   + "; ".join(f"{s.ref}: {s.error}" for s in unreadable[:5]))] if unreadable else []),
        filters,
        table("runs-table", run_rows(summaries), columns, page_size=PAGE_SIZE, filters=True),
        html.H3("Compare two runs"), compare,
        html.H3("Throughput over time and commits, per suite"),
        html.P("Lines: the dslab arm of each case (other arms in the legend). Shaded: the gate's baseline "
               "(min to max of its trials). Triangles: the gate's change points.", className="note"),
        html.Div(history_graphs(store, summaries, None), id="runs-graphs"),
    ]


def compare_href(a: str | None, b: str | None) -> str:
    return f"/compare?a={quote(a or '')}&b={quote(b or '')}"


# -- compare ----------------------------------------------------------------------------------


def compare_page(store: RunStore, a: tuple[str, str], b: tuple[str, str]) -> list:
    ra, rb = store.report(*a), store.report(*b)
    results_a, results_b = frames.results(ra), frames.results(rb)
    run_a, run_b = frames.records(frames.runs([ra, rb]))
    env = [("", f"A: {a[0]}/{a[1]}", f"B: {b[0]}/{b[1]}")]
    env += [("GPU", gpu_label(run_a), gpu_label(run_b)), ("commit", commit_label(run_a), commit_label(run_b)),
            ("source digest", source_label(run_a), source_label(run_b)),
            ("created", ra.created or "?", rb.created or "?"), ("status", ra.status, rb.status)]
    return [
        html.H2("Compare two runs"),
        html.Table([html.Tr([html.Th(k), html.Td(x), html.Td(y)]) for k, x, y in env], className="kv"),
        *guarded("dslab against the best plain-PyTorch arm", lambda: table(
            "compare-best-plain", views.best_plain_compare_rows(results_a, results_b), [
                ("case", "case"), ("A_arm", "A: best plain arm"), ("A", "A: dslab/best plain"),
                ("B_arm", "B: best plain arm"), ("B", "B: dslab/best plain"), ("B_over_A", "B/A")])),
        *guarded("Metrics", lambda: table("compare-table", views.compare_rows(results_a, results_b), [
            ("case", "case"), ("arm", "arm"), ("metric", "metric"), ("A", "A"), ("B", "B"), ("B_over_A", "B/A")])),
        *guarded("Side by side", lambda: graph("compare-bar", figures.compare_bar(results_a, results_b))),
    ]
