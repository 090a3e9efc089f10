"""Verdicts: a candidate's trials against a baseline's, per (case, arm, metric), and the exit code.

The rule, for one metric with trials ``b`` (baseline, m of them) and ``c`` (candidate, n):

* ``ratio = median(c) / median(b)``; the percentile-bootstrap interval ``[low, high]`` of that
  ratio at level ``1 - alpha`` (99% by default; :attr:`GateSettings.confidence` overrides it),
  widened by :attr:`GateSettings.run_noise` when the trials of a side come from one process;
  ``p``, the two-sided Mann-Whitney p-value.
* **regression** iff all of: the interval lies entirely on the bad side of 1 (``high < 1`` for a
  metric where higher is better, ``low > 1`` where lower is better), ``p < alpha`` (default 0.01),
  and the change reaches the threshold (default 5%): the interval's bad end lies beyond it
  (``low < 1 - threshold``, resp. ``high > 1 + threshold``), i.e. a change of the threshold's
  size is consistent with the data. A change that is statistically clear but whose whole
  interval lies within the threshold passes, as "clear but smaller than the threshold".
* **improvement**: the same on the good side.
* **cannot-judge**: a side has no trials of the metric, an arm failed, the settings of the case
  differ, the metric has no known direction, or there are too few trials for the rank test ever
  to reach ``p < alpha`` (with alpha 0.01 that takes 5 trials on each side: ``2 / C(10, 5) =
  0.0079``).
* **pass** otherwise. A pass with no clear change whose interval still reaches past the
  threshold on the bad side is **unresolved** (``Row.unresolved``): the trials could not have told
  a change of the threshold's size from none (too few, or too spread: more or longer trials narrow
  the interval). Its reason says so and the report counts such rows; with
  :attr:`GateSettings.strict` it is cannot-judge instead (exit 2), so CI cannot pass a comparison
  too noisy to catch what the threshold names.

Why the threshold is tested against the interval's far end and not against the median: a real
drop of exactly the threshold has an observed median beyond the threshold only half the time,
so "median beyond the threshold" would miss half of the regressions the threshold names. With
the far end of an interval at the same level as the test, a drop of the threshold's size is
caught as often as the significance conditions allow, and a significant change passes as small
only when the data show it to be smaller than the threshold with that same confidence.

Exit code over all rows (:attr:`GateReport.exit_code`): 1 if any row is a regression, else 2 if
any row (or the comparison as a whole, e.g. a fingerprint mismatch) cannot be judged, else 0.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from dslab.gate.fingerprint import explain_case_difference, explain_difference
from dslab.gate.stats import as_sample, bootstrap_ratio_ci, mann_whitney
from dslab.gate.trial_set import TrialSet
from dslab.report.schema import METRIC_DIRECTIONS


PASS, REGRESSION, IMPROVEMENT, CANNOT_JUDGE = "pass", "regression", "improvement", "cannot-judge"
VERDICTS = (PASS, REGRESSION, IMPROVEMENT, CANNOT_JUDGE)
DIRECTIONS = ("higher", "lower")
EXIT_PASS, EXIT_REGRESSION, EXIT_CANNOT_JUDGE = 0, 1, 2
DEFAULT_METRICS = ("samples_per_s", "tokens_per_s")


@dataclass(frozen=True)
class GateSettings:
    """``threshold``: the smallest relative change that matters (0.05 = 5%); ``alpha``: the rank
    test's significance level; ``confidence``: the bootstrap interval's level (None: ``1 - alpha``,
    so that the interval and the test are equally strict); ``resamples`` and
    ``seed``: the bootstrap's size and its numpy Generator seed (fixed, so verdicts repeat);
    ``run_noise``: the relative spread of a run's median from one process to another that its own
    trials cannot show (0: none; see :func:`dslab.gate.stats.bootstrap_ratio_ci`), widening the
    interval; ``strict``: an unresolved pass (no clear change, the interval reaching past the
    threshold on the bad side) becomes cannot-judge."""

    threshold: float = 0.05
    alpha: float = 0.01
    confidence: float | None = None
    resamples: int = 4000
    seed: int = 0
    run_noise: float = 0.0
    strict: bool = False

    @property
    def level(self) -> float:
        """The interval's confidence level: ``confidence``, or ``1 - alpha`` when that is None."""
        return 1.0 - self.alpha if self.confidence is None else self.confidence

    def __post_init__(self):
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must lie in (0, 1) (0.05 = 5%), got {self.threshold}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must lie in (0, 1), got {self.alpha}")
        if self.confidence is not None and not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must lie in (0, 1), got {self.confidence}")
        if self.resamples < 100:
            raise ValueError(f"resamples must be >= 100, got {self.resamples}")
        if not 0.0 <= self.run_noise < 0.5:
            raise ValueError(f"run noise must lie in [0, 0.5) (0.003 = 0.3%), got {self.run_noise}")


@dataclass
class Comparison:
    """One metric judged: the figures and the verdict with its reason. Figures are None when
    the comparison could not be made."""

    verdict: str
    reason: str
    direction: str | None = None
    n_baseline: int = 0
    n_candidate: int = 0
    baseline_median: float | None = None
    candidate_median: float | None = None
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    p_value: float | None = None
    test: str | None = None
    unresolved: bool = False


@dataclass
class Row(Comparison):
    case: str = ""
    arm: str = ""
    metric: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def smallest_p(m: int, n: int) -> float:
    """The smallest two-sided p the exact rank test can give for m and n trials: ``2 / C(m + n, m)``."""
    return min(1.0, 2.0 / math.comb(m + n, m))


def trials_needed(alpha: float) -> int:
    """The fewest trials per side (equal sides) at which the rank test can reach ``p < alpha``."""
    k = 1
    while smallest_p(k, k) >= alpha:
        k += 1
    return k


def _pct(ratio: float) -> str:
    return f"{(ratio - 1.0) * 100:+.1f}%"


def compare_samples(baseline, candidate, direction: str, settings: GateSettings | None = None) -> Comparison:
    """Judge one metric: ``baseline`` and ``candidate`` are its trial values, ``direction`` is
    "higher" or "lower" (which way is better). See the module docstring for the rule."""
    settings = settings or GateSettings()
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    base = np.asarray(baseline, dtype=np.float64).ravel()
    cand = np.asarray(candidate, dtype=np.float64).ravel()
    out = Comparison(verdict=CANNOT_JUDGE, reason="", direction=direction, n_baseline=base.size, n_candidate=cand.size)
    for name, values in (("baseline", base), ("candidate", cand)):
        if values.size == 0:
            out.reason = f"the {name} has no trials of this metric"
            return out
        as_sample(values, name)
    out.baseline_median, out.candidate_median = float(np.median(base)), float(np.median(cand))
    if out.baseline_median <= 0 or np.any(base <= 0):
        out.reason = "baseline values must be positive to form a ratio"
        return out
    out.ratio = out.candidate_median / out.baseline_median
    floor = smallest_p(base.size, cand.size)
    if floor >= settings.alpha:
        out.reason = (f"{base.size} baseline and {cand.size} candidate trials are too few: the rank test's "
                      f"smallest p is {floor:.3g}, never below alpha {settings.alpha:g}; "
                      f"run at least {trials_needed(settings.alpha)} trials on each side")
        return out
    test = mann_whitney(cand, base)
    out.p_value, out.test = test.p_value, test.method
    out.ci_low, out.ci_high = bootstrap_ratio_ci(base, cand, settings.level, settings.resamples, settings.seed,
                                                 settings.run_noise)
    interval = f"{settings.level:.0%} CI {_pct(out.ci_low)} to {_pct(out.ci_high)}"
    summary = f"median {_pct(out.ratio)} ({interval}), p={out.p_value:.2g}"
    low, high, limit = out.ci_low, out.ci_high, settings.threshold
    if direction == "higher":
        worse, better, worse_reaches, better_reaches = high < 1.0, low > 1.0, low < 1.0 - limit, high > 1.0 + limit
    else:
        worse, better, worse_reaches, better_reaches = low > 1.0, high < 1.0, high > 1.0 + limit, low < 1.0 - limit
    significant = out.p_value < settings.alpha
    threshold = f"{limit:.1%}".replace(".0%", "%")
    if significant and (worse or better):
        if worse_reaches if worse else better_reaches:
            out.verdict = REGRESSION if worse else IMPROVEMENT
            out.reason = (f"{'worse' if worse else 'better'}: {summary} < alpha {settings.alpha:g}; "
                          f"the change reaches the {threshold} threshold")
        else:
            out.verdict = PASS
            out.reason = (f"a clear but small change for the {'worse' if worse else 'better'}: {summary}; "
                          f"the whole CI lies within the {threshold} threshold")
        return out
    out.verdict = PASS
    if not significant:
        out.reason = f"no clear change: {summary} >= alpha {settings.alpha:g}"
    else:
        out.reason = f"no clear change: {summary}; the CI includes 1 (no change)"
    if worse_reaches:
        out.unresolved = True
        bad_end = high if direction == "lower" else low
        out.reason += (f"; unresolved: the CI's worse end ({_pct(bad_end)}) lies past the {threshold} threshold, "
                       f"so these trials cannot rule out a regression of that size (more or longer trials "
                       f"narrow the CI)")
        if settings.strict:
            out.verdict = CANNOT_JUDGE
            out.reason += "; --strict counts that as cannot-judge"
    return out


@dataclass
class GateReport:
    """The whole gate: one row per (case, arm, metric), and ``problems`` that stop any judgement
    (a fingerprint mismatch, no baseline); ``notes`` say what else the reader should know."""

    suite: str
    baseline: str
    candidate: str
    settings: GateSettings
    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if any(r.verdict == REGRESSION for r in self.rows):
            return EXIT_REGRESSION
        if self.problems or not self.rows or any(r.verdict == CANNOT_JUDGE for r in self.rows):
            return EXIT_CANNOT_JUDGE
        return EXIT_PASS

    @property
    def unresolved(self) -> list[Row]:
        """The rows that passed without ruling out a regression of the threshold's size."""
        return [r for r in self.rows if r.unresolved]

    @property
    def outcome(self) -> str:
        return {EXIT_PASS: PASS, EXIT_REGRESSION: REGRESSION, EXIT_CANNOT_JUDGE: CANNOT_JUDGE}[self.exit_code]

    def to_dict(self) -> dict:
        return {
            "schema": "dslab.gate",
            "schema_version": 1,
            "suite": self.suite,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "settings": {**dataclasses.asdict(self.settings), "level": self.settings.level},
            "problems": list(self.problems),
            "notes": list(self.notes),
            "rows": [r.to_dict() for r in self.rows],
        }


def _cannot(case: str, arm: str, metric: str, reason: str) -> Row:
    return Row(verdict=CANNOT_JUDGE, reason=reason, direction=METRIC_DIRECTIONS.get(metric), case=case, arm=arm,
               metric=metric)


def _row(baseline: TrialSet, candidate: TrialSet, case: str, arm: str, metric: str, settings: GateSettings) -> Row:
    direction = METRIC_DIRECTIONS.get(metric)
    if direction is None:
        known = ", ".join(sorted(METRIC_DIRECTIONS))
        return _cannot(case, arm, metric, f"metric {metric!r} has no known direction (known: {known})")
    base, cand = baseline.values(case, arm, metric), candidate.values(case, arm, metric)
    for name, values in (("baseline", base), ("candidate", cand)):
        if not values:
            return _cannot(case, arm, metric, f"the {name} has no trials of {metric} for {case}/{arm}")
    try:
        comparison = compare_samples(base, cand, direction, settings)
    except ValueError as err:
        return _cannot(case, arm, metric, str(err))
    return Row(**dataclasses.asdict(comparison), case=case, arm=arm, metric=metric)


def _metrics_for(trial_set: TrialSet, case: str, arm: str, metrics: tuple[str, ...] | None) -> list[str]:
    if metrics:
        return list(metrics)
    have = trial_set.trials.get((case, arm), {})
    return [next((m for m in DEFAULT_METRICS if m in have), DEFAULT_METRICS[0])]


def gate_trial_sets(
    baseline: TrialSet,
    candidate: TrialSet,
    metrics: tuple[str, ...] | None = None,
    arms: tuple[str, ...] | None = ("dslab",),
    settings: GateSettings | None = None,
) -> GateReport:
    """Judge ``candidate`` against ``baseline`` for every (case, arm) of either whose arm is in
    ``arms`` (None: all arms) and every metric of ``metrics`` (None: samples_per_s where the
    candidate has it, else tokens_per_s).

    The hardware and config fingerprints must match (else every difference becomes a problem and
    no row is judged); a case whose own settings differ becomes a cannot-judge row naming them.
    """
    settings = settings or GateSettings()
    report = GateReport(suite=candidate.suite, baseline=baseline.label, candidate=candidate.label, settings=settings)
    if baseline.suite != candidate.suite:
        report.problems.append(f"suite differs: {baseline.suite!r} (baseline) vs {candidate.suite!r} (candidate)")
    differences = explain_difference(baseline.fingerprint, candidate.fingerprint)
    if differences:
        report.problems.append("hardware or config fingerprints differ: " + "; ".join(differences))
    if report.problems:
        return report
    pairs = [p for p in dict.fromkeys([*candidate.pairs(), *baseline.pairs()]) if arms is None or p[1] in arms]
    if not pairs:
        report.problems.append(f"no results for arm(s) {', '.join(arms or ())} in either run")
        return report
    for case, arm in pairs:
        chosen = _metrics_for(candidate, case, arm, metrics)
        reason = None
        if (case, arm) not in candidate.status:
            reason = f"the candidate has no result for {case}/{arm}"
        elif candidate.status[(case, arm)]["status"] != "ok":
            state = candidate.status[(case, arm)]
            reason = f"the candidate's {case}/{arm} {state['status']}: {state.get('error') or 'no error recorded'}"
        elif (case, arm) not in baseline.status:
            reason = f"the baseline has no result for {case}/{arm}"
        elif baseline.status[(case, arm)]["status"] != "ok":
            state = baseline.status[(case, arm)]
            reason = f"the baseline's {case}/{arm} {state['status']}: {state.get('error') or 'no error recorded'}"
        else:
            fields = explain_case_difference(baseline.fingerprint, candidate.fingerprint, case)
            if fields:
                reason = "case settings differ: " + "; ".join(fields)
        for metric in chosen:
            report.rows.append(_cannot(case, arm, metric, reason) if reason else
                               _row(baseline, candidate, case, arm, metric, settings))
    return report
