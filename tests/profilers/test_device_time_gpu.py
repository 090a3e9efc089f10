"""On a GPU: a real BERT-large run's flops profile tells the steady state's truth. The Flops page's
model TFLOP/s is within 10% of the run's own figure, the 24 identical encoder layers read device
times within 10% of their median, and the timed step's device time is close to the step."""

from __future__ import annotations

import statistics

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dslab.bench.runner import run_suite
    from dslab.report import read_report

    out = tmp_path_factory.mktemp("reports")
    _, path = run_suite("suites/bert_large", scale="full", arms=["dslab"], cases=["seq128"], trials=2,
                        steps=10, warmup_steps=10, out=out)
    return read_report(path)


def test_flops_page_shows_the_steady_state(bert_run):
    from dashboards import flops_view

    flops = bert_run.profilers["flops"]["seq128"]
    result = bert_run.result("seq128", "dslab")
    page = flops_view.model_tflops(flops)
    run = result.metrics["model_tflops"]
    assert page == pytest.approx(run, rel=0.10), (page, run)
    rows = dict(flops_view.mfu_rows(flops))
    assert rows["achieved TFLOP/s (steady state)"] == format(page, ".4g")


def test_identical_layers_read_the_same_device_time(bert_run):
    from dashboards import flops_view
    from dslab.report import frames

    nodes = {n["name"]: n for n in flops_view.flops_tree(frames.flops_modules(bert_run, case="seq128", strict=True))}
    layers = [nodes[f"layers.{i}"] for i in range(24)]
    assert all(n["timing"] == "device" for n in layers)
    times = [n["latency_ms"] for n in layers]
    middle = statistics.median(times)
    assert max(times) <= 1.10 * middle and min(times) >= 0.90 * middle, times


def test_timed_step_device_time_against_the_steady_step(bert_run):
    """The module-timed step (eager: hooks) ran the same kernels as a step without hooks (CUDA
    graphs replayed): their busy times agree; and the modules, the optimizer and the unattributed
    rest add up to the timed step's busy time."""
    flops = bert_run.profilers["flops"]["seq128"]
    device, steady = flops["device_time"], flops["steady_state"]
    root = next(m for m in flops["modules"] if m["name"] == "")
    model_ms = root["forward_device_ms"] + root["backward_device_ms"]
    top_ms = sum(m["forward_device_ms"] + m["backward_device_ms"] for m in flops["modules"] if m["depth"] == 1)
    print(f"top-level modules {top_ms:.2f} ms, model {model_ms:.2f} ms, optimizer {device['optimizer_ms']:.2f} ms, "
          f"busy {device['busy_ms']:.2f} ms (no hooks: {device['steady_busy_ms']:.2f} ms), "
          f"steady step {steady['step_ms']:.2f} ms")
    assert device["busy_ms"] == pytest.approx(device["steady_busy_ms"], rel=0.05)
    parts = model_ms + device["optimizer_ms"] + sum(device["unattributed_ms"].values())
    assert parts == pytest.approx(device["work_ms"], rel=1e-6)
    assert top_ms <= model_ms <= device["busy_ms"] <= steady["step_ms"] * 1.02
