import itertools
import math

import numpy as np
import pytest

from dslab.gate.stats import (
    bootstrap_ratio_ci,
    exact_u_counts,
    mann_whitney,
    median_ratio,
    midranks,
    rank_u,
    rank_z,
)


def brute_force_u_counts(m, n):
    """Count U over every choice of which m of the m + n pooled positions belong to x."""
    counts = [0] * (m * n + 1)
    for x_positions in itertools.combinations(range(m + n), m):
        chosen = set(x_positions)
        # U of x = pairs (x, y) with x above y = for each x, the y positions below it.
        u = sum(sum(1 for q in range(p) if q not in chosen) for p in x_positions)
        counts[u] += 1
    return counts


@pytest.mark.parametrize("m,n", [(1, 1), (2, 2), (3, 3), (2, 5), (4, 3), (5, 5)])
def test_exact_u_distribution_matches_enumeration(m, n):
    assert list(exact_u_counts(m, n)) == brute_force_u_counts(m, n)
    assert sum(exact_u_counts(m, n)) == math.comb(m + n, m)


def test_exact_u_distribution_is_symmetric_and_large_sizes_are_fast():
    counts = np.array(exact_u_counts(30, 40))
    assert counts.size == 30 * 40 + 1
    np.testing.assert_allclose(counts, counts[::-1], rtol=1e-12)
    assert math.isclose(counts.sum(), math.comb(70, 30), rel_tol=1e-12)


def test_midranks_average_ties():
    np.testing.assert_array_equal(midranks(np.array([3.0, 1.0, 3.0, 2.0])), [3.5, 1.0, 3.5, 2.0])
    np.testing.assert_array_equal(midranks(np.array([5.0, 5.0, 5.0])), [2.0, 2.0, 2.0])


def test_u_counts_pairs_with_half_ties():
    # x = [1, 2, 2, 3], y = [2, 3, 4, 4]: x beats y in (3 > 2) = 1 pair; ties (2,2) x2, (3,3) x1 -> 1.5.
    assert rank_u([1, 2, 2, 3], [2, 3, 4, 4]) == pytest.approx(2.5)
    assert rank_u([2, 3, 4, 4], [1, 2, 2, 3]) == pytest.approx(16 - 2.5)


@pytest.mark.parametrize(
    "x,y,u,p",
    [
        ([1, 2, 3], [4, 5, 6], 0.0, 2 / 20),          # the most extreme of C(6,3)=20 orderings, both tails
        ([4, 5, 6], [1, 2, 3], 9.0, 2 / 20),
        ([1, 3], [2, 4], 1.0, 2 * 2 / 6),             # P(U <= 1) = (1 + 1) / 6
        ([1, 2], [3, 4, 5], 0.0, 2 / 10),             # C(5,2) = 10
        ([1, 4], [2, 3], 2.0, 1.0),                    # the centre of the distribution
        ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], 0.0, 2 / 252),
    ],
)
def test_exact_rank_test_known_values(x, y, u, p):
    result = mann_whitney(x, y)
    assert result.method == "exact"
    assert result.u == pytest.approx(u)
    assert result.p_value == pytest.approx(p)


def test_normal_approximation_with_ties_hand_computed():
    # Pooled 1,2,2,2,3,3,4,4: tie groups of sizes 1,3,2,2 -> sum(t^3 - t) = 0 + 24 + 6 + 6 = 36.
    # sigma^2 = 4*4/12 * (9 - 36/56) = 11.142857...; z = (|2.5 - 8| - 0.5) / sigma.
    result = mann_whitney([1, 2, 2, 3], [2, 3, 4, 4])
    assert result.method == "normal"
    sigma = math.sqrt(16 / 12 * (9 - 36 / 56))
    assert sigma**2 == pytest.approx(11.142857142857142)
    assert result.p_value == pytest.approx(math.erfc(5.0 / sigma / math.sqrt(2)))
    assert result.p_value == pytest.approx(0.13417, abs=1e-5)


def test_all_tied_gives_p_one():
    assert mann_whitney([2.0, 2.0, 2.0], [2.0, 2.0]).p_value == 1.0


def test_normal_approximation_agrees_with_exact_without_ties():
    rng = np.random.default_rng(3)
    for shift in (0.0, 0.4, 0.9):
        x, y = rng.normal(0, 1, 30), rng.normal(shift, 1, 30)
        exact, normal = mann_whitney(x, y), mann_whitney(x, y, exact_max_size=0)
        assert (exact.method, normal.method) == ("exact", "normal")
        assert normal.p_value == pytest.approx(exact.p_value, abs=0.01)


def test_exact_test_holds_its_level_under_the_null():
    rng = np.random.default_rng(11)
    p = np.array([mann_whitney(rng.normal(size=6), rng.normal(size=6)).p_value for _ in range(2000)])
    assert np.mean(p < 0.05) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 2000)
    assert np.mean(p < 0.05) > 0.02  # and it is not degenerate


def test_median_ratio_and_errors():
    assert median_ratio([10, 20, 30], [15, 30, 45]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="baseline is empty"):
        median_ratio([], [1.0])
    with pytest.raises(ValueError, match="baseline median must be positive"):
        median_ratio([0.0, 0.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="candidate holds a value that is not finite"):
        median_ratio([1.0], [float("nan")])


def test_bootstrap_is_deterministic_and_brackets_the_ratio():
    rng = np.random.default_rng(5)
    base, cand = rng.lognormal(0, 0.03, 12) * 100, rng.lognormal(0, 0.03, 12) * 90
    first = bootstrap_ratio_ci(base, cand, seed=7)
    assert first == bootstrap_ratio_ci(base, cand, seed=7)
    assert first[0] <= median_ratio(base, cand) <= first[1]
    assert bootstrap_ratio_ci([5.0] * 6, [5.0] * 6) == (1.0, 1.0)
    narrow = bootstrap_ratio_ci(base, cand, confidence=0.5)
    assert first[0] <= narrow[0] <= narrow[1] <= first[1]


def test_bootstrap_interval_covers_the_true_ratio():
    rng = np.random.default_rng(9)
    covered = 0
    for _ in range(200):
        base, cand = rng.lognormal(0, 0.03, 15), rng.lognormal(np.log(0.95), 0.03, 15)
        low, high = bootstrap_ratio_ci(base, cand, confidence=0.95, resamples=1000, seed=1)
        covered += low <= 0.95 <= high
    assert covered / 200 >= 0.85  # percentile bootstrap of medians at n=15 under-covers a little


def test_bootstrap_run_noise_covers_the_offset_between_processes():
    # each side's trials are rounds of one process whose median is shifted by 0.3%: the plain
    # interval bounds only the process medians, the widened one covers the true ratio
    rng = np.random.default_rng(21)
    plain = widened = 0
    for _ in range(200):
        base = np.exp(rng.normal(0, 0.003) + rng.normal(0, 0.0005, 15))
        cand = np.exp(rng.normal(0, 0.003) + rng.normal(0, 0.0005, 15))
        low, high = bootstrap_ratio_ci(base, cand, confidence=0.95, resamples=1000, seed=1)
        plain += low <= 1.0 <= high
        low, high = bootstrap_ratio_ci(base, cand, confidence=0.95, resamples=1000, seed=1, run_noise=0.003)
        widened += low <= 1.0 <= high
    assert plain / 200 < 0.5
    assert widened / 200 >= 0.9
    assert bootstrap_ratio_ci([5.0] * 6, [5.0] * 6, run_noise=0.0) == (1.0, 1.0)


def test_bootstrap_rejects_bad_settings():
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ratio_ci([1.0, 2.0], [1.0, 2.0], confidence=1.0)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_ratio_ci([1.0, 2.0], [1.0, 2.0], resamples=10)
    with pytest.raises(ValueError, match="run_noise"):
        bootstrap_ratio_ci([1.0, 2.0], [1.0, 2.0], run_noise=-0.1)


def test_rank_z_is_the_standardised_u():
    # Same pooled sample as the hand-computed tie case: u = 2.5, mu = 8, sigma^2 = 11.142857...
    assert rank_z([1, 2, 2, 3], [2, 3, 4, 4]) == pytest.approx((2.5 - 8) / math.sqrt(16 / 12 * (9 - 36 / 56)))
    assert rank_z([2, 3, 4, 4], [1, 2, 2, 3]) == pytest.approx(-rank_z([1, 2, 2, 3], [2, 3, 4, 4]))
    assert rank_z([1.0, 1.0], [1.0]) == 0.0
