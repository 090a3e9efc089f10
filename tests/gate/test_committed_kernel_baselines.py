"""The kernel-gate baselines committed in ``benchmarks/kernels/baselines/``: each is one that
``dslab gate --pytest-benchmark`` and ``--kernel-pins`` accept (per-round timings saved, every case
of dslab's timed from a CUDA-graph replay, kernel choices with their fingerprint recorded), and the gate's
verdicts on it move as they should: the file against itself passes every row, and the same
file with one dslab case's rounds 3% slower is called a regression on that row alone."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dslab.gate.pytest_benchmark import benchmark_timings, gate_pytest_benchmark, timing_methods
from dslab.gate.verdict import PASS, REGRESSION, GateSettings
from dslab.kernels.pinning import load_kernel_choices

BASELINES = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "baselines").glob("*.json"))
ROUNDS = 10  # the committed baselines' KERNEL_ROUNDS


def test_the_baselines_folder_is_not_empty():
    assert len(BASELINES) >= 8, [p.name for p in BASELINES]


@pytest.fixture(params=BASELINES, ids=[p.stem for p in BASELINES])
def baseline(request) -> Path:
    return request.param


def test_a_baseline_has_rounds_graph_timing_and_pins(baseline):
    data = json.loads(baseline.read_text())
    assert data["machine_info"]["gpu"]["name"] == "NVIDIA H200"
    timings = benchmark_timings(data)
    assert timings, f"{baseline.name}: no benchmarks"
    for key, rounds in timings.items():
        assert rounds is not None and len(rounds) == ROUNDS, (baseline.name, key)
        assert all(r > 0 for r in rounds), (baseline.name, key)
    arms = {b["extra_info"]["arm"] for b in data["benchmarks"]}
    assert arms == {"dslab", "torch"}, (baseline.name, arms)
    methods = timing_methods(data)
    for bench in data["benchmarks"]:  # PyTorch's AdamW without capturable=True is timed eager, saying why
        if bench["extra_info"]["arm"] == "dslab":
            assert methods[(bench["fullname"], bench["group"])] == "graph", (baseline.name, bench["name"])
    choices = load_kernel_choices(baseline)
    assert choices["fingerprint"]["torch"], baseline.name


def test_the_gate_passes_a_baseline_against_itself_and_catches_three_percent(baseline, tmp_path):
    settings = GateSettings(threshold=0.03, run_noise=0.003)
    same = gate_pytest_benchmark(baseline, baseline, settings)
    assert not same.problems and same.exit_code == 0
    assert {row.verdict for row in same.rows} == {PASS}

    data = json.loads(baseline.read_text())
    slowed = copy.deepcopy(data)
    target = next(b for b in slowed["benchmarks"] if b["extra_info"]["arm"] == "dslab")
    target["stats"]["data"] = [t * 1.03 for t in target["stats"]["data"]]
    path = tmp_path / "slowed.json"
    path.write_text(json.dumps(slowed))
    report = gate_pytest_benchmark(baseline, path, settings)
    flagged = [row.case for row in report.rows if row.verdict == REGRESSION]
    assert flagged == [target["fullname"]], (baseline.name, flagged)
    assert report.exit_code == 1
