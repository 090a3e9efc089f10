"""Rendering a :class:`dslab.gate.verdict.GateReport`: plain text for a terminal, Markdown for a
pull-request comment (one table row per (case, arm, metric)), JSON for machines."""

from __future__ import annotations

import json

from dslab.gate.verdict import CANNOT_JUDGE, IMPROVEMENT, REGRESSION, GateReport, Row

FORMATS = ("text", "markdown", "json")
ARROWS = {"higher": "↑", "lower": "↓", None: ""}
OUTCOME_WORDS = {"pass": "PASS", REGRESSION: "REGRESSION", CANNOT_JUDGE: "CANNOT JUDGE"}


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.4g}"


def _change(ratio: float | None) -> str:
    return "-" if ratio is None else f"{(ratio - 1.0) * 100:+.1f}%"


def _interval(row: Row) -> str:
    if row.ci_low is None or row.ci_high is None:
        return "-"
    return f"{_change(row.ci_low)} .. {_change(row.ci_high)}"


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def _subject(row: Row) -> str:
    return "/".join(part for part in (row.case, row.arm) if part) or "-"


def _settings_line(report: GateReport) -> str:
    s = report.settings
    return (f"threshold {s.threshold:.1%}".replace(".0%", "%") + f", alpha {s.alpha:g}, "
            f"{s.level:.0%} bootstrap CI of the median ratio ({s.resamples} resamples"
            + (f", run-to-run noise {s.run_noise:.2%}" if s.run_noise else "") + "), two-sided Mann-Whitney U")


def _unresolved_note(report: GateReport) -> str | None:
    rows = report.unresolved
    if not rows:
        return None
    verdict = "counted as cannot-judge (--strict)" if report.settings.strict else "passed"
    return (f"{len(rows)} of {len(report.rows)} row(s) {verdict} without ruling out a regression of the threshold's "
            f"size: their CI reaches past it on the worse side ({', '.join(_subject(r) for r in rows)}); "
            f"more trials, or longer ones, narrow the CI")


def _cells(row: Row) -> list[str]:
    metric = f"{row.metric} {ARROWS.get(row.direction, '')}".rstrip()
    return [
        row.case or "-", row.arm or "-", metric, _number(row.baseline_median), _number(row.candidate_median),
        _change(row.ratio), _interval(row), _p(row.p_value), f"{row.n_baseline}/{row.n_candidate}", row.verdict,
    ]


HEADER = ["case", "arm", "metric", "baseline", "candidate", "change", "CI", "p", "trials b/c", "verdict"]


def format_text(report: GateReport) -> str:
    """Header lines, an aligned table, then one 'why' line per row and the problems."""
    lines = [
        f"dslab gate: {report.suite}: {OUTCOME_WORDS[report.outcome]} (exit {report.exit_code})",
        f"  baseline:  {report.baseline}",
        f"  candidate: {report.candidate}",
        f"  {_settings_line(report)}",
    ]
    for problem in report.problems:
        lines.append(f"  cannot judge: {problem}")
    if report.rows:
        table = [HEADER] + [_cells(r) for r in report.rows]
        widths = [max(len(cells[i]) for cells in table) for i in range(len(HEADER))]
        lines.append("")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in table]
        lines.append("")
        lines.append("  why:")
        lines += [f"    {_subject(r)} {r.metric}: {r.reason}" for r in report.rows]
    for note in [*report.notes, _unresolved_note(report)]:
        if note:
            lines.append(f"  note: {note}")
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_markdown(report: GateReport) -> str:
    """A heading with the outcome, the baseline and candidate, then one table row per metric."""
    outcome = OUTCOME_WORDS[report.outcome]
    lines = [
        f"### dslab gate: `{report.suite}` — **{outcome}**",
        "",
        f"Baseline: {_md(report.baseline)}  ",
        f"Candidate: {_md(report.candidate)}  ",
        f"{_settings_line(report)}",
        "",
    ]
    for problem in report.problems:
        lines.append(f"> **Cannot judge:** {_md(problem)}")
    if report.problems:
        lines.append("")
    if report.rows:
        header = HEADER + ["why"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---:" if h in ("baseline", "candidate", "change", "p") else "---"
                                    for h in header) + "|")
        for row in report.rows:
            cells = _cells(row)
            if row.verdict in (REGRESSION, CANNOT_JUDGE, IMPROVEMENT):
                cells[-1] = f"**{cells[-1]}**"
            lines.append("| " + " | ".join(_md(c) for c in [*cells, row.reason]) + " |")
        lines.append("")
    for note in [*report.notes, _unresolved_note(report)]:
        if note:
            lines.append(f"_{_md(note)}_")
    return "\n".join(lines).rstrip() + "\n"


def format_json(report: GateReport) -> str:
    return json.dumps(report.to_dict(), indent=1) + "\n"


def render(report: GateReport, fmt: str = "text") -> str:
    """``report`` in ``fmt``: one of :data:`FORMATS`."""
    if fmt == "text":
        return format_text(report)
    if fmt == "markdown":
        return format_markdown(report)
    if fmt == "json":
        return format_json(report)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
