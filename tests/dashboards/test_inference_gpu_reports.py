"""The inference suite's GPU reports (``dslab bench suites/gpt2_inference`` on an H200, kept under
``fixtures/inference_reports``: the 124m cases in one run, 1.5b-b1 in another) read back with their
inference sections, and the dashboard draws their Inference tab for every case."""

from __future__ import annotations

from pathlib import Path

import pytest

from dslab.report import read_report

FIXTURES = Path(__file__).parent / "fixtures" / "inference_reports"
RUNS = {"20261126T044232Z-e33ccf": ("124m-b1", "124m-b32"), "20261126T043709Z-2158a5": ("1.5b-b1",)}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_gpu_inference_reports_read_back(run):
    report = read_report(FIXTURES / "gpt2_inference" / run / "run.json")
    assert report.missing == [] and report.warnings == []
    assert sorted(report.inference) == sorted(RUNS[run])
    for case in RUNS[run]:
        arms = report.inference[case]["arms"]
        assert set(arms) == {"dslab", "dslab-int8", "hf", "hf-static"}
        # what the suite README's table says: dslab's token is the fastest, hf-static the best plain arm
        assert arms["dslab"]["per_token_ms_p50"] < arms["hf-static"]["per_token_ms_p50"] < arms["hf"]["per_token_ms_p50"]
        assert report.best_plain[case] == "hf-static"
        assert report.ratios[case]["dslab/hf-static"] > 1.5


def test_the_dashboard_draws_the_gpu_inference_tabs():
    pytest.importorskip("dash")
    from dashboards.app import render
    from dashboards.data import RunStore

    store = RunStore(FIXTURES)
    for run, cases in RUNS.items():
        for case in cases:
            text = str(render(store, f"/run/gpt2_inference/{run}/inference", f"?case={case}"))
            assert f"batch {case.split('-b')[1]}, prompt 32 + 128 new tokens" in text  # the case asked for
            for expected in ("inference-arms", "inference-per-token", "inference-greedy", "hf-static"):
                assert expected in text, (run, case, expected)
            assert "could not be drawn" not in text
