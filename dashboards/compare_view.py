"""The Compare page's views: which two runs the Runs page offers by default, the two runs side by
side, and the gate's verdict on every (case, arm) of run B against run A.

The verdict is the gate's own (:func:`dslab.gate.gate_trial_sets` over
:func:`dslab.gate.trial_set_from_reports` of each run, default settings: 5% threshold, alpha
0.01), with A as the baseline and B as the candidate, so the page says what ``dslab gate
--baseline A --candidate B --arm ...`` would: B/A of the medians, the bootstrap interval of that
ratio and the rank test's p-value, and regression, improvement, no change, unresolved (no clear
change, but trials too few or too spread to rule out one of the threshold's size) or not
comparable with the gate's reason (another GPU or config, case settings that differ, an arm that
failed, too few trials).
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboards import figures
from dashboards.data import RunSummary
from dashboards.history_view import MARK_STYLE, metric_label
from dslab.gate import GateReport, GateSettings, gate_trial_sets, trial_set_from_reports
from dslab.gate.baseline import injected_sleep_ms
from dslab.gate.verdict import CANNOT_JUDGE, IMPROVEMENT, PASS, REGRESSION
from dslab.report import RunReport

VERDICT_WORDS = {REGRESSION: "regression", IMPROVEMENT: "improvement", PASS: "no change",
                 CANNOT_JUDGE: "not comparable"}
UNRESOLVED = "unresolved"  # a pass whose interval reaches past the threshold on the worse side
SIDE_COLOURS = {"A": "#7f7f7f", "B": "#1f77b4"}
JUDGED_METRICS = ("samples_per_s", "tokens_per_s")


def default_pair(summaries: list[RunSummary]) -> tuple[str | None, str | None]:
    """The runs the Runs page compares by default, as ``(A, B)`` refs: the two newest readable runs
    of the newest run's suite, else of the suite with two readable runs whose newest run is the
    newest; ``(None, newest)`` when no suite has two (``summaries`` oldest first)."""
    readable = [s for s in summaries if s.error is None]
    if not readable:
        return None, None
    by_suite: dict[str, list[RunSummary]] = {}
    for s in readable:
        by_suite.setdefault(s.suite, []).append(s)
    pairs = [runs for runs in by_suite.values() if len(runs) > 1]
    if not pairs:
        return None, readable[-1].ref
    order = {s.ref: i for i, s in enumerate(readable)}
    runs = max(pairs, key=lambda runs: order[runs[-1].ref])
    return runs[-2].ref, runs[-1].ref


def judged_metric(a: RunReport, b: RunReport) -> str:
    """samples_per_s where either run has it, else tokens_per_s (the gate's default metrics)."""
    for metric in JUDGED_METRICS:
        if any(metric in r.metrics for report in (a, b) for r in report.results):
            return metric
    return JUDGED_METRICS[0]


def gate_verdict(a: RunReport, b: RunReport, a_ref: str, b_ref: str, metric: str,
                 settings: GateSettings | None = None) -> GateReport:
    """The gate's report on run B (candidate) against run A (baseline), every arm, ``metric``;
    a run the gate cannot use (not complete, no environment) becomes a problem naming it."""
    settings = settings or GateSettings()
    sets, problems = [], []
    for side, ref, report in (("A", a_ref, a), ("B", b_ref, b)):
        try:
            sets.append(trial_set_from_reports([report], label=f"{side}: {ref}"))
        except ValueError as err:
            problems.append(f"the gate cannot use run {side} ({ref}): {err}")
    if problems:
        return GateReport(b.suite, a_ref, b_ref, settings, problems=problems)
    verdict = gate_trial_sets(sets[0], sets[1], (metric,), None, settings)
    for side, ref, report in (("A", a_ref, a), ("B", b_ref, b)):
        if injected_sleep_ms(report):
            verdict.notes.append(f"run {side} ({ref}) ran with DSLAB_INJECT_STEP_SLEEP_MS="
                                 f"{injected_sleep_ms(report)}: a deliberate slowdown of its dslab arm")
    return verdict


def _trials(report: RunReport, metric: str) -> dict[tuple[str, str], tuple[str, float | None, list[float]]]:
    """``{(case, arm): (status, median, trial values)}`` of ``metric``."""
    out = {}
    for r in report.results:
        values = [float(t.metrics[metric]) for t in r.trials
                  if isinstance(t.metrics.get(metric), (int, float)) and not isinstance(t.metrics[metric], bool)]
        median = r.metrics.get(metric)
        out[(r.case, r.arm)] = (r.status, float(median) if isinstance(median, (int, float)) else None, values)
    return out


def _spread(status: str, median: float | None, values: list[float]) -> str:
    if status != "ok":
        return status
    if not values:
        return "-" if median is None else "no trials"
    return f"{min(values):.4g} to {max(values):.4g} (n={len(values)})"


def verdict_rows(a: RunReport, b: RunReport, verdict: GateReport, metric: str) -> list[dict]:
    """One row per (case, arm) of either run: ``A`` and ``B`` (the medians), ``A_trials`` and
    ``B_trials`` (min to max of the trials, or the arm's status), ``B_over_A``, the gate's ``ci``
    and ``p_value``, ``verdict`` (regression, improvement, no change, unresolved, not comparable) and its
    ``reason``; ``A_low`` ... ``B_high`` are the trial extremes for the figure."""
    mine, theirs = _trials(a, metric), _trials(b, metric)
    judged = {(row.case, row.arm): row for row in verdict.rows if row.metric == metric}
    rows = []
    for key in dict.fromkeys([*mine, *theirs]):
        case, arm = key
        a_status, a_median, a_values = mine.get(key, ("absent", None, []))
        b_status, b_median, b_values = theirs.get(key, ("absent", None, []))
        row = judged.get(key)
        if row is not None:
            word, reason = VERDICT_WORDS[row.verdict], row.reason
            if row.verdict == PASS and row.unresolved:
                word = UNRESOLVED
        else:
            word = VERDICT_WORDS[CANNOT_JUDGE]
            reason = "; ".join(verdict.problems) or f"the gate did not judge {case}/{arm}"
        rows.append({
            "case": case, "arm": arm, "A": a_median, "A_trials": _spread(a_status, a_median, a_values),
            "B": b_median, "B_trials": _spread(b_status, b_median, b_values),
            "B_over_A": b_median / a_median if a_median and b_median is not None else None,
            "ci": (f"{row.ci_low:.3f} to {row.ci_high:.3f}" if row is not None and row.ci_low is not None else "-"),
            "p_value": row.p_value if row is not None else None, "verdict": word, "reason": reason,
            "A_low": min(a_values) if a_values else a_median, "A_high": max(a_values) if a_values else a_median,
            "B_low": min(b_values) if b_values else b_median, "B_high": max(b_values) if b_values else b_median,
        })
    return rows


def verdict_columns(metric: str, settings: GateSettings | None = None) -> list[tuple[str, str]]:
    """The verdict table's columns, headed with their units."""
    level = (settings or GateSettings()).level
    unit = metric_label(metric)
    return [("case", "case"), ("arm", "arm"), ("verdict", "gate verdict"), ("B_over_A", "B/A"),
            ("ci", f"B/A {level:.0%} interval"), ("p_value", "p (rank test)"), ("A", f"A: {unit} (median)"),
            ("A_trials", f"A: trials ({unit})"), ("B", f"B: {unit} (median)"), ("B_trials", f"B: trials ({unit})"),
            ("reason", "why")]


def outcome_text(verdict: GateReport, rows: list[dict]) -> str:
    """One sentence: what the gate finds over all rows."""
    flagged = {word: [f"{r['case']}/{r['arm']}" for r in rows if r["verdict"] == word]
               for word in ("regression", "improvement", UNRESOLVED, "not comparable")}
    if verdict.problems:
        return "The gate cannot compare these runs: " + "; ".join(verdict.problems)
    parts = [f"{word}: {', '.join(names)}" for word, names in flagged.items() if names]
    return ("The gate, B against A: " + ("; ".join(parts) if parts else "no change in any case and arm")
            + (" (" + "; ".join(verdict.notes) + ")" if verdict.notes else ""))


def change_figure(rows: list[dict], metric: str, a_name: str, b_name: str, threshold: float = 0.05) -> go.Figure:
    """One panel per case, on a scale relative to A's median of each arm: A at 1 and B at B/A, the
    whiskers each run's trials (min to max, over A's median), the gate's threshold as a grey band
    around 1, and its regressions and improvements marked on B. Arms that only one run measured
    are in the table, not here."""
    drawn = [r for r in rows if r["A"] and r["B"] is not None]
    label = metric_label(metric)
    if not drawn:
        return figures.empty(f"{label}: B against A", f"no case and arm with {metric} in both runs")
    cases = list(dict.fromkeys(r["case"] for r in drawn))
    fig = make_subplots(rows=len(cases), cols=1, subplot_titles=cases, vertical_spacing=min(0.12, 0.35 / len(cases)))
    shown: set[str] = set()
    for row_index, case in enumerate(cases, start=1):
        mine = [r for r in drawn if r["case"] == case]
        extremes = [1 - threshold, 1 + threshold]
        for side, name in (("A", a_name), ("B", b_name)):
            scaled = [(r[side] / r["A"], r[f"{side}_low"] / r["A"], r[f"{side}_high"] / r["A"]) for r in mine]
            extremes += [x for point in scaled for x in point]
            fig.add_trace(go.Scatter(
                x=[r["arm"] for r in mine], y=[y for y, _, _ in scaled], name=f"{side}: {name}",
                mode="markers+text" if side == "B" else "markers", legendgroup=side, showlegend=side not in shown,
                offsetgroup=side, meta=case, marker={"size": 11, "color": SIDE_COLOURS[side]},
                text=[f"{y:.3f}" for y, _, _ in scaled] if side == "B" else None, textposition="middle right",
                error_y={"type": "data", "array": [high - y for y, _, high in scaled],
                         "arrayminus": [y - low for y, low, _ in scaled], "thickness": 1.5, "width": 6},
                hovertext=[f"{side} {case}/{r['arm']}: {r[side]:.4g} {label} (trials {r[f'{side}_low']:.4g} to "
                           f"{r[f'{side}_high']:.4g}); x{y:.3f} of A's median" for r, (y, _, _) in zip(mine, scaled)],
                hoverinfo="text"), row=row_index, col=1)
            shown.add(side)
        for verdict, (symbol, colour) in MARK_STYLE.items():
            word = VERDICT_WORDS[verdict]
            flagged = [r for r in mine if r["verdict"] == word]
            if flagged:
                name = f"gate: {word}"
                fig.add_trace(go.Scatter(
                    x=[r["arm"] for r in flagged], y=[r["B_over_A"] for r in flagged], mode="markers", name=name,
                    legendgroup=name, showlegend=name not in shown, offsetgroup="B", meta=case,
                    text=[r["reason"] for r in flagged], hoverinfo="text",
                    marker={"symbol": f"{symbol}-open", "size": 22, "color": colour, "line": {"width": 2.5}}),
                    row=row_index, col=1)
                shown.add(name)
        fig.add_hrect(y0=1 - threshold, y1=1 + threshold, fillcolor="rgba(127,127,127,0.12)", line_width=0,
                      layer="below", row=row_index, col=1)
        # grouped markers would stretch the axis to 0, where a 5% change cannot be seen: fit the trials
        pad = (max(extremes) - min(extremes)) * 0.12
        fig.update_yaxes(title_text="x A's median", range=[min(extremes) - pad, max(extremes) + pad],
                         row=row_index, col=1)
    fig.update_layout(title=f"{label}: B against A per case and arm (whiskers: trial min to max; grey: the gate's "
                            f"{threshold:.0%} threshold; triangles: its verdict)", template=figures.TEMPLATE,
                      margin=figures.MARGIN, scattermode="group", height=140 + 260 * len(cases))
    return fig
