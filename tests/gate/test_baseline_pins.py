"""Kernel choices through a bench run and a baseline: ``dslab bench --pin-kernels FILE`` replays a
file's choices before any arm is built and every run records its own in its report; a baseline
written from the run keeps them, and ``--pin-kernels <baseline>`` replays them in the next run.

On a CPU the arms run PyTorch's reference kernels, so the Triton choice pinned here is one of
dslab's grouped-GEMM autotuner (a module attribute: it exists once the module is imported), at a
key no launch of these tests uses; the test takes it out of the cache when it is done.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dslab import cli
from dslab.bench.common import World
from dslab.bench.kernel_pins import merge_part_pins, record_pins
from dslab.gate.baseline import kernel_choices_of, read_baseline, trial_set_from_reports, write_baseline
from dslab.kernels import pinning
from dslab.report import Result, RunReport, Trial, list_runs, read_report

pytest.importorskip("triton")

KERNEL = "dslab.kernels.moe.grouped_gemm_triton:_forward_tuned"
KEY = [160, 96, False, "torch.bfloat16", "torch.bfloat16", "torch.bfloat16", "torch.int32"]


def tiny_suite(tmp_path: Path) -> Path:
    """One case, the dslab arm alone, one trial of one step: the pipeline, not a measurement."""
    suite = {"name": "gpt2_pins", "family": "gpt2", "precision": "bf16",
             "engine": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "arms": ["dslab"],
             "scales": {"tiny": {"preset": "gpt2_tiny", "warmup_steps": 0, "steps": 1, "trials": 1,
                                 "cases": [{"name": "a", "seq_len": 16, "micro_batch": 2}]}}}
    path = tmp_path / "suite"
    path.mkdir()
    (path / "suite.json").write_text(json.dumps(suite))
    return path


@pytest.fixture
def pinned_state():
    """What a replay sets in this process (flags, the autotuner's cache), put back afterwards."""
    before = pinning.backend_flags()
    autotuner = pinning.autotuned_kernels()[KERNEL]
    yield autotuner
    autotuner.cache.pop(tuple(KEY), None)
    pinning.set_backend_flags(before)


def _newest_report(reports: Path) -> RunReport:
    return read_report(list_runs(reports, "gpt2_pins")[-1])


def test_bench_replays_pins_records_them_and_a_baseline_keeps_them(tmp_path, capsys, pinned_state):
    suite, reports = tiny_suite(tmp_path), tmp_path / "reports"
    pins = pinning.record_kernel_choices()
    pins["backends"]["cudnn.deterministic"] = True
    chosen = pinning.config_dict(pinned_state.configs[2])
    pins["triton"] = {KERNEL: [{"key": KEY, "config": chosen}]}
    pin_file = tmp_path / "pins.json"
    pin_file.write_text(json.dumps(pins))

    assert cli.main(["bench", str(suite), "--pin-kernels", str(pin_file), "--out", str(reports)]) == 0
    report = _newest_report(reports)
    record = report.profilers["kernel_choices"]["_run"]
    assert record["fingerprint"] == pinning.fingerprint()
    assert record["triton"][KERNEL] == [{"key": KEY, "config": chosen}]  # the pinned choice, in the cache
    assert record["backends"]["cudnn.deterministic"] is True
    assert record["replay"]["source"] == str(pin_file) and record["replay"]["pinned"] == 1
    assert record["replay"]["stale"] == [] and KERNEL not in record["replay"]["misses"]
    assert any(note.startswith(f"kernel choices pinned from {pin_file}: 1 Triton") for note in report.notes)
    assert pinned_state.cache[tuple(KEY)] is pinned_state.configs[2]

    baseline = write_baseline(trial_set_from_reports([report]), reports)
    assert json.loads(baseline.read_text())["kernel_choices"] == record
    assert read_baseline(baseline).kernel_choices == record

    # The next run, in a process whose cache and flags are as they were, pins from the baseline.
    pinned_state.cache.pop(tuple(KEY))
    pinning.set_backend_flags({**pins["backends"], "cudnn.deterministic": False})
    capsys.readouterr()
    assert cli.main(["bench", str(suite), "--pin-kernels", str(baseline), "--out", str(reports)]) == 0
    again = _newest_report(reports)
    assert again.run_id != report.run_id
    replayed = again.profilers["kernel_choices"]["_run"]
    assert replayed["replay"]["source"] == str(baseline) and replayed["replay"]["pinned"] == 1
    assert replayed["triton"][KERNEL] == record["triton"][KERNEL]
    assert replayed["replay"]["backends_changed"]["cudnn.deterministic"] == [False, True]


def test_pins_that_cannot_be_used_stop_the_run_before_it_starts(tmp_path, capsys, pinned_state):
    suite, reports = tiny_suite(tmp_path), tmp_path / "reports"
    elsewhere = pinning.record_kernel_choices()
    elsewhere["fingerprint"]["device_name"] = "NVIDIA H200"
    elsewhere_file = tmp_path / "elsewhere.json"
    elsewhere_file.write_text(json.dumps(elsewhere))
    assert cli.main(["bench", str(suite), "--pin-kernels", str(elsewhere_file), "--out", str(reports)]) == 2
    assert 'fingerprint.device_name is "NVIDIA H200" there' in capsys.readouterr().err

    old = write_baseline(trial_set_from_reports([_finished_run("20261101T000000Z-000001")]), tmp_path)
    assert "kernel_choices" not in json.loads(old.read_text())  # the layout of baselines before them
    assert read_baseline(old).kernel_choices is None
    assert cli.main(["bench", str(suite), "--pin-kernels", str(old), "--out", str(reports)]) == 2
    assert "holds no kernel choices" in capsys.readouterr().err
    assert cli.main(["bench", str(suite), "--pin-kernels", str(tmp_path / "nope.json"), "--out", str(reports)]) == 2
    assert "no kernel-choices file" in capsys.readouterr().err
    assert not reports.exists()  # refused before anything was written


def _finished_run(run_id: str, choices: dict | None = None) -> RunReport:
    report = RunReport(run_id=run_id, suite="gpt2_pins", status="complete")
    report.environment = {"torch": {"version": "2.13.0"}, "cuda": {"gpus": []}, "cpu_count": 2}
    report.config = {"scale": "tiny", "precision": "bf16", "family": "gpt2",
                     "cases": [{"name": "a", "seq_len": 16, "micro_batch": 2}]}
    result = Result(case="a", arm="dslab", trials=[Trial(trial=0, metrics={"samples_per_s": 10.0})])
    result.summarize()
    report.results.append(result)
    if choices is not None:
        report.profilers["kernel_choices"] = {"_run": choices}
    return report


def test_a_pooled_baseline_keeps_the_newest_choices_recorded():
    older = {"triton": {}, "fingerprint": {"device_name": "a"}}
    newer = {"triton": {}, "fingerprint": {"device_name": "b"}}
    runs = [_finished_run("20261101T000000Z-000001", older), _finished_run("20261102T000000Z-000002", newer),
            _finished_run("20261103T000000Z-000003")]
    assert kernel_choices_of(runs[2]) is None
    assert trial_set_from_reports(runs).kernel_choices == newer
    assert trial_set_from_reports(runs[:1]).kernel_choices == older
    assert trial_set_from_reports(runs[2:]).kernel_choices is None


def test_every_process_records_and_the_launching_process_merges_the_parts():
    report = RunReport(run_id="r", suite="s")
    record_pins(report, World(), None)
    run = report.profilers["kernel_choices"]["_run"]
    assert run["replay"] is None and run["fingerprint"] == pinning.fingerprint()
    assert run["backends"] == pinning.backend_flags()

    launched = RunReport(run_id="r", suite="s")
    for part in ("n1", "n2"):
        record_pins(launched, World(part=part), None)
    launched.profilers["kernel_choices"]["_run n2"]["triton"] = {KERNEL: [{"key": KEY, "config": {
        "kwargs": {"BLOCK_M": 64}, "num_warps": 4, "num_stages": 3}}]}
    merge_part_pins(launched)
    merged = launched.profilers["kernel_choices"]["_run"]
    assert merged["triton"][KERNEL][0]["key"] == KEY
    assert merged["fingerprint"] == pinning.fingerprint()


def test_a_launching_run_hands_the_pins_to_its_launches_and_merges_their_records(tmp_path, monkeypatch,
                                                                                 pinned_state):
    from dslab.bench import runner
    from dslab.bench.launcher import merge_part

    pin_file = tmp_path / "pins.json"
    pin_file.write_text(json.dumps(pinning.record_kernel_choices()))
    seen = {}

    def launches(report, suite_file, nprocs, cases_by_n, arms, options, run_path, gpus, progress, write, trials=None):
        """Each launch's processes record their choices in their part, which the launcher merges."""
        seen["options"] = options
        for n in nprocs:
            part = RunReport(run_id=report.run_id, suite=report.suite)
            record_pins(part, World(part=f"n{n}"), None)
            merge_part(report, part)

    monkeypatch.setattr(runner, "run_launches", launches)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    report, _ = runner.run_suite(Path(__file__).resolve().parents[2] / "suites" / "zero", scale="tiny",
                                 out=tmp_path / "r", pin_kernels=pin_file, stream=io.StringIO(),
                                 summary=io.StringIO())
    options = seen["options"]
    assert options[options.index("--pin-kernels") + 1] == str(pin_file.resolve())
    section = report.profilers["kernel_choices"]
    assert set(section) == {"_run", "_run n1", "_run n2"}
    assert section["_run"]["fingerprint"] == pinning.fingerprint()
