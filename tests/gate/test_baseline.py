import json

import numpy as np
import pytest

from dslab.gate.baseline import (
    baseline_path,
    detect_change_points,
    history_change_points,
    read_baseline,
    rolling_baseline,
    trial_set_from_reports,
    write_baseline,
    write_change_points,
)
from dslab.gate.fingerprint import (
    case_fingerprints,
    config_fingerprint,
    explain_difference,
    fingerprint_of,
    hardware_fingerprint,
    major_minor,
)
from dslab.gate.verdict import GateSettings
from dslab.report import Result, RunReport, Trial, read_report, write_report

H100 = "NVIDIA H100 80GB HBM3"


def run_id(i):
    return f"202611{1 + i // 24:02d}T{i % 24:02d}0000Z-{i:06x}"


def make_run(i, scale=1.0, gpu=H100, trials=8, cv=0.01, status="complete", steps=30, torch_version="2.13.0+cu128"):
    rng = np.random.default_rng(1000 + i)
    report = RunReport(run_id=run_id(i), suite="bert_large", status=status)
    report.environment = {"torch": {"version": torch_version, "cuda": "12.8"}, "cpu_count": 16,
                          "cuda": {"gpus": [{"index": 0, "name": gpu}]},
                          "environment_variables": {"DSLAB_KERNELS": None}}
    report.config = {"suite_file": f"/checkout{i}/suites/bert_large/suite.json", "scale": "full", "precision": "bf16",
                     "family": "bert", "trials": trials, "steps": steps, "warmup_steps": 10, "seed": 1234,
                     "arms": ["dslab", "torch"], "device": "cuda:0", "engine": {"gradient_clipping": 1.0},
                     "cases": [{"name": "seq128", "seq_len": 128, "micro_batch": 64}]}
    for arm in ("dslab", "torch"):
        result = Result(case="seq128", arm=arm)
        for t, sps in enumerate(1000.0 * scale * np.exp(rng.normal(0, cv, trials))):
            result.trials.append(Trial(trial=t, step_times_ms=[64e3 / sps] * 3,
                                       metrics={"samples_per_s": sps, "step_time_ms": 64e3 / sps}))
        result.summarize()
        report.results.append(result)
    return report


def test_fingerprint_fields():
    report = make_run(0)
    hardware = hardware_fingerprint(report.environment)
    assert hardware == {"gpu_names": [H100], "gpu_count": 1, "torch": "2.13", "cuda": "12.8", "dslab_kernels": None}
    cpu_only = hardware_fingerprint({"torch": {"version": "2.13.0"}, "cuda": {"gpus": []}, "cpu_count": 2})
    assert cpu_only["gpu_count"] == 0 and cpu_only["cpu_count"] == 2 and cpu_only["cuda"] is None
    assert config_fingerprint(report.config) == {"engine": {"gradient_clipping": 1.0}, "family": "bert",
                                                 "precision": "bf16", "scale": "full"}
    assert case_fingerprints(report.config) == {"seq128": {"micro_batch": 64, "seq_len": 128}}
    assert major_minor("2.13.0a0+git123") == "2.13" and major_minor(None) is None and major_minor("12") == "12"
    with pytest.raises(ValueError, match="environment"):
        hardware_fingerprint({})


def test_fingerprint_ignores_counts_and_paths_but_not_versions():
    a = fingerprint_of(make_run(0))
    assert fingerprint_of(make_run(1, trials=20, steps=50)).key == a.key  # trials, steps, suite path differ
    slowed = make_run(1)
    slowed.config["inject_step_sleep_ms"] = 5.0
    assert fingerprint_of(slowed).key == a.key
    newer = fingerprint_of(make_run(2, torch_version="2.14.0"))
    assert newer.key != a.key
    assert explain_difference(a, newer) == ['hardware.torch: "2.13" (baseline) vs "2.14" (candidate)']


def test_baseline_round_trip_from_a_written_run(tmp_path):
    path = write_report(make_run(0), tmp_path)
    trial_set = trial_set_from_reports([read_report(path)])
    written = write_baseline(trial_set, tmp_path)
    assert written == baseline_path(tmp_path, "bert_large", trial_set.fingerprint.key)
    assert written.parent == tmp_path / "baselines" / "bert_large"
    assert [p.name for p in written.parent.iterdir()] == [written.name]  # atomic: no temp file left
    back = read_baseline(written)
    assert back.fingerprint == trial_set.fingerprint and back.source_runs == [run_id(0)]
    assert back.trials == trial_set.trials and back.status == trial_set.status
    assert len(back.values("seq128", "dslab", "samples_per_s")) == 8
    data = json.loads(written.read_text())
    assert data["schema"] == "dslab.baseline" and data["fingerprint"]["key"] == written.stem


def test_read_baseline_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_baseline(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "dslab.run"}')
    with pytest.raises(ValueError, match="not a dslab baseline"):
        read_baseline(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_baseline(bad)


def test_pooling_refuses_incomplete_or_mismatched_runs():
    with pytest.raises(ValueError, match="incomplete"):
        trial_set_from_reports([make_run(0, status="incomplete")])
    with pytest.raises(ValueError, match="hardware.gpu_names"):
        trial_set_from_reports([make_run(0), make_run(1, gpu="NVIDIA A100-SXM4-80GB")])
    pooled = trial_set_from_reports([make_run(0), make_run(1)])
    assert len(pooled.values("seq128", "dslab", "samples_per_s")) == 16


def test_rolling_baseline_takes_the_last_n_with_the_same_fingerprint(tmp_path):
    gpus = [H100, H100, "NVIDIA A100-SXM4-80GB", H100, H100, "NVIDIA A100-SXM4-80GB", H100]
    for i, gpu in enumerate(gpus):
        write_report(make_run(i, gpu=gpu), tmp_path)
    write_report(make_run(7, status="incomplete"), tmp_path)
    candidate = fingerprint_of(make_run(6))
    rolling = rolling_baseline(tmp_path, "bert_large", candidate.key, 3, exclude=(run_id(6),), before=run_id(6))
    assert rolling.source_runs == [run_id(1), run_id(3), run_id(4)]
    assert len(rolling.values("seq128", "dslab", "samples_per_s")) == 3 * 8
    assert "rolling baseline: 3 run(s)" in rolling.label
    with pytest.raises(ValueError, match="no earlier finished run"):
        rolling_baseline(tmp_path, "bert_large", candidate.key, 3, before=run_id(0), exclude=(run_id(0),))


def history(step_at=None, runs=16, drop=0.1, trials=8, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(runs):
        scale = 1.0 - drop if step_at is not None and i >= step_at else 1.0
        out.append((run_id(i), list(1000 * scale * np.exp(rng.normal(0, 0.02, trials)))))
    return out


def test_change_point_found_at_a_step_and_not_in_a_flat_history():
    points = detect_change_points(history(step_at=9), "higher")
    assert len(points) == 1
    point = points[0]
    assert point["run_id"] == run_id(9) and point["index"] == 9
    assert point["kind"] == "regression" and point["direction"] == "down"
    assert point["change"] == pytest.approx(0.9, abs=0.02)
    for seed in range(5):
        assert detect_change_points(history(seed=seed), "higher") == []
    # A real but small (2%) step stays under the 5% threshold; at a 1% threshold it is found.
    small = history(step_at=8, drop=0.02)
    assert detect_change_points(small, "higher") == []
    assert [p["index"] for p in detect_change_points(small, "higher", GateSettings(threshold=0.01))] == [8]


def test_change_points_of_two_steps_and_of_a_lower_is_better_metric():
    rising = [(rid, [1e6 / v for v in values]) for rid, values in history(step_at=5)]
    points = detect_change_points(rising, "lower")
    assert [(p["index"], p["kind"], p["direction"]) for p in points] == [(5, "regression", "up")]
    two = history(step_at=5, runs=12)
    two += [(run_id(12 + i), [v * 1.25 for v in values]) for i, (_, values) in enumerate(history(runs=6, seed=3))]
    found = detect_change_points(two, "higher")
    assert [(p["index"], p["kind"]) for p in found] == [(5, "regression"), (12, "improvement")]


def test_history_change_points_written_for_the_dashboard(tmp_path):
    for i in range(10):
        write_report(make_run(i, scale=0.88 if i >= 6 else 1.0), tmp_path)
    points = history_change_points(tmp_path, "bert_large", arms=("dslab",))
    assert [(p["run_id"], p["case"], p["arm"], p["metric"], p["kind"]) for p in points] == [
        (run_id(6), "seq128", "dslab", "samples_per_s", "regression")]
    path = write_change_points(tmp_path, "bert_large", points)
    assert path == tmp_path / "bert_large" / "change_points.json"
    data = json.loads(path.read_text())
    assert data["schema"] == "dslab.change_points" and data["change_points"][0]["run_id"] == run_id(6)
    assert read_report(tmp_path / "bert_large" / run_id(0))  # the runs are still readable beside it
