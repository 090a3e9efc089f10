"""The continuous profiles' stream-mark timer (:mod:`dslab.profilers.event_time`) on a CPU, where
its marks are the host clock: modules that sleep known times in their forward and backward read
those times, nested modules include their submodules, a recompute inside the backward counts as
backward, micro-steps add up, the depth limit hooks what it says, and nothing stays hooked."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from dslab.profilers import flops_continuous
from dslab.profilers.event_time import WAITING, EventModuleTimer
from dslab.profilers.flops_continuous import ContinuousProfiles

SLACK_MS = 40.0  # the host's own time between a mark and the sleep, generous for a loaded CI machine


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class Sleepy(nn.Module):
    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        return self.linear(_Sleep.apply(x, self.forward_s, self.backward_s))


class Model(nn.Module):
    def __init__(self, recompute: bool = False):
        super().__init__()
        self.recompute = recompute
        self.first = Sleepy(0.03, 0.06)
        self.blocks = nn.ModuleList([Sleepy(0.02, 0.05), Sleepy(0.01, 0.08)])
        self.blocks[0].inner = Sleepy(0.0, 0.0)

    def forward(self, x):
        x = self.first(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return x.square().mean()


def _step(model, timer, micro_steps: int = 1, optimizer_s: float = 0.0):
    x = torch.randn(4, 8, requires_grad=True)  # so that the first module's sleep has a backward
    # A full garbage collection inside a timed module (170 ms with a pytest session's objects,
    # depending on what ran before in the process) is host time the timer rightly charges to that
    # module, but not what these tests measure: collect first, then hold collections off.
    gc.collect()
    gc.disable()
    try:
        timer.start()
        for _ in range(micro_steps):
            model(x).backward()
        timer.phase("optimizer")
        time.sleep(optimizer_s)
        timer.phase(None)
        timer.stop()
    finally:
        gc.enable()
    steps = timer.attribution_steps()
    while True:
        try:
            assert next(steps) is not WAITING  # a CPU's marks are done at once
        except StopIteration as done:
            return done.value


def _near(ms: float, expected_s: float) -> bool:
    return expected_s * 1e3 <= ms <= expected_s * 1e3 + SLACK_MS


@pytest.mark.serial  # sleeps read back within SLACK_MS: another worker's load wakes them late
def test_modules_read_their_forward_and_backward_sleeps():
    torch.manual_seed(0)
    model = Model()
    figures = _step(model, EventModuleTimer(model), optimizer_s=0.02)
    modules = figures["modules"]
    for name, (fwd, bwd) in {"first": (0.03, 0.06), "blocks.0": (0.02, 0.05), "blocks.1": (0.01, 0.08)}.items():
        assert _near(modules[name]["forward_ms"], fwd), (name, modules[name])
        assert _near(modules[name]["backward_ms"], bwd), (name, modules[name])
    root = modules[""]
    assert _near(root["forward_ms"], 0.06) and _near(root["backward_ms"], 0.19)
    assert root["forward_ms"] >= sum(modules[n]["forward_ms"] for n in ("first", "blocks.0", "blocks.1"))
    assert _near(figures["optimizer_ms"], 0.02)
    assert figures["span_ms"] >= root["forward_ms"] + root["backward_ms"] + figures["optimizer_ms"]
    assert "blocks" not in modules  # never called: the continuous profile sums it from its layers
    assert figures["busy_ms"] is None and figures["host_lead"] is None and figures["method"] == "events"


@pytest.mark.serial  # sleeps read back within SLACK_MS: another worker's load wakes them late
def test_a_recompute_is_backward_time_and_micro_steps_add_up():
    torch.manual_seed(0)
    model = Model(recompute=True)
    _step(model, EventModuleTimer(model))  # the checkpoint's first call pays one-time costs
    figures = _step(model, EventModuleTimer(model), micro_steps=2)
    modules = figures["modules"]
    # each block's forward ran twice per micro-step (once more inside the backward), counted once
    assert _near(modules["blocks.0"]["forward_ms"], 2 * 0.02) and _near(modules["blocks.1"]["forward_ms"], 2 * 0.01)
    assert _near(modules["blocks.0"]["backward_ms"], 2 * (0.02 + 0.05))
    assert _near(modules["blocks.1"]["backward_ms"], 2 * (0.01 + 0.08))
    assert _near(modules["first"]["backward_ms"], 2 * 0.06)


def test_the_depth_limit_and_the_containers_layers():
    model = Model()
    modules = _step(model, EventModuleTimer(model, max_depth=1))["modules"]
    # depth 1 and the never-called ModuleList's own layers (depth 2), not the deeper ones
    assert set(modules) == {"", "first", "blocks.0", "blocks.1"}
    modules = _step(model, EventModuleTimer(model, max_depth=0))["modules"]
    assert set(modules) == {""}
    modules = _step(model, EventModuleTimer(model))["modules"]
    assert {"first.linear", "blocks.0.linear", "blocks.1.linear"} <= set(modules)
    assert "blocks.0.inner" not in modules  # hooked, never called


def test_nothing_stays_hooked_and_later_steps_move_no_mark():
    torch.manual_seed(0)
    model = Model()
    timer = EventModuleTimer(model)
    first = _step(model, timer)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())
    model(torch.randn(4, 8)).backward()  # an unprofiled step after the stop
    assert timer.figures() == first
    with pytest.raises(RuntimeError, match="stop called before start"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="start called twice"):
        timer.start()
    timer.stop()


def test_the_series_leaves_waiting_work_to_later_steps_and_polls_it_when_asked(monkeypatch):
    """Work that yields WAITING (marks the device has not passed) costs a step no more than the
    poll, and ``wait()`` polls it to its end."""
    monkeypatch.setattr(flops_continuous, "WORK_PER_STEP_MS", 1e6)  # a budget that WAITING must not spend
    series = ContinuousProfiles(every_n_steps=10, first_step=1, names=["", "layers"], module_depth=-1,
                                top_modules=1, cuda=False)
    counted = {"total_flops": 10**12, "peaks": {}}
    polls = []

    def work():
        while len(polls) < 5:
            polls.append(time.perf_counter())
            yield WAITING
        return {"modules": {"": {"forward_ms": 1.0, "backward_ms": 2.0}}, "optimizer_ms": 0.1, "busy_ms": None,
                "span_ms": 4.0, "method": "events", "host_lead": True}

    series.add_later(1, work(), counted)
    started = time.perf_counter()
    series.on_step_begin(2, clean=True)
    assert len(polls) == 1 and time.perf_counter() - started < 0.5
    series.on_step_begin(3, clean=True)
    assert len(polls) == 2 and "modules" not in series.profiles[0]
    profile = series.records(counted)["profiles"][0]
    assert len(polls) == 5 and profile["timer"] == "events" and profile["host_lead"] is True
    assert profile["busy_ms"] is None and profile["forward_ms"] == 1.0


class FakeEvent:
    """A CUDA event stand-in: recorded at a step, passed by the device when ``Device.at`` is past it."""

    def __init__(self, device, step):
        self.device, self.step = device, step

    def query(self):
        return self.device.at > self.step

    def synchronize(self):
        self.device.synchronized.append(self.step)
        self.device.at = max(self.device.at, self.step + 1)

    def elapsed_time(self, other):
        return 10.0 * (other.step - self.step)


class Device:
    def __init__(self):
        self.at, self.step, self.synchronized = 0, 0, []


def test_beginning_a_profile_never_waits_for_the_previous_window(monkeypatch):
    """On CUDA the window of the previous profile is read once the device has passed its marks,
    at a later step's begin, not when the next profile begins (which would take the host's lead
    away); the records read whatever is left, waiting if they must."""
    from dslab.profilers import timers

    device = Device()
    monkeypatch.setattr(timers, "mark", lambda cuda: FakeEvent(device, device.step))
    series = ContinuousProfiles(every_n_steps=3, first_step=1, names=[""], module_depth=0, top_modules=1, cuda=True)
    counted = {"total_flops": 10**12, "peaks": {"measured_tflops": 100.0}}
    timed = {"modules": {"": {"forward_ms": 1.0, "backward_ms": 2.0}}, "optimizer_ms": 0.1, "busy_ms": None,
             "span_ms": 4.0, "method": "events", "host_lead": True}
    for step in range(1, 8):
        device.step = step
        profiled = step == series.next_step
        series.on_step_begin(step, clean=not profiled)
        if profiled:
            series.add(step, timed, counted)
    # profiles at 1, 4 and 7; the host is far ahead: the device has passed no mark
    assert [p["step"] for p in series.profiles] == [1, 4, 7]
    assert device.synchronized == [] and all(p["step_ms"] is None for p in series.profiles)
    device.at = 4  # past the marks of steps 2 and 3: profile 1's window (2 -> 3, 3 -> 4)... not yet 4's mark
    series.on_step_begin(8, clean=True)
    assert series.profiles[0]["step_ms"] is None and device.synchronized == []
    device.at = 5
    series.on_step_begin(9, clean=True)
    assert series.profiles[0]["step_ms"] == 10.0 and series.profiles[0]["window_steps"] == 2
    assert device.synchronized == [4] and series.profiles[1]["step_ms"] is None  # 4's window ends at 7
    records = series.records(counted)
    assert [p["window_steps"] for p in records["profiles"]] == [2, 2, 1]  # the last: 8 -> 9 so far
    assert records["profiles"][0]["achieved_tflops"] == pytest.approx(100.0)
