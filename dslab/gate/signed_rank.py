"""The Wilcoxon signed-rank statistics of paired trials: the null distribution, the confidence
interval of the pseudo-median, and the exact chance of a false alarm over repeated looks.

``d`` holds one number per pair (a log change, :mod:`dslab.gate.sequential`). ``T+`` is the
signed-rank statistic at 0: the sum of the ranks of ``|d_i|`` over the positive ``d_i``. With no
change and ``d_i`` independent, continuous and symmetric about 0, every sign pattern is equally
likely whatever the noise's shape, so ``T+`` has a known distribution on ``0 .. M`` with
``M = n (n + 1) / 2``, symmetric about ``M / 2``.

The interval: with ``W_(1) <= ... <= W_(M)`` the sorted Walsh averages ``(d_i + d_j) / 2``
(``i <= j``), the number of them above ``mu`` is ``T+`` computed on ``d - mu``. So for ``k`` the
largest integer with ``P(T+ <= k) <= a`` (:func:`critical_rank`),

    P(mu < W_(k+1)) = P(T+ >= M - k) = P(T+ <= k) <= a

and likewise ``P(mu > W_(M-k)) <= a``: ``[W_(k+1), W_(M-k)]`` holds the centre ``mu`` of a
symmetric distribution with probability at least ``1 - 2a`` (Hollander & Wolfe, *Nonparametric
Statistical Methods*, sec. 3.3). When even ``P(T+ = 0) = 2**-n`` exceeds ``a`` no ``k`` exists and
that side is unbounded. The centre's estimate is the median of the Walsh averages, the
Hodges-Lehmann pseudo-median. Ranks make both robust: a pair with one slow trial counts as one
rank however slow it was. Ties among the ``|d_i|`` (which trial timings practically never have)
make the levels approximate.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import numpy as np

from dslab.gate.stats import as_sample

EXACT_MAX_PAIRS = 50  # exact null distribution up to this many pairs, normal beyond
JOINT_EXACT_MAX_PAIRS = 18  # repeated looks calibrated exactly up to this many pairs, Bonferroni beyond


@functools.lru_cache(maxsize=None)
def signed_rank_counts(n: int) -> tuple[int, ...]:
    """How many of the ``2**n`` sign patterns of ``n`` untied pairs give each ``T+ = 0 .. n(n+1)/2``.

    ``T+`` is the sum of a subset of the ranks 1..n, so the counts are the coefficients of
    ``(1 + x)(1 + x**2)...(1 + x**n)``, multiplied out one rank at a time (rank r either counts,
    shifting the counts by r, or does not). Python integers: exact for any n."""
    if n < 0:
        raise ValueError(f"the number of pairs must be >= 0, got {n}")
    counts = [1]
    for rank in range(1, n + 1):
        grown = counts + [0] * rank
        for total, ways in enumerate(counts):
            grown[total + rank] += ways
        counts = grown
    return tuple(counts)


def signed_rank_cdf(n: int, k: int) -> float:
    """``P(T+ <= k)`` for ``n`` untied pairs with no change (exact)."""
    if k < 0:
        return 0.0
    return sum(signed_rank_counts(n)[: k + 1]) / 2**n


def cdf_values(n: int) -> list[float]:
    """``P(T+ <= k)`` for every ``k = 0 .. n(n+1)/2`` (exact): the levels at which the critical
    rank of ``n`` pairs changes."""
    total, cumulative, values = 2**n, 0, []
    for ways in signed_rank_counts(n):
        cumulative += ways
        values.append(cumulative / total)
    return values


@functools.lru_cache(maxsize=None)
def critical_rank(n: int, tail: float) -> int:
    """The largest ``k`` with ``P(T+ <= k) <= tail`` for ``n`` pairs, or -1 when there is none.

    Exact for ``n <= EXACT_MAX_PAIRS``; beyond, from the normal approximation with continuity
    correction, ``P(T+ <= k) ~ Phi((k + 1/2 - M/2) / sqrt(n (n+1) (2n+1) / 24))``."""
    if not 0.0 < tail < 1.0:
        raise ValueError(f"tail must lie in (0, 1), got {tail}")
    if n < 1:
        return -1
    if n <= EXACT_MAX_PAIRS:
        k = -1
        for value, probability in enumerate(cdf_values(n)):
            if probability > tail:
                break
            k = value
        return k
    mean = n * (n + 1) / 4.0
    sd = math.sqrt(n * (n + 1) * (2 * n + 1) / 24.0)
    return max(-1, math.floor(mean + NormalDist().inv_cdf(tail) * sd - 0.5))


def sorted_walsh_averages(d: np.ndarray) -> np.ndarray:
    """Row-wise sorted Walsh averages of ``d`` (shape ``(rows, n)``): shape ``(rows, n (n+1) / 2)``."""
    i, j = np.triu_indices(d.shape[1])
    return np.sort(0.5 * (d[:, i] + d[:, j]), axis=1)


def pseudo_medians(walsh: np.ndarray) -> np.ndarray:
    """The median of each row of sorted Walsh averages: the Hodges-Lehmann estimates."""
    m = walsh.shape[1]
    return 0.5 * (walsh[:, (m - 1) // 2] + walsh[:, m // 2])


def interval_bounds(walsh: np.ndarray, n: int, tail: float | None) -> tuple[np.ndarray, np.ndarray]:
    """``(low, high)``: ``W_(k+1)`` and ``W_(M-k)`` of each row of sorted Walsh averages of ``n``
    pairs, each side at one-sided level ``tail`` (module docstring); infinite where ``n`` pairs
    cannot reach ``tail``, or ``tail`` is None."""
    rows = walsh.shape[0]
    k = -1 if tail is None else critical_rank(n, tail)
    if k < 0:
        return np.full(rows, -np.inf), np.full(rows, np.inf)
    return walsh[:, k], walsh[:, walsh.shape[1] - 1 - k]


def pseudo_median_interval(d, tail: float) -> tuple[float, float, float]:
    """The pseudo-median of ``d`` and its signed-rank interval of two-sided level ``1 - 2 tail``:
    ``(estimate, low, high)``; a side is infinite when ``len(d)`` pairs are too few."""
    values = as_sample(d, "d")
    walsh = sorted_walsh_averages(values[None, :])
    low, high = interval_bounds(walsh, values.size, tail)
    return float(pseudo_medians(walsh)[0]), float(low[0]), float(high[0])


def joint_null_alarm(critical: dict[int, int]) -> float:
    """The chance, with no change, that ``T+ <= critical[n]`` at some look ``n`` (``T+`` over the
    first ``n`` pairs): that any look's interval lies wholly below 0.

    Exact, by dynamic programming over the pairs' signs in the order of their ``|d|``. With no
    change each new pair is positive with probability 1/2 and its ``|d|`` falls at each of the
    ``n`` places among the first ``n`` with probability ``1/n`` (the sequential ranks of a
    continuous sample are independent and uniform), whatever the noise's shape. The state after
    ``n`` pairs is the sign pattern in that order (bit ``r``: the sign of the pair of rank
    ``r + 1``; ``2**n`` states), which fixes ``T+``; the mass of the states a look rejects is
    counted and dropped. Time and memory grow as ``2**n``, hence :data:`JOINT_EXACT_MAX_PAIRS`."""
    last = max(critical, default=0)
    prob, tplus, alarm = np.ones(1), np.zeros(1, dtype=np.int64), 0.0
    for n in range(1, last + 1):
        old = np.arange(2 ** (n - 1), dtype=np.int64)
        grown = np.zeros(2**n)
        for place in range(n):
            below, above = old & ((1 << place) - 1), (old >> place) << (place + 1)
            for sign in (0, 1):
                grown += np.bincount(below | (sign << place) | above, weights=prob, minlength=2**n)
        prob = grown / (2 * n)
        tplus = np.concatenate([tplus, tplus + n])  # the new top bit is rank n
        k = critical.get(n, -1)
        if k >= 0:
            hit = tplus <= k
            alarm += float(prob[hit].sum())
            prob[hit] = 0.0
    return alarm


def calibrated_tail(budget: float, looks: tuple[int, ...], fixed: tuple[tuple[int, int], ...] = ()) -> float | None:
    """The largest one-sided level ``a`` for every look in ``looks`` such that, together with the
    looks ``fixed`` already has (``(n, critical rank)`` pairs), the chance with no change that any
    look's interval lies wholly below 0 stays within ``budget``; None when no look can reject
    within it.

    Up to :data:`JOINT_EXACT_MAX_PAIRS` pairs the chance is :func:`joint_null_alarm`, a step
    function of ``a`` that moves only where ``a`` equals some ``P(T+ <= k)`` of a look; those
    values are searched by bisection. Beyond, Bonferroni: what ``fixed`` spends (its levels summed)
    is taken from ``budget`` and the rest split evenly over the looks from the first that can
    reach its share (``2**-n <= share``)."""
    if not looks:
        return None
    fixed_ranks = dict(fixed)
    if max(looks[-1], max(fixed_ranks, default=0)) > JOINT_EXACT_MAX_PAIRS:
        left = budget - sum(signed_rank_cdf(n, k) for n, k in fixed)
        for start, first in enumerate(looks):
            share = left / (len(looks) - start)
            if share > 0 and 2.0**-first <= share:
                return share
        return None
    candidates = sorted({v for n in looks for v in cdf_values(n) if v <= budget})

    def alarm(tail: float) -> float:
        return joint_null_alarm({**fixed_ranks, **{n: critical_rank(n, tail) for n in looks}})

    if not candidates or alarm(candidates[0]) > budget:
        return None
    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high + 1) // 2
        if alarm(candidates[middle]) <= budget:
            low = middle
        else:
            high = middle - 1
    return candidates[low]
