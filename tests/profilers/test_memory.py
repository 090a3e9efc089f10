"""Memory tracer (dslab.profilers.memory): its hooks called by hand around a real forward,
backward and optimizer step on small models."""

import json
import pickle
import random

import pytest
import torch
import torch.nn as nn

from dslab.config_base import parse_section
from dslab.profilers.memory import (CPU_NOTE, MemoryTracer, MemoryTracerConfig, SavedTensorTracker,
                                    model_state_bytes)

F32 = 4


def run_step(tracer, model, optimizer, x, step, optimizer_step=True, forward=None):
    """One micro-step with the engine's hook order; returns the loss."""
    tracer.on_step_begin(step)
    tracer.on_forward_begin()
    loss = (forward or model)(x).float().pow(2).mean()
    tracer.on_forward_end()
    tracer.on_backward_begin()
    loss.backward()
    tracer.on_backward_end()
    if optimizer_step:
        tracer.on_optimizer_step_begin()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracer.on_optimizer_step_end()
    tracer.on_step_end(step)
    return loss


def random_dims(seed):
    rng = random.Random(seed)
    return rng.randint(2, 9), rng.randint(3, 40), rng.randint(3, 40), rng.randint(2, 20)


# --- config -----------------------------------------------------------------------------------

def test_config_defaults_validation_and_from_config():
    cfg = MemoryTracerConfig()
    assert (cfg.enabled, cfg.profile_step, cfg.snapshot) == (False, 1, False)
    assert MemoryTracer.from_config(cfg) is None
    on = parse_section(MemoryTracerConfig, {"enabled": True, "profile_step": 3, "snapshot": True},
                       "memory_tracer")
    tracer = MemoryTracer.from_config(on, output_dir="/tmp/x")
    assert (tracer.profile_step, tracer.snapshot, str(tracer.output_dir)) == (3, True, "/tmp/x")
    with pytest.raises(ValueError, match="memory_tracer.profile_step"):
        parse_section(MemoryTracerConfig, {"profile_step": -1}, "memory_tracer")
    with pytest.raises(ValueError, match="'memory_tracer.snapshot'"):
        parse_section(MemoryTracerConfig, {"snapshott": True}, "memory_tracer")
    with pytest.raises(ValueError, match="profile_step"):
        MemoryTracer(profile_step=-2)


# --- activations ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_activation_bytes_linear_relu_stack(seed, input_requires_grad):
    """Linear saves its input, ReLU its output; the second Linear's input is ReLU's output, so it
    is charged nothing; saved transposed weights are parameter views and excluded."""
    torch.manual_seed(seed)
    batch, d_in, d_hidden, d_out = random_dims(seed)
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = MemoryTracer(profile_step=0)
    tracer.attach(model, optimizer)
    x = torch.randn(batch, d_in, requires_grad=input_requires_grad)
    run_step(tracer, model, optimizer, x, 0)
    rows = {row["module"]: row for row in tracer.records()["activations"]}
    assert set(rows) == {"0", "1", "2", "(outside modules)"}
    # the loss's pow(2) runs outside the model and saves its input, the model's output
    assert rows["(outside modules)"]["bytes"] == batch * d_out * F32
    assert (rows["0"]["bytes"], rows["0"]["tensors"]) == (batch * d_in * F32, 1)
    assert (rows["1"]["bytes"], rows["1"]["tensors"]) == (batch * d_hidden * F32, 1)
    assert (rows["2"]["bytes"], rows["2"]["tensors"], rows["2"]["storages"]) == (0, 1, 0)
    assert rows["2"]["shared_bytes"] == batch * d_hidden * F32
    assert tracer.records()["activation_bytes"] == batch * (d_in + d_hidden + d_out) * F32
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


class SplitProduct(nn.Module):
    """z = lin(x); returns z[:, :k] * z[:, k:] (mul saves two views of z's one storage) and
    exp(z), which saves its output and is thrown away (freed before forward ends)."""

    def __init__(self, d_in, k):
        super().__init__()
        self.k = k
        self.lin = nn.Linear(d_in, 2 * k)

    def forward(self, x):
        z = self.lin(x)
        torch.exp(z)
        return z[:, : self.k] * z[:, self.k:]


def test_activation_dedupe_within_module_and_dead_storages():
    torch.manual_seed(2)
    batch, d_in, k, _ = random_dims(2)
    model = nn.Sequential(SplitProduct(d_in, k))
    tracker = SavedTensorTracker(model)
    tracker.start()
    out = model(torch.randn(batch, d_in))
    tracker.stop()
    rows = {row["module"]: row for row in tracker.results()}
    assert rows["0.lin"]["bytes"] == batch * d_in * F32
    # two saved views of z for mul, one dead exp output: one live storage of z
    assert rows["0"]["tensors"] == 3
    assert (rows["0"]["bytes"], rows["0"]["storages"]) == (batch * 2 * k * F32, 1)
    out.sum().backward()  # the identity pack/unpack hooks leave backward intact


def test_activation_outside_modules_and_only_profiled_step():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = MemoryTracer(profile_step=1)
    tracer.attach(model, optimizer)
    x = torch.randn(4, 6)

    def forward(inp):
        return torch.sigmoid(model(inp))  # sigmoid runs outside every module: saves its output

    run_step(tracer, model, optimizer, x, 0, forward=forward)
    assert tracer.records()["activations"] == []
    run_step(tracer, model, optimizer, x, 1, forward=forward)
    rows = {row["module"]: row["bytes"] for row in tracer.records()["activations"]}
    assert rows == {"0": 4 * 6 * F32, "(outside modules)": 4 * 5 * F32}
    run_step(tracer, model, optimizer, 2 * torch.randn(9, 6), 2, forward=forward)
    assert {r["module"]: r["bytes"] for r in tracer.records()["activations"]} == rows


# --- model states -----------------------------------------------------------------------------

def linear_stack(seed):
    torch.manual_seed(seed)
    _, d_in, d_hidden, d_out = random_dims(seed)
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.Tanh(), nn.Linear(d_hidden, d_out))
    n = d_in * d_hidden + d_hidden + d_hidden * d_out + d_out
    return model, n, d_in


@pytest.mark.parametrize("seed", [4, 5])
def test_model_states_adam_fp32_against_formula(seed):
    model, n, d_in = linear_stack(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tracer = MemoryTracer(profile_step=0)
    tracer.attach(model, optimizer)
    run_step(tracer, model, optimizer, torch.randn(3, d_in), 0)
    states = tracer.records()["model_states"]
    n_tensors = 4
    assert states["num_params"] == n
    assert states["params"] == 4 * n
    assert states["grads"] == 4 * n  # as the step consumed them, though zero_grad freed them
    # exp_avg + exp_avg_sq in fp32, plus one fp32 scalar step counter per parameter tensor
    assert states["optimizer_states"] == 8 * n + 4 * n_tensors
    assert states["estimate"] == 16 * n  # 4 + 4 + 8 bytes per parameter
    assert states["estimate_bytes_per_param"] == 16.0
    assert states["total"] == 16 * n + 4 * n_tensors
    json.dumps(tracer.records())


def test_model_states_sgd_bf16_frozen_and_amsgrad():
    model, n, _ = linear_stack(6)
    model.to(torch.bfloat16)
    frozen = model[2]
    frozen.requires_grad_(False)
    n_frozen = sum(p.numel() for p in frozen.parameters())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                                momentum=0.9)
    trainable = n - n_frozen
    states = model_state_bytes(model, optimizer)
    # bf16: params 2 bytes each; trainable ones add a grad and a momentum buffer of 2 bytes
    assert states["estimate"] == 2 * n + 2 * trainable + 2 * trainable
    assert (states["params"], states["grads"], states["optimizer_states"]) == (2 * n, 0, 0)

    model32, n32, _ = linear_stack(7)
    adam = torch.optim.Adam(model32.parameters(), amsgrad=True)
    assert model_state_bytes(model32, adam)["estimate"] == 4 * n32 * (1 + 1 + 3)
    assert model_state_bytes(model32)["estimate"] == 4 * n32 * 2  # no optimizer: params + grads


def test_model_states_master_copies_and_unknown_optimizer():
    model, n, _ = linear_stack(8)
    masters = [p.detach().double().requires_grad_(True) for p in model.parameters()]
    optimizer = torch.optim.Adam(masters)
    states = model_state_bytes(model, optimizer)
    assert states["optimizer_params"] == 8 * n

    class Mystery(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1.0})

    unknown = model_state_bytes(model, Mystery(model.parameters()))
    assert unknown["estimate"] is None and "Mystery" in unknown["estimate_note"]


# --- CPU behaviour ----------------------------------------------------------------------------

def test_cpu_records_say_cuda_is_not_traced(tmp_path):
    model, _, d_in = linear_stack(9)
    optimizer = torch.optim.Adam(model.parameters())
    tracer = MemoryTracer(profile_step=1, snapshot=True)
    tracer.set_output_dir(tmp_path)
    tracer.attach(model, optimizer)
    for step in range(3):
        run_step(tracer, model, optimizer, torch.randn(2, d_in), step)
    tracer.close()
    rec = tracer.records()
    assert rec["cuda"] is False and rec["note"] == CPU_NOTE and "not traced" in rec["note"]
    assert rec["steps"] == [] and rec["peak"] is None
    assert rec["phases"]["forward_delta"] is None and rec["phases"]["optimizer_delta"] is None
    assert rec["snapshot"] is None and "CUDA" in rec["snapshot_note"]
    assert rec["activation_bytes"] > 0 and rec["model_states"]["params"] > 0
    assert list(tmp_path.iterdir()) == []
    json.dumps(rec)


def test_gradient_accumulation_traces_first_micro_step_and_the_boundary():
    model, n, d_in = linear_stack(10)
    optimizer = torch.optim.Adam(model.parameters())
    tracer = MemoryTracer(profile_step=0)
    tracer.attach(model, optimizer)
    run_step(tracer, model, optimizer, torch.randn(2, d_in), 0, optimizer_step=False)
    first = tracer.records()["activation_bytes"]
    assert tracer.records()["model_states"]["optimizer_states"] == 0
    run_step(tracer, model, optimizer, torch.randn(7, d_in), 0, optimizer_step=True)
    rec = tracer.records()
    assert rec["activation_bytes"] == first
    assert rec["model_states"]["optimizer_states"] == 8 * n + 4 * 4


# --- GPU --------------------------------------------------------------------------------------

class Spiky(nn.Module):
    """A Linear whose forward allocates and frees ``spike_bytes`` when ``spike`` is set."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.spike = False
        self.spike_bytes = 64 * 2**20

    def forward(self, x):
        if self.spike:
            tmp = torch.empty(self.spike_bytes, dtype=torch.uint8, device=x.device)
            del tmp
        return self.lin(x)


@pytest.mark.gpu
def test_cuda_peaks_phases_and_snapshot(tmp_path):
    torch.manual_seed(11)
    device = torch.device("cuda")
    model = Spiky(256).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    n = sum(p.numel() for p in model.parameters())
    tracer = MemoryTracer(profile_step=1, snapshot=True)
    tracer.set_output_dir(tmp_path)
    tracer.attach(model, optimizer)
    x = torch.randn(64, 256, device=device)
    for step in range(4):
        model.spike = step == 2
        run_step(tracer, model, optimizer, x, step)
    tracer.close()
    rec = tracer.records()
    assert rec["cuda"] is True and rec["note"] is None
    steps = {s["step"]: s for s in rec["steps"]}
    assert sorted(steps) == [0, 1, 2, 3]
    assert steps[2]["peak_allocated"] >= model.spike_bytes
    # the peak was reset at step begin: step 3 lacks step 2's spike (absolute figures include
    # whatever else the process holds on the GPU, so compare the two steps)
    assert steps[2]["peak_allocated"] - steps[3]["peak_allocated"] >= 0.9 * model.spike_bytes
    assert all(s["peak_reserved"] >= s["peak_allocated"] for s in steps.values())
    assert rec["peak"]["allocated"] == steps[2]["peak_allocated"]
    acts = {row["module"]: row["bytes"] for row in rec["activations"]}
    assert acts == {"lin": 64 * 256 * F32, "(outside modules)": 64 * 256 * F32}
    phases = rec["phases"]
    # forward allocates the Linear's output (held by the loss's pow) and the loss
    assert phases["forward_delta"] >= acts["(outside modules)"]
    # Adam's states exist since step 0; run_step's zero_grad frees the gradients inside the step
    # (the allocator rounds each block up to 512 bytes)
    grad_bytes = 4 * n
    assert -grad_bytes - 2 * 512 <= phases["optimizer_delta"] <= -grad_bytes
    assert rec["model_states"]["optimizer_states"] >= 8 * n
    path = tmp_path / "memory_snapshot_step1.pickle"
    assert rec["snapshot"] == str(path) and path.exists()
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert "segments" in snapshot and any(snapshot["device_traces"])
    # the step's peak by allocation site: the blocks from before the step (parameters and Adam's
    # states among them) counted through the snapshot's end state, the total the allocator's peak
    sites = rec["peak_sites"]
    assert sites["peak_bytes"] == pytest.approx(steps[1]["peak_allocated"], rel=0.01)
    held = {row["site"]: row["bytes"] for row in sites["sites"]}
    assert held["(allocated before the trace)"] >= 3 * 4 * n
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
