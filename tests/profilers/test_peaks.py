"""The allocator peaks shared by the memory tracer (a reset every step) and a benchmark trial (a
reset at its begin): on a fake allocator on any machine, and on a GPU with the real tracer inside
``run_trial``, a trial's peak is the largest over all of its steps, not its last step's."""

from __future__ import annotations

import pytest
import torch

from dslab.profilers import peaks


class FakeAllocator:
    """torch's per-device peak counters: allocate/free move the current bytes, reset sets the
    peaks to the current."""

    def __init__(self):
        self.current = 0
        self.reserved = 0
        self.peak = [0, 0]

    def alloc(self, n):
        self.current += n
        self.reserved = max(self.reserved, self.current)
        self.peak = [max(self.peak[0], self.current), max(self.peak[1], self.reserved)]

    def free(self, n):
        self.current -= n

    def read(self, index):
        return tuple(self.peak)

    def reset(self, index):
        self.peak = [self.current, self.reserved]


@pytest.fixture
def fake(monkeypatch):
    allocator = FakeAllocator()
    monkeypatch.setattr(peaks, "_read", allocator.read)
    monkeypatch.setattr(peaks, "_reset", allocator.reset)
    monkeypatch.setattr(peaks, "_kept", {})
    return allocator


def test_a_trial_keeps_its_largest_step_across_step_resets(fake):
    device = torch.device("cuda", 0)
    fake.alloc(100)  # weights
    fake.alloc(900)  # something before the trial, freed before it begins
    fake.free(900)
    peaks.reset_peak(device)
    step_peaks = []
    for spike in (500, 50, 20):  # the first step is the largest
        peaks.reset_step_peak(device)
        fake.alloc(spike)
        fake.free(spike)
        step_peaks.append(fake.read(0)[0])  # what the tracer reads at the step's end
    assert step_peaks == [600, 150, 120]
    assert peaks.peak_allocated(device) == 600  # not the last step's 120, not the 1000 before the trial
    assert peaks.peak_reserved(device) == 1000  # reserved memory stays reserved
    peaks.reset_peak(device)
    assert peaks.peak_allocated(device) == 100
    other = torch.device("cuda", 1)
    peaks.reset_step_peak(other)
    assert peaks._kept[1] == [100, 1000] and peaks._kept.get(0) is None  # per device


@pytest.mark.gpu
def test_run_trial_peak_spans_the_tracer_steps():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dslab.bench.measure import run_trial
    from dslab.profilers.memory import MemoryTracer

    device = torch.device("cuda")
    model = torch.nn.Linear(256, 256).to(device)
    tracer = MemoryTracer(profile_step=10**9)
    tracer.attach(model)
    spike = 256 << 20
    calls = []

    def step():
        n = len(calls)
        tracer.on_step_begin(n)
        if n == 0:
            torch.empty(spike, dtype=torch.uint8, device=device)  # freed at once
        loss = model(torch.randn(8, 256, device=device)).square().mean()
        tracer.on_step_end(n)
        calls.append(n)
        return loss

    trial = run_trial(step, device, 0, 4)
    steps = {s["step"]: s["peak_allocated"] for s in tracer.records()["steps"]}
    tracer.close()
    assert steps[0] >= spike > 2 * steps[3]  # the tracer still sees each step's own peak
    assert trial["peak_memory_bytes"] >= steps[0] >= spike
