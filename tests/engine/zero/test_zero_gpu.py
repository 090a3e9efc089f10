"""ZeRO on one CUDA GPU (no process group): optimizer offload with its pinned buffers, side-stream
gradient copies and GPU-side accumulation, norms taken on the GPU and the chunked CPU step, and
stage 3 sharding a model built on the CPU, each against stage 0 on the same GPU.

Offload steps on the CPU, stage 0 on the GPU: the two optimizers' results differ by an ulp or
so per step. Adam with a tiny epsilon turns such differences in near-zero gradients into whole
sign flips of the update (lr-sized), so the comparisons use momentum SGD and Adam with an
epsilon (1e-3) that keeps those updates proportional to the gradient."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dslab

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import base_config  # noqa: E402

pytestmark = pytest.mark.gpu

WIDTH, LAYERS, CLASSES = 96, 6, 7


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return nn.functional.cross_entropy(self.head(self.norm(x)).float(), y)


OPTIMIZERS = {
    "sgd": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
    "adamw": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.01}},
}
PRECISIONS = {
    "bf16": {"bf16": {"enabled": True}},
    # a scale high enough that the first steps overflow and are skipped
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 19, "hysteresis": 1}},
}


def _train(stage, zero=None, steps=4, accumulation=2, device_model=True, optimizer="adamw",
           precision="bf16"):
    torch.manual_seed(0)
    model = Stack()
    if device_model:
        model = model.cuda()
    config = base_config(
        train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=accumulation,
        gradient_clipping=0.5, optimizer=OPTIMIZERS[optimizer], **PRECISIONS[precision],
        zero_optimization={"stage": stage, "reduce_bucket_size": 5_000,
                           "stage3_param_persistence_threshold": 0, **(zero or {})})
    engine, _, _, _ = dslab.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    observed = []
    for _ in range(steps * accumulation):
        x = torch.randn(8, WIDTH, generator=g).cuda()
        y = torch.randint(0, CLASSES, (8,), generator=g).cuda()
        engine.backward(engine(x, y))
        if engine.zero is not None:
            observed.append([u.grad_shard is None for u in engine.zero.units])
        engine.step()
    state = {k: v.detach().float().cpu() for k, v in engine.module_state_dict().items()}
    return engine, state, observed


CASES = [(stage, pin, optimizer, precision, accumulation)
         for stage in (1, 2, 3) for pin in (True, False) for optimizer in ("sgd", "adamw")
         for precision, accumulation in (("bf16", 2), ("bf16", 1), ("fp16", 2))
         if pin or (optimizer == "adamw" and precision == "bf16")]


@pytest.mark.parametrize("stage, pin, optimizer, precision, accumulation", CASES)
def test_offload_on_cuda_ends_where_stage0_ends(stage, pin, optimizer, precision, accumulation):
    kwargs = {"optimizer": optimizer, "precision": precision, "accumulation": accumulation}
    reference, expected, _ = _train(0, **kwargs)
    skipped = reference.skipped_steps
    reference.destroy()
    engine, state, observed = _train(
        stage, {"offload_optimizer": {"device": "cpu", "pin_memory": pin}, "sub_group_size": 4_000},
        **kwargs)
    offload = engine.zero.offload
    assert len(offload.chunks) > 1  # the CPU step really ran chunk by chunk
    assert all(m.device.type == "cpu" and m.is_pinned() == pin for m in offload.masters)
    assert all(g.is_pinned() for g in offload.buffers())  # device-to-host copy targets
    if stage >= 2:  # every reduced shard went to CPU memory; none stayed on the GPU
        assert all(all(flags) for flags in observed)
    assert engine.skipped_steps == skipped
    if precision == "fp16":
        assert 0 < skipped < 4
    engine.destroy()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")


def test_stage3_shards_a_model_built_on_the_cpu():
    reference, expected, _ = _train(0)
    reference.destroy()
    engine, state, _ = _train(3, device_model=False)
    assert all(p.device.type == "cuda" for p in engine.module.parameters())
    assert all(b.device.type == "cuda" for b in engine.module.buffers())
    assert all(u.shard.device.type == "cuda" for u in engine.zero.units)
    engine.destroy()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")



@pytest.mark.parametrize("stage, offload", [(1, False), (2, False), (3, False), (2, True)])
def test_nccl_averaging_collectives_match_the_run_without_a_group(tmp_path, stage, offload):
    """Through a one-rank NCCL group the reductions average inside the collective (AVG), the
    stage-3 units are broadcast as they are built, and the clipping norm is all-reduced: the
    result is the same as with no process group at all (where collectives are copies)."""
    import torch.distributed as dist

    from dslab import comm

    zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True}} if offload else None
    without, expected, _ = _train(stage, zero, device_model=stage != 3)
    assert without.zero.reducer.average_op is None
    without.destroy()
    comm.init_distributed(dist_backend="nccl", init_method=f"file://{tmp_path / 'store'}",
                          rank=0, world_size=1)
    try:
        engine, state, _ = _train(stage, zero, device_model=stage != 3)
        assert engine.zero.reducer.average_op == comm.ReduceOp.AVG
        engine.destroy()
    finally:
        dist.destroy_process_group()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, key=key: f"{key}: {m}")


def _granularity(module: nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / sum(1 for _ in module.modules())


def _train_gpt2_graphed(stage, steps=3, accumulation=2, graphs=True, zero=None):
    from dslab.models import GPT2LMHeadModel, gpt2_tiny

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="dslab")
    config = base_config(
        train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=accumulation,
        gradient_clipping=0.5, optimizer=OPTIMIZERS["sgd"], bf16={"enabled": True},
        cuda_graphs={"enabled": graphs},
        zero_optimization={"stage": stage, "reduce_bucket_size": 20_000,
                           "stage3_param_persistence_threshold": 0, **(zero or {})})
    engine, _, _, _ = dslab.initialize(model=model, config=config)
    units = [sorted(u.layout.names) for u in engine.zero.units] if engine.zero else []
    g = torch.Generator().manual_seed(3)
    for _ in range(steps * accumulation):
        ids = torch.randint(0, 1000, (2, 32), generator=g).cuda()
        engine.backward(engine(input_ids=ids, labels=ids))
        engine.step()
    state = {k: v.detach().float().cpu() for k, v in engine.module_state_dict().items()}
    stats = model.cuda_graph_stats
    engine.destroy()
    return state, stats, units


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_graphs_under_zero_match_graphed_stage0(stage):
    """What ``dslab bench --zero-stage`` runs: the suites' CUDA-graphed layer stack under ZeRO.
    At stages 1 and 2 the graphs replay and ZeRO's gradient hooks fire on the replay's
    gradients; at stage 3 the gather hooks on the layers make the stack run eagerly."""
    expected, reference_stats, _ = _train_gpt2_graphed(0)
    assert reference_stats.get("replays", 0) > 0
    state, stats, _ = _train_gpt2_graphed(stage)
    if stage < 3:
        assert stats.get("replays", 0) > 0 and not any(k.startswith("eager") for k in stats), stats
    else:
        assert stats.get("eager_hooks", 0) > 0 and "replays" not in stats, stats
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")


def test_stage3_gathers_whole_layers_under_a_granularity_threshold():
    """``stage3_module_granularity_threshold`` between a layer's granularity and the model's: one
    unit per transformer layer (attention, MLP and norms together), the same result as stage 0."""
    from dslab.models import GPT2LMHeadModel, gpt2_tiny

    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="dslab")
    layer, root = _granularity(model.layers[0]), _granularity(model)
    assert layer < root
    expected, _, _ = _train_gpt2_graphed(0, graphs=False)
    state, _, units = _train_gpt2_graphed(
        3, graphs=False, zero={"stage3_module_granularity_threshold": int(layer + root) // 2})
    for i in range(len(model.layers)):
        assert sorted(n for n, _ in model.layers[i].named_parameters(prefix=f"layers.{i}")) in units
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")
