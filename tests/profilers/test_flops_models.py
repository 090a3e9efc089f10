"""Flops profiler on whole models: totals equal to torch's FlopCounterMode, attribution to modules
(functional calls, repeated calls, tied weights, recomputation), repeatability, the text and data
outputs, get_model_profile, and the engine driver called through its hooks."""

import json
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from dslab.config_base import parse_section
from dslab.profilers.flops import FlopsProfiler, FlopsProfilerConfig, get_model_profile
from dslab.profilers.flops_step import FlopsStepProfiler, from_config
from dslab.profilers.flops_output import peaks_and_mfu


class MLP(nn.Module):
    def __init__(self, sizes=(12, 32, 32, 4)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class Block(nn.Module):
    """A pre-LN transformer block: nn.MultiheadAttention (its explicit matmul path) then an SDPA
    self-attention written by hand, then an MLP."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = MLP((dim, 4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.mha(h, h, h)[0]
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm2(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm3(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=50, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TiedLM(nn.Module):
    """Embedding tied to the output projection (one parameter, two uses)."""

    def __init__(self, vocab=40, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.embed(ids))))


def _models():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 9))
    return [
        ("mlp", MLP(), (torch.randn(6, 12),)),
        ("transformer", TinyTransformer(), (ids,)),
        ("tied", TiedLM(), (ids % 40,)),
    ]


def _train_step(model, inputs):
    loss = model(*inputs).float().pow(2).mean()
    loss.backward()


def _profile(model, inputs, **kwargs):
    profiler = FlopsProfiler(model, **kwargs)
    profiler.start_profile()
    _train_step(model, inputs)
    profiler.stop_profile()
    return profiler


@pytest.mark.parametrize("name, model, inputs", _models(), ids=lambda v: v if isinstance(v, str) else "")
def test_total_equals_flop_counter_mode(name, model, inputs):
    profiler = _profile(model, inputs)
    with FlopCounterMode(display=False) as reference:
        _train_step(model, inputs)
    assert reference.get_total_flops() > 0
    assert profiler.get_total_flops() == reference.get_total_flops()
    root = profiler.records()["modules"][0]
    assert root["name"] == "" and root["forward_flops"] + root["backward_flops"] == profiler.get_total_flops()


def test_tied_weights_are_counted_once():
    model = TiedLM(vocab=40, dim=16)
    profiler = _profile(model, (torch.randint(0, 40, (3, 5)),))
    expected = 40 * 16 + (16 * 16 + 16)
    assert profiler.get_total_params() == expected
    records = profiler.records()
    assert records["params"] == expected
    by_name = {m["name"]: m for m in records["modules"]}
    assert by_name[""]["params"] == expected and by_name["out"]["params"] == 40 * 16


def test_mlp_split_and_attribution_by_hand():
    """MLP 12 -> 32 -> 32 -> 4 on x [6, 12] (x needs no gradient): forward 2*6*(12*32 + 32*32 + 32*4);
    backward: weight gradients of all three, input gradients of the last two."""
    model = MLP()
    profiler = _profile(model, (torch.randn(6, 12),))
    per_layer = [2 * 6 * 12 * 32, 2 * 6 * 32 * 32, 2 * 6 * 32 * 4]
    assert profiler.get_total_flops(phase="forward") == sum(per_layer)
    assert profiler.get_total_flops(phase="backward") == sum(per_layer) + per_layer[1] + per_layer[2]
    modules = {m["name"]: m for m in profiler.records()["modules"]}
    for i, flops in enumerate(per_layer):
        layer = modules[f"layers.{i}"]
        assert layer["forward_flops"] == flops
        assert layer["backward_flops"] == (1 if i == 0 else 2) * flops
        assert layer["calls"] == 1
    assert modules["layers"]["calls"] == 0  # a ModuleList is never called: it sums its layers
    assert modules["layers"]["forward_flops"] == sum(per_layer)


def test_module_called_twice_and_functional_ops_in_the_parent():
    """A shared linear called twice holds both calls' flops once in the parent; the parent's own
    functional matmul counts for the parent only, forward and backward."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(8, 8, bias=False)
            self.mix = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            h = self.shared(x) @ self.mix
            return self.shared(h)

    model = Twice()
    profiler = _profile(model, (torch.randn(5, 8),))
    one = 2 * 5 * 8 * 8
    modules = {m["name"]: m for m in profiler.records()["modules"]}
    assert modules["shared"]["calls"] == 2
    assert modules["shared"]["forward_flops"] == 2 * one
    assert modules["shared"]["backward_flops"] == 3 * one  # first call: weight grad only
    assert modules[""]["forward_flops"] == 3 * one
    assert modules[""]["backward_flops"] == 3 * one + 2 * one
    assert modules["shared"]["params"] == 64 and modules[""]["params"] == 128


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputation_is_counted_in_backward(reentrant):
    """The checkpointed linear + tanh runs its forward again inside the backward (tanh saved its
    output, which the backward needs): that matmul counts as backward work of the module."""

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.linear(x))

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            return self.out(checkpoint(self.inner, x, use_reentrant=reentrant))

    x = torch.randn(4, 8, requires_grad=True)
    profiler = _profile(Checkpointed(), (x,))
    modules = {m["name"]: m for m in profiler.records()["modules"]}
    one = 2 * 4 * 8 * 8
    for name in ("inner", "inner.linear"):
        assert modules[name]["forward_flops"] == one
        assert modules[name]["backward_flops"] == 3 * one  # recomputed forward, input and weight gradients
        assert modules[name]["calls"] == 1
    assert modules[""]["backward_flops"] == 3 * one + 2 * 4 * 8 * 2 * 2


def test_profiling_twice_gives_the_same_counts():
    torch.manual_seed(0)
    model, inputs = TinyTransformer(), (torch.randint(0, 50, (2, 9)),)
    profiler = FlopsProfiler(model)
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)  # else the second backward also accumulates into .grad
        profiler.start_profile()
        _train_step(model, inputs)
        profiler.stop_profile()
        records = profiler.records()
        runs.append((records["total_flops"], records["elementwise_flops"],
                     [(m["name"], m["forward_flops"], m["backward_flops"], m["calls"]) for m in records["modules"]]))
    assert runs[0] == runs[1]
    profiler.end_profile()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert torch._C._len_torch_dispatch_stack() == 0


def test_ignored_module_types_count_for_their_parent():
    torch.manual_seed(0)
    model, inputs = TinyTransformer(), (torch.randint(0, 50, (2, 9)),)
    profiler = FlopsProfiler(model)
    profiler.start_profile(ignore_list=[nn.MultiheadAttention, nn.LayerNorm])
    _train_step(model, inputs)
    profiler.stop_profile()
    records = profiler.records()
    assert not {"MultiheadAttention", "LayerNorm"} & {m["type"] for m in records["modules"]}
    model.zero_grad(set_to_none=True)
    full = _profile(model, inputs).records()
    assert records["total_flops"] == full["total_flops"]
    block, full_block = ({m["name"]: m for m in r["modules"]}["blocks.0"] for r in (records, full))
    assert block["forward_flops"] == full_block["forward_flops"]
    with pytest.raises(ValueError, match="ignore_list"):
        FlopsProfiler(model).start_profile(ignore_list=["LayerNorm"])


def test_records_are_json_and_latencies_are_positive():
    profiler = _profile(TinyTransformer(), (torch.randint(0, 50, (2, 9)),))
    records = json.loads(json.dumps(profiler.records(profile_step=3)))
    for key in ("total_flops", "forward_flops", "backward_flops", "total_macs", "params", "duration_ms",
                "mfu", "peaks", "modules", "profile_step"):
        assert key in records
    assert records["profile_step"] == 3
    assert records["total_macs"] == records["total_flops"] // 2
    assert records["forward_flops"] + records["backward_flops"] == records["total_flops"]
    assert records["mfu"] == {"measured": None, "datasheet": None}
    module = records["modules"][0]
    assert set(module) >= {"name", "depth", "params", "forward_flops", "backward_flops", "macs",
                           "forward_latency_ms", "backward_latency_ms", "calls"}
    assert 0 < module["forward_latency_ms"] <= records["duration_ms"]
    assert 0 < records["backward_latency_ms"] <= records["duration_ms"]
    assert 0 < module["backward_latency_ms"] <= records["backward_latency_ms"]


def test_text_output_has_deepspeed_sections_and_sane_units(tmp_path):
    profiler = _profile(TinyTransformer(), (torch.randint(0, 50, (2, 9)),), measured_peak_tflops=1.0)
    out = tmp_path / "flops.txt"
    text = profiler.print_model_profile(profile_step=2, module_depth=2, top_modules=2, output_file=str(out))
    assert out.read_text().strip() == text.strip()
    for section in ("Flops Profiler", "Profile Summary at step 2", "Aggregated Profile per GPU",
                    "Detailed Profile per GPU", "depth 0:", "depth 2:", "MFU (measured peak):"):
        assert section in text
    assert "depth 3:" not in text and "(0): Linear" not in text  # cut at module_depth 2
    latencies = re.findall(r"^\w+ latency: (\S+) (\S+)$", text, flags=re.M)
    assert latencies and all(unit in ("us", "ms", "s") for _, unit in latencies)
    assert not re.search(r"\d [kMGT]?s\b", text.replace(" ms", "").replace(" us", "").replace(" s\n", "\n"))
    assert re.search(r"fwd FLOPS per GPU = .*: \d+\.\d\d [kMGT]?FLOPS", text)
    assert "TinyTransformer(" in text and "(blocks): ModuleList(" in text
    short = profiler.print_model_profile(detailed=False, output_file=str(tmp_path / "short.txt"))
    assert "Detailed Profile per GPU" not in short


def test_peaks_and_mfu_against_datasheet_and_measured_peak():
    """H100 SXM: 989.5 dense bf16 TFLOPS, 67 fp32. Half a second of bf16 work at peak done in one
    second is 50%; a mix of dtypes is priced per dtype."""
    peak = 1979 / 2 * 1e12
    peaks, mfu = peaks_and_mfu(int(peak / 2), {"bfloat16": int(peak / 2)}, 1.0, "NVIDIA H100 80GB HBM3", 500.0)
    assert peaks["datasheet_gpu"] == "H100 SXM5 80GB"
    assert mfu["datasheet"] == pytest.approx(0.5)
    assert mfu["measured"] == pytest.approx(peak / 2 / 500e12)
    mixed = {"bfloat16": int(peak / 4), "float32": int(67e12 / 4)}
    _, mfu = peaks_and_mfu(sum(mixed.values()), mixed, 1.0, "NVIDIA H100 80GB HBM3", None)
    assert mfu["datasheet"] == pytest.approx(0.5) and mfu["measured"] is None
    peaks, mfu = peaks_and_mfu(10, {"float32": 10}, 1.0, "cpu", None)
    assert mfu["datasheet"] is None and "cpu" in peaks["note"]


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_get_model_profile(mode, capsys):
    model = MLP()
    forward = 2 * 6 * (12 * 32 + 32 * 32 + 32 * 4)
    flops, macs, params = get_model_profile(model, input_shape=(6, 12), mode=mode, as_string=False,
                                            print_profile=(mode == "train"), warm_up=1)
    expected = forward if mode == "forward" else forward + forward + 2 * 6 * (32 * 32 + 32 * 4)
    assert (flops, macs) == (expected, expected // 2)
    assert params == sum(p.numel() for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert not model._forward_hooks
    if mode == "train":
        assert "Detailed Profile per GPU" in capsys.readouterr().out
    strings = get_model_profile(model, args=[torch.randn(6, 12)], print_profile=False, mode=mode)
    assert all(isinstance(s, str) for s in strings)
    with pytest.raises(ValueError, match="mode"):
        get_model_profile(model, input_shape=(6, 12), mode="backward")
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(model, input_shape=(6, 12), args=[torch.randn(6, 12)])


def test_config_defaults_and_errors():
    cfg = FlopsProfilerConfig()
    assert (cfg.enabled, cfg.profile_step, cfg.module_depth, cfg.top_modules, cfg.detailed, cfg.output_file) == \
        (False, 1, -1, 1, True, None)
    assert from_config(cfg) is None and from_config({"enabled": False}) is None
    with pytest.raises(ValueError, match="flops_profiler.top_modules"):
        from_config({"enabled": True, "top_modules": 0})
    with pytest.raises(ValueError, match="flops_profiler.profile_stepp"):
        parse_section(FlopsProfilerConfig, {"profile_stepp": 1}, prefix="flops_profiler")


def test_engine_driver_profiles_only_its_step(tmp_path):
    """Hooks called by hand in the engine's order over global steps 0..5 with two micro-steps
    each: only the first micro-step of step 1 is counted (forward, backward, optimizer), the first
    micro-step of step 2 is timed by device activity (hooks, no dispatch mode), step 3 runs under the
    profiler alone, steps 4..6 are the steady state, the file gets the profile once, and the other
    steps run without the dispatch mode or hooks."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    out = tmp_path / "flops.txt"
    driver = from_config({"enabled": True, "profile_step": 1, "output_file": str(out), "module_depth": 1})
    assert isinstance(driver, FlopsStepProfiler) and driver.section == "flops"
    driver.attach(model, optimizer)
    assert driver.records() == {"profiled": False, "profile_step": 1}
    x = torch.randn(6, 12)
    for step in range(7):
        for micro in range(2):
            driver.on_step_begin(step)
            counting = step == 1 and micro == 0
            timing = step == 2 and micro == 0
            assert (torch._C._len_torch_dispatch_stack() == 1) == counting
            assert bool(model._forward_hooks) == (counting or timing)
            driver.on_forward_begin()
            loss = model(x).pow(2).mean()
            driver.on_forward_end()
            driver.on_backward_begin()
            loss.backward()
            driver.on_backward_end()
            if micro == 0:
                driver.on_optimizer_step_begin()
                optimizer.step()
                optimizer.zero_grad()
                driver.on_optimizer_step_end()
            driver.on_step_end(step)
    records = driver.records()
    forward = 2 * 6 * (12 * 32 + 32 * 32 + 32 * 4)
    assert records["profiled"] and records["profile_step"] == 1
    assert records["forward_flops"] == forward
    assert records["backward_flops"] == forward + 2 * 6 * (32 * 32 + 32 * 4)
    assert records["optimizer_flops"] == 0 and records["elementwise_flops"]["optimizer"] > 0
    assert records["optimizer_latency_ms"] > 0
    device = records["device_time"]
    assert device["step"] == 2 and device["optimizer_ms"] > 0 and device["forward_ms"] > 0
    layers = [m for m in records["modules"] if m["name"].startswith("layers.")]
    assert len(layers) == 3 and all(m["forward_device_ms"] > 0 and m["backward_device_ms"] > 0 for m in layers)
    steady = records["steady_state"]
    assert device["steady_busy_step"] == 3 and 0 < device["steady_busy_ms"] <= device["steady_span_ms"]
    assert device["steady_busy_hooked"] is False
    assert steady["steps"] == 2 and steady["step_ms"] > 0  # steps 4->5 and 5->6
    assert steady["achieved_tflops"] == pytest.approx(records["total_flops"] / (steady["step_ms"] * 1e-3) / 1e12)
    text = out.read_text()
    assert text.count("Profile Summary at step 1") == 1 and "step latency:" in text
    assert "device time of step 2" in text and "device busy in step 3 (no hooks" in text
    driver.close()
    assert torch._C._len_torch_dispatch_stack() == 0 and not model._forward_hooks
