"""The Runs page's throughput history of a suite: one panel per case, each with its own y range, one
line per (arm, GPU model), the spread of each run's trials as a band, and the gate's verdicts.

A 5% change is what the gate looks for, so cases of very different speed (GPT-2 124M and 1.5B,
BERT at seq128 and seq512) never share an axis, and runs on different GPUs never share a line. The
band around a line spans each run's trials (min to max): a step outside it is a change, a step
inside it may be noise.

Marks are the gate's own verdicts (:func:`dslab.gate.gate_trial_sets`): every run whose report the
gate can use (complete, with an environment, not slowed on purpose) is judged against the previous
such run of the suite with its fingerprint, as ``dslab gate --baseline rolling:1`` would judge it,
for the dslab arm (or the arms the filter names). The gate's change points and baselines, where it
wrote them, are drawn too. Judging needs each run's trials, which the run summaries do not hold:
:class:`HistoryCache` keeps them per run (re-read only when ``run.json`` changes) and the verdicts
per pair of runs, one cache per :class:`~dashboards.data.RunStore`.
"""

from __future__ import annotations

import datetime
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.colors import hex_to_rgb, qualitative
from plotly.subplots import make_subplots

from dashboards import figures
from dashboards.data import RunStore, RunSummary
from dslab.gate import GateSettings, TrialSet, gate_trial_sets, trial_set_from_reports
from dslab.gate.baseline import injected_sleep_ms
from dslab.gate.verdict import IMPROVEMENT, REGRESSION, Row
from dslab.report import RunReport, read_report
from dslab.report.store import REPORT_FILE

HISTORY_METRICS = ("samples_per_s", "tokens_per_s")
METRIC_LABELS = {"samples_per_s": "samples/s", "tokens_per_s": "tokens/s", "step_time_ms": "step time (ms)",
                 "model_tflops": "model TFLOP/s"}
GATED_ARMS = ("dslab",)
MARK_STYLE = {REGRESSION: ("triangle-down", "#d62728"), IMPROVEMENT: ("triangle-up", "#2ca02c")}
VERDICT_CACHE_SIZE = 4096
PANEL_HEIGHT = 240


def metric_label(metric: str) -> str:
    """``samples_per_s`` -> ``samples/s``; a metric without a label is shown by its name."""
    return METRIC_LABELS.get(metric, metric)


@dataclass
class RunTrials:
    """What the history needs of one run beyond its summary: ``values[(case, arm)][metric]``, the
    trial values of :data:`HISTORY_METRICS`; ``trial_set``, the run as the gate reads it (those
    metrics only), or None with ``unusable`` saying why the gate cannot use the run."""

    ref: str
    stamp: tuple[int, int]
    values: dict[tuple[str, str], dict[str, list[float]]]
    trial_set: TrialSet | None
    unusable: str | None = None


def run_trials(report: RunReport, ref: str, stamp: tuple[int, int] = (0, 0)) -> RunTrials:
    """The :class:`RunTrials` of ``report``."""
    values: dict[tuple[str, str], dict[str, list[float]]] = {}
    for result in report.results:
        mine = values.setdefault((result.case, result.arm), {})
        for trial in result.trials:
            for metric in HISTORY_METRICS:
                value = trial.metrics.get(metric)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    mine.setdefault(metric, []).append(float(value))
    try:
        if injected_sleep_ms(report):
            raise ValueError(f"run {report.run_id} ran with DSLAB_INJECT_STEP_SLEEP_MS={injected_sleep_ms(report)}, "
                             "a deliberate slowdown")
        trial_set = trial_set_from_reports([report], label=f"run {ref}")
    except ValueError as err:
        return RunTrials(ref, stamp, values, None, str(err))
    trial_set.trials = {key: {m: v for m, v in metrics.items() if m in HISTORY_METRICS}
                        for key, metrics in trial_set.trials.items()}
    return RunTrials(ref, stamp, values, trial_set)


class HistoryCache:
    """Each run's :class:`RunTrials`, re-read when its ``run.json`` changes, and the gate's rows of
    each judged pair of runs (the newest :data:`VERDICT_CACHE_SIZE`)."""

    def __init__(self):
        self._runs: dict[str, RunTrials] = {}
        self._verdicts: OrderedDict[tuple, dict[tuple[str, str], Row]] = OrderedDict()
        self._lock = threading.Lock()

    def run(self, store: RunStore, summary: RunSummary) -> RunTrials | None:
        """The run's trials, None when its report cannot be read now."""
        path = store.root / summary.suite / summary.run_id  # names from the directory listing, not a URL
        try:
            stat = (path / REPORT_FILE).stat()
        except OSError:
            return None
        stamp = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._runs.get(summary.ref)
        if cached is not None and cached.stamp == stamp:
            return cached
        try:
            made = run_trials(read_report(path), summary.ref, stamp)
        except (OSError, ValueError):
            return None
        with self._lock:
            self._runs[summary.ref] = made
        return made

    def verdicts(self, baseline: RunTrials, candidate: RunTrials, metric: str,
                 arms: tuple[str, ...]) -> dict[tuple[str, str], Row]:
        """The gate's row for each (case, arm) of ``arms``: ``candidate`` judged against ``baseline``."""
        key = (baseline.ref, baseline.stamp, candidate.ref, candidate.stamp, metric, arms)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        report = gate_trial_sets(baseline.trial_set, candidate.trial_set, (metric,), arms, GateSettings())
        rows = {(row.case, row.arm): row for row in report.rows}
        with self._lock:
            self._verdicts[key] = rows
            while len(self._verdicts) > VERDICT_CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return rows


_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def cache_of(store: RunStore) -> HistoryCache:
    """The :class:`HistoryCache` of ``store`` (made on first use, dropped with the store)."""
    with _CACHES_LOCK:
        cache = _CACHES.get(store)
        if cache is None:
            cache = _CACHES[store] = HistoryCache()
        return cache


def created_at(summary: RunSummary) -> datetime.datetime | None:
    """When the run was created; None when its report does not say (such runs are left out)."""
    try:
        return datetime.datetime.fromisoformat(summary.created) if summary.created else None
    except ValueError:
        return None


@dataclass
class Point:
    """One run on one line: its median, its trials' min and max (the median alone without trials)."""

    when: datetime.datetime
    run: RunSummary
    value: float
    low: float
    high: float
    trials: int


@dataclass
class Mark:
    """A run (``ref``) the gate flags on one line: ``verdict`` is regression or improvement."""

    ref: str
    case: str
    arm: str
    gpu: str
    when: datetime.datetime
    value: float
    verdict: str
    text: str


def gate_marks(store: RunStore, history: list[RunSummary], metric: str,
               arms: tuple[str, ...] = GATED_ARMS) -> list[Mark]:
    """The gate's regressions and improvements over ``history`` (one suite's summaries, oldest
    first): each usable run against the previous usable run with its fingerprint key."""
    cache = cache_of(store)
    previous: dict[str, RunTrials] = {}
    marks = []
    for summary in history:
        when = created_at(summary)
        trials = cache.run(store, summary) if summary.error is None else None
        if trials is None or trials.trial_set is None:
            continue
        key = trials.trial_set.fingerprint.key
        before = previous.get(key)
        previous[key] = trials
        if before is None or when is None:
            continue
        for (case, arm), row in cache.verdicts(before, trials, metric, arms).items():
            value = summary.metrics.get((case, arm), {}).get(metric)
            if row.verdict in MARK_STYLE and value is not None:
                marks.append(Mark(summary.ref, case, arm, summary.gpu, when, value, row.verdict,
                                  f"{row.verdict} {case}/{arm} on {summary.gpu}<br>{summary.run_id} against "
                                  f"{before.ref.split('/', 1)[1]}: {row.reason}"))
    return marks


def history_lines(store: RunStore, runs: list[RunSummary], arms: set[str] | None,
                  metric: str) -> dict[tuple[str, str, str], list[Point]]:
    """``{(case, arm, GPU): points}`` of ``runs`` (one suite's, oldest first) that measured
    ``metric``, only ``arms`` where given; each point's band from the run's trials."""
    cache = cache_of(store)
    lines: dict[tuple[str, str, str], list[Point]] = {}
    for summary in runs:
        when = created_at(summary)
        if summary.error is not None or when is None:
            continue
        trials = None
        for (case, arm), metrics in summary.metrics.items():
            if metric not in metrics or (arms and arm not in arms):
                continue
            if trials is None:
                trials = cache.run(store, summary)
            values = (trials.values.get((case, arm), {}).get(metric) if trials else None) or [metrics[metric]]
            lines.setdefault((case, arm, summary.gpu), []).append(
                Point(when, summary, metrics[metric], min(values), max(values), len(values)))
    return lines


def _rgba(colour: str, alpha: float) -> str:
    r, g, b = hex_to_rgb(colour)
    return f"rgba({r},{g},{b},{alpha})"


def history_figure(suite: str, lines: dict[tuple[str, str, str], list[Point]], marks: list[Mark],
                   baselines: list[dict], change_points: list[dict], runs: list[RunSummary],
                   arms: set[str] | None, metric: str = "samples_per_s") -> go.Figure:
    """One panel per case (own y axis, shared time axis), one line per (arm, GPU) with its band
    of trials (dslab shown, other arms in the legend unless the filter names them), the gate's
    marks, its change points and its baseline bands (min to max of the baseline's trials)."""
    label = metric_label(metric)
    if not lines:
        return figures.empty(f"{suite}: {label} over time", f"no runs with {metric}")
    cases = list(dict.fromkeys(case for case, _, _ in lines))
    fig = make_subplots(rows=len(cases), cols=1, shared_xaxes=True, subplot_titles=cases,
                        vertical_spacing=min(0.1, 0.3 / len(cases)))
    groups = list(dict.fromkeys(sorted(((arm, gpu) for _, arm, gpu in lines), key=lambda k: (k[0] != "dslab", k))))
    colours = {group: qualitative.D3[i % len(qualitative.D3)] for i, group in enumerate(groups)}
    shown: set = set()
    by_row = {case: row for row, case in enumerate(cases, start=1)}
    for (case, arm, gpu), points in lines.items():
        row, group, colour = by_row[case], f"{arm} on {gpu}", colours[(arm, gpu)]
        visible = True if arm == "dslab" or arms else "legendonly"
        xs = [p.when for p in points]
        fig.add_trace(go.Scatter(
            x=xs + xs[::-1], y=[p.high for p in points] + [p.low for p in points][::-1], fill="toself",
            mode="lines", line={"width": 0}, fillcolor=_rgba(colour, 0.18), hoverinfo="skip", meta=case,
            name=f"{group}: trial min-max", legendgroup=group, showlegend=False, visible=visible), row=row, col=1)
        fig.add_trace(go.Scatter(
            x=xs, y=[p.value for p in points], mode="lines+markers", name=group, legendgroup=group, meta=case,
            showlegend=group not in shown, visible=visible, line={"color": colour}, marker={"color": colour},
            error_y={"type": "data", "array": [p.high - p.value for p in points],
                     "arrayminus": [p.value - p.low for p in points], "thickness": 1, "width": 3, "color": colour},
            hovertext=[f"{case}/{group}<br>{p.run.run_id}<br>commit {p.run.commit}<br>median {p.value:.4g} "
                       f"(trials {p.low:.4g} to {p.high:.4g}, n={p.trials})" for p in points],
            hoverinfo="text"), row=row, col=1)
        shown.add(group)
    _add_baselines(fig, lines, baselines, by_row, metric)
    for verdict, (symbol, colour) in MARK_STYLE.items():
        name = f"gate: {verdict} against the previous run"
        for case in cases:
            mine = [m for m in marks if m.case == case and m.verdict == verdict and (m.case, m.arm, m.gpu) in lines]
            if mine:
                fig.add_trace(go.Scatter(
                    x=[m.when for m in mine], y=[m.value for m in mine], mode="markers", name=name, meta=case,
                    text=[m.text for m in mine], hoverinfo="text", legendgroup=name, showlegend=name not in shown,
                    marker={"symbol": symbol, "size": 15, "color": colour}), row=by_row[case], col=1)
                shown.add(name)
    _add_change_points(fig, change_points, runs, by_row, metric, shown)
    for row, case in enumerate(cases, start=1):
        fig.update_yaxes(title_text=label, row=row, col=1)
    fig.update_xaxes(title_text="run created (UTC)", row=len(cases), col=1)
    commits = {r.commit for r in runs if r.error is None}
    gpus = {gpu for _, _, gpu in lines}
    fig.update_layout(title=f"{suite}: {label} over time ({len(runs)} runs, {len(commits)} commits, "
                            f"{len(gpus)} GPU model(s))", template=figures.TEMPLATE, margin=figures.MARGIN,
                      height=140 + PANEL_HEIGHT * len(cases))
    return fig


def _add_baselines(fig: go.Figure, lines: dict, baselines: list[dict], by_row: dict[str, int], metric: str) -> None:
    """The baseline bands (min to max of each baseline's trials) across the case's panel."""
    when = [p.when for points in lines.values() for p in points]
    x_range = [min(when), max(when)]
    drawn = {(case, arm) for case, arm, _ in lines}
    for baseline in baselines:
        for result in baseline.get("results", []):
            if not isinstance(result, dict) or (result.get("case"), result.get("arm")) not in drawn:
                continue
            values = [v for v in (result.get("trials") or {}).get(metric, []) if isinstance(v, (int, float))]
            if values:
                fig.add_trace(go.Scatter(
                    x=[x_range[0], x_range[1], x_range[1], x_range[0]],
                    y=[min(values), min(values), max(values), max(values)], fill="toself", mode="none",
                    fillcolor="rgba(31,119,180,0.10)", hoverinfo="name", meta=result["case"],
                    name=f"baseline {result['case']}/{result['arm']} ({baseline.get('label', baseline['_file'])})"),
                    row=by_row[result["case"]], col=1)


def _add_change_points(fig: go.Figure, change_points: list[dict], runs: list[RunSummary], by_row: dict[str, int],
                       metric: str, shown: set) -> None:
    """The change points ``dslab gate`` wrote for the suite, on the runs that start them."""
    by_run = {r.run_id: r for r in runs if r.error is None and created_at(r) is not None}
    for verdict, (symbol, colour) in MARK_STYLE.items():
        name = f"gate: {verdict} (change point)"
        for case, row in by_row.items():
            xs, ys, texts = [], [], []
            for p in change_points:
                run = by_run.get(p.get("run_id"))
                if (p.get("kind") != verdict or p.get("case") != case or run is None
                        or p.get("metric", metric) != metric):
                    continue
                value = run.metrics.get((case, p.get("arm")), {}).get(metric)
                if value is not None:
                    change = p.get("change")
                    xs.append(created_at(run))
                    ys.append(value)
                    texts.append(f"change point: {verdict} {case}/{p.get('arm')}"
                                 + (f": x{change:.3f}" if isinstance(change, (int, float)) else ""))
            if xs:
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=name, text=texts, hoverinfo="text",
                                         meta=case, legendgroup=name, showlegend=name not in shown,
                                         marker={"symbol": f"{symbol}-open", "size": 20, "color": colour,
                                                 "line": {"width": 2}}), row=row, col=1)
                shown.add(name)


def history_figure_of(store: RunStore, suite: str, summaries: list[RunSummary], arms: set[str] | None,
                      metric: str = "samples_per_s") -> go.Figure:
    """The history of ``suite`` over ``summaries`` (the filtered runs); the gate's marks are judged
    over the suite's whole history, so a filter hides marks but never moves them."""
    runs = [s for s in summaries if s.suite == suite]
    lines = history_lines(store, runs, arms, metric)
    history = [s for s in store.summaries() if s.suite == suite]
    marks = gate_marks(store, history, metric, tuple(sorted(arms)) if arms else GATED_ARMS)
    shown = {s.ref for s in runs}
    marks = [m for m in marks if m.ref in shown]
    return history_figure(suite, lines, marks, store.baselines(suite), store.change_points(suite), runs, arms, metric)
