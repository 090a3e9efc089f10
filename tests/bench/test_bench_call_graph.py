"""A suite's path through bench (benchmarks/bench_call_graph.py): the runner drives each kind of
suite through the protocol, in the protocol's order, and no kind calls back into the runner."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_call_graph import trace_suite  # noqa: E402


@pytest.mark.parametrize("suite, kind, suite_class, case_class", [
    ("bert_large", "training", "TrainingSuite", "TrainingCase"),
    ("gpt2_inference", "inference", "InferenceSuite", "GenerationCase"),
])
def test_the_runner_drives_each_kind_and_no_kind_calls_it_back(suite, kind, suite_class, case_class):
    calls, handed = trace_suite(str(ROOT / "suites" / suite), ["dslab"])
    assert [pair for pair in calls if pair[1] == "runner"] == []
    assert calls[("runner", kind)] > 0
    protocol = [f"{kind}.{suite_class}.join_world", f"{kind}.{suite_class}.plan", f"{kind}.{suite_class}.open_case",
                f"{kind}.{case_class}.build_arm", f"{kind}.{case_class}.before_trials",
                f"{kind}.{case_class}.run_trial", f"{kind}.{case_class}.trial_line", f"{kind}.{case_class}.finish",
                f"{kind}.{case_class}.close"]
    assert [step for step in handed if step in protocol] == protocol, handed
