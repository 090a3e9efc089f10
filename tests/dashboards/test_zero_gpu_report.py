"""The 4-GPU run of ``suites/zero`` kept under ``fixtures/zero_reports``: it reads as a
data-parallel report, its scaling figures follow from its results, and the figures its README
states are the report's."""

from pathlib import Path

import pytest

from dslab.report import list_runs, read_report
from dslab.report.scaling import peer_comparisons, scaling_points

FIXTURES = Path(__file__).parent / "fixtures" / "zero_reports"


@pytest.fixture(scope="module")
def report():
    (run,) = list_runs(FIXTURES, "zero")
    return read_report(run)


def test_the_run_is_a_complete_four_gpu_data_parallel_report(report):
    assert report.status == "complete" and not report.missing
    assert report.config["kind"] == "data_parallel" and report.config["nprocs"] == [1, 4]
    assert report.environment["cuda"]["device_count"] == 4
    assert report.cases() == ["355m-n1", "355m-n4"]
    assert all(r.status == "ok" for r in report.results)
    # every rank's collectives and model states of the 4-process launch
    assert len(report.profilers["comms"]["355m-n4 dslab-zero2"]["per_rank"]) == 4
    assert len(report.profilers["memory"]["355m-n4 dslab-zero2"]["model_states_per_rank"]) == 4


def test_efficiency_and_peer_ratios_follow_from_the_results(report):
    points = {(p.arm, p.nprocs): p for p in scaling_points(report)}
    for arm in report.arms():
        one, four = points[(arm, 1)], points[(arm, 4)]
        assert four.efficiency == pytest.approx(four.tokens_per_s / (4 * one.tokens_per_s))
        metrics = report.result("355m-n4", arm).metrics
        peaks = [v for k, v in metrics.items() if k.startswith("peak_memory_bytes_rank")]
        # the largest rank's (with what CUDA-graph pools hold beyond the allocator's peak)
        assert len(peaks) == 4 and four.peak_memory_bytes == metrics["peak_memory_bytes"] >= max(peaks)
    stated = {"dslab-zero0": 0.80, "dslab-zero1": 0.91, "dslab-zero2": 0.92, "ddp": 0.77, "fsdp2": 0.79}
    for arm, efficiency in stated.items():  # the fixture README's table
        assert round(points[(arm, 4)].efficiency, 2) == efficiency
    pairs = {(c.arm, c.peer): c for c in peer_comparisons(report) if c.case == "355m-n4"}
    assert round(pairs[("dslab-zero0", "ddp")].speedup, 2) == 1.84
    assert round(pairs[("dslab-zero2", "deepspeed-zero2")].speedup, 2) == 3.79
    assert report.ratios["355m-n4"]["dslab-zero0/ddp"] == pytest.approx(pairs[("dslab-zero0", "ddp")].speedup)
