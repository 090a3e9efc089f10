"""The Flops page on a real GPU run (``dslab bench suites/bert_large``, five arms, 3 trials, one
H100, kept under ``fixtures/gpu_reports``): the model's achieved TFLOP/s is the steady state's,
within 10% of the run's own figure, and the 24 identical encoder layers read device times within
10% of their median. The run before device timing (kept beside it) read 58.9 TFLOP/s for a model
running at 325, and 5.0 ms and 10.2 ms for layers of the same shape."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from dashboards import flops_view
from dslab.report import frames, read_report

FIXTURES = Path(__file__).parent / "fixtures" / "gpu_reports" / "bert_large"
RUN = FIXTURES / "20261125T002038Z-fe42e8" / "run.json"
BEFORE = FIXTURES / "20261123T195220Z-eb4df9" / "run.json"
CASES = ("seq128", "seq512")


@pytest.fixture(scope="module")
def report():
    return read_report(RUN)


@pytest.mark.parametrize("case", CASES)
def test_model_tflops_on_the_page_is_the_runs(report, case):
    flops = report.profilers["flops"][case]
    run = report.result(case, "dslab").metrics["model_tflops"]
    page = flops_view.model_tflops(flops)
    assert page == pytest.approx(run, rel=0.10)
    rows = dict(flops_view.mfu_rows(flops))
    assert rows["achieved TFLOP/s (steady state)"] == format(page, ".4g")
    assert "device time of the kernels" in rows["module times"]
    # the counted step's own figure stays visible, labelled, and is far from the run's
    assert float(rows["counted step: TFLOP/s (with counting)"]) < 0.5 * run


@pytest.mark.parametrize("case", CASES)
def test_identical_layers_read_the_same_time(report, case):
    nodes = {n["name"]: n for n in flops_view.flops_tree(frames.flops_modules(report, case=case, strict=True))}
    layers = [nodes[f"layers.{i}"] for i in range(24)]
    assert all(n["timing"] == "device" for n in layers)
    times = [n["latency_ms"] for n in layers]
    middle = statistics.median(times)
    assert max(times) <= 1.10 * middle and min(times) >= 0.90 * middle, times
    # and every layer's achieved rate is the same story
    rates = [n["tflops"] for n in layers]
    assert max(rates) <= 1.10 * statistics.median(rates) and min(rates) >= 0.90 * statistics.median(rates)


def test_the_report_before_device_timing_shows_what_it_measured():
    """The older report has no device times: the page falls back to the counted step's spans and
    says so, instead of passing them off as the run's speed."""
    before = read_report(BEFORE)
    flops = before.profilers["flops"]["seq128"]
    rows = dict(flops_view.mfu_rows(flops))
    assert rows["steady state"].startswith("not in this report")
    assert rows["module times"] == "CUDA-event spans on the counted step (host gaps included)"
    nodes = {n["name"]: n for n in flops_view.flops_tree(frames.flops_modules(before, case="seq128", strict=True))}
    spans = [nodes[f"layers.{i}"]["latency_ms"] for i in range(24)]
    assert max(spans) > 1.5 * min(spans)  # why the device timing exists
    assert all(nodes[f"layers.{i}"]["timing"] == "events" for i in range(24))


@pytest.mark.parametrize("case", CASES)
def test_the_step_breakdown_accounts_for_the_steady_step(report, case):
    """Submodules, the model's own ops, the optimizer, work outside the model and the rest add up
    to the steady-state step; on BERT the rest (the device idle around the sparse-MLM sync, or
    waiting on the host) is a tenth of the step, and the page shows the table."""
    flops = report.profilers["flops"][case]
    modules = frames.flops_modules(report, case=case, strict=True)
    rows = {r["part"]: r for r in flops_view.step_breakdown(flops, modules)}
    step = flops["steady_state"]["step_ms"]
    assert sum(r["device_ms"] for r in rows.values()) == pytest.approx(step, rel=0.01)
    layers = next(m for m in flops["modules"] if m["name"] == "layers")
    top = rows["top-level submodules (forward + backward)"]["device_ms"]
    assert top >= layers["forward_device_ms"] + layers["backward_device_ms"]
    assert rows["optimizer step"]["device_ms"] == pytest.approx(flops["device_time"]["optimizer_ms"])
    rest = rows["rest of the steady-state step (device idle or overlapping work)"]["share_of_step_pct"]
    assert 5 < rest < 20

    from dashboards.app import render
    from dashboards.data import RunStore

    run = f"bert_large/{RUN.parent.name}"
    text = str(render(RunStore(FIXTURES.parent), f"/run/{run}/flops", f"?case={case}"))
    assert "flops-breakdown" in text and "flops-breakdown-empty" not in text
    old = str(render(RunStore(FIXTURES.parent), f"/run/bert_large/{BEFORE.parent.name}/flops", f"?case={case}"))
    assert "flops-breakdown-empty" in old and "could not be drawn" not in old
