"""The gate on real runs of a tiny CPU suite: an unchanged rerun passes, a run slowed with
DSLAB_INJECT_STEP_SLEEP_MS fails with exit 1."""

import json

import pytest

from dslab import cli
from dslab.bench.runner import run_suite

THRESHOLD = "70%"


def _suite(tmp_path):
    suite = {
        "name": "gate_e2e",
        "family": "gpt2",
        "engine": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
        "arms": ["dslab"],
        "scales": {"tiny": {"preset": "gpt2_tiny", "warmup_steps": 2, "steps": 4, "trials": 8,
                            "cases": [{"name": "small", "seq_len": 32, "micro_batch": 2}]}},
    }
    path = tmp_path / "suite"
    path.mkdir()
    (path / "suite.json").write_text(json.dumps(suite))
    return path


@pytest.mark.serial  # compares the timings of two runs
def test_gate_passes_a_rerun_and_fails_an_injected_slowdown(tmp_path, monkeypatch, capsys):
    suite, reports = _suite(tmp_path), tmp_path / "reports"
    baseline, _ = run_suite(suite, out=reports)
    assert cli.main(["gate", "--reports", str(reports), "--update-baseline", baseline.run_id]) == 0
    capsys.readouterr()

    rerun, _ = run_suite(suite, out=reports)
    # A wide threshold: this CPU is shared and its speed wanders (CI runs saw an unchanged rerun's
    # median 20% and 45% slower, the latter's 99% interval reaching -52%); the statistics themselves
    # are validated on synthetic noise in test_verdict.py. This test checks the plumbing (reports,
    # baseline, gate, exit codes): the injected slowdown below takes ~90% off.
    code = cli.main(["gate", "--suite", "gate_e2e", "--reports", str(reports), "--candidate", rerun.run_id,
                     "--threshold", THRESHOLD])
    assert code == 0, capsys.readouterr().out

    step_ms = baseline.result("small", "dslab").metrics["step_time_ms"]
    monkeypatch.setenv("DSLAB_INJECT_STEP_SLEEP_MS", f"{max(9 * step_ms, 100):.0f}")
    slowed, _ = run_suite(suite, out=reports)
    capsys.readouterr()
    code = cli.main(["gate", "--suite", "gate_e2e", "--reports", str(reports), "--candidate", slowed.run_id,
                     "--threshold", THRESHOLD, "--format", "markdown"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "samples_per_s" in out and "regression" in out.lower()
