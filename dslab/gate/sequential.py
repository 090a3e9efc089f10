"""Sequential verdicts on paired trials: judge a candidate against a baseline measured in
alternation on one machine, and stop as soon as the answer is clear.

Data
----
Pair ``i`` is one baseline trial ``b_i`` and one candidate trial ``c_i`` of one metric, run back to
back (``dslab gate --ab``, :mod:`dslab.gate.ab`). The test works on the log changes
``d_i = log(c_i / b_i)`` where higher is better and ``d_i = log(b_i / c_i)`` where lower is
better, so that ``d < 0`` is always worse. A slow drift of the machine (clocks, temperature, a
neighbour) moves both trials of a pair alike and cancels in ``d_i``: what pairing buys over two
independent runs. The centre of the ``d_i`` is estimated by the Hodges-Lehmann pseudo-median with
the Wilcoxon signed-rank interval (:mod:`dslab.gate.signed_rank`), valid for any noise that leaves
``d_i`` symmetric about its centre. With no change that holds when the two trials of a pair are
exchangeable: alternating ABBA order puts each side first equally often, so the order within a
pair cannot favour one, and ``d_i`` is as likely to be ``+x`` as ``-x``. What no order removes is
a persistent difference between the two worker processes themselves (their memory layout, the
CPU cores the scheduler keeps them on): the test sees it as a change like any other, and the
threshold absorbs it only when it is small against the threshold. A/A runs on the machine (the
same tree on both sides) measure it.

The rule
--------
Let ``t`` be the threshold in the metric's own terms and, in ``d`` units, ``bad = log(1 - t)``
(``-log(1 + t)`` where lower is better) and ``good = log(1 + t)`` (resp. ``-log(1 - t)``). The test
looks after each pair ``n`` from ``min_pairs`` to ``max_pairs`` (skipping the first few, where the
levels below cannot be reached with ``n`` pairs at all) and computes two intervals of the
pseudo-median: ``[L, U]``, each side at the look's one-sided level ``a_n``, which says whether
there is a change at all; and the wider ``[W, B]`` at level ``a_pass``, whose ends are the worst
and the best change consistent with the data. Then:

* **regression** iff ``U < 0`` and ``W < bad``: clearly worse, and a change of the threshold's size
  is consistent with the data. As in :mod:`dslab.gate.verdict` the interval's far end, not the
  estimate, is held against the threshold, so a drop of exactly the threshold is caught as often
  as the significance allows; the far end comes from the wider interval so that such a drop is
  taken for a smaller one at most :data:`FUTILITY` of the time (below);
* **improvement** iff ``L > 0`` and ``B > good``;
* **pass** iff ``W > bad``: even the worst change consistent with the data is smaller than a
  threshold-sized regression (with ``U < 0`` as well: a clear change, smaller than the threshold);
* otherwise the next pair is run; at ``max_pairs`` the verdict is **pass**, marked inconclusive
  (nothing was established either way).

A run stops at its first verdict, so an improvement not yet established at the look that rules
out a regression ends as a pass: the gate's question is the regression.

The levels
----------
Each bound below is exact (not simulated) and holds whatever the noise's shape: with no change the
signed-rank statistics of all the looks have one joint distribution, free of the noise, computed
by dynamic programming (:func:`dslab.gate.signed_rank.joint_null_alarm`).

* ``a_pass`` is the largest level, common to all looks, at which a candidate worse by exactly the
  threshold (``d`` symmetric about ``bad``) has ``W > bad`` at some look with probability at most
  :data:`FUTILITY`: **a threshold-sized regression is passed as ruled out or small in at most 1%
  of runs**; the other misses are runs that end undecided at ``max_pairs``. The looks are the
  pair counts at which ``W`` is bounded at this level.
* The looks before the last share the largest level ``a_n`` at which the chance, with no change,
  that any of them finds ``U < 0`` is at most :data:`EARLY_SHARE` of ``alpha``; the last look gets
  the largest level at which the chance over all looks is at most ``alpha``. A regression needs
  ``U < 0``, and a candidate truly no worse only makes that rarer, so **an unchanged or better
  candidate is called a regression with probability at most alpha**. Improvements are bounded
  alike: an A/A run ends in either with probability at most ``2 alpha``. Spending little early
  and most at the last look (Haybittle and Peto's design) keeps the last look, which decides the
  hard cases, nearly as strong as a single test at ``alpha``, while a clear change still ends the
  run at the first look.

With the defaults (alpha 5%, pairs 5..15): ``a_pass = 0.34%``, so the looks are at 9..15 pairs
(``2**-9 <= 0.34% < 2**-8``); ``a_n = 0.93%`` before the last look and ``a_15 = 4.16%`` at it; the
exact chance of a false alarm over all looks is 4.67%. Beyond
:data:`~dslab.gate.signed_rank.JOINT_EXACT_MAX_PAIRS` pairs the levels come from Bonferroni's
inequality instead, which keeps the same bounds less tightly.

Simulated operating characteristics
-----------------------------------
Each trial scatters lognormally with the given coefficient of variation (CV), independently on
each side, and is 5-15% slow with probability 5% (a neighbour's job, a clock dip); ``change`` is
the candidate's throughput over the baseline's (0.98: a 2% drop). Defaults alpha 5%, pairs
5..15; :func:`operating_table` prints this table (:func:`simulate`, 4000 draws a cell, seed 2025).
Each cell: the share of gate runs that end in regression, and the mean number of pairs run.

=========  ======  ==================  ==================
threshold  change  CV 1%               CV 2%
=========  ======  ==================  ==================
3%         1.00    2.5%, 11.0 pairs    3.9%, 12.5 pairs
3%         0.98    78.1%, 10.8 pairs   61.8%, 13.1 pairs
3%         0.97    96.3%, 10.6 pairs   88.3%, 11.7 pairs
3%         0.95    99.2%, 9.8 pairs    99.1%, 10.0 pairs
3%         0.90    100.0%, 9.0 pairs   100.0%, 9.0 pairs
2%         1.00    3.3%, 11.8 pairs    4.5%, 13.8 pairs
2%         0.98    91.2%, 11.3 pairs   63.1%, 13.3 pairs
=========  ======  ==================  ==================

An unchanged candidate is flagged in 2.5-4.5% of runs, within the 5% bound. At 1% CV a drop of the
threshold's size is caught in 96% of runs at a 3% threshold but in only 91% at a 2% threshold:
a 2% drop is 1.4 times the spread of a pair's ``d`` (1.4% at 1% CV), and when two or more of 15
baseline trials are slowed by 5-15% (17% of runs) the rank interval at the last look's level
reaches past 0. Without the slow trials the same drop is caught in 99.5% (8000 draws, seed 5).
A drop well below the threshold passes as "smaller than the threshold" once the interval shows
it (a 2% drop at a 3% threshold is flagged in 78% of runs). At 2% CV, 15 pairs are too few for a
threshold-sized drop: gate such a machine at a wider threshold or with more pairs. A large change
ends the run at the first look (9 pairs); an unchanged candidate passes after 11 to 14 pairs on
average.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from dslab.gate.signed_rank import (
    JOINT_EXACT_MAX_PAIRS,
    calibrated_tail,
    critical_rank,
    interval_bounds,
    joint_null_alarm,
    pseudo_medians,
    signed_rank_cdf,
    sorted_walsh_averages,
)
from dslab.gate.stats import as_sample
from dslab.gate.verdict import DIRECTIONS, IMPROVEMENT, PASS, REGRESSION

CONTINUE = "continue"  # no verdict yet: run another pair
EARLY_SHARE = 0.4  # the share of alpha the looks before the last may spend
FUTILITY = 0.01  # the chance an early pass may end a regression of exactly the threshold's size

# Decision codes of the vectorised rule.
_UNDECIDED, _REGRESSION, _IMPROVEMENT, _PASS, _INCONCLUSIVE = range(5)
_NAMES = {_REGRESSION: REGRESSION, _IMPROVEMENT: IMPROVEMENT, _PASS: PASS, _INCONCLUSIVE: PASS}


@dataclass(frozen=True)
class LookPlan:
    """The looks and their levels (module docstring): ``looks``, the pair counts at which the
    test looks; ``pass_tail`` for the interval ``[W, B]``; ``early_tail`` for ``[L, U]`` at the
    looks before the last (None: they cannot reach their share, and only pass early) and
    ``final_tail`` at the last; all one-sided, for each side of an interval. ``false_alarm`` is
    the chance, with no change, that some look finds ``U < 0`` (exact, or Bonferroni's bound
    beyond :data:`~dslab.gate.signed_rank.JOINT_EXACT_MAX_PAIRS` pairs)."""

    looks: tuple[int, ...]
    early_tail: float | None
    final_tail: float
    pass_tail: float
    false_alarm: float

    def tail(self, n: int) -> float | None:
        """The level of ``[L, U]`` at the look after ``n`` pairs."""
        return self.final_tail if n == self.looks[-1] else self.early_tail


@functools.lru_cache(maxsize=64)
def look_plan(alpha: float, min_pairs: int, max_pairs: int) -> LookPlan:
    """The looks ``min_pairs .. max_pairs`` and their levels at overall false-alarm bound ``alpha``;
    ValueError when ``max_pairs`` is too few for the signed-rank test to reach them."""
    every = tuple(range(min_pairs, max_pairs + 1))
    pass_tail = calibrated_tail(FUTILITY, every)
    looks = tuple(n for n in every if pass_tail is not None and critical_rank(n, pass_tail) >= 0)
    early_tail = calibrated_tail(EARLY_SHARE * alpha, looks[:-1])
    fixed = tuple((n, critical_rank(n, early_tail)) for n in looks[:-1]) if early_tail else ()
    final_tail = calibrated_tail(alpha, (max_pairs,), fixed) if looks else None
    if final_tail is None:
        fewest = math.ceil(-math.log2(min(FUTILITY, (1.0 - EARLY_SHARE) * alpha)))
        raise ValueError(f"max_pairs {max_pairs} is too few for alpha {alpha:g}: the signed-rank test could never "
                         f"decide at the levels the looks need; allow at least {fewest} pairs")
    ranks = {**dict(fixed), max_pairs: critical_rank(max_pairs, final_tail)}
    if max_pairs <= JOINT_EXACT_MAX_PAIRS:
        false_alarm = joint_null_alarm(ranks)
    else:
        false_alarm = sum(signed_rank_cdf(n, k) for n, k in ranks.items())
    return LookPlan(looks, early_tail, final_tail, pass_tail, false_alarm)


@dataclass(frozen=True)
class SequentialSettings:
    """``threshold``: the smallest relative change that matters (0.03 = 3%); ``alpha``: the bound on
    the chance of calling an unchanged candidate a regression, over all looks; ``min_pairs`` /
    ``max_pairs``: the first pair count at which a verdict may be reached, and the most pairs run."""

    threshold: float = 0.03
    alpha: float = 0.05
    min_pairs: int = 5
    max_pairs: int = 15

    def __post_init__(self):
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must lie in (0, 1) (0.03 = 3%), got {self.threshold}")
        if not 0.0 < self.alpha < 0.5:
            raise ValueError(f"alpha must lie in (0, 0.5), got {self.alpha}")
        if self.min_pairs < 1:
            raise ValueError(f"min_pairs must be >= 1, got {self.min_pairs}")
        if self.max_pairs < self.min_pairs:
            raise ValueError(f"max_pairs ({self.max_pairs}) must be >= min_pairs ({self.min_pairs})")
        look_plan(self.alpha, self.min_pairs, self.max_pairs)  # ValueError when max_pairs is too few

    @property
    def plan(self) -> LookPlan:
        return look_plan(self.alpha, self.min_pairs, self.max_pairs)

    @property
    def looks(self) -> tuple[int, ...]:
        """The pair counts at which the test looks (:class:`LookPlan`)."""
        return self.plan.looks

    def limits(self, direction: str) -> tuple[float, float]:
        """``(bad, good)``: the threshold in ``d`` units (log change, worse negative)."""
        t = self.threshold
        if direction == "higher":
            return math.log(1.0 - t), math.log(1.0 + t)
        if direction == "lower":
            return -math.log(1.0 + t), -math.log(1.0 - t)
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")

    def to_dict(self) -> dict:
        plan = self.plan
        return {"threshold": self.threshold, "alpha": self.alpha, "min_pairs": self.min_pairs,
                "max_pairs": self.max_pairs, "early_share": EARLY_SHARE, "futility": FUTILITY,
                "early_tail": plan.early_tail, "final_tail": plan.final_tail, "pass_tail": plan.pass_tail,
                "false_alarm_bound": plan.false_alarm, "looks": list(self.looks)}


def _reaches(n: int, tail: float | None) -> bool:
    return tail is not None and critical_rank(n, tail) >= 0


def _decide(low, high, worst, best, bad: float, good: float, last: bool) -> np.ndarray:
    """The rule of the module docstring, element-wise, as decision codes."""
    code = np.full(low.shape, _INCONCLUSIVE if last else _UNDECIDED)
    code[worst > bad] = _PASS
    code[(low > 0) & (best > good)] = _IMPROVEMENT
    code[(high < 0) & (worst < bad)] = _REGRESSION
    return code


def log_changes(baseline, candidate, direction: str) -> np.ndarray:
    """``d_i``: ``log(c_i / b_i)`` where higher is better, ``log(b_i / c_i)`` where lower is better."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    base = as_sample(baseline, "baseline")
    cand = as_sample(candidate, "candidate")
    if base.size != cand.size:
        raise ValueError(f"paired trials need as many baseline as candidate values, got {base.size} and {cand.size}")
    if np.any(base <= 0) or np.any(cand <= 0):
        raise ValueError("trial values must be positive to form a ratio")
    change = np.log(cand) - np.log(base)
    return change if direction == "higher" else -change


def _ratio(value: float, direction: str) -> float | None:
    """A bound in ``d`` units as a candidate/baseline ratio of the metric; None when unbounded."""
    if not math.isfinite(value):
        return None
    return math.exp(value if direction == "higher" else -value)


@dataclass
class Look:
    """One look after ``n`` pairs, in the metric's own terms (candidate over baseline): the
    pseudo-median ratio; its interval ``[L, U]`` at two-sided ``level`` (a side None: unbounded);
    ``worst`` and ``best``, the ends of the wider interval ``[W, B]`` (the worst and the best change
    consistent with the data); and the decision (None: go on)."""

    n: int
    ratio: float
    ci_low: float | None
    ci_high: float | None
    level: float | None
    worst: float
    best: float
    decision: str | None


@dataclass
class SequentialVerdict:
    """What :func:`judge_pairs` found. ``verdict``: pass, regression, improvement, or ``continue``
    (more pairs are needed); ``n``: the pairs it rests on; ``ratio`` (the pseudo-median of the
    pair ratios candidate/baseline) and ``[ci_low, ci_high]`` (its interval at two-sided
    ``level``) at the last look taken; ``inconclusive``: a pass at ``max_pairs`` with nothing
    established."""

    verdict: str
    reason: str
    direction: str
    n: int
    threshold: float
    alpha: float
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    level: float | None = None
    inconclusive: bool = False
    looks: list[Look] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.verdict != CONTINUE

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "reason": self.reason, "direction": self.direction, "n": self.n,
                "threshold": self.threshold, "alpha": self.alpha, "ratio": self.ratio, "ci_low": self.ci_low,
                "ci_high": self.ci_high, "level": self.level, "inconclusive": self.inconclusive,
                "looks": [vars(look).copy() for look in self.looks]}


def _pct(ratio: float | None, unbounded: str = "?") -> str:
    return unbounded if ratio is None else f"{(ratio - 1.0) * 100:+.2f}%"


def _reason(code: int, look: Look, clearly_worse: bool, limit: str) -> str:
    interval = (f"{look.level:.1%} CI {_pct(look.ci_low, '-inf')} to {_pct(look.ci_high, '+inf')}"
                if look.level is not None else "no interval at this look's level")
    summary = f"after {look.n} pairs: median {_pct(look.ratio)} ({interval})"
    if code == _REGRESSION:
        return f"worse: {summary}; at worst {_pct(look.worst)}, a {limit} regression is consistent with the data"
    if code == _IMPROVEMENT:
        return f"better: {summary}; at best {_pct(look.best)}, a {limit} improvement is consistent with the data"
    if code == _INCONCLUSIVE:
        return (f"inconclusive: {summary}, at worst {_pct(look.worst)}: neither rules out nor establishes a "
                f"{limit} regression")
    kind = "a clear but small change for the worse" if clearly_worse else "no regression of the threshold's size"
    return f"{kind}: {summary}; at worst {_pct(look.worst)}, within the {limit} threshold"


def judge_pairs(baseline, candidate, direction: str, settings: SequentialSettings | None = None) -> SequentialVerdict:
    """Judge paired trials (``baseline[i]`` and ``candidate[i]`` measured back to back) by the
    sequential rule of the module docstring: look after each pair in order and stop at the first
    look that decides; pairs beyond ``max_pairs`` are ignored. It answers ``continue`` until a
    look decides and is stateless, so a driver may call it with all pairs so far after each new one."""
    settings = settings or SequentialSettings()
    d = log_changes(baseline, candidate, direction)
    bad, good = settings.limits(direction)
    plan, last = settings.plan, settings.max_pairs
    out = SequentialVerdict(verdict=CONTINUE, reason="", direction=direction, n=min(d.size, last),
                            threshold=settings.threshold, alpha=settings.alpha)
    limit = f"{settings.threshold:.1%}".replace(".0%", "%")
    for n in settings.looks:
        if n > d.size:
            break
        tail = plan.tail(n)
        walsh = sorted_walsh_averages(d[None, :n])
        low, high = interval_bounds(walsh, n, tail)
        pass_low, pass_high = interval_bounds(walsh, n, plan.pass_tail)
        code = int(_decide(low, high, pass_low, pass_high, bad, good, n == last)[0])
        look = Look(n=n, ratio=_ratio(float(pseudo_medians(walsh)[0]), direction),
                    ci_low=_ratio(float(low[0] if direction == "higher" else high[0]), direction),
                    ci_high=_ratio(float(high[0] if direction == "higher" else low[0]), direction),
                    level=1.0 - 2.0 * tail if _reaches(n, tail) else None,
                    worst=_ratio(float(pass_low[0]), direction), best=_ratio(float(pass_high[0]), direction),
                    decision=_NAMES.get(code))
        out.looks.append(look)
        out.n, out.ratio, out.ci_low, out.ci_high, out.level = n, look.ratio, look.ci_low, look.ci_high, look.level
        if code != _UNDECIDED:
            out.verdict, out.inconclusive = _NAMES[code], code == _INCONCLUSIVE
            out.reason = _reason(code, look, bool(high[0] < 0), limit)
            return out
    looks = settings.looks
    if not out.looks:
        out.reason = f"{d.size} pair(s) so far; the first look that can decide is at {looks[0]}"
    else:
        out.reason = f"no verdict yet after {out.n} pairs: the interval is not decisive; run another pair"
    return out


@dataclass(frozen=True)
class SimulationResult:
    """Shares of ``draws`` simulated gate runs ending in each verdict, and the mean pairs run."""

    change: float
    cv: float
    draws: int
    regression: float
    improvement: float
    passed: float
    inconclusive: float
    mean_pairs: float


def simulated_pairs(rng: np.random.Generator, draws: int, pairs: int, change: float, cv: float,
                    slow_share: float = 0.05, slow_range: tuple[float, float] = (0.05, 0.15),
                    drift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic throughputs ``(baseline, candidate)``, each ``(draws, pairs)``: lognormal noise of
    coefficient of variation ``cv`` on every trial; each trial, with probability ``slow_share``,
    slower by a share drawn from ``slow_range`` (its time that much longer); the candidate's
    centre ``change`` times the baseline's; and a drift common to both sides, a ramp of
    ``drift`` (0.1 = 10%) over the run's trials in time, up or down at random, taken at each
    trial's slot in ABBA order (pair k runs the baseline first when k is even)."""
    sigma = math.sqrt(math.log1p(cv * cv))

    def side(centre: float) -> np.ndarray:
        values = centre * np.exp(rng.normal(0.0, sigma, (draws, pairs)))
        slow = rng.random((draws, pairs)) < slow_share
        values[slow] /= 1.0 + rng.uniform(*slow_range, int(slow.sum()))
        return values

    baseline, candidate = side(1.0), side(change)
    if drift:
        k = np.arange(pairs)
        slot_baseline, slot_candidate = 2 * k + k % 2, 2 * k + 1 - k % 2
        sign = rng.choice([-1.0, 1.0], size=(draws, 1))
        span = max(1, 2 * pairs - 1)
        baseline = baseline * np.exp(sign * drift * slot_baseline / span)
        candidate = candidate * np.exp(sign * drift * slot_candidate / span)
    return baseline, candidate


def judge_many(baseline: np.ndarray, candidate: np.ndarray, direction: str,
               settings: SequentialSettings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`judge_pairs` on every row of ``(draws, pairs)`` arrays at once (same looks, same
    rule, vectorised): arrays of the verdicts, the pairs used and whether the pass was inconclusive."""
    d = log_changes(baseline.ravel(), candidate.ravel(), direction).reshape(baseline.shape)
    bad, good = settings.limits(direction)
    plan, last = settings.plan, settings.max_pairs
    code = np.full(d.shape[0], _UNDECIDED)
    used = np.full(d.shape[0], last)
    for n in settings.looks:
        live = np.flatnonzero(code == _UNDECIDED)
        if live.size == 0:
            break
        tail = plan.tail(n)
        walsh = sorted_walsh_averages(d[live, :n])
        low, high = interval_bounds(walsh, n, tail)
        pass_low, pass_high = interval_bounds(walsh, n, plan.pass_tail)
        decided = _decide(low, high, pass_low, pass_high, bad, good, n == last)
        code[live] = decided
        used[live[decided != _UNDECIDED]] = n
    verdicts = np.array([_NAMES[c] for c in code.tolist()], dtype=object)
    return verdicts, used, code == _INCONCLUSIVE


def simulate(change: float, cv: float, settings: SequentialSettings | None = None, draws: int = 1000,
             seed: int = 0, slow_share: float = 0.05, drift: float = 0.0, direction: str = "higher") -> SimulationResult:
    """The sequential gate on ``draws`` synthetic A/B runs (:func:`simulated_pairs`, with
    ``numpy.random.default_rng(seed)``); with ``direction`` "lower" the same runs are judged as
    step times (one over the throughput). Returns the shares of each verdict."""
    settings = settings or SequentialSettings()
    rng = np.random.default_rng(seed)
    baseline, candidate = simulated_pairs(rng, draws, settings.max_pairs, change, cv, slow_share, drift=drift)
    if direction == "lower":
        baseline, candidate = 1.0 / baseline, 1.0 / candidate
    verdicts, used, inconclusive = judge_many(baseline, candidate, direction, settings)
    return SimulationResult(change=change, cv=cv, draws=draws, regression=float(np.mean(verdicts == REGRESSION)),
                            improvement=float(np.mean(verdicts == IMPROVEMENT)),
                            passed=float(np.mean(verdicts == PASS)), inconclusive=float(np.mean(inconclusive)),
                            mean_pairs=float(np.mean(used)))


TABLE_ROWS = ((0.03, 1.00), (0.03, 0.98), (0.03, 0.97), (0.03, 0.95), (0.03, 0.90), (0.02, 1.00), (0.02, 0.98))
TABLE_CVS = (0.01, 0.02)
TABLE_SEED, TABLE_DRAWS = 2025, 4000


def table_cell(threshold: float, change: float, cv: float, draws: int = TABLE_DRAWS, seed: int = TABLE_SEED) -> str:
    """One cell of the module docstring's table: ``"<regression share>, <mean pairs> pairs"``."""
    result = simulate(change, cv, SequentialSettings(threshold=threshold), draws=draws, seed=seed)
    return f"{result.regression:.1%}, {result.mean_pairs:.1f} pairs"


def operating_table(draws: int = TABLE_DRAWS, seed: int = TABLE_SEED) -> str:
    """The module docstring's table of simulated operating characteristics (reStructuredText)."""
    rule = "=========  ======  " + "  ".join(["=================="] * len(TABLE_CVS))
    header = "threshold  change  " + "  ".join(f"{f'CV {cv:.0%}':<18}" for cv in TABLE_CVS)
    lines = [rule, header.rstrip(), rule]
    for threshold, change in TABLE_ROWS:
        cells = "  ".join(f"{table_cell(threshold, change, cv, draws, seed):<18}" for cv in TABLE_CVS)
        lines.append(f"{f'{threshold:.0%}':<9}  {change:<6.2f}  {cells}".rstrip())
    return "\n".join([*lines, rule])
