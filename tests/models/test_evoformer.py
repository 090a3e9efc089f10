"""The Evoformer stack: the three kernel sets (dslab, torch, sdpa) against each other per sublayer
and for the whole stack from one state dict, with masks holding zeros (outputs, input gradients
and every parameter gradient in fp32); activation checkpointing; masking semantics; dropout;
mixed precision; the flop formula against the flops profiler; configs, presets and input checks."""

import importlib.util

import pytest
import torch
import torch.nn as nn

from dslab.kernels import dispatch, kernel_backend
from dslab.models.evoformer import (
    AF2_MSA_DROPOUT, AF2_PAIR_DROPOUT, EvoformerConfig, EvoformerStack, evoformer_finetune, evoformer_flops,
    evoformer_initial, evoformer_tiny, sublayer_flops,
)
from dslab.models.evoformer_blocks import GateLinear, shared_dropout
from dslab.profilers.flops import FlopsProfiler

HAVE_DSLAB_ATTENTION = importlib.util.find_spec("dslab.kernels.evoformer.evoformer_attention") is not None
DSLAB = pytest.param("dslab", marks=pytest.mark.skipif(
    not HAVE_DSLAB_ATTENTION, reason="dslab.kernels.evoformer.evoformer_attention is not there yet"))
FAST_SETS = ["sdpa", DSLAB]  # compared against "torch"
ALL_SETS = ["torch", *FAST_SETS]

BATCH = 2
# fp32: the sets differ in summation order only (the softmax scale applied to q or to the logits,
# the biases added one by one or summed first). TOL holds for the outputs; gradients, summed over
# many more terms, get an absolute tolerance of 1e-5 of their largest entry (_assert_close).
TOL = dict(rtol=1e-4, atol=1e-5)
# The pair bias's LayerNorm bias adds one constant to every logit of a row, which the softmax
# cancels: its gradient is zero in exact arithmetic and rounding noise in floating point.
ZERO_GRADIENT = ("msa_att_row.layer_norm_z.bias",)


def _assert_close(ours, ref, name=""):
    atol = 1e-5 * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=atol, msg=lambda s: f"{name}: {s}")


def _config(**overrides) -> EvoformerConfig:
    # A wider init than the default 0.02 so that every sublayer's update is far from zero and a
    # wrong attention shows in the outputs, not only in the gradients.
    return evoformer_tiny(**{"initializer_range": 0.2, **overrides})


def _inputs(seed: int, config: EvoformerConfig, batch: int = BATCH):
    """m, z and masks with zeros; every row and column of each mask keeps a one (see
    ``evoformer_blocks``: a query with every key masked has no well-defined attention)."""
    g = torch.Generator().manual_seed(seed)
    seqs, res = config.n_seq, config.n_res
    m = torch.randn(batch, seqs, res, config.c_m, generator=g)
    z = torch.randn(batch, res, res, config.c_z, generator=g)
    msa_mask = (torch.rand(batch, seqs, res, generator=g) > 0.3).float()
    msa_mask[:, 0, :] = 1
    msa_mask[:, :, 0] = 1
    pair_mask = (torch.rand(batch, res, res, generator=g) > 0.3).float()
    pair_mask[:, 0, :] = 1
    pair_mask[:, :, 0] = 1
    assert (msa_mask == 0).any() and (pair_mask == 0).any()
    return m, z, msa_mask, pair_mask


def _stacks(config: EvoformerConfig, kernel_sets) -> dict[str, EvoformerStack]:
    """One model per kernel set, all holding the torch set's weights from seed 0."""
    torch.manual_seed(0)
    state = EvoformerStack(config, kernels="torch").state_dict()
    models = {}
    for kernels in kernel_sets:
        model = EvoformerStack(config, kernels=kernels)
        model.load_state_dict(state)
        models[kernels] = model
    return models


def _run(module_call, module, tensors, seed=99):
    """Outputs of ``module_call(*tensors)`` and the gradients of a random linear function of them
    with respect to the float inputs and to every parameter of ``module``."""
    leaves = [t.clone().requires_grad_(t.dtype.is_floating_point and t.dim() == 4) for t in tensors]
    out = module_call(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    module.zero_grad(set_to_none=True)
    loss.backward()
    grads = {f"input{i}": t.grad for i, t in enumerate(leaves) if t.grad is not None}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return [o.detach() for o in outs], grads


# How each sublayer of a block is called on (m, z, msa_mask, pair_mask).
SUBLAYERS = {
    "msa_att_row": lambda block, m, z, mm, pm: block.msa_att_row(m, z, mm),
    "msa_att_col": lambda block, m, z, mm, pm: block.msa_att_col(m, mm),
    "msa_transition": lambda block, m, z, mm, pm: block.msa_transition(m, mm),
    "outer_product_mean": lambda block, m, z, mm, pm: block.outer_product_mean(m, mm),
    "tri_mul_out": lambda block, m, z, mm, pm: block.tri_mul_out(z, pm),
    "tri_mul_in": lambda block, m, z, mm, pm: block.tri_mul_in(z, pm),
    "tri_att_start": lambda block, m, z, mm, pm: block.tri_att_start(z, pm),
    "tri_att_end": lambda block, m, z, mm, pm: block.tri_att_end(z, pm),
    "pair_transition": lambda block, m, z, mm, pm: block.pair_transition(z, pm),
}


@pytest.mark.parametrize("kernels", FAST_SETS)
@pytest.mark.parametrize("sublayer", list(SUBLAYERS))
def test_each_sublayer_matches_the_torch_set(sublayer, kernels):
    config = _config(n_seq=6, n_res=9)
    models = _stacks(config, ["torch", kernels])
    inputs = _inputs(1, config)
    results = {}
    for name, model in models.items():
        block = model.blocks[0]
        sub = getattr(block, sublayer)
        results[name] = _run(lambda *t, block=block: SUBLAYERS[sublayer](block, *t), sub, inputs)
    (ref_out, ref_grads), (out, grads) = results["torch"], results[kernels]
    assert ref_out[0].abs().mean() > 1e-2  # a real update, not a near-zero one
    torch.testing.assert_close(out, ref_out, **TOL)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert ref is not None and (ref.abs().sum() > 0 or name.endswith(ZERO_GRADIENT)), name
        _assert_close(grads[name], ref, name)


@pytest.mark.skipif(not (HAVE_DSLAB_ATTENTION and dispatch.triton_available() and dispatch.interpreting()),
                    reason="needs dslab.kernels.evoformer.evoformer_attention, triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("sublayer", ["msa_att_row", "msa_att_col", "tri_att_start", "tri_att_end"])
def test_triton_interpreter_path_matches_the_torch_set(sublayer):
    """The dslab set with its attention and layer norms forced onto their Triton kernels
    (interpreted on CPU): the row attention with both biases and the ending-node attention on the
    transposed pair stack, and the column attention, both attending down columns through transposed
    views, and the starting-node attention (slow under the interpreter, so the attentions only)."""
    config = _config()
    models = _stacks(config, ["torch", "dslab"])
    inputs = _inputs(11, config)
    results = {}
    for name, model in models.items():
        block = model.blocks[0]
        with kernel_backend("triton" if name == "dslab" else "torch"):
            results[name] = _run(lambda *t, block=block: SUBLAYERS[sublayer](block, *t),
                                 getattr(block, sublayer), inputs)
    (ref_out, ref_grads), (out, grads) = results["torch"], results["dslab"]
    torch.testing.assert_close(out, ref_out, **TOL)
    for name, ref in ref_grads.items():
        _assert_close(grads[name], ref, name)


@pytest.mark.parametrize("kernels", FAST_SETS)
def test_stack_matches_the_torch_set(kernels):
    config = _config()
    models = _stacks(config, ["torch", kernels])
    inputs = _inputs(2, config)
    (ref_out, ref_grads), (out, grads) = (_run(model, model, inputs) for model in models.values())
    for ours, ref, x in zip(out, ref_out, inputs[:2], strict=True):
        torch.testing.assert_close(ours - x, ref - x, **TOL)  # the updates, not dominated by the residual
    for name, ref in ref_grads.items():
        _assert_close(grads[name], ref, name)


def test_same_seed_builds_the_same_parameters_in_every_set():
    states = {}
    for kernels in ("torch", "sdpa", "dslab"):
        torch.manual_seed(3)
        states[kernels] = EvoformerStack(_config(), kernels=kernels).state_dict()
    for kernels in ("sdpa", "dslab"):
        assert states[kernels].keys() == states["torch"].keys()
        for name, value in states["torch"].items():
            assert torch.equal(states[kernels][name], value), name


def test_initialisation():
    torch.manual_seed(0)
    model = EvoformerStack(evoformer_tiny(c_m=64, c_z=64), kernels="torch")
    block = model.blocks[0]
    assert isinstance(block.msa_att_row.mha.linear_g, GateLinear)
    for name, p in model.named_parameters():
        if "layer_norm" in name:
            assert torch.all(p == (1.0 if name.endswith("weight") else 0.0)), name
        elif name.endswith("bias"):
            gate = isinstance(model.get_submodule(name.rsplit(".", 1)[0]), GateLinear)
            assert torch.all(p == (1.0 if gate else 0.0)), name
        else:
            assert abs(p.std().item() - 0.02) < 0.01 and abs(p.mean().item()) < 0.01, name


@pytest.mark.parametrize("kernels", ALL_SETS)
def test_every_parameter_gets_a_gradient(kernels):
    config = evoformer_tiny()  # the default init: every residual branch already has a gradient
    model = _stacks(config, [kernels])[kernels]
    _, grads = _run(model, model, _inputs(3, config))
    for name, grad in grads.items():
        assert grad is not None and torch.isfinite(grad).all(), name
        if name.endswith(ZERO_GRADIENT):
            assert grad.abs().max() < 1e-5, name
        else:
            assert grad.abs().max() > 1e-4, name


@pytest.mark.parametrize("kernels", ["torch", DSLAB])
def test_checkpoint_blocks_gives_the_same_outputs_and_gradients(kernels):
    plain = _stacks(_config(), [kernels])[kernels]
    recomputed = EvoformerStack(_config(checkpoint_blocks=True), kernels=kernels)
    recomputed.load_state_dict(plain.state_dict())
    calls = []
    recomputed.blocks[1].tri_att_end.register_forward_hook(lambda *_: calls.append(1))
    inputs = _inputs(4, plain.config)
    (ref_out, ref_grads), (out, grads) = _run(plain, plain, inputs), _run(recomputed, recomputed, inputs)
    assert len(calls) == 2  # the forward, then the recomputation in the backward
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-6, atol=1e-7, msg=lambda s, name=name: f"{name}: {s}")


@pytest.mark.parametrize("kernels", ALL_SETS)
def test_no_masks_means_all_ones(kernels):
    config = _config()
    model = _stacks(config, [kernels])[kernels]
    m, z, msa_mask, pair_mask = _inputs(5, config)
    with torch.no_grad():
        implicit = model(m, z)
        explicit = model(m, z, torch.ones_like(msa_mask), torch.ones_like(pair_mask))
        masked = model(m, z, msa_mask, pair_mask)
    torch.testing.assert_close(implicit, explicit, rtol=0, atol=0)
    assert not torch.allclose(masked[1], implicit[1])


@pytest.mark.parametrize("kernels", ALL_SETS)
def test_masked_msa_entries_reach_neither_the_pair_nor_other_entries(kernels):
    """A masked MSA entry is no key of either MSA attention, is zeroed before the outer product and
    only updates itself: changing it changes no other output."""
    config = _config()
    model = _stacks(config, [kernels])[kernels]
    m, z, msa_mask, pair_mask = _inputs(6, config)
    masked = msa_mask == 0
    changed = torch.where(masked[..., None], torch.randn_like(m) * 5, m)
    with torch.no_grad():
        m_a, z_a = model(m, z, msa_mask, pair_mask)
        m_b, z_b = model(changed, z, msa_mask, pair_mask)
    torch.testing.assert_close(z_b, z_a, **TOL)
    torch.testing.assert_close(m_b[~masked], m_a[~masked], **TOL)
    assert not torch.allclose(m_b[masked], m_a[masked])


@pytest.mark.parametrize("kernels", ALL_SETS)
def test_dropout_is_reproducible_and_off_in_eval(kernels):
    config = _config(msa_dropout=AF2_MSA_DROPOUT, pair_dropout=AF2_PAIR_DROPOUT)
    model = EvoformerStack(config, kernels=kernels)
    without = EvoformerStack(_config(), kernels=kernels)
    without.load_state_dict(model.state_dict())
    m, z, msa_mask, pair_mask = _inputs(7, config)

    def run(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return model(m, z, msa_mask, pair_mask)

    torch.testing.assert_close(run(1), run(1), rtol=0, atol=0)
    assert not torch.allclose(run(1)[1], run(2)[1])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(m, z, msa_mask, pair_mask), without(m, z, msa_mask, pair_mask),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("shared_dim", [-3, -2])
def test_shared_dropout_shares_its_mask_along_one_dim(shared_dim):
    torch.manual_seed(0)
    out = shared_dropout(torch.ones(2, 6, 6, 8), 0.5, shared_dim, training=True)
    assert set(out.unique().tolist()) == {0.0, 2.0}
    first = out.select(shared_dim, 0).unsqueeze(shared_dim)
    assert torch.equal(out, first.expand_as(out))
    assert torch.equal(shared_dropout(out, 0.5, shared_dim, training=False), out)


@pytest.mark.parametrize("kernels", ALL_SETS)
def test_mixed_precision(kernels):
    """bf16 autocast over fp32 parameters keeps the fp32 residual streams and stays near the fp32
    result; a model cast to bf16 keeps bf16 streams."""
    config = _config()
    model = _stacks(config, [kernels])[kernels]
    m, z, msa_mask, pair_mask = _inputs(8, config)
    with torch.no_grad():
        ref = model(m, z, msa_mask, pair_mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(m, z, msa_mask, pair_mask)
        model.to(torch.bfloat16)
        low = model(m.bfloat16(), z.bfloat16(), msa_mask.bfloat16(), pair_mask.bfloat16())
    assert [t.dtype for t in mixed] == [torch.float32] * 2
    assert [t.dtype for t in low] == [torch.bfloat16] * 2
    for ours, exact, x in zip(mixed, ref, (m, z), strict=True):
        update, ref_update = ours - x, exact - x
        assert (update - ref_update).abs().max() <= 0.05 * ref_update.abs().max()
    for ours, exact in zip(low, ref, strict=True):
        assert torch.isfinite(ours).all() and (ours.float() - exact).abs().max() <= 0.05 * exact.abs().max()


def _profile_forward(model, inputs) -> FlopsProfiler:
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    with torch.no_grad():
        model(*inputs)
    profiler.stop_profile()
    return profiler


# Every width different, so that a swapped factor in a formula shows.
FLOPS_CONFIG = dict(blocks=2, n_seq=6, n_res=9, c_m=20, c_z=12, msa_heads=3, pair_heads=2, head_dim=16,
                    opm_hidden=5, tri_mul_hidden=7, transition_factor=3)


@pytest.mark.parametrize("kernels", ALL_SETS)
def test_flops_match_the_profiler(kernels):
    """The formula equals the profiler's count exactly, per sublayer and for the stack. The sdpa set's
    attention runs as the CPU fused kernel, which the profiler keeps beside its total; the dslab
    set's runs its PyTorch reference on CPU."""
    config = EvoformerConfig(**FLOPS_CONFIG)
    model = EvoformerStack(config, kernels=kernels)
    profiler = _profile_forward(model, _inputs(9, config, batch=3))
    records = profiler.records()
    counted = profiler.get_total_flops(phase="forward") + records["cpu_attention_flops"]["forward"]
    assert counted == evoformer_flops(config, batch=3)
    if kernels != "sdpa":
        modules = {m["name"]: m for m in records["modules"]}
        for name, flops in sublayer_flops(config, batch=3).items():
            for block in range(config.blocks):
                assert modules[f"blocks.{block}.{name}"]["forward_flops"] == flops, name


def test_flops_formula_by_hand():
    """The flops of the default widths at one block, N_seq 128, N_res 256, written out term by term."""
    config = evoformer_initial(blocks=1)
    s, r = 128, 256
    attention_msa_row = 5 * 2 * s * r * 256 * 256 + 4 * s * 8 * r * r * 32 + 2 * r * r * 128 * 8
    attention_msa_col = 5 * 2 * s * r * 256 * 256 + 4 * r * 8 * s * s * 32
    transition_msa = 2 * 2 * s * r * 256 * 1024
    opm = 2 * 2 * s * r * 256 * 32 + 2 * s * r * r * 32 * 32 + 2 * s * r * r + 2 * r * r * 1024 * 128
    tri_mul = 4 * 2 * r * r * 128 * 128 + 2 * r * r * 128 * 128 + 2 * r * r * 128 * 128 + 2 * 128 * r ** 3
    tri_att = 5 * 2 * r * r * 128 * 128 + 4 * r * 4 * r * r * 32 + 2 * r * r * 128 * 4
    transition_pair = 2 * 2 * r * r * 128 * 512
    total = attention_msa_row + attention_msa_col + transition_msa + opm + 2 * tri_mul + 2 * tri_att + transition_pair
    assert evoformer_flops(config) == total
    assert evoformer_flops(evoformer_initial(), batch=2) == 8 * total
    with pytest.raises(ValueError, match="batch"):
        evoformer_flops(config, batch=0)


def test_presets():
    initial, finetune, tiny = evoformer_initial(), evoformer_finetune(), evoformer_tiny()
    assert (initial.blocks, initial.n_seq, initial.n_res) == (4, 128, 256)
    assert (finetune.blocks, finetune.n_seq, finetune.n_res) == (4, 512, 384)
    for config in (initial, finetune):
        assert (config.c_m, config.c_z, config.msa_heads, config.pair_heads, config.head_dim) == (256, 128, 8, 4, 32)
        assert (config.opm_hidden, config.tri_mul_hidden, config.transition_factor) == (32, 128, 4)
        assert (config.msa_dropout, config.pair_dropout, config.checkpoint_blocks) == (0.0, 0.0, False)
    assert (tiny.blocks, tiny.c_m, tiny.c_z, tiny.head_dim, tiny.n_seq, tiny.n_res) == (2, 32, 16, 16, 5, 7)
    assert evoformer_initial(blocks=48, checkpoint_blocks=True).blocks == 48


def test_full_size_parameter_count_on_meta():
    """One block at OpenFold's widths, counted by hand (weights + biases)."""
    c_m, c_z, hd = 256, 128, 32 * 8
    gated_msa = 3 * c_m * hd + (c_m * hd + hd) + (hd * c_m + c_m)
    gated_pair = 3 * c_z * 128 + (c_z * 128 + 128) + (128 * c_z + c_z)
    block = (
        2 * c_m + 2 * c_z + c_z * 8 + gated_msa                                  # msa_att_row
        + 2 * c_m + gated_msa                                                    # msa_att_col
        + 2 * c_m + (c_m * 4 * c_m + 4 * c_m) + (4 * c_m * c_m + c_m)           # msa_transition
        + 2 * c_m + 2 * (c_m * 32 + 32) + (32 * 32 * c_z + c_z)                 # outer_product_mean
        + 2 * (2 * c_z + 4 * (c_z * 128 + 128) + (c_z * c_z + c_z) + (128 * c_z + c_z) + 2 * 128)  # tri_mul
        + 2 * (2 * c_z + c_z * 4 + gated_pair)                                   # tri_att
        + 2 * c_z + (c_z * 4 * c_z + 4 * c_z) + (4 * c_z * c_z + c_z)           # pair_transition
    )
    with torch.device("meta"):
        model = EvoformerStack(evoformer_initial(), kernels="dslab")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 4 * block


@pytest.mark.parametrize(("field", "value"), [
    ("blocks", 0), ("n_seq", -1), ("n_res", 2.5), ("c_m", 0), ("c_z", None), ("msa_heads", True),
    ("pair_heads", 0), ("head_dim", 0), ("opm_hidden", 0), ("tri_mul_hidden", -4), ("transition_factor", 0),
    ("msa_dropout", 1.0), ("pair_dropout", -0.1), ("checkpoint_blocks", 1), ("initializer_range", 0.0),
])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        evoformer_tiny(**{field: value})
    config = evoformer_tiny()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        EvoformerStack(config, kernels="torch")


def test_unknown_kernel_set_is_an_error():
    with pytest.raises(ValueError, match="kernels='triton'.*dslab, torch, sdpa"):
        EvoformerStack(evoformer_tiny(), kernels="triton")


@pytest.mark.skipif(not HAVE_DSLAB_ATTENTION, reason="dslab.kernels.evoformer.evoformer_attention is not there yet")
def test_dslab_set_rejects_a_head_dim_its_kernel_lacks():
    with pytest.raises(ValueError, match="head_dim=8"):
        EvoformerStack(evoformer_tiny(head_dim=8), kernels="dslab")
    EvoformerStack(evoformer_tiny(head_dim=8), kernels="torch")


def test_bad_input_shapes_name_the_expected_shape():
    config = evoformer_tiny()
    model = EvoformerStack(config, kernels="torch")
    m, z, msa_mask, pair_mask = _inputs(10, config)
    with pytest.raises(ValueError, match=r"m must be \[batch, N_seq, N_res, c_m=32\]"):
        model(m[0], z)
    with pytest.raises(ValueError, match=r"m must be .*got shape \(2, 5, 7, 31\)"):
        model(m[..., :31], z)
    with pytest.raises(ValueError, match=r"z must be \[batch, N_res, N_res, c_z\] = \(2, 7, 7, 16\)"):
        model(m, z[:, :6])
    with pytest.raises(ValueError, match=r"msa_mask must be \[batch, N_seq, N_res\] = \(2, 5, 7\)"):
        model(m, z, msa_mask[:, :, :6])
    with pytest.raises(ValueError, match=r"pair_mask must be \[batch, N_res, N_res\] = \(2, 7, 7\)"):
        model(m, z, msa_mask, pair_mask[:1])


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_projections_match_separate_linears(autocast):
    """One matmul over concatenated weights: the same outputs and gradients as the separate
    Linears, an unused output included (its weight gets no gradient), fp32 weights under autocast."""
    from dslab.models.evoformer_blocks import fused_projections

    torch.manual_seed(3)
    layers = [nn.Linear(12, width, bias=False) for width in (8, 16, 8)]
    x = torch.randn(2, 5, 7, 12, requires_grad=True)
    grads = [torch.randn(2, 5, 7, 8), torch.randn(2, 5, 7, 16), None]
    results = []
    for fused in (True, False):
        for p in (x, *(layer.weight for layer in layers)):
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = fused_projections(x, layers) if fused else [layer(x) for layer in layers]
        torch.autograd.backward([o for o, g in zip(outs, grads) if g is not None],
                                [g.to(outs[0].dtype) for g in grads if g is not None])
        results.append(([o.detach() for o in outs], x.grad.clone(), [layer.weight.grad for layer in layers]))
    (outs, dx, dws), (ref_outs, ref_dx, ref_dws) = results
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    for got, ref in zip(outs, ref_outs):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(dx, ref_dx, **tol)
    assert dws[2] is None and ref_dws[2] is None
    for got, ref in zip(dws[:2], ref_dws[:2]):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, **tol)
