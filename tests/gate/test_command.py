"""``dslab gate`` end to end on run reports written to a temporary reports root."""

import argparse
import json

import numpy as np
import pytest

from dslab.gate.command import add_arguments, parse_run_noise, parse_threshold, run
from dslab.report import Result, RunReport, Trial, write_report

H100 = "NVIDIA H100 80GB HBM3"
SUITE = "bert_large"


def run_id(i):
    return f"20261122T{i:06d}Z-{i:06x}"


def make_run(i, scale=1.0, gpu=H100, trials=15, status="complete", failed=False, sleep_ms=None):
    rng = np.random.default_rng(500 + i)
    report = RunReport(run_id=run_id(i), suite=SUITE, status=status)
    report.environment = {"torch": {"version": "2.13.0+cu128", "cuda": "12.8"}, "cpu_count": 16,
                          "cuda": {"gpus": [{"index": 0, "name": gpu}]}, "environment_variables": {}}
    report.config = {"scale": "full", "precision": "bf16", "family": "bert", "trials": trials, "steps": 30,
                     "cases": [{"name": "seq128", "seq_len": 128, "micro_batch": 64}],
                     "inject_step_sleep_ms": sleep_ms}
    for arm in ("dslab", "torch"):
        result = Result(case="seq128", arm=arm)
        if failed and arm == "dslab":
            result.status, result.error = "failed", "RuntimeError: CUDA error: an illegal memory access"
        else:
            for t, sps in enumerate(1000.0 * scale * np.exp(rng.normal(0, 0.01, trials))):
                result.trials.append(Trial(trial=t, metrics={"samples_per_s": sps, "step_time_ms": 64e3 / sps}))
            result.summarize()
        report.results.append(result)
    return report


def gate(capsys, *argv):
    parser = argparse.ArgumentParser(prog="dslab gate")
    add_arguments(parser)
    code = run(parser.parse_args(list(argv)))
    return code, capsys.readouterr()


@pytest.fixture
def reports(tmp_path, capsys):
    """A reports root with a baseline written from run 0."""
    write_report(make_run(0), tmp_path)
    code, out = gate(capsys, "--reports", str(tmp_path), "--update-baseline", run_id(0))
    assert code == 0 and "baseline written" in out.out
    return tmp_path


def test_update_baseline_writes_the_fingerprint_file(reports):
    files = list((reports / "baselines" / SUITE).glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["source_runs"] == [run_id(0)] and files[0].stem == data["fingerprint"]["key"]
    assert len(data["results"][0]["trials"]["samples_per_s"]) == 15


def test_unchanged_code_passes_and_slower_code_fails(reports, capsys):
    write_report(make_run(1), reports)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports))  # newest run vs the stored baseline
    assert code == 0, out.out
    assert "PASS (exit 0)" in out.out and run_id(1) in out.out
    write_report(make_run(2, scale=0.92), reports)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports), "--format", "markdown",
                     "--metric", "samples_per_s", "--metric", "step_time_ms")
    assert code == 1
    rows = [line for line in out.out.splitlines() if line.startswith("| seq128")]
    assert len(rows) == 2 and all("**regression**" in row for row in rows)
    assert "samples_per_s" in rows[0] and "step_time_ms" in rows[1] and "-8." in rows[0]


def test_small_slowdowns_under_the_threshold_pass(reports, capsys):
    write_report(make_run(1, scale=0.975), reports)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports), "--threshold", "5%")
    assert code == 0, out.out
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports), "--threshold", "0.5%")
    assert code == 1, out.out


def test_fingerprint_mismatch_names_the_field(reports, capsys):
    write_report(make_run(1, gpu="NVIDIA A100-SXM4-80GB"), reports)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports))
    assert code == 2
    assert "no baseline for this fingerprint" in out.out and "hardware.gpu_names[0]" in out.out
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports), "--baseline", run_id(0),
                     "--format", "json")
    data = json.loads(out.out)
    assert code == 2 and data["exit_code"] == 2 and data["rows"] == []
    assert "hardware.gpu_names[0]" in data["problems"][0] and "A100" in data["problems"][0]


def test_missing_metric_or_failed_arm_cannot_judge(reports, capsys):
    write_report(make_run(1), reports)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports), "--metric", "tokens_per_s")
    assert code == 2 and "no trials of tokens_per_s" in out.out
    write_report(make_run(2, failed=True), reports)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports))
    assert code == 2 and "illegal memory access" in out.out
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports), "--arm", "torch")
    assert code == 0, out.out


def test_too_few_trials_cannot_judge(tmp_path, capsys):
    write_report(make_run(0, trials=2), tmp_path)
    code, out = gate(capsys, "--reports", str(tmp_path), "--update-baseline", run_id(0))
    assert code == 0 and "needs at least 5" in out.err
    write_report(make_run(1, trials=2, scale=0.5), tmp_path)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path))
    assert code == 2 and "at least 5 trials on each side" in out.out


def test_rolling_and_run_baselines(tmp_path, capsys):
    for i in range(4):
        write_report(make_run(i), tmp_path)
    write_report(make_run(4, scale=0.9), tmp_path)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path), "--baseline", "rolling:3")
    assert code == 1 and f"rolling baseline: 3 run(s) {run_id(1)} .. {run_id(3)}" in out.out
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path), "--baseline", "rolling:3",
                     "--candidate", run_id(3))
    assert code == 0 and f"{run_id(0)} .. {run_id(2)}" in out.out
    code, out = gate(capsys, "--reports", str(tmp_path), "--baseline", str(tmp_path / SUITE / run_id(0)),
                     "--candidate", f"{SUITE}/{run_id(1)}", run_id(2))
    assert code == 0 and f"2 runs {run_id(1)} .. {run_id(2)}" in out.out
    assert (tmp_path / SUITE / "change_points.json").is_file()
    points = json.loads((tmp_path / SUITE / "change_points.json").read_text())["change_points"]
    assert [(p["run_id"], p["arm"], p["kind"]) for p in points] == [(run_id(4), "dslab", "regression"),
                                                                     (run_id(4), "torch", "regression")]


def test_problems_exit_2_never_1(tmp_path, capsys):
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path))
    assert code == 2 and "no runs of suite" in out.out
    write_report(make_run(0), tmp_path)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path), "--candidate", "20990101T000000Z-abcdef")
    assert code == 2 and "no run" in out.out
    write_report(make_run(1, status="incomplete"), tmp_path)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path), "--baseline", run_id(0))
    assert code == 2 and "incomplete" in out.out
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(tmp_path), "--baseline", "rolling:x",
                     "--candidate", run_id(0))
    assert code == 2 and "rolling:N" in out.out
    code, out = gate(capsys, "--reports", str(tmp_path), "--update-baseline", run_id(1))
    assert code == 2 and "incomplete" in out.err


def test_threshold_parsing():
    assert parse_threshold("5%") == pytest.approx(0.05) and parse_threshold("0.03") == pytest.approx(0.03)
    for bad in ("5", "abc", "0%", "150%"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_threshold(bad)


def bench_file(path, scale=1.0, save_data=True, cpu="AMD EPYC 9654", seed=0, extra_machine_info=None, timing=None,
               cv=0.02):
    rng = np.random.default_rng(seed)
    benchmarks = []
    for name in ("test_layer_norm", "test_softmax"):
        times = list(1e-4 * scale * np.exp(rng.normal(0, cv, 40)))
        stats = {"min": min(times), "median": float(np.median(times)), "rounds": len(times)}
        if save_data:
            stats["data"] = times
        bench = {"name": name, "fullname": f"tests/test_k.py::{name}", "group": None, "stats": stats}
        if timing is not None:
            bench["extra_info"] = {"timing": timing[name] if isinstance(timing, dict) else timing}
        benchmarks.append(bench)
    path.write_text(json.dumps({
        "machine_info": {"node": f"host{seed}", "machine": "x86_64", "processor": "x86_64", "system": "Linux",
                         "python_implementation": "CPython", "python_version": "3.12.3",
                         "cpu": {"brand_raw": cpu, "count": 16}, **(extra_machine_info or {})},
        "benchmarks": benchmarks, "version": "5.1.0"}))
    return str(path)


def test_pytest_benchmark_gating(tmp_path, capsys):
    base = bench_file(tmp_path / "base.json", seed=1)
    code, out = gate(capsys, "--pytest-benchmark", base, bench_file(tmp_path / "same.json", seed=2))
    assert code == 0, out.out
    code, out = gate(capsys, "--pytest-benchmark", base, bench_file(tmp_path / "slow.json", scale=1.1, seed=3),
                     "--format", "markdown")
    rows = [line for line in out.out.splitlines() if line.startswith("| tests/")]
    assert code == 1 and len(rows) == 2 and all("time ↓" in r and "**regression**" in r for r in rows)
    code, out = gate(capsys, "--pytest-benchmark", base, bench_file(tmp_path / "nodata.json", save_data=False))
    assert code == 2 and "--benchmark-save-data" in out.out
    code, out = gate(capsys, "--pytest-benchmark", base, bench_file(tmp_path / "other.json", cpu="Intel Xeon", seed=4))
    assert code == 2 and "machine_info.cpu.brand_raw" in out.out
    code, out = gate(capsys, "--pytest-benchmark", base, str(tmp_path / "absent.json"))
    assert code == 2 and "absent.json" in out.out


def test_run_noise_widens_the_interval_of_one_process_rounds(tmp_path, capsys):
    """Rounds that scatter by 0.05% bound one process's median tightly: a 2.9% slower candidate
    passes a 3% gate as "within the threshold" unless the run-to-run noise is allowed for."""
    base = bench_file(tmp_path / "base.json", seed=1, cv=0.0005)
    cand = bench_file(tmp_path / "cand.json", seed=2, cv=0.0005, scale=1.029)
    code, out = gate(capsys, "--pytest-benchmark", base, cand, "--threshold", "3%")
    assert code == 0 and "the whole CI lies within the 3% threshold" in out.out, out.out
    code, out = gate(capsys, "--pytest-benchmark", base, cand, "--threshold", "3%", "--run-noise", "0.3%",
                     "--format", "json")
    report = json.loads(out.out)
    assert code == 1 and report["settings"]["run_noise"] == pytest.approx(0.003)
    assert all(row["verdict"] == "regression" and row["ci_high"] > 1.03 for row in report["rows"])
    code, out = gate(capsys, "--pytest-benchmark", base, bench_file(tmp_path / "same.json", seed=3, cv=0.0005),
                     "--threshold", "3%", "--run-noise", "0.3%")
    assert code == 0 and "run-to-run noise 0.30%" in out.out
    assert parse_run_noise("0") == 0.0 and parse_run_noise("0.3%") == pytest.approx(0.003)
    for bad in ("-1%", "x", "2"):
        with pytest.raises(argparse.ArgumentTypeError, match="--run-noise"):
            parse_run_noise(bad)
    code, out = gate(capsys, "--ab", "--suite", "gpt2", "--case", "124m", "--run-noise", "0.3%")
    assert code == 2 and "--run-noise" in out.err and "not with --ab" in out.err


def test_strict_refuses_to_pass_rounds_too_spread_to_see_the_threshold(tmp_path, capsys):
    """Rounds that scatter by 8% cannot tell an unchanged candidate from one 3% slower: the gate
    passes them and says so; with --strict it cannot judge them (exit 2). Tight rounds still pass."""
    base = bench_file(tmp_path / "base.json", seed=1, cv=0.08)
    cand = bench_file(tmp_path / "cand.json", seed=2, cv=0.08)
    code, out = gate(capsys, "--pytest-benchmark", base, cand, "--threshold", "3%")
    assert code == 0 and "unresolved" in out.out and "2 of 2 row(s) passed without ruling out" in out.out, out.out
    code, out = gate(capsys, "--pytest-benchmark", base, cand, "--threshold", "3%", "--strict", "--format", "json")
    report = json.loads(out.out)
    assert code == 2 and report["settings"]["strict"] is True
    assert all(row["verdict"] == "cannot-judge" and row["unresolved"] for row in report["rows"])
    tight = bench_file(tmp_path / "tight.json", seed=3, cv=0.002)
    code, out = gate(capsys, "--pytest-benchmark", tight, bench_file(tmp_path / "tight2.json", seed=4, cv=0.002),
                     "--threshold", "3%", "--strict")
    assert code == 0 and "unresolved" not in out.out, out.out
    code, out = gate(capsys, "--ab", "--suite", "gpt2", "--case", "124m", "--strict")
    assert code == 2 and "--strict" in out.err and "not with --ab" in out.err


def test_pytest_benchmark_gating_judges_only_benchmarks_timed_alike(tmp_path, capsys):
    """The kernel benchmarks' --kernel-timing: a graph-timed benchmark is not judged against an
    eager one (a file from before the option counts as eager); the rest are judged as usual."""
    base = bench_file(tmp_path / "base.json", seed=1, timing="graph")
    code, out = gate(capsys, "--pytest-benchmark", base, bench_file(tmp_path / "g.json", seed=2, timing="graph"))
    assert code == 0, out.out
    mixed = {"test_layer_norm": "graph", "test_softmax": "eager: the case could not be captured (RuntimeError: x)"}
    code, out = gate(capsys, "--pytest-benchmark", base, bench_file(tmp_path / "m.json", seed=2, timing=mixed),
                     "--format", "json")
    rows = {row["case"]: row for row in json.loads(out.out)["rows"]}
    assert code == 2
    assert rows["tests/test_k.py::test_layer_norm"]["verdict"] == "pass"
    softmax = rows["tests/test_k.py::test_softmax"]
    assert softmax["verdict"] == "cannot-judge" and "graph in the baseline, eager in the candidate" in softmax["reason"]
    code, out = gate(capsys, "--pytest-benchmark", bench_file(tmp_path / "old.json", seed=3), base)
    assert code == 2 and "eager in the baseline, graph in the candidate" in out.out


def kernel_machine_info(gpu="NVIDIA H100 80GB HBM3", torch_version="2.13.0+cu128", kernels=None):
    """What benchmarks/kernels/conftest.py adds to pytest-benchmark's machine_info."""
    return {"gpu": {"name": gpu, "count": 8, "measured_peaks": {"copy_gbps": 3000.0 + 100 * len(gpu)}},
            "torch": {"version": torch_version, "cuda": "12.8", "triton": "3.5.0"}, "dslab_kernels": kernels}


def test_pytest_benchmark_gating_compares_the_gpu_stack(tmp_path, capsys):
    base = bench_file(tmp_path / "base.json", seed=1, extra_machine_info=kernel_machine_info())
    same = bench_file(tmp_path / "same.json", seed=2, extra_machine_info=kernel_machine_info(torch_version="2.13.1"))
    code, out = gate(capsys, "--pytest-benchmark", base, same)
    assert code == 0, out.out  # a patch release of torch, other measured peaks: comparable
    for name, info, field in (
        ("gpu", kernel_machine_info(gpu="NVIDIA H200"), "machine_info.gpu.name"),
        ("torch", kernel_machine_info(torch_version="2.14.0+cu128"), "machine_info.torch.version"),
        ("reference", kernel_machine_info(kernels="torch"), "machine_info.dslab_kernels"),
        ("cpu-only", {}, "machine_info.gpu.name"),
    ):
        code, out = gate(capsys, "--pytest-benchmark", base, bench_file(tmp_path / f"{name}.json", seed=3,
                                                                        extra_machine_info=info))
        assert code == 2 and field in out.out, out.out


def test_injected_sleep_is_caught_and_never_becomes_history(reports, capsys):
    write_report(make_run(1, scale=0.9, sleep_ms=7.0), reports)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports))
    assert code == 1 and "DSLAB_INJECT_STEP_SLEEP_MS=7.0" in out.out  # same fingerprint, slower: caught
    code, out = gate(capsys, "--reports", str(reports), "--update-baseline", run_id(1))
    assert code == 2 and "cannot be a baseline" in out.err
    write_report(make_run(2), reports)
    code, out = gate(capsys, "--suite", SUITE, "--reports", str(reports), "--baseline", "rolling:5")
    assert code == 0 and f"rolling baseline: 1 run(s) {run_id(0)} .. {run_id(0)}" in out.out


def test_pytest_benchmark_gating_notes_a_baseline_from_another_gpu_unit(tmp_path, capsys):
    def info(uuid):
        machine = kernel_machine_info()
        machine["gpu"]["uuid"] = uuid
        return machine

    base = bench_file(tmp_path / "base.json", seed=1, extra_machine_info=info("GPU-aaaa"))
    for name, uuid, noted in (("same", "GPU-aaaa", False), ("other", "GPU-bbbb", True), ("unrecorded", None, False)):
        code, out = gate(capsys, "--pytest-benchmark", base,
                         bench_file(tmp_path / f"{name}.json", seed=2, extra_machine_info=info(uuid)), "--format", "json")
        report = json.loads(out.out)
        assert code == 0, (name, report)  # judged either way: another unit is not another machine kind
        notes = [n for n in report["notes"] if "another GPU unit" in n]
        assert bool(notes) == noted, (name, report["notes"])
        if noted:
            assert "GPU-aaaa" in notes[0] and "GPU-bbbb" in notes[0]
