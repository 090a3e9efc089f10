"""dslab.gate: throughput regression verdicts over run reports that CI can trust.

``dslab gate --suite S`` compares the trials of a candidate run with those of a baseline, per
(case, arm, metric), and exits 0 (pass), 1 (regression) or 2 (cannot judge: missing data, too
few trials, or hardware/config fingerprints that differ, each named). How a verdict is reached
is in :mod:`dslab.gate.verdict`: the median ratio, its bootstrap interval and a Mann-Whitney
rank test (:mod:`dslab.gate.stats`) must all agree that the change is real, and the change must
reach the threshold. Which runs may be compared is in :mod:`dslab.gate.fingerprint`; where
baselines live, rolling baselines and change points over a run history in
:mod:`dslab.gate.baseline`; pytest-benchmark files in :mod:`dslab.gate.pytest_benchmark`.

A/B mode: paired trials in alternation, judged sequentially
-----------------------------------------------------------
``dslab gate --ab --suite suites/S --case C --baseline-tree DIR`` does not read two runs made at
different times: it makes the comparison itself (:mod:`dslab.gate.ab`). One worker process per
source tree (``python -m dslab.bench.ab_worker``, the bench runner's own machinery for one arm of
one case) builds and warms up the arm; then the baseline's and the candidate's trials alternate
in ABBA order on the same machine, so a drift of the machine falls on both trials of a pair
alike. After each pair, :func:`dslab.gate.sequential.judge_pairs` judges the log ratios of the
pairs with the Wilcoxon signed-rank interval of their pseudo-median and stops at the first clear
verdict: regression (clearly worse, and a threshold-sized drop consistent with the data),
improvement, or pass (a threshold-sized drop ruled out); after ``--max-trials`` pairs (default
15) it passes, marked inconclusive. The looks' levels are set exactly, by the joint null
distribution of the signed-rank statistics over the looks, so that an unchanged candidate is
called a regression with probability at most alpha (default 0.05) whatever the noise's shape,
and a threshold-sized regression is passed early in at most 1% of runs. Defaults there: a 3%
threshold; the first look that can decide is at 9 pairs. With 1% trial-to-trial CV and 5% of
trials 5-15% slow, simulation gives 2.5-3.3% false alarms, a 3% drop at a 3% threshold caught
in 96% of runs and a 2% drop at a 2% threshold in 91% (the table and why in
:mod:`dslab.gate.sequential`). ``--candidate-env NAME=VALUE`` sets a variable for the candidate's
worker only, e.g. ``DSLAB_INJECT_STEP_SLEEP_MS`` to check the gate against this checkout itself.

Trials: how many a suite needs
------------------------------
A trial is one warm-up plus measured steps of one arm, summarised by its median; the gate
treats trials as independent draws, so the trial count, not the step count, sets its power.
With the defaults (alpha 0.01, threshold 5%) and trial values that scatter lognormally with a
given coefficient of variation, plus 5% of trials 5-15% slow (a neighbour's job, a clock dip),
1000 simulated draws per cell (numpy seed 2024; ``tests/gate/test_verdict.py`` checks the
15-trial, 2% cell with other seeds) give, for equal trial counts on both sides, the share of
A/A draws flagged as regressions and the share of 5%-drop draws caught:

=======  ===========================  ===========================  ===========================
trials   CV 1%: A/A alarms, caught    CV 2%: A/A alarms, caught    CV 3%: A/A alarms, caught
=======  ===========================  ===========================  ===========================
5        0.2%, 76.8%                  0.3%, 46.8%                  0.5%, 20.3%
7        0.1%, 70.6%                  0.1%, 60.6%                  0.2%, 31.9%
10       0.1%, 91.7%                  0.2%, 86.0%                  0.2%, 54.8%
12       0.0%, 93.3%                  0.0%, 90.6%                  0.1%, 67.4%
15       0.0%, 98.5%                  0.1%, 96.7%                  0.2%, 76.1%
20       0.0%, 99.2%                  0.0%, 99.1%                  0.1%, 90.7%
=======  ===========================  ===========================  ===========================

So :data:`RECOMMENDED_TRIALS` = 15 trials per arm catch a 5% drop in at least 95% of draws on
machines whose trial-to-trial CV is 2% or less; 5 or 7 trials are too few once an occasional
slow trial lands in the baseline (the rank test at alpha 0.01 then needs full separation), and
fewer than 5 can never reach p < 0.01 at all (the gate says so and exits 2). Noisier machines
need more: 20 trials reach 91% at 3% CV. False alarms stay at or under 0.5% throughout.

Checking a gate end to end
--------------------------
``DSLAB_INJECT_STEP_SLEEP_MS=<ms>`` makes the bench runner's ``dslab`` arm (only that arm, only
when set) wait for the device and then sleep that many milliseconds in every step it runs, so
each measured step grows by at least that much; the run records the value as its config's
``inject_step_sleep_ms``. It is a tool for checking a gate, never for real measurements: run a
suite once and write a baseline from it (``dslab gate --update-baseline RUN``), run it again
with a sleep of, say, 5-10% of the step time, and ``dslab gate`` must exit 1 on the slowed run
and 0 on a rerun without the variable. The value is left out of the fingerprint, so the slowed
run stays comparable; the gate's output notes it; and a slowed run is refused as a baseline and
skipped by rolling baselines and change-point histories. In A/B mode the check is one command
each way, with this checkout on both sides: ``dslab gate --ab --suite suites/S --case C
--candidate-env DSLAB_INJECT_STEP_SLEEP_MS=<ms>`` must exit 1, and the same without the variable
(an A/A run) 0; the result notes the sleep.
"""

from dslab.gate.ab import ABRequest, render_ab, run_ab
from dslab.gate.baseline import (
    TrialSet,
    baseline_path,
    detect_change_points,
    history_change_points,
    read_baseline,
    rolling_baseline,
    trial_set_from_reports,
    write_baseline,
    write_change_points,
)
from dslab.gate.fingerprint import Fingerprint, explain_difference, fingerprint_of
from dslab.gate.format import render
from dslab.gate.sequential import SequentialSettings, SequentialVerdict, judge_pairs, simulate
from dslab.gate.stats import bootstrap_ratio_ci, mann_whitney, median_ratio
from dslab.gate.verdict import GateReport, GateSettings, Row, compare_samples, gate_trial_sets

RECOMMENDED_TRIALS = 15
INJECT_SLEEP_VARIABLE = "DSLAB_INJECT_STEP_SLEEP_MS"

__all__ = [
    "ABRequest",
    "INJECT_SLEEP_VARIABLE",
    "RECOMMENDED_TRIALS",
    "Fingerprint",
    "GateReport",
    "GateSettings",
    "Row",
    "SequentialSettings",
    "SequentialVerdict",
    "TrialSet",
    "baseline_path",
    "bootstrap_ratio_ci",
    "compare_samples",
    "detect_change_points",
    "explain_difference",
    "fingerprint_of",
    "gate_trial_sets",
    "history_change_points",
    "judge_pairs",
    "mann_whitney",
    "median_ratio",
    "read_baseline",
    "render",
    "render_ab",
    "rolling_baseline",
    "run_ab",
    "simulate",
    "trial_set_from_reports",
    "write_baseline",
    "write_change_points",
]
