"""Per-module device time: attribution of device records to module ranges, autograd nodes and the
optimizer (on hand-built records whose answer is known), and the timer on a real model on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from dslab.profilers.device_time import (
    BACKWARD_RANGE, MODULE_RANGE, PHASE_RANGE, Activity, ModuleDeviceTimer, attribute, without_kineto_markers,
)

MAIN, AUTOGRAD = 1, 2


def _range(name, start, end, tid=MAIN, seq=-1, fwd_tid=0, op_id=0):
    return Activity("range", name, tid, start, end, seq, fwd_tid, op_id)


def _kernel(start, end, op_id=0, correlation=0):
    return Activity("work", "k", 0, start, end, op_id=op_id, correlation=correlation)


def test_attribution_forward_backward_optimizer_and_unattributed():
    """A model "" with children "a" and "b"; "a" runs an op with sequence number 7, "b" one with 8.
    Kernels are launched by ops (op ids), by runtime calls (correlation) and from the autograd
    thread inside the nodes of 7, 8 and an AccumulateGrad (no sequence number)."""
    ms = 1_000_000
    acts = [
        _range(MODULE_RANGE, 0, 100 * ms),
        _range(MODULE_RANGE + "a", 1 * ms, 40 * ms),
        _range("aten::mm", 2 * ms, 3 * ms, seq=7, op_id=11),
        _range(MODULE_RANGE + "b", 50 * ms, 90 * ms),
        _range("aten::gelu", 51 * ms, 52 * ms, seq=8, op_id=12),
        _range("aten::sum", 95 * ms, 96 * ms, seq=9, op_id=13),  # inside the root only
        _range("aten::mse", 101 * ms, 102 * ms, seq=10, op_id=14),  # outside every module
        Activity("launch", "cudaLaunchKernel", MAIN, 60 * ms, 60 * ms + 10, correlation=500),
        _range(BACKWARD_RANGE + "GeluBackward0", 200 * ms, 210 * ms, tid=AUTOGRAD, seq=8, fwd_tid=MAIN),
        _range("aten::gelu_backward", 201 * ms, 202 * ms, tid=AUTOGRAD, op_id=21),
        _range(BACKWARD_RANGE + "MmBackward0", 220 * ms, 230 * ms, tid=AUTOGRAD, seq=7, fwd_tid=MAIN),
        _range("aten::mm", 221 * ms, 222 * ms, tid=AUTOGRAD, op_id=22),
        _range(BACKWARD_RANGE + "torch::autograd::AccumulateGrad", 240 * ms, 241 * ms, tid=AUTOGRAD),
        _range("aten::add_", 240 * ms + 10, 240 * ms + 20, tid=AUTOGRAD, op_id=23),
        _range(PHASE_RANGE + "optimizer", 300 * ms, 310 * ms),
        _range("aten::_fused_adamw_", 301 * ms, 302 * ms, op_id=31),
        _kernel(10 * ms, 14 * ms, op_id=11),  # a: 4 ms forward
        _kernel(15 * ms, 17 * ms, op_id=12),  # b: 2 ms forward
        _kernel(20 * ms, 21 * ms, correlation=500),  # launched inside b by a runtime call: 1 ms
        _kernel(30 * ms, 30 * ms + 500_000, op_id=13),  # root only: 0.5 ms
        _kernel(40 * ms, 43 * ms, op_id=14),  # outside: unattributed forward, 3 ms
        _kernel(205 * ms, 213 * ms, op_id=21),  # b backward, 8 ms
        _kernel(212 * ms, 222 * ms, op_id=22),  # a backward, 10 ms (overlaps the previous by 1 ms)
        _kernel(250 * ms, 251 * ms, op_id=23),  # AccumulateGrad: unattributed backward
        _kernel(320 * ms, 327 * ms, op_id=31),  # optimizer, 7 ms
    ]
    r = attribute(acts)
    mods = r["modules"]
    assert mods["a"] == pytest.approx({"forward_ms": 4.0, "backward_ms": 10.0})
    assert mods["b"] == pytest.approx({"forward_ms": 3.0, "backward_ms": 8.0})
    assert mods[""] == pytest.approx({"forward_ms": 7.5, "backward_ms": 18.0})
    assert r["optimizer_ms"] == pytest.approx(7.0)
    assert r["unattributed_ms"] == pytest.approx({"forward": 3.0, "backward": 1.0})
    assert r["work_ms"] == pytest.approx(4 + 2 + 1 + 0.5 + 3 + 8 + 10 + 1 + 7)
    assert r["busy_ms"] == pytest.approx(r["work_ms"] - 1.0)  # the overlapping millisecond once
    assert r["span_ms"] == pytest.approx(317.0)
    assert r["records"] == 9
    assert attribute(acts, serial=True)["busy_ms"] == pytest.approx(r["work_ms"])


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.serial  # compares host-clock timings
def test_timer_on_cpu_charges_each_module_its_work():
    """Two identical blocks read similar times, a block four times as wide reads more, the parents
    hold their children, and the optimizer step is charged apart."""
    torch.manual_seed(0)
    # one intra-op thread: a parallel op waits for its slowest thread, which another process on the
    # host can hold up, so timings with several threads vary far more than the work does
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _timer_on_cpu_checks()
    finally:
        torch.set_num_threads(threads)


def _timer_on_cpu_checks():
    # wide enough that each block's work (milliseconds) dwarfs a cold cache at the first block
    model = nn.Sequential(Block(192), Block(192), Block(768))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(1024, 192)

    def step(timer=None):
        y = model[2](torch.cat([model[1](model[0](x))] * 4, dim=1))
        y.pow(2).mean().backward()
        if timer:
            timer.phase("optimizer")
        optimizer.step()
        if timer:
            timer.phase(None)
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    results = []
    for _ in range(5):
        timer = ModuleDeviceTimer(model)
        timer.start()
        step(timer)
        results.append(timer.stop())
    assert not model._forward_hooks and not model[0]._forward_pre_hooks
    # the median of five runs per figure keeps a busy CI machine's hiccups out
    def median(name, key):
        return sorted(r["modules"][name][key] for r in results)[2]

    for key in ("forward_ms", "backward_ms"):
        a, b, wide = median("0", key), median("1", key), median("2", key)
        assert 0.4 < a / b < 2.5, (key, a, b)
        assert wide > 2 * max(a, b), (key, a, b, wide)  # 4x the work; 2x leaves room for a loaded CI host
        for block in ("0", "1", "2"):  # within each run (medians of separate figures may come from other runs)
            for r in results:
                parts = r["modules"][f"{block}.up"][key] + r["modules"][f"{block}.down"][key]
                assert r["modules"][block][key] >= parts * 0.999, (key, block, r["modules"][block][key], parts)
    r = results[-1]
    assert "" not in r["modules"]  # the Sequential itself is never called here
    blocks = sum(r["modules"][name][k] for name in ("0", "1", "2") for k in ("forward_ms", "backward_ms"))
    assert r["optimizer_ms"] > 0
    assert r["busy_ms"] == pytest.approx(r["work_ms"])
    # the cat, the loss and AccumulateGrad run outside the blocks
    assert r["unattributed_ms"]["forward"] > 0 and r["unattributed_ms"]["backward"] > 0
    total = blocks + r["optimizer_ms"] + sum(r["unattributed_ms"].values())
    assert total == pytest.approx(r["work_ms"], rel=1e-6)


def test_timer_misuse_is_an_error():
    timer = ModuleDeviceTimer(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="before start"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="twice"):
        timer.start()
    timer.stop()


def test_deepspeed_import_paths():
    """A DeepSpeed script's import lines work with the package name swapped, in a fresh process."""
    code = (
        "from dslab.profiling.flops_profiler import get_model_profile, FlopsProfiler\n"
        "from dslab.profiling.flops_profiler.profiler import FlopsProfiler as P2\n"
        "from dslab.profilers import get_model_profile as g2, FlopsProfiler as P3\n"
        "import dslab.profilers.flops as f\n"
        "assert FlopsProfiler is P2 is P3 is f.FlopsProfiler and get_model_profile is g2 is f.get_model_profile\n"
        "import torch\n"
        "flops, macs, params = get_model_profile(torch.nn.Linear(8, 4), input_shape=(3, 8), print_profile=False,"
        " as_string=False)\n"
        "assert (flops, macs, params) == (2 * 3 * 8 * 4, 3 * 8 * 4, 8 * 4 + 4), (flops, macs, params)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_failed_device_timing_is_recorded_and_training_goes_on(monkeypatch, tmp_path):
    """If reading the device activity fails, the step still ends, the hooks are gone, and the
    records and the printed profile say why the module times are the counted step's."""
    from dslab.profilers import device_time
    from dslab.profilers.flops_step import from_config

    def broken(*args, **kwargs):
        raise ValueError("no activity records")

    monkeypatch.setattr(device_time, "attribute", broken)
    model = nn.Sequential(Block(16), Block(16))
    out = tmp_path / "flops.txt"
    driver = from_config({"enabled": True, "profile_step": 0, "output_file": str(out)})
    driver.attach(model)
    for step in range(3):
        driver.on_step_begin(step)
        model(torch.randn(4, 16)).sum().backward()
        driver.on_step_end(step)
        assert not model._forward_hooks and not model[0]._forward_pre_hooks
    records = driver.records()
    device = records["device_time"]
    assert (device["step"], device["error"]) == (1, "ValueError: no activity records")
    assert device["steady_busy_error"] == "ValueError: no activity records"  # step 2's, likewise
    assert "forward_device_ms" not in records["modules"][1]
    assert "device time of step 1: not measured (ValueError: no activity records)" in out.read_text()
    from dashboards import flops_view
    from dslab.report import RunReport, frames
    rows = dict(flops_view.mfu_rows(records))
    assert "failed (ValueError: no activity records)" in rows["module times"]
    report = RunReport(run_id="20261201T000000Z-000000", suite="test", profilers={"flops": {"case": records}})
    assert all(n["timing"] == "events" for n in flops_view.flops_tree(frames.flops_modules(report, strict=True)))
    driver.close()


def test_the_unhooked_step_says_when_another_profiler_hooked_it(tmp_path):
    """Step profile_step + 2 is meant to run as the steady state does; when another profiler's
    hooks are on the model during it (the memory tracer on the same step), the records say so."""
    from dashboards import flops_view
    from dslab.profilers.flops_step import from_config

    model = nn.Sequential(Block(16), Block(16))
    out = tmp_path / "flops.txt"
    driver = from_config({"enabled": True, "profile_step": 0, "output_file": str(out)})
    driver.attach(model)
    for step in range(3):
        driver.on_step_begin(step)
        handle = model[0].register_forward_hook(lambda *args: None) if step == 2 else None
        model(torch.randn(4, 16)).sum().backward()
        driver.on_step_end(step)
        if handle is not None:
            handle.remove()
    device = driver.records()["device_time"]
    assert device["steady_busy_step"] == 2 and device["steady_busy_hooked"] is True
    assert "device busy in step 2 (another profiler's hooks ran on it, so it ran eagerly)" in out.read_text()
    rows = dict(flops_view.mfu_rows(driver.records()))
    assert any(key.startswith("device busy in step 2 (another profiler's hooks: eager)") for key in rows)
    driver.close()


def test_kineto_start_and_stop_markers_are_dropped_from_stderr_and_other_lines_kept(capfd):
    """Kineto writes its markers to file descriptor 2 from C++; the timer's start and stop drop
    them, and anything else written there meanwhile still reaches stderr."""
    with without_kineto_markers():
        os.write(2, b"USDT:2026-11-26 02:04:39 7867:7867 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"WARNING: something a user must see\n")
        os.write(2, b"USDT:2026-11-26 02:04:40 7867:7867 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    assert capfd.readouterr().err == "WARNING: something a user must see\n"
    timer = ModuleDeviceTimer(nn.Linear(4, 4))
    timer.start()
    nn.Linear(4, 4)(torch.ones(2, 4))
    timer.stop()
    assert "profiler_st" not in capfd.readouterr().err
