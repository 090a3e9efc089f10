"""``dslab gate`` on ``partial`` runs (some arm failed or ran out of memory): the arms that ran are
judged, a note names the failed ones, and a failed arm that is judged cannot be (exit 2, with its
error); a run that did not finish is still refused."""

import argparse

import numpy as np
import pytest

from dslab.gate.baseline import trial_set_from_reports
from dslab.gate.command import add_arguments, run
from dslab.report import Result, RunReport, Trial, write_report
from dslab.report.schema import STATUS_COMPLETE, STATUS_PARTIAL

SUITE = "bert_large"
OOM = "out of memory (trial 2): CUDA out of memory. Tried to allocate 3.00 GiB"


def run_id(i):
    return f"20261123T{i:06d}Z-{i:06x}"


def make_run(i, failing: dict[str, str] | None = None, scale=1.0, trials=15):
    """A run of arms dslab and torch on case seq128; ``failing`` maps an arm to its result's
    ``(status, error)`` and makes the run partial, as the bench runner does."""
    failing = failing or {}
    rng = np.random.default_rng(900 + i)
    report = RunReport(run_id=run_id(i), suite=SUITE)
    report.environment = {"torch": {"version": "2.13.0+cu128", "cuda": "12.8"}, "cpu_count": 16,
                          "cuda": {"gpus": [{"index": 0, "name": "NVIDIA H200"}]}, "environment_variables": {}}
    report.config = {"scale": "full", "precision": "bf16", "family": "bert", "trials": trials, "steps": 30,
                     "cases": [{"name": "seq128", "seq_len": 128, "micro_batch": 64}]}
    for arm in ("dslab", "torch"):
        result = Result(case="seq128", arm=arm)
        if arm in failing:
            result.status, result.error = failing[arm]
        else:
            for t, sps in enumerate(1000.0 * scale * np.exp(rng.normal(0, 0.01, trials))):
                result.trials.append(Trial(trial=t, metrics={"samples_per_s": sps, "step_time_ms": 64e3 / sps}))
            result.summarize()
        report.results.append(result)
    report.status = report.finished_status()
    return report


def gate(capsys, *argv):
    parser = argparse.ArgumentParser(prog="dslab gate")
    add_arguments(parser)
    code = run(parser.parse_args(list(argv)))
    return code, capsys.readouterr()


def test_a_run_is_partial_only_when_an_arm_failed_or_ran_out_of_memory():
    assert make_run(0).status == STATUS_COMPLETE
    assert make_run(0, {"torch": ("skipped", "transformers is not installed")}).status == STATUS_COMPLETE
    for status, error in (("failed", "RuntimeError: boom"), ("oom", OOM)):
        partial = make_run(0, {"torch": (status, error)})
        assert partial.status == STATUS_PARTIAL
        assert [(r.arm, r.status) for r in partial.failed_results()] == [("torch", status)]


def test_partial_candidate_is_judged_on_the_arms_that_ran(tmp_path, capsys):
    write_report(make_run(0), tmp_path)
    assert gate(capsys, "--reports", str(tmp_path), "--update-baseline", run_id(0))[0] == 0
    write_report(make_run(1, {"torch": ("oom", OOM)}), tmp_path)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path))
    assert code == 0, out.out
    assert "note: the candidate is partial: seq128/torch (oom) did not finish" in out.out
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path), "--arm", "torch")
    assert code == 2 and f"the candidate's seq128/torch oom: run {run_id(1)}: {OOM}" in out.out


def test_partial_candidate_whose_dslab_arm_failed_cannot_be_judged(tmp_path, capsys):
    write_report(make_run(0), tmp_path)
    error = "ValueError: unknown config key 'gradient_cliping'; did you mean 'gradient_clipping'?"
    write_report(make_run(1, {"dslab": ("failed", error)}), tmp_path)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path), "--baseline", run_id(0),
                     "--format", "markdown")
    assert code == 2 and "gradient_cliping" in out.out and "seq128/dslab (failed)" in out.out


def test_partial_runs_make_baselines_and_rolling_baselines(tmp_path, capsys):
    write_report(make_run(0, {"torch": ("failed", "RuntimeError: boom")}), tmp_path)
    code, out = gate(capsys, "--reports", str(tmp_path), "--update-baseline", run_id(0))
    assert code == 0 and "baseline written" in out.out
    assert "warning: the baseline is partial: seq128/torch (failed)" in out.err
    for i in (1, 2):
        write_report(make_run(i, {"torch": ("failed", "RuntimeError: boom")}), tmp_path)
    write_report(make_run(3, scale=0.9), tmp_path)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path), "--baseline", "rolling:3")
    assert code == 1 and f"rolling baseline: 3 run(s) {run_id(0)} .. {run_id(2)}" in out.out
    assert "the baseline is partial: seq128/torch (failed)" in out.out


def test_a_run_that_did_not_finish_is_still_refused():
    unfinished = make_run(0, {"torch": ("failed", "RuntimeError: boom")})
    unfinished.status = "incomplete"
    with pytest.raises(ValueError, match="is incomplete, not complete or partial"):
        trial_set_from_reports([unfinished])
