"""ZeRO in one process (no process group): config errors, optimizers passed to initialize(), the
parameter release of stage 3, and the shard layout."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dslab
from dslab.engine.config import load_config
from dslab.engine.lamb import Lamb
from dslab.engine.zero.partition import UnitLayout, plan_module_units

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import TinyNet, base_config, make_data  # noqa: E402


def _train(engine, steps=3):
    x, y = make_data(8 * steps, seed=3)
    for s in range(steps):
        loss = engine(x[s * 8:(s + 1) * 8], y[s * 8:(s + 1) * 8])
        engine.backward(loss)
        engine.step()


def _zero(stage, **extra):
    return {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0,
            **extra}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lamb_is_refused_with_zero(stage):
    cfg = base_config(optimizer={"type": "Lamb", "params": {"lr": 1e-3}},
                      zero_optimization={"stage": stage})
    with pytest.raises(ValueError, match="'optimizer.type' = 'Lamb'.*'zero_optimization.stage'"):
        load_config(cfg)
    model = TinyNet()
    cfg = base_config(zero_optimization={"stage": stage})
    del cfg["optimizer"]
    with pytest.raises(ValueError, match=f"Lamb cannot run with ZeRO stage {stage}"):
        dslab.initialize(model=model, optimizer=Lamb(model.parameters()), config=cfg)


def test_bad_offload_configs_are_refused():
    with pytest.raises(ValueError, match="'zero_optimization.offload_optimizer.nvme_path' is required"):
        load_config(base_config(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}))
    with pytest.raises(ValueError, match="must be 'cpu', 'nvme' or 'none'"):
        load_config(base_config(zero_optimization={"stage": 2, "offload_optimizer": {"device": "gpu"}}))
    with pytest.raises(ValueError, match="offload_optimizer.device.*needs 'zero_optimization.stage' >= 1"):
        load_config(base_config(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}))
    with pytest.raises(ValueError, match="pin_mem"):
        load_config(base_config(zero_optimization={"stage": 1, "offload_optimizer": {"pin_mem": True}}))
    with pytest.raises(ValueError, match="offload_param.device' = 'cpu' needs 'zero_optimization.stage' = 3"):
        load_config(base_config(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"},
                                                   "offload_optimizer": {"device": "cpu"}}))
    with pytest.raises(ValueError, match="offload_param.device' = 'cpu' needs .*offload_optimizer.device"):
        load_config(base_config(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}))
    with pytest.raises(ValueError, match="'zero_optimization.offload_param.nvme_path' is required"):
        load_config(base_config(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"},
                                                   "offload_optimizer": {"device": "cpu"}}))
    for ratio in (0.0, 1.5):
        with pytest.raises(ValueError, match="ratio"):
            load_config(base_config(zero_optimization={
                "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}}))
    with pytest.raises(ValueError, match="offload_param.device must be 'cpu', 'nvme' or 'none'"):
        load_config(base_config(zero_optimization={"stage": 3, "offload_param": {"device": "gpu"}}))
    with pytest.raises(ValueError, match="offload_param.fetch_dtype must be 'bf16', 'fp16' or null, got 'int8'"):
        load_config(base_config(zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "fetch_dtype": "int8"},
                                                   "offload_optimizer": {"device": "cpu"}}))
    with pytest.raises(ValueError, match="offload_param.fetch_dtype' = 'bf16' needs offload_param.device 'cpu'"):
        load_config(base_config(zero_optimization={
            "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/x", "fetch_dtype": "bf16"},
            "offload_optimizer": {"device": "cpu"}}))
    with pytest.raises(ValueError, match="offload_optimizer.staging_dtype must be 'bf16' or null, got 'fp8'"):
        load_config(base_config(zero_optimization={
            "stage": 2, "offload_optimizer": {"device": "cpu", "accumulate_on": "cpu", "staging_dtype": "fp8"}}))
    with pytest.raises(ValueError, match="offload_optimizer.staging_dtype' = 'bf16' needs offload_optimizer."
                                         "accumulate_on 'cpu'.*got accumulate_on 'gpu'"):
        load_config(base_config(zero_optimization={
            "stage": 2, "offload_optimizer": {"device": "cpu", "staging_dtype": "bf16"}}))
    with pytest.raises(ValueError, match="offload_optimizer.accumulate_on must be 'gpu', 'cpu' or 'gpu_resident', "
                                         "got 'host'"):
        load_config(base_config(zero_optimization={
            "stage": 2, "offload_optimizer": {"device": "cpu", "accumulate_on": "host"}}))
    with pytest.raises(ValueError, match="staging_buffers"):
        load_config(base_config(zero_optimization={
            "stage": 2, "offload_optimizer": {"device": "cpu", "accumulate_on": "cpu", "staging_buffers": 0}}))
    # a DeepSpeed ZeRO-3 config with parameter offload switched off loads
    config = load_config(base_config(zero_optimization={
        "stage": 3, "offload_param": {"device": "none", "pin_memory": True},
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}))
    assert config.zero_optimization.offload_param.device == "none"


@pytest.mark.parametrize("key, value", [("zero_quantized_weights", True),
                                        ("zero_quantized_gradients", True),
                                        ("zero_quantized_nontrainable_weights", True),
                                        ("zero_hpz_partition_size", 8)])
def test_zeropp_switched_on_is_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"ZeRO\\+\\+ is not supported.*'zero_optimization.{key} = {value}'"):
        load_config(base_config(zero_optimization={"stage": 3, key: value}))
    off = {"zero_quantized_weights": False, "zero_quantized_gradients": False,
           "zero_quantized_nontrainable_weights": False, "zero_hpz_partition_size": 1}
    assert load_config(base_config(zero_optimization={"stage": 3, **off})).zero_optimization.stage == 3


def test_compile_with_stage3_is_refused():
    with pytest.raises(ValueError, match="'compile.enabled' cannot be combined with 'zero_optimization.stage' = 3"):
        load_config(base_config(zero_optimization={"stage": 3}, compile={"enabled": True}))


def test_zero_needs_an_optimizer():
    cfg = base_config(zero_optimization={"stage": 2})
    del cfg["optimizer"]
    with pytest.raises(ValueError, match="ZeRO stage 2.*pass an optimizer"):
        dslab.initialize(model=TinyNet(), config=cfg)


def _with_optimizer(stage, make):
    torch.manual_seed(0)
    model = TinyNet(dropout=0.0)
    cfg = base_config(zero_optimization=_zero(stage))
    del cfg["optimizer"]
    if make == "instance":
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    else:
        def optimizer(params):
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    engine, opt, _, _ = dslab.initialize(model=model, optimizer=optimizer, config=cfg)
    if make == "instance":
        assert opt is optimizer
    return engine, opt


@pytest.mark.parametrize("make", ["instance", "callable"])
@pytest.mark.parametrize("stage", [1, 3])
def test_optimizer_instance_and_callable_are_sharded(stage, make):
    reference, _ = _with_optimizer(0, make)
    _train(reference)
    engine, opt = _with_optimizer(stage, make)
    if make == "instance":  # each group keeps its options
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    model_ids = {id(p) for p in engine.module.parameters()}
    assert all(p.dim() == 1 and id(p) not in model_ids for g in opt.param_groups for p in g["params"])
    _train(engine)
    state, expected = engine.module_state_dict(), reference.module_state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7)
    engine.destroy()
    reference.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_an_optimizer_that_holds_state_already_is_refused_with_the_reason(stage):
    """Adagrad builds its state when constructed; ZeRO builds the shards' states itself.
    ``zero_allow_untested_optimizer`` (DeepSpeed's permission key) changes nothing either way."""
    cfg = base_config(zero_optimization=_zero(stage), zero_allow_untested_optimizer=True)
    del cfg["optimizer"]
    model = TinyNet(dropout=0.0)
    with pytest.raises(ValueError, match=r"\(Adagrad\) holds state already: it has stepped, or it builds its "
                                         r"state when constructed"):
        dslab.initialize(model=model, optimizer=torch.optim.Adagrad(model.parameters()), config=cfg)
    model = TinyNet(dropout=0.0)
    engine, opt, _, _ = dslab.initialize(model=model, optimizer=torch.optim.RMSprop(model.parameters(), lr=1e-3),
                                         config=cfg)
    _train(engine)
    assert all(len(opt.state[p]) > 0 for g in opt.param_groups for p in g["params"])  # stepped the shards
    engine.destroy()


def test_stage3_releases_parameters_between_uses():
    cfg = base_config(zero_optimization=_zero(3))
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=cfg)
    _train(engine, 1)
    assert all(p.numel() == 0 for p in engine.module.parameters())
    full = engine.module_state_dict()
    assert full["fc1.weight"].shape == (32, 16)
    assert all(p.numel() == 0 for p in engine.module.parameters())
    with torch.no_grad():  # forward without autograd gathers and releases too
        engine(*[t[:4] for t in make_data(4)])
    assert all(p.numel() == 0 for p in engine.module.parameters())
    engine.destroy()


def test_persistent_units_stay_gathered():
    cfg = base_config(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 200})
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=cfg)
    _train(engine, 1)
    sizes = {n: p.numel() for n, p in engine.module.named_parameters()}
    # fc1 (16x32 + 32 = 544 elements) is above the threshold, fc2 (32x4 + 4 = 132) below
    assert sizes == {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 128, "fc2.bias": 4}
    engine.destroy()


class _Layer(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.fc_in = torch.nn.Linear(dim, 4 * dim)
        self.fc_out = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc_out(torch.relu(self.fc_in(self.norm(x))))


class _Stack(torch.nn.Module):
    def __init__(self, dim=8, layers=3, vocab=100):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(_Layer(dim) for _ in range(layers))

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return h


def _planned_names(model, granularity):
    named = [list(model.named_parameters())]
    return [sorted(layout.names) for layout, _, _ in
            plan_module_units(model, named, persistence_threshold=0, granularity_threshold=granularity)]


def test_granularity_threshold_gathers_whole_layers_but_never_a_module_list():
    model = _Stack()
    # a layer: 16 + 288 + 264 = 568 elements over 1 + 3 modules = 142; the ModuleList 1704 / 13
    # = 131 (below 150, but it has no forward of its own); the root 2504 / 15 = 167; emb 800
    per_module = _planned_names(model, 0)
    assert len(per_module) == 1 + 3 * 3  # every module that registers parameters
    per_layer = _planned_names(model, 150)
    assert per_layer == [["emb.weight"]] + [
        sorted(f"layers.{i}.{n}" for n in ("norm.weight", "norm.bias", "fc_in.weight", "fc_in.bias",
                                           "fc_out.weight", "fc_out.bias")) for i in range(3)]
    assert _planned_names(model, 170) == [sorted(n for n, _ in model.named_parameters())]  # root
    assert sorted(sum(per_layer, [])) == sorted(sum(per_module, []))


@pytest.mark.parametrize("granularity, largest", [(0, 480), (145, 568)])
def test_memory_tracer_sizes_stage3_buffer_from_the_largest_unit(granularity, largest):
    """The estimate's transient stage 3 buffer is the largest unit gathered at once: the
    embedding (480 elements) per module, the whole layer (568) when it is gathered whole
    (granularities: layer 568 / 4 = 142, root 1048 / 7 = 150)."""
    from dslab.profilers.model_states import model_state_bytes

    cfg = base_config(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0,
                                         "stage3_module_granularity_threshold": granularity})
    engine, _, _, _ = dslab.initialize(model=_Stack(layers=1, vocab=60), config=cfg)
    states = model_state_bytes(engine.module, engine.optimizer, 1, runtime=engine.zero, stage=3)
    assert states["zero_estimate"]["compared"]["estimate_buffer"] == largest * 4 * 2
    engine.destroy()


@pytest.mark.parametrize("reuse, kept", [
    (0, set()),
    # distances: layers.2.fc_out 0, layers.2.fc_in 2 x 264 = 528, layers.2.norm 2 x 552 = 1104
    (600, {"layers.2.fc_in", "layers.2.fc_out"}),
    (1_000_000_000, None),  # DeepSpeed's default: every unit stays until its backward
])
def test_stage3_keeps_units_that_backward_reuses_soon(reuse, kept):
    model = _Stack()
    cfg = base_config(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0,
                                         "stage3_max_reuse_distance": reuse})
    engine, _, _, _ = dslab.initialize(model=model, config=cfg)
    ids = torch.randint(0, 100, (2, 5))

    def gathered():
        return {name.rsplit(".", 1)[0] for name, p in model.named_parameters() if p.numel()}

    for step in range(2):  # the first forward records the order
        out = engine(ids)
        if step == 1:
            assert gathered() == (kept if kept is not None else
                                  {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()})
        engine.backward(out.float().square().mean())
        assert gathered() == set()  # every unit released once its gradients are reduced
        engine.step()
    with torch.no_grad():  # no backward follows: nothing is kept
        engine(ids)
    assert gathered() == set()
    engine.destroy()


def test_unit_layout_pads_to_the_world_size():
    layout = UnitLayout(("a", "b"), ((3, 3), (4,)), group=0, resident=True)
    assert layout.numel == 13 and layout.offsets == [0, 9]
    assert [layout.padded(w) for w in (1, 2, 3, 4)] == [13, 14, 15, 16]
    assert layout.shard_numel(3) == 5
    assert UnitLayout.from_dict(layout.to_dict()) == layout


def test_stage3_leaves_trainable_parameters_where_the_model_was_built():
    from dslab.engine.engine import _move_to_device

    model = TinyNet()
    model.fc2.bias.requires_grad_(False)
    model.register_buffer("counter", torch.zeros(3))
    moved = _move_to_device(model, torch.device("meta"), keep_trainable=True)
    assert moved is model
    assert {n: p.device.type for n, p in model.named_parameters()} == {
        "fc1.weight": "cpu", "fc1.bias": "cpu", "fc2.weight": "cpu", "fc2.bias": "meta"}
    assert model.counter.device.type == "meta"
    _move_to_device(model, torch.device("meta"), keep_trainable=False)
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("budget", [10_000, 0])
def test_stage3_prefetches_the_next_unit_in_forward_and_backward_order(budget):
    cfg = base_config(zero_optimization=_zero(3, stage3_prefetch_bucket_size=budget,
                                              stage3_max_reuse_distance=0))
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=cfg)
    gatherer = engine.zero.gatherer
    _train(engine, 1)  # the first forward records the order: fc1's unit, then fc2's
    assert [u.index for u in gatherer.order] == [0, 1]
    calls = []
    start_gather = gatherer._start_gather

    def spy(unit, async_op):
        calls.append((unit.index, async_op))
        start_gather(unit, async_op)

    gatherer._start_gather = spy
    _train(engine, 1)
    if budget:
        # forward: fc1 gathered, fc2 fetched ahead; backward: fc2 gathered, fc1 fetched ahead
        assert calls == [(0, False), (1, True), (1, False), (0, True)]
    else:
        assert calls == [(0, False), (1, False), (1, False), (0, False)]
    engine.destroy()


def test_stage3_adopts_a_unit_read_outside_its_owners_forward():
    """The attention module reads its qkv projection's bias after calling the projection: on the
    first step that unit is held from the read to the reduction of its gradients; from then on
    the attention module gathers and releases it with its own, so nothing but the tied embedding
    (read by the model itself, outside any hooked module) stays gathered past the forward."""
    from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="dslab")
    cfg = base_config(train_micro_batch_size_per_gpu=2, zero_optimization=_zero(3, stage3_max_reuse_distance=0))
    engine, _, _, _ = dslab.initialize(model=model, config=cfg)
    names = {u.index: u.layout.names[0] for u in engine.zero.units}
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    live = []
    for _ in range(3):
        loss = engine(ids, labels=ids)
        live.append(sorted(names[u.index] for u in engine.zero.units if u.full is not None))
        engine.backward(loss)
        engine.step()
    qkv = ["layers.0.attention.qkv.weight", "layers.1.attention.qkv.weight"]
    assert sorted(names[i] for i in engine.zero.gatherer.adopted) == qkv
    assert live[0] == sorted(["wte.weight", *qkv]) and live[1] == live[2] == ["wte.weight"]
    engine.destroy()


class _CountOps:
    def __init__(self):
        self.ops = []

    def before(self, call):
        self.ops.append(call.op)

    def after(self, call, work):
        pass


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_group_of_one_reduces_and_gathers_without_collectives(tmp_path, stage):
    """With a process group of one rank (torchrun with one process, as a suite's N = 1 runs),
    the ZeRO units' reduce-scatters and gathers move nothing: they are skipped (no collective for
    the comm observers, no NCCL launch), and training gives what it gives without a group."""
    import torch.distributed as dist

    from dslab import comm

    def train(grouped):
        torch.manual_seed(0)
        model = TinyNet(dropout=0.0)
        engine, _, _, _ = dslab.initialize(model=model, config=base_config(
            zero_optimization=_zero(stage), gradient_clipping=1.0))
        counted = _CountOps()
        comm.add_observer(counted)
        try:
            _train(engine)
        finally:
            comm.remove_observer(counted)
        return [p.detach().clone() for p in model.parameters()], counted.ops

    alone, _ = train(grouped=False)
    comm.init_distributed(dist_backend="gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        grouped, ops = train(grouped=True)
    finally:
        dist.destroy_process_group()
    assert not {"reduce_scatter", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor"} & set(ops), ops
    assert ops  # the group is there: the gradient norm's all-reduce still goes through it
    for a, b in zip(alone, grouped):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_stage3_buckets_its_resident_units():
    """Parameters under the persistence threshold go into buckets of at most
    ``reduce_bucket_size`` elements (one reduce-scatter each a step), not one unit per module;
    the released units stay one per module, and every parameter is in exactly one unit."""
    from dslab.engine.zero.partition import bucket_resident_units

    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.LayerNorm(64),
                          nn.Linear(64, 4))
    named = [list(model.named_parameters())]
    planned = plan_module_units(model, named, persistence_threshold=300)
    bucketed = bucket_resident_units(planned, model, bucket_size=200)
    resident_before = [layout for layout, _, _ in planned if layout.resident]
    resident_after = [(layout, owner) for layout, _, owner in bucketed if layout.resident]
    assert len(resident_before) == 3  # the two norms and the last linear (260 elements)
    # in parameter order: norm 1 (64 + 64) and norm 2's weight, norm 2's bias, the linear's
    # weight (larger than a bucket: alone), its bias
    assert [layout.numel for layout, _ in resident_after] == [192, 64, 256, 4]
    assert all(layout.numel <= 200 or len(layout.names) == 1 for layout, _ in resident_after)
    assert all(owner is model for _, owner in resident_after)
    released = [(layout.names, owner) for layout, _, owner in bucketed if not layout.resident]
    assert released == [(layout.names, owner) for layout, _, owner in planned if not layout.resident]
    names = [n for layout, _, _ in bucketed for n in layout.names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("staging, staging_dtype", [(1, None), (3, None), (2, "bf16")])
def test_host_accumulation_sums_every_micro_step_in_order(staging, staging_dtype, monkeypatch):
    """offload_optimizer.accumulate_on = "cpu": the first shard of a window is copied, later ones
    added on the CPU by the worker through ``staging`` buffers (one: every shard waits for the
    addition before it), in bf16 with ``staging_dtype`` (each later shard rounded, the sum
    fp32: exactly the first shard plus the rounded later ones); the sums, and the squared norms taken on the window's last backward,
    are the plain sums' on fresh random shards; a new window starts from the next shard."""
    from dslab.engine.zero import offload as offload_module
    from dslab.engine.zero.offload import CpuOptimizerOffload
    from dslab.engine.zero.partition import FlatUnit, UnitLayout

    monkeypatch.setattr(offload_module, "WIDEN_CHUNK", 7)  # bf16 shards widened in several pieces, the last short
    g = torch.Generator().manual_seed(11 + staging)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (37, 5, 64, 19)]
    units = [FlatUnit(i, UnitLayout((f"p{i}",), (tuple(p.shape),), 0, False), [p], world_size=1, rank=0)
             for i, p in enumerate(params)]
    offload = CpuOptimizerOffload(units, pin_memory=False, chunk_numel=50, accumulate_on="cpu",
                                  staging_buffers=staging, staging_dtype=staging_dtype)
    try:
        for window in range(2):
            offload.zero_grad()
            micro_steps = 4
            expected = [torch.zeros(u.shard_numel) for u in units]
            for step in range(micro_steps):
                offload.begin(last_backward=step == micro_steps - 1)
                for i, unit in enumerate(units):
                    shard = torch.randn(unit.shard_numel, generator=g)
                    staged = shard if staging_dtype is None or step == 0 else shard.bfloat16().float()
                    expected[i] += staged
                    offload.receive(unit, shard)
            grads = offload.gradients()
            for i in range(len(units)):
                torch.testing.assert_close(grads[i], expected[i], rtol=1e-6, atol=1e-6, msg=f"window {window} unit {i}")
            want = sum(float(e.double().square().sum()) for e in expected)
            assert offload.squared_norm(torch.device("cpu")).item() == pytest.approx(want, rel=1e-5)
        assert offload._staging_made == staging
        assert {b.dtype for b in offload._staging_free} == {torch.bfloat16 if staging_dtype else torch.float32}
        stats = offload.stats()
        assert stats["host_adds"] == 2 * 3 * len(units)  # every micro-step after a window's first
        assert stats["grad_d2h_bytes"] == stats["grad_h2d_bytes"] == 0  # CPU shards: nothing crossed PCIe
        assert stats["add_s"] > 0 and stats["add_copy_wait_s"] >= 0  # the worker's own time, counted
    finally:
        offload.close()
    assert offload._worker is None


def test_resident_accumulation_hands_over_the_window_sum_once():
    """offload_optimizer.accumulate_on = "gpu_resident": a window's shards are summed where they
    are and the host's gradient buffer is written once, at the window's last backward (untouched
    before it); the sums and squared norms are the plain sums' on fresh random shards; a unit
    whose last shard came before the last backward is handed over by ``gradients()``; a new
    window starts from the next shard."""
    from dslab.engine.zero.offload import CpuOptimizerOffload
    from dslab.engine.zero.partition import FlatUnit, UnitLayout

    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (37, 5, 64)]
    units = [FlatUnit(i, UnitLayout((f"p{i}",), (tuple(p.shape),), 0, False), [p], world_size=1, rank=0)
             for i, p in enumerate(params)]
    offload = CpuOptimizerOffload(units, pin_memory=False, chunk_numel=50, accumulate_on="gpu_resident")
    for window in range(2):
        offload.zero_grad()
        micro_steps = 3
        expected = [torch.zeros(u.shard_numel) for u in units]
        for step in range(micro_steps):
            last = step == micro_steps - 1
            offload.begin(last_backward=last)
            for i, unit in enumerate(units):
                if last and i == 2:
                    continue  # unit 2 gets nothing at the last micro-step
                before = offload.grads[i].clone()
                shard = torch.randn(unit.shard_numel, generator=g)
                expected[i] += shard
                offload.receive(unit, shard)
                if last:
                    torch.testing.assert_close(offload.grads[i], expected[i], rtol=1e-6, atol=1e-6)
                else:
                    assert torch.equal(offload.grads[i], before), (window, step, i)  # not yet written
        grads = offload.gradients()
        for i in range(len(units)):
            torch.testing.assert_close(grads[i], expected[i], rtol=1e-6, atol=1e-6, msg=f"window {window} unit {i}")
        want = sum(float(e.double().square().sum()) for e in expected)
        assert offload.squared_norm(torch.device("cpu")).item() == pytest.approx(want, rel=1e-5)
    stats = offload.stats()
    assert stats["host_adds"] == 0 and stats["grad_h2d_bytes"] == 0
