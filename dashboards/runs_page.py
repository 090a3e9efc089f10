"""The runs page (every run, filters, throughput history per suite: :mod:`dashboards.history_view`)
and the page comparing two runs, with the gate's verdict on each case and arm
(:mod:`dashboards.compare_view`)."""

from __future__ import annotations

from urllib.parse import quote

from dash import dcc, html

from dashboards import autotune_view, compare_view, history_view, views
from dashboards.components import PAGE_SIZE, graph, guarded, table, warning
from dashboards.data import RunStore, RunSummary, commit_label, gpu_label, source_label
from dslab.gate import GateSettings
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
    """One history figure per suite of ``summaries`` (the filtered runs), ``arms`` as filtered. The
    autotune suite has none: its cases are tuning experiments, a panel each, not workloads to follow
    over commits."""
    out = []
    suites = {s.suite for s in summaries}
    for suite in sorted(suites - {autotune_view.SUITE}):
        out.extend(guarded(f"{suite}", lambda suite=suite: graph(
            f"history-{suite}", history_view.history_figure_of(store, suite, summaries, set(arms or ())))))
    if autotune_view.SUITE in suites:
        out.append(html.P(f"{autotune_view.SUITE}: no throughput history (its cases are the tuner's experiments; "
                          "a run's page draws them)", className="note", id="history-autotune-note"))
    return out or [html.P("no runs match the filters")]


def runs_page(store: RunStore) -> list:
    summaries = store.summaries()
    if not summaries:
        return [html.H2("Runs"), html.P(f"no run reports under {store.root}: run `dslab bench SUITE` first")]

    def options(values):
        return [{"label": v, "value": v} for v in sorted(set(values))]

    refs = [{"label": f"{s.ref} ({s.gpu})", "value": s.ref} for s in reversed(summaries) if s.error is None]
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
    first, second = compare_view.default_pair(summaries)
    compare = html.Div([
        dcc.Dropdown(id="compare-a", options=refs, value=first, placeholder="run A (baseline)"),
        dcc.Dropdown(id="compare-b", options=refs, value=second, placeholder="run B (candidate)"),
        dcc.Link("compare", id="compare-link", href=compare_href(first, second), className="button"),
    ], className="filters")
    return [
        html.H2(f"Runs ({len(summaries)})"),
        *([warning(f"{len(unreadable)} run(s) could not be read: "
                   + "; ".join(f"{s.ref}: {s.error}" for s in unreadable[:5]))] if unreadable else []),
        filters,
        table("runs-table", run_rows(summaries), columns, page_size=PAGE_SIZE, filters=True),
        html.H3("Compare two runs"), compare,
        html.H3("Throughput over time and commits, per suite"),
        html.P("One panel per case, each with its own axis; one line per arm and GPU model (dslab shown, other "
               "arms in the legend). Band and whiskers: each run's trials, min to max. Filled triangles: the "
               "gate's verdict on a run against the previous run with its fingerprint (dslab gate --baseline "
               "rolling:1); open triangles: the gate's change points; pale band: the gate's baseline.",
               className="note"),
        html.Div(history_graphs(store, summaries, None), id="runs-graphs"),
    ]


def compare_href(a: str | None, b: str | None) -> str:
    return f"/compare?a={quote(a or '')}&b={quote(b or '')}"


# -- compare ----------------------------------------------------------------------------------

GAP = {"paddingRight": "28px"}  # between run A's column and run B's


def runs_header(a: tuple[str, str], b: tuple[str, str], ra, rb) -> html.Table:
    """Run A and run B in their own columns: suite, run (a link to it), GPU, commit, source, created,
    status."""
    run_a, run_b = frames.records(frames.runs([ra, rb]))
    rows = [("suite", a[0], b[0]),
            ("run", dcc.Link(a[1], href=f"/run/{quote(a[0])}/{quote(a[1])}"),
             dcc.Link(b[1], href=f"/run/{quote(b[0])}/{quote(b[1])}")),
            ("GPU", gpu_label(run_a), gpu_label(run_b)), ("commit", commit_label(run_a), commit_label(run_b)),
            ("source digest", source_label(run_a), source_label(run_b)),
            ("created", ra.created or "?", rb.created or "?"), ("status", ra.status, rb.status)]
    head = html.Tr([html.Th(""), html.Th("A (baseline)", style=GAP), html.Th("B (candidate)", style=GAP)])
    return html.Table([html.Thead(head), html.Tbody(
        [html.Tr([html.Th(k), html.Td(x, className="run-a", style=GAP), html.Td(y, className="run-b", style=GAP)])
         for k, x, y in rows])],
        id="compare-runs", className="kv compare-runs")


def verdict_section(ra, rb, a_ref: str, b_ref: str) -> list:
    """The gate's verdict on B against A: a sentence, the table per case and arm, and the change
    per case drawn against the trials and the gate's threshold."""
    metric = compare_view.judged_metric(ra, rb)
    settings = GateSettings()
    verdict = compare_view.gate_verdict(ra, rb, a_ref, b_ref, metric, settings)
    rows = compare_view.verdict_rows(ra, rb, verdict, metric)
    return [
        html.P(compare_view.outcome_text(verdict, rows), id="compare-outcome",
               className="warning" if verdict.problems else "note"),
        html.P(f"As dslab gate judges B (candidate) against A (baseline), on {history_view.metric_label(metric)}: "
               f"B/A of the medians, its {settings.level:.0%} bootstrap interval and the rank test's p; a regression "
               f"or improvement needs the interval clear of 1, p < {settings.alpha:g} and a change that can reach "
               f"{settings.threshold:.0%}.", className="note"),
        table("compare-verdicts", rows, compare_view.verdict_columns(metric, settings)),
        html.H3("Change per case"),
        graph("compare-change", compare_view.change_figure(rows, metric, a_ref, b_ref, settings.threshold)),
    ]


def compare_page(store: RunStore, a: tuple[str, str], b: tuple[str, str]) -> list:
    """Run A (the baseline) and run B (the candidate) side by side, the gate's verdict on each case
    and arm, dslab against the best plain arm in each, and the other metrics' medians."""
    ra, rb = store.report(*a), store.report(*b)
    results_a, results_b = frames.results(ra), frames.results(rb)
    a_ref, b_ref = f"{a[0]}/{a[1]}", f"{b[0]}/{b[1]}"
    others = [{**r, "metric": history_view.metric_label(r["metric"])}
              for r in views.compare_rows(results_a, results_b)]
    return [
        html.H2("Compare two runs"),
        runs_header(a, b, ra, rb),
        *guarded("The gate's verdict per case and arm, B against A", lambda: verdict_section(ra, rb, a_ref, b_ref)),
        *guarded("dslab against the best plain-PyTorch arm", lambda: table(
            "compare-best-plain", views.best_plain_compare_rows(results_a, results_b), [
                ("case", "case"), ("A_arm", "A: best plain arm"), ("A", "A: dslab/best plain"),
                ("B_arm", "B: best plain arm"), ("B", "B: dslab/best plain"), ("B_over_A", "B/A")])),
        *guarded("Other metrics (medians)", lambda: table("compare-table", others, [
            ("case", "case"), ("arm", "arm"), ("metric", "metric (unit)"), ("A", "A"), ("B", "B"),
            ("B_over_A", "B/A")])),
    ]
