"""``dslab bench`` under torchrun with 2 gloo processes and ``--zero-stage 2``: one report from
rank 0, the dslab arm stepped on both ranks with global throughput and both ranks' memory, the
single-process arms skipped."""

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from dslab.bench.common import World
from dslab.bench.training import engine_config, gather_trial
from dslab.report import list_runs, read_report

sys.path.insert(0, str(Path(__file__).parent))
from test_runner import tiny_suite  # noqa: E402

pytestmark = pytest.mark.world_size(2)


def test_two_ranks_write_one_report_with_global_throughput(tmp_path):
    suite = tiny_suite(tmp_path, arms=["dslab", "torch", "hf"])
    out = tmp_path / "reports"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "dslab.cli", "bench", str(suite), "--cases", "b", "--trials", "2", "--steps", "2",
           "--warmup", "1", "--zero-stage", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # only rank 0 prints progress: each trial's line once
    assert proc.stderr.count("trial 1/2 dslab") == 1 and proc.stderr.count("trial 2/2 dslab") == 1
    assert proc.stderr.count("x 2 ranks") == 1
    assert (proc.stdout + proc.stderr).count("processes 2  ZeRO stage 2") == 1  # the summary, rank 0 only

    (run,) = list_runs(out)
    report = read_report(run)
    assert report.status == "complete"
    assert report.config["world_size"] == 2 and report.config["zero_stage"] == 2
    assert report.config["engine"]["zero_optimization"]["stage"] == 2
    for arm in ("torch", "hf"):
        skipped = report.result("b", arm)
        assert skipped.status == "skipped" and not skipped.trials
        assert skipped.error == "single-process arm; not run with WORLD_SIZE=2"
    dslab = report.result("b", "dslab")
    assert dslab.status == "ok" and len(dslab.trials) == 2
    micro_batch, seq_len = 4, 16
    for trial in dslab.trials:
        m = trial.metrics
        assert m["step_time_ms"] == pytest.approx(statistics.median(trial.step_times_ms))
        # global: both ranks' micro-batches per (slowest rank's) step
        assert m["samples_per_s"] == pytest.approx(2 * micro_batch / (m["step_time_ms"] / 1e3))
        assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * seq_len)
        assert m["peak_rss_bytes_rank0"] > 0 and m["peak_rss_bytes_rank1"] > 0
    memory = report.profilers["memory"]["b"]
    per_rank = memory["model_states_per_rank"]
    assert len(per_rank) == 2
    for states in per_rank:
        compared = states["zero_estimate"]["compared"]
        assert compared["stage"] == 2 and states["zero_estimate"]["world_size"] == 2
        assert 0.9 <= compared["ratio"] <= 1.1
    profiles = run / "profiles" / "b"  # each rank's profiler files apart
    assert not profiles.exists() or {p.name for p in profiles.iterdir()} <= {"rank0", "rank1"}


def test_gather_trial_takes_the_slowest_rank_and_every_peak(monkeypatch):
    outcomes = [
        {"measured": {"step_times_ms": [10.0, 11.0, 12.0], "peak_memory_bytes": 100, "final_loss": 2.0},
         "error": None, "rss": 5},
        {"measured": {"step_times_ms": [13.0, 14.0, 15.0], "peak_memory_bytes": 300, "final_loss": 2.5},
         "error": None, "rss": 7},
    ]
    monkeypatch.setattr("dslab.bench.training.comm.all_gather_object", lambda obj: outcomes)
    combined, error = gather_trial(outcomes[0]["measured"], None, World(0, 2))
    assert error is None and combined["step_times_ms"] == [13.0, 14.0, 15.0]
    assert combined["peak_memory_bytes"] == 300 and combined["final_loss"] == 2.0
    assert combined["per_rank_memory"] == {"peak_memory_bytes_rank0": 100.0, "peak_memory_bytes_rank1": 300.0}
    outcomes[1] = {"measured": None, "error": "out of memory", "rss": 7}
    assert gather_trial(outcomes[0]["measured"], None, World(0, 2)) == (None, "rank 1: out of memory")


def test_zero_stage_override_is_checked():
    engine = {"zero_optimization": {"stage": 0, "reduce_bucket_size": 10}}
    assert engine_config(engine, 3)["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 10}
    assert engine["zero_optimization"]["stage"] == 0  # the suite's config is not changed
    assert engine_config({}, None) == {}
    with pytest.raises(ValueError, match="--zero-stage must be 0, 1, 2 or 3"):
        engine_config({}, 4)
