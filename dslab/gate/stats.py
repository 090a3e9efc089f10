"""The statistics of the gate: the median ratio, its bootstrap confidence interval, and the
Mann-Whitney U rank test, in numpy alone (scipy is not a dependency).

Everything takes two one-dimensional samples: ``baseline`` (the trials of the reference run, m of
them) and ``candidate`` (the trials of the run being judged, n of them), each trial one number (a
trial's median samples/s, say). Results are deterministic: the bootstrap draws from a
``numpy.random.Generator`` seeded by the caller (default seed 0).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

EXACT_MAX_SIZE = 50  # exact U distribution for samples without ties up to this many per side


def as_sample(values, name: str) -> np.ndarray:
    """``values`` as a 1-D float64 array of finite numbers; ValueError naming ``name`` otherwise."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of numbers, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} holds a value that is not finite: {array.tolist()}")
    return array


def median_ratio(baseline, candidate) -> float:
    """``median(candidate) / median(baseline)``; 1.0 means no change. Needs a positive baseline median."""
    base = as_sample(baseline, "baseline")
    cand = as_sample(candidate, "candidate")
    denominator = float(np.median(base))
    if denominator <= 0:
        raise ValueError(f"baseline median must be positive to form a ratio, got {denominator}")
    return float(np.median(cand)) / denominator


def _row_medians(samples: np.ndarray) -> np.ndarray:
    """Median of each row of a ``(rows, k)`` array: the mean of the two middle order statistics
    (one when k is odd). A sort per row is several times faster than ``np.median(axis=1)`` here."""
    ordered = np.sort(samples, axis=1)
    k = samples.shape[1]
    return 0.5 * (ordered[:, (k - 1) // 2] + ordered[:, k // 2])


def bootstrap_ratio_ci(
    baseline,
    candidate,
    confidence: float = 0.95,
    resamples: int = 4000,
    seed: int = 0,
    run_noise: float = 0.0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``median(candidate) / median(baseline)``.

    Each of ``resamples`` replicates draws m baseline and n candidate trials with replacement
    (independently: the two runs are independent samples) and takes the ratio of the medians;
    the interval is the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of the
    replicates. Vectorised: two index arrays of shape ``(resamples, m)`` and ``(resamples, n)``.

    ``run_noise`` (a relative standard deviation, 0.003 = 0.3%) is the spread of a whole run's
    median from one process to the next that the trials of one process cannot show: when a side's
    trials are rounds of one process (pytest-benchmark), resampling them bounds only that process's
    median. Each replicate is then multiplied by ``exp(e_c - e_b)``, one draw each of
    ``N(0, run_noise^2)`` for the candidate's and the baseline's process, so the interval also
    covers the offset two unchanged processes show.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples}")
    if not 0.0 <= run_noise < 1.0 or not math.isfinite(run_noise):
        raise ValueError(f"run_noise must lie in [0, 1) (0.003 = 0.3%), got {run_noise}")
    base = as_sample(baseline, "baseline")
    cand = as_sample(candidate, "candidate")
    if np.any(base <= 0):
        raise ValueError("baseline values must be positive to form a ratio")
    rng = np.random.default_rng(seed)
    base_medians = _row_medians(base[rng.integers(0, base.size, size=(resamples, base.size))])
    cand_medians = _row_medians(cand[rng.integers(0, cand.size, size=(resamples, cand.size))])
    ratios = cand_medians / base_medians
    if run_noise > 0.0:
        offsets = rng.normal(0.0, run_noise, size=(2, resamples))
        ratios = ratios * np.exp(offsets[0] - offsets[1])
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class RankTest:
    """A two-sided Mann-Whitney U test of ``x`` against ``y``.

    ``u`` is the statistic of ``x``: the number of pairs ``(x_i, y_j)`` with ``x_i > y_j`` plus half
    the tied pairs, so ``u`` ranges over ``[0, m n]`` and is ``m n / 2`` on average under the null
    hypothesis that both samples come from one distribution. ``method`` is "exact" or "normal".
    """

    u: float
    p_value: float
    method: str
    m: int
    n: int


def rank_u(x, y) -> float:
    """U of ``x``: ``R_x - m (m + 1) / 2`` with ``R_x`` the sum of x's mid-ranks in the pooled sample."""
    xs = as_sample(x, "x")
    ys = as_sample(y, "y")
    ranks = midranks(np.concatenate([xs, ys]))
    return float(ranks[: xs.size].sum() - xs.size * (xs.size + 1) / 2.0)


def midranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..N of ``values``, ties given the mean of the ranks they span."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    ranks = np.empty(values.size, dtype=np.float64)
    # Group boundaries: a new group starts where the sorted value changes.
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], values.size]
    mean_rank = (starts + ends + 1) / 2.0  # ranks starts+1 .. ends, averaged
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


@functools.lru_cache(maxsize=256)
def exact_u_counts(m: int, n: int) -> tuple[float, ...]:
    """How many of the ``C(m + n, m)`` orderings of two tie-free samples give each ``U = 0..m n``.

    Recurrence on the largest pooled value: it belongs to x (adding n to U, since it beats every
    y) or to y (adding nothing): ``f(m, n, u) = f(m - 1, n, u - n) + f(m, n - 1, u)``, with
    ``f(0, n, 0) = f(m, 0, 0) = 1``. Built row by row over m in numpy (the
    counts, as float64: exact up to 2**53 and within 1e-15 relative beyond, ample for a p-value).
    """
    if m < 0 or n < 0:
        raise ValueError(f"sample sizes must be >= 0, got m={m}, n={n}")
    # table[j] = counts for sizes (i, j), for the current i.
    table = [np.array([1], dtype=np.float64) for _ in range(n + 1)]
    for i in range(1, m + 1):
        new = [np.array([1], dtype=np.float64)]  # (i, 0): one ordering, U = 0
        for j in range(1, n + 1):
            from_x = np.concatenate([np.zeros(j, dtype=np.float64), table[j]])  # shift by j
            from_y = new[j - 1]
            size = i * j + 1
            counts = np.zeros(size, dtype=np.float64)
            counts[: from_x.size] += from_x
            counts[: from_y.size] += from_y
            new.append(counts)
        table = new
    counts = table[n]
    assert counts.size == m * n + 1 and math.isclose(counts.sum(), math.comb(m + n, m), rel_tol=1e-9)
    return tuple(float(c) for c in counts)


def rank_z(x, y) -> float:
    """The standardised U of ``x`` against ``y``: ``(u - m n / 2) / sigma`` with the tie-corrected
    sigma of :func:`mann_whitney` and no continuity correction; 0 when every value ties. Unlike
    p-values from different methods, it ranks splits of one sample on one scale."""
    xs = as_sample(x, "x")
    ys = as_sample(y, "y")
    m, n = xs.size, ys.size
    pooled = np.concatenate([xs, ys])
    u = float(midranks(pooled)[:m].sum() - m * (m + 1) / 2.0)
    variance = _u_variance(pooled, m, n)
    return 0.0 if variance <= 0 else (u - m * n / 2.0) / math.sqrt(variance)


def _u_variance(pooled: np.ndarray, m: int, n: int) -> float:
    big_n = m + n
    if big_n < 2:
        return 0.0
    _, tie_sizes = np.unique(pooled, return_counts=True)
    tie_term = float(np.sum(tie_sizes.astype(np.float64) ** 3 - tie_sizes)) / (big_n * (big_n - 1))
    return m * n / 12.0 * ((big_n + 1) - tie_term)


def mann_whitney(x, y, exact_max_size: int = EXACT_MAX_SIZE) -> RankTest:
    """Two-sided Mann-Whitney U test of ``x`` against ``y``.

    Exact when neither sample is larger than ``exact_max_size`` and the pooled sample has no
    ties: ``p = min(1, 2 min(P(U <= u), P(U >= u)))`` over the distribution of
    :func:`exact_u_counts`. Otherwise the normal approximation with the tie correction and a
    continuity correction of 1/2::

        mu = m n / 2
        sigma^2 = m n / 12 * ((N + 1) - sum_k (t_k^3 - t_k) / (N (N - 1)))     N = m + n
        z = (|u - mu| - 1/2) / sigma,   p = erfc(z / sqrt(2))

    with ``t_k`` the size of the k-th group of tied values. When every value ties (sigma = 0) the
    samples cannot be told apart and p = 1.
    """
    xs = as_sample(x, "x")
    ys = as_sample(y, "y")
    m, n = xs.size, ys.size
    pooled = np.concatenate([xs, ys])
    ranks = midranks(pooled)
    u = float(ranks[:m].sum() - m * (m + 1) / 2.0)
    has_ties = np.unique(pooled).size < pooled.size
    if not has_ties and max(m, n) <= exact_max_size:
        counts = np.array(exact_u_counts(m, n), dtype=np.float64)
        total = counts.sum()
        k = int(round(u))
        lower = counts[: k + 1].sum() / total
        upper = counts[k:].sum() / total
        return RankTest(u=u, p_value=float(min(1.0, 2.0 * min(lower, upper))), method="exact", m=m, n=n)
    variance = _u_variance(pooled, m, n)
    if variance <= 0:
        return RankTest(u=u, p_value=1.0, method="normal", m=m, n=n)
    z = max(0.0, abs(u - m * n / 2.0) - 0.5) / math.sqrt(variance)
    return RankTest(u=u, p_value=float(min(1.0, math.erfc(z / math.sqrt(2.0)))), method="normal", m=m, n=n)
