"""The gate's rule: statistical validation on synthetic trials, and row-level verdicts."""

import numpy as np
import pytest

from dslab.gate import RECOMMENDED_TRIALS
from dslab.gate.baseline import trial_set_from_reports
from dslab.gate.format import render
from dslab.gate.verdict import (
    CANNOT_JUDGE,
    IMPROVEMENT,
    PASS,
    REGRESSION,
    GateSettings,
    compare_samples,
    gate_trial_sets,
    smallest_p,
    trials_needed,
)
from dslab.report import Result, RunReport, Trial

DRAWS = 1000


def noisy_trials(rng, n, cv=0.02, scale=1.0, slow_fraction=0.05):
    """n trial throughputs: lognormal scatter of ``cv`` around 1000 * scale, and each trial with
    probability ``slow_fraction`` 5-15% slow (a neighbour's job, a clock dip)."""
    values = 1000.0 * scale * np.exp(rng.normal(0.0, cv, n))
    slow = rng.random(n) < slow_fraction
    values[slow] *= rng.uniform(0.85, 0.95, slow.sum())
    return values


def regression_rate(drop, direction="higher", n=RECOMMENDED_TRIALS, seed=0, draws=DRAWS):
    rng = np.random.default_rng(seed)
    settings = GateSettings()
    hits = 0
    for _ in range(draws):
        base, cand = noisy_trials(rng, n), noisy_trials(rng, n, scale=1.0 - drop)
        if direction == "lower":  # the same runs seen as step times (ms per fixed work)
            base, cand = 1e6 / base, 1e6 / cand
        hits += compare_samples(base, cand, direction, settings).verdict == REGRESSION
    return hits / draws


def test_recommended_trials_is_documented():
    import dslab.gate

    assert RECOMMENDED_TRIALS == 15
    assert "RECOMMENDED_TRIALS` = 15" in dslab.gate.__doc__


def test_a_a_false_alarms_at_most_one_percent():
    assert regression_rate(0.0, seed=1) <= 0.01


def test_five_percent_throughput_drop_caught_in_95_percent():
    assert regression_rate(0.05, seed=2) >= 0.95


def test_step_time_direction_catches_the_same_drop_and_stays_quiet_on_a_a():
    assert regression_rate(0.05, "lower", seed=3, draws=500) >= 0.95
    assert regression_rate(0.0, "lower", seed=4, draws=500) <= 0.01


def one_process_rounds(rng, n, slowdown=0.0, run_sd=0.0025, round_cv=0.0005):
    """n rounds of one pytest-benchmark process timing a kernel: the rounds scatter by
    ``round_cv`` around a median that the process itself shifts by ``N(0, run_sd)`` (what 4 A/A
    processes of the H200 kernel benchmarks showed: 0.02-0.48% per benchmark, 0.23% pooled)."""
    offset = rng.normal(0.0, run_sd)
    return 1e-3 * (1.0 + slowdown) * np.exp(offset + rng.normal(0.0, round_cv, n))


def kernel_gate_rate(slowdown, run_noise, seed, draws=400, n=15):
    rng = np.random.default_rng(seed)
    settings = GateSettings(threshold=0.03, run_noise=run_noise, resamples=1000)
    hits = 0
    for _ in range(draws):
        base, cand = one_process_rounds(rng, n), one_process_rounds(rng, n, slowdown)
        hits += compare_samples(base, cand, "lower", settings).verdict == REGRESSION
    return hits / draws


def test_run_noise_lets_a_kernel_gate_at_3_percent_catch_3_percent():
    # rounds of one process bound that process's median only: without the run-to-run noise the
    # interval is a tenth of the processes' spread, and a real 3% slowdown that one pair of
    # processes reads as 2.9% passes as "clear but within the threshold" about half the time
    assert kernel_gate_rate(0.03, run_noise=0.0, seed=11) < 0.7
    assert kernel_gate_rate(0.03, run_noise=0.003, seed=12) >= 0.95
    assert kernel_gate_rate(0.0, run_noise=0.003, seed=13) <= 0.05
    assert kernel_gate_rate(0.01, run_noise=0.003, seed=14) <= 0.05  # 1% is not a 3% regression


def test_too_few_trials_cannot_judge_and_says_how_many():
    assert trials_needed(0.01) == 5 and smallest_p(5, 5) < 0.01 <= smallest_p(4, 4)
    result = compare_samples([100, 101, 99, 100], [80, 81, 79, 80], "higher")
    assert result.verdict == CANNOT_JUDGE
    assert "at least 5 trials" in result.reason


def test_large_drop_with_few_but_enough_trials_is_a_regression_with_figures():
    rng = np.random.default_rng(0)
    base, cand = noisy_trials(rng, 7, slow_fraction=0), noisy_trials(rng, 7, scale=0.8, slow_fraction=0)
    result = compare_samples(base, cand, "higher")
    assert result.verdict == REGRESSION
    assert result.ci_high < 1 and result.p_value < 0.01 and result.ratio == pytest.approx(0.8, abs=0.03)
    assert "reaches the 5% threshold" in result.reason


def test_improvement_and_clear_but_small_changes():
    rng = np.random.default_rng(1)
    up = compare_samples(noisy_trials(rng, 15), noisy_trials(rng, 15, scale=1.15), "higher")
    assert up.verdict == IMPROVEMENT
    # 1% slower, measured very precisely: clear, but its whole interval lies within the 5% threshold.
    base, cand = noisy_trials(rng, 200, cv=0.002, slow_fraction=0), noisy_trials(rng, 200, cv=0.002, scale=0.99,
                                                                                   slow_fraction=0)
    small = compare_samples(base, cand, "higher")
    assert small.verdict == PASS and small.p_value < 1e-6 and small.ci_high < 1
    assert "within the 5% threshold" in small.reason
    # The same change at a 0.5% threshold is a regression.
    assert compare_samples(base, cand, "higher", GateSettings(threshold=0.005)).verdict == REGRESSION


def test_noise_is_a_pass_that_says_why():
    rng = np.random.default_rng(2)
    result = compare_samples(noisy_trials(rng, 15), noisy_trials(rng, 15), "higher")
    assert result.verdict == PASS and "no clear change" in result.reason


def test_settings_are_checked():
    with pytest.raises(ValueError, match="threshold"):
        GateSettings(threshold=5)
    with pytest.raises(ValueError, match="alpha"):
        GateSettings(alpha=0)
    with pytest.raises(ValueError, match="run noise"):
        GateSettings(run_noise=-0.01)
    with pytest.raises(ValueError, match="direction"):
        compare_samples([1.0], [1.0], "up")
    assert GateSettings().level == pytest.approx(0.99)
    assert GateSettings(confidence=0.9).level == 0.9


def make_run(run_id, scale=1.0, gpu="NVIDIA H100 80GB HBM3", micro_batch=64, seed=0, trials=RECOMMENDED_TRIALS,
             failed_arm=None, metrics=("samples_per_s", "step_time_ms")):
    rng = np.random.default_rng(seed)
    report = RunReport(run_id=run_id, suite="bert_large", status="complete")
    report.environment = {"torch": {"version": "2.13.0+cu128", "cuda": "12.8"}, "cpu_count": 16,
                          "cuda": {"gpus": [{"index": 0, "name": gpu}]}, "environment_variables": {}}
    report.config = {"scale": "full", "precision": "bf16", "family": "bert", "trials": trials, "steps": 30,
                     "cases": [{"name": "seq128", "seq_len": 128, "micro_batch": micro_batch},
                               {"name": "seq512", "seq_len": 512, "micro_batch": 16}]}
    for case in ("seq128", "seq512"):
        for arm in ("dslab", "torch"):
            result = Result(case=case, arm=arm)
            if arm == failed_arm:
                result.status, result.error = "failed", "out of memory: tried to allocate 2 GiB\ntraceback"
            else:
                for t, sps in enumerate(noisy_trials(rng, trials, cv=0.01, scale=scale, slow_fraction=0)):
                    values = {"samples_per_s": sps, "step_time_ms": 64e3 / sps}
                    result.trials.append(Trial(trial=t, metrics={m: values[m] for m in metrics}))
                result.summarize()
            report.results.append(result)
    return report


def test_gate_rows_per_case_and_exit_codes():
    base = trial_set_from_reports([make_run("20261101T000000Z-000001", seed=1)])
    same = trial_set_from_reports([make_run("20261102T000000Z-000002", seed=2)])
    slow = trial_set_from_reports([make_run("20261102T000000Z-000003", seed=3, scale=0.9)])
    passed = gate_trial_sets(base, same)
    assert [(r.case, r.arm, r.metric) for r in passed.rows] == [("seq128", "dslab", "samples_per_s"),
                                                                  ("seq512", "dslab", "samples_per_s")]
    assert passed.exit_code == 0 and passed.outcome == PASS
    regressed = gate_trial_sets(base, slow, metrics=("samples_per_s", "step_time_ms"), arms=None)
    assert len(regressed.rows) == 2 * 2 * 2
    assert all(r.verdict == REGRESSION for r in regressed.rows) and regressed.exit_code == 1
    assert all(r.ratio == pytest.approx(0.9 if r.metric == "samples_per_s" else 1 / 0.9, rel=0.02)
               for r in regressed.rows)


def test_gate_cannot_judge_names_what_is_wrong():
    base = trial_set_from_reports([make_run("20261101T000000Z-000001", seed=1)])
    other_gpu = trial_set_from_reports([make_run("20261102T000000Z-000002", gpu="NVIDIA A100-SXM4-80GB")])
    mismatch = gate_trial_sets(base, other_gpu)
    assert mismatch.exit_code == 2 and not mismatch.rows
    assert "hardware.gpu_names[0]" in mismatch.problems[0] and "A100" in mismatch.problems[0]

    case_changed = gate_trial_sets(base, trial_set_from_reports([make_run("20261102T000000Z-000003", micro_batch=32)]))
    by_case = {r.case: r for r in case_changed.rows}
    assert by_case["seq128"].verdict == CANNOT_JUDGE and "cases.seq128.micro_batch: 64" in by_case["seq128"].reason
    assert by_case["seq512"].verdict == PASS and case_changed.exit_code == 2

    failed = gate_trial_sets(base, trial_set_from_reports([make_run("20261102T000000Z-000004", failed_arm="dslab")]))
    assert {r.verdict for r in failed.rows} == {CANNOT_JUDGE} and "out of memory" in failed.rows[0].reason

    no_metric = gate_trial_sets(base, trial_set_from_reports(
        [make_run("20261102T000000Z-000005", metrics=("step_time_ms",))]))
    assert no_metric.exit_code == 2 and "no trials of samples_per_s" in no_metric.rows[0].reason
    unknown = gate_trial_sets(base, base, metrics=("final_loss",))
    assert unknown.exit_code == 2 and "no known direction" in unknown.rows[0].reason


def test_a_regression_outranks_cannot_judge():
    base = trial_set_from_reports([make_run("20261101T000000Z-000001", seed=1)])
    slow = trial_set_from_reports([make_run("20261102T000000Z-000002", seed=2, scale=0.85)])
    report = gate_trial_sets(base, slow, metrics=("samples_per_s", "final_loss"))
    assert {r.verdict for r in report.rows} == {REGRESSION, CANNOT_JUDGE} and report.exit_code == 1


def test_formats_render_one_row_per_metric():
    base = trial_set_from_reports([make_run("20261101T000000Z-000001", seed=1)])
    slow = trial_set_from_reports([make_run("20261102T000000Z-000002", seed=2, scale=0.9)])
    report = gate_trial_sets(base, slow, metrics=("samples_per_s", "step_time_ms"))
    markdown = render(report, "markdown")
    table = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(report.rows) == 5  # header + one row per (case, arm, metric)
    assert "**REGRESSION**" in markdown and "**regression**" in table[1] and "-10." in table[1]
    text = render(report, "text")
    assert "REGRESSION (exit 1)" in text and text.count("reaches the 5% threshold") == 4
    with pytest.raises(ValueError, match="format"):
        render(report, "html")


# Rounds of one H200 run (benchmarks/gate_gpu.sh kernels, cross_entropy fwd+bwd 16384x50304 bf16,
# dslab arm, 10 rounds of 200 ms, us per call): the plain kernel's rounds swing with the clock, by
# 7.7% from the fastest to the slowest, and a copy slowed 3% on the device reads flat.
CE_PLAIN_200MS = [1276.2, 1275.3, 1289.9, 1370.7, 1313.2, 1278.5, 1272.9, 1312.7, 1346.3, 1299.5]
CE_SLOWED_200MS = [1338.8, 1326.0, 1326.4, 1340.0, 1344.9, 1335.0, 1326.6, 1331.0, 1333.1, 1342.5]


def test_a_pass_that_cannot_rule_out_a_threshold_sized_change_says_so():
    settings = GateSettings(threshold=0.03, run_noise=0.003)
    result = compare_samples(CE_PLAIN_200MS, CE_SLOWED_200MS, "lower", settings)
    assert result.verdict == PASS and result.unresolved
    assert result.ci_high > 1.03 and "unresolved" in result.reason and "past the 3% threshold" in result.reason
    strict = compare_samples(CE_PLAIN_200MS, CE_SLOWED_200MS, "lower", GateSettings(threshold=0.03, run_noise=0.003,
                                                                                      strict=True))
    assert strict.verdict == CANNOT_JUDGE and strict.unresolved and "--strict" in strict.reason
    # The same for a throughput (higher is better): the interval's low end is the worse one.
    speeds = compare_samples([1e6 / t for t in CE_PLAIN_200MS], [1e6 / t for t in CE_SLOWED_200MS], "higher", settings)
    assert speeds.verdict == PASS and speeds.unresolved and speeds.ci_low < 0.97


def test_tight_trials_resolve_and_clear_changes_are_never_unresolved():
    rng = np.random.default_rng(7)
    base, same = noisy_trials(rng, 15, cv=0.002, slow_fraction=0), noisy_trials(rng, 15, cv=0.002, slow_fraction=0)
    tight = compare_samples(base, same, "higher")
    assert tight.verdict == PASS and not tight.unresolved and "unresolved" not in tight.reason
    slow = compare_samples(base, base * 0.9, "higher", GateSettings(strict=True))
    assert slow.verdict == REGRESSION and not slow.unresolved


def test_the_report_counts_unresolved_rows_and_strict_exits_2():
    def report_of(strict):
        def run(seq, values):
            report = RunReport(run_id=f"20261130T00000{seq}Z-00000{seq}", suite="s", status="complete")
            report.environment = {"torch": {"version": "2.11.0+cu128", "cuda": "12.8"}, "cpu_count": 16,
                                  "cuda": {"gpus": [{"index": 0, "name": "NVIDIA H200"}]}, "environment_variables": {}}
            report.config = {"scale": "full", "cases": [{"name": "c"}]}
            result = Result(case="c", arm="dslab")
            for t, v in enumerate(values):
                result.trials.append(Trial(trial=t, metrics={"step_time_ms": v / 1000}))
            result.summarize()
            report.results.append(result)
            return report
        base = trial_set_from_reports([run(1, CE_PLAIN_200MS)])
        cand = trial_set_from_reports([run(2, CE_SLOWED_200MS)])
        return gate_trial_sets(base, cand, metrics=("step_time_ms",),
                               settings=GateSettings(threshold=0.03, run_noise=0.003, strict=strict))
    lenient, strict = report_of(False), report_of(True)
    assert lenient.exit_code == 0 and len(lenient.unresolved) == 1
    assert "1 of 1 row(s) passed without ruling out" in render(lenient, "text")
    assert strict.exit_code == 2 and "counted as cannot-judge (--strict)" in render(strict, "markdown")
