"""``dslab bench suites/zero``: the data-parallel suite starts its processes itself (one torchrun
per process count; gloo processes at the tiny scale on a CPU) and writes one report with every
arm's throughput, weak-scaling efficiency, each rank's memory and every rank's collectives; the
launcher's bookkeeping (a failed launch, merging a part) with stand-in commands; the suite's
config checks and ``--nprocs``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dslab.bench import launcher
from dslab.bench.common import Progress
from dslab.bench.data_parallel import arm_engine_config, process_counts
from dslab.bench.data_parallel_suite import default_nprocs, parse_nprocs
from dslab.bench.runner import run_suite
from dslab.bench.suite import load_suite
from dslab.report import Result, RunReport, Trial, list_runs, read_report
from dslab.report.scaling import best_peer_ratios, peer_comparisons, scaling_points

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "suites" / "zero"


def _deepspeed_importable() -> bool:
    return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True).returncode == 0


@pytest.mark.world_size(2)
def test_tiny_scale_on_cpu_launches_one_and_two_processes_into_one_report(zero_tiny_run):
    """The run of tests/bench/conftest.py's ``zero_tiny_run``: ``dslab bench suites/zero --trials 1
    --steps 2 --warmup 1``, the tiny scale's process counts and arms."""
    proc, out = zero_tiny_run, zero_tiny_run.out
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "launching 1 process(es)" in proc.stderr and "launching 2 process(es)" in proc.stderr
    assert "weak scaling" in proc.stdout  # the summary, on standard output

    (run,) = list_runs(out)
    report = read_report(run)
    assert report.status == "complete" and report.config["kind"] == "data_parallel"
    assert report.config["nprocs"] == [1, 2]
    assert {k: v["exit_status"] for k, v in report.config["launches"].items()} == {"n1": 0, "n2": 0}
    assert (run / "part-n1.json").is_file() and (run / "part-n2.json").is_file()
    arms = load_suite(SUITE)[0].scales["tiny"].arms
    assert report.cases() == ["tiny-n1", "tiny-n2"] and report.arms() == arms
    deepspeed = _deepspeed_importable()
    for case in ("tiny-n1", "tiny-n2"):
        for arm in arms:
            result = report.result(case, arm)
            if arm.startswith("deepspeed") and not deepspeed:
                assert result.status == "skipped" and "deepspeed is not installed" in result.error
                continue
            assert result.status == "ok", (case, arm, result.error)
            assert result.metrics["tokens_per_s"] > 0
    # every rank's memory and collectives from the two-process launch
    two = report.result("tiny-n2", "dslab-zero3").trials[0].metrics
    assert two["peak_rss_bytes_rank0"] > 0 and two["peak_rss_bytes_rank1"] > 0
    comms = report.profilers["comms"]["tiny-n2 dslab-zero3"]
    assert len(comms["per_rank"]) == 2
    ops = {op["op"] for op in comms["ops"]}
    assert {"all_gather", "reduce_scatter"} <= ops
    assert len(report.profilers["memory"]["tiny-n2 dslab-zero2"]["model_states_per_rank"]) == 2
    # efficiency and the peer ratios from the measured throughputs
    points = {(p.arm, p.nprocs): p for p in scaling_points(report)}
    for arm in ("dslab-zero0", "dslab-zero3", "ddp", "fsdp2"):
        one, two_ = points[(arm, 1)], points[(arm, 2)]
        assert two_.efficiency == pytest.approx(two_.tokens_per_s / (2 * one.tokens_per_s))
        assert one.efficiency == pytest.approx(1.0)
    expected = (report.result("tiny-n2", "dslab-zero3").metrics["tokens_per_s"]
                / report.result("tiny-n2", "fsdp2").metrics["tokens_per_s"])
    assert report.ratios["tiny-n2"]["dslab-zero3/fsdp2"] == pytest.approx(expected)
    assert "dslab-zero0/ddp" in report.ratios["tiny-n1"]


def _fake_launch(tmp_path, script: str) -> list[str]:
    path = tmp_path / "fake_launch.py"
    path.write_text(script)
    return [sys.executable, str(path)]


def test_a_failed_launch_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    out = tmp_path / "reports"
    report = RunReport(run_id="20261128T000000Z-abcdef", suite="zero", config={"kind": "data_parallel"})
    run_path = out / "zero" / report.run_id
    # n1 fails after printing; n2 writes its part (one ok result) and exits 0
    script = f"""
import os, sys
from dslab.report import Result, RunReport, Trial, write_report
part = os.environ["DSLAB_BENCH_PART"]
assert os.environ["DSLAB_BENCH_RUN_ID"] == "{report.run_id}" and os.environ["NCCL_NVLS_ENABLE"] == "0"
if part == "n1":
    print("rank 0: something broke", file=sys.stderr)
    sys.exit(3)
r = RunReport(run_id="{report.run_id}", suite="zero", notes=["from n2"])
r.results.append(Result(case="c-n2", arm="ddp", trials=[Trial(trial=0, step_times_ms=[2.0], metrics={{"tokens_per_s": 5.0}})]))
r.results[0].summarize()
r.profilers["comms"] = {{"c-n2 dslab-zero1": {{"ops": []}}}}
write_report(r, {str(out)!r}, "part-n2.json")
"""
    command = _fake_launch(tmp_path, script)
    monkeypatch.setattr(launcher, "launch_command", lambda suite_file, n, options: command)
    writes = []
    lines = []

    class Lines:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    launcher.run_launches(report, SUITE / "suite.json", [1, 2], {1: ["c-n1"], 2: ["c-n2"]}, ["dslab-zero1", "ddp"],
                          [], run_path, gpus=0, progress=Progress(Lines()), write=lambda: writes.append(1))
    assert len(writes) == 2  # the report rewritten after each launch
    assert any("something broke" in line for line in lines)  # the launch's output passed through
    failed = [r for r in report.results if r.case == "c-n1"]
    assert [r.arm for r in failed] == ["dslab-zero1", "ddp"] and all(r.status == "failed" for r in failed)
    assert "exited with status 3" in failed[0].error and "rank 0: something broke" in failed[0].error
    merged = report.result("c-n2", "ddp")
    assert merged.status == "ok" and merged.metrics["tokens_per_s"] == 5.0
    # the arm the part has no result for is recorded as failed only when the launch failed
    assert report.result("c-n2", "dslab-zero1") is None
    assert report.profilers["comms"]["c-n2 dslab-zero1"] == {"ops": []} and "from n2" in report.notes
    assert report.config["launches"] == {"n1": {"nprocs": 1, "exit_status": 3, "part_file": "part-n1.json"},
                                         "n2": {"nprocs": 2, "exit_status": 0, "part_file": "part-n2.json"}}


def test_a_launch_that_dies_in_its_trials_fails_the_arms_it_did_not_finish(tmp_path, monkeypatch):
    """Rank 0 writes an arm's result as the arm starts: a launch that dies in its trials leaves
    ``ok`` results with no trials, or fewer than asked; those are failed, their trials kept."""
    out = tmp_path / "reports"
    report = RunReport(run_id="20261128T000000Z-abcdef", suite="zero", config={"kind": "data_parallel"})
    run_path = out / "zero" / report.run_id
    script = f"""
import os, sys
from dslab.report import Result, RunReport, Trial, write_report
r = RunReport(run_id="{report.run_id}", suite="zero")
trial = Trial(trial=0, step_times_ms=[2.0], metrics={{"tokens_per_s": 5.0}})
r.results = [Result(case="c", arm="ddp", trials=[trial, Trial(trial=1, step_times_ms=[2.0], metrics={{"tokens_per_s": 5.0}})]),
             Result(case="c", arm="fsdp2", trials=[trial]), Result(case="c", arm="dslab-zero1")]
for result in r.results:
    result.summarize()
write_report(r, {str(out)!r}, "part-" + os.environ["DSLAB_BENCH_PART"] + ".json")
print("Segmentation fault", file=sys.stderr)
sys.exit(int(os.environ["DSLAB_BENCH_PART"] == "n2") * 139)
"""
    command = _fake_launch(tmp_path, script)
    monkeypatch.setattr(launcher, "launch_command", lambda suite_file, n, options: command)
    arms = ["ddp", "fsdp2", "dslab-zero1"]
    launcher.run_launches(report, SUITE / "suite.json", [2], {2: ["c"]}, arms, [], run_path, gpus=0,
                          progress=Progress(sys.stderr, enabled=False), write=lambda: None, trials=2)
    done, half, unstarted = (report.result("c", arm) for arm in arms)
    assert done.status == "ok" and done.error is None and len(done.trials) == 2
    assert half.status == "failed" and len(half.trials) == 1
    assert half.error == "the launch of 2 process(es) exited with status 139 after 1 of 2 trial(s) of this arm: " \
                         "Segmentation fault"
    assert unstarted.status == "failed" and "after 0 of 2 trial(s)" in unstarted.error
    assert report.finished_status() == "partial"
    # every arm finished and the launch then failed (a hang at exit, killed): the results stand
    report = RunReport(run_id="20261128T000000Z-abcdef", suite="zero", config={"kind": "data_parallel"})
    launcher.run_launches(report, SUITE / "suite.json", [2], {2: ["c"]}, ["ddp"], [], run_path, gpus=0,
                          progress=Progress(sys.stderr, enabled=False), write=lambda: None, trials=2)
    assert report.result("c", "ddp").status == "ok" and report.finished_status() == "complete"
    assert "n2: the launch of 2 process(es) exited with status 139 after its arms had run their trials: " \
           "Segmentation fault" in report.notes


def test_more_processes_than_gpus_are_skipped_with_the_reason(tmp_path):
    report = RunReport(run_id="20261128T000000Z-abcdef", suite="zero")
    launcher.run_launches(report, SUITE / "suite.json", [8], {8: ["c-n8"]}, ["dslab-zero1"], [], tmp_path,
                          gpus=4, progress=Progress(sys.stderr, enabled=False), write=lambda: None)
    (result,) = report.results
    assert result.status == "skipped" and result.error == "8 process(es) need 8 GPUs; this machine has 4"


def test_process_counts_and_the_nprocs_option():
    assert default_nprocs(4) == [1, 2, 4] and default_nprocs(3) == [1, 2, 3] and default_nprocs(8) == [1, 2, 4, 8]
    assert default_nprocs(0) == [1, 2]
    assert parse_nprocs("4, 1,2,2") == [1, 2, 4]
    for bad, words in (("0,2", ">= 1"), ("1,x", "'x' is not a process count"), ("", "at least one")):
        with pytest.raises(ValueError, match=words):
            parse_nprocs(bad)
    suite, _ = load_suite(SUITE)
    assert process_counts(suite, "tiny", None) == [1, 2]
    assert process_counts(suite, "tiny", [4, 1]) == [1, 4]


def test_nprocs_is_refused_for_a_suite_that_does_not_launch(tmp_path):
    with pytest.raises(ValueError, match="only a data-parallel suite starts processes"):
        run_suite(REPO / "suites" / "gpt2", scale="tiny", nprocs=[1, 2], out=tmp_path)


def test_arm_engine_configs():
    engine = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"reduce_bucket_size": 1000}}
    three = arm_engine_config(engine, "dslab-zero3-offload")
    assert three["zero_optimization"] == {"reduce_bucket_size": 1000, "stage": 3,
                                          "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert arm_engine_config(engine, "dslab-zero1")["zero_optimization"] == {"reduce_bucket_size": 1000, "stage": 1}
    assert engine["zero_optimization"] == {"reduce_bucket_size": 1000}  # the suite's config is left alone
    with pytest.raises(ValueError, match="not a dslab arm"):
        arm_engine_config(engine, "ddp")


@pytest.mark.parametrize("change, words", [
    (lambda s: s["engine"].setdefault("zero_optimization", {}).update(stage=2), "set by each arm"),
    (lambda s: s.update(arms=["ddp", "fsdp2"]), "must include a dslab arm"),
    (lambda s: s.update(arms=["dslab-zero1", "torch"]), "arms"),
    (lambda s: s["scales"]["tiny"].update(nprocs=[0]), "process counts must be whole numbers >= 1"),
    (lambda s: s["engine"].update(bf16={"enabled": True}), "engine.bf16"),
])
def test_bad_suite_configs_name_the_problem(tmp_path, change, words):
    data = json.loads((SUITE / "suite.json").read_text())
    change(data)
    (tmp_path / "suite.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=words):
        load_suite(tmp_path)


def _report(rows):
    report = RunReport(run_id="r", suite="zero", config={"kind": "data_parallel", "cases": [
        {"name": f"m-n{n}", "base_case": "m", "nprocs": n} for n in (1, 4)]})
    for case, arm, tokens, peak, status in rows:
        result = Result(case=case, arm=arm, status=status)
        if status == "ok":
            result.trials = [Trial(trial=0, metrics={"tokens_per_s": tokens, "peak_memory_bytes": peak})]
            result.summarize()
        report.results.append(result)
    return report


def test_scaling_points_and_peer_ratios():
    report = _report([
        ("m-n1", "dslab-zero3", 100.0, 10.0, "ok"), ("m-n4", "dslab-zero3", 360.0, 8.0, "ok"),
        ("m-n1", "fsdp2", 50.0, 12.0, "ok"), ("m-n4", "fsdp2", 150.0, 10.0, "ok"),
        ("m-n4", "deepspeed-zero3", 120.0, 9.0, "ok"), ("m-n4", "fsdp2-compile", 0.0, 0.0, "failed"),
    ])
    points = {(p.arm, p.nprocs): p for p in scaling_points(report)}
    assert points[("dslab-zero3", 4)].efficiency == pytest.approx(0.9)
    assert points[("fsdp2", 4)].efficiency == pytest.approx(0.75)
    assert points[("deepspeed-zero3", 4)].efficiency is None  # never ran on one process
    assert points[("fsdp2-compile", 4)].tokens_per_s is None
    pairs = {(c.case, c.peer): (c.speedup, c.memory_ratio) for c in peer_comparisons(report)}
    assert pairs[("m-n4", "fsdp2")] == pytest.approx((2.4, 0.8))
    assert pairs[("m-n4", "deepspeed-zero3")] == pytest.approx((3.0, 8 / 9))
    assert ("m-n4", "fsdp2-compile") not in pairs
    ratios = best_peer_ratios(report)
    assert ratios["m-n4"]["dslab-zero3/best_peer"] == pytest.approx(2.4)  # against the fastest peer


def test_host_time_per_step_is_the_median_of_the_host_times():
    from dslab.bench.measure import trial_metrics

    trial = {"step_times_ms": [10.0, 12.0, 11.0], "host_times_ms": [3.0, 9.0, 4.0], "peak_memory_bytes": None,
             "final_loss": 1.0}
    metrics = trial_metrics(trial, samples=8, tokens=800, flops=None, peaks={}, datasheet_bf16_tflops=None)
    assert metrics["host_step_ms"] == 4.0 and metrics["step_time_ms"] == 11.0
    del trial["host_times_ms"]  # a CPU trial: the host is the device
    assert "host_step_ms" not in trial_metrics(trial, 8, 800, None, {}, None)
