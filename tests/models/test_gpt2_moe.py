"""GPT-2-MoE on CPU: shapes, the two kernel sets computing one function (loss and gradients,
top-1 and top-2, dropless and with capacity dropping), the routing it reports, the load-balancing
loss in the loss, and the checks of its config."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dslab.models.gpt2 import gpt2_tiny
from dslab.models.gpt2_moe import (GPT2MoEConfig, GPT2MoELMHeadModel, check_graphable, gpt2_moe_124m_8e,
                                   gpt2_moe_tiny, moe_capacity)
from dslab.models.moe_naive import NaiveMoE


def tiny(**overrides) -> GPT2MoEConfig:
    """4 layers (MoE in 1 and 3), 4 experts, no dropout: deterministic forward and backward."""
    return gpt2_moe_tiny(layers=4, dropout=0.0, **overrides)


def batch(seq: int = 24, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, 1000, (rows, seq), generator=torch.Generator().manual_seed(7))


def loss_and_grads(config: GPT2MoEConfig, kernels: str, ids: torch.Tensor, train: bool = True):
    torch.manual_seed(0)
    model = GPT2MoELMHeadModel(config, kernels).train(train)
    torch.manual_seed(1)  # the gate's random draws (Gumbel noise, RTS priorities)
    loss = model(ids, ids)
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_layout_shapes_and_parameter_count():
    with torch.device("meta"):
        model = GPT2MoELMHeadModel(gpt2_moe_124m_8e(), kernels="torch")
    assert model.config.moe_layers == [1, 3, 5, 7, 9, 11]
    assert sum(p.numel() for p in model.parameters()) == 322_818_816
    experts = model.layers[1].mlp.moe.deepspeed_moe.experts
    assert tuple(experts.w1.shape) == (8, 3072, 768) and tuple(experts.w2.shape) == (8, 768, 3072)
    assert type(model.layers[0].mlp).__name__ == "FeedForward"

    model = GPT2MoELMHeadModel(tiny(), kernels="dslab")
    ids = batch()
    assert model(ids).shape == (2, 24, 1000)
    assert [s["layer"] for s in model.moe_stats()] == [1, 3]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop_tokens", [False, True], ids=["dropless", "capacity"])
def test_kernel_sets_compute_the_same_function(k, drop_tokens):
    """Same seed -> same weights, same routing (top-2 draws Gumbel noise, top-1 with capacity
    draws RTS priorities), same loss and gradients; capacity_factor 0.5 makes the layers drop."""
    config = tiny(k=k, drop_tokens=drop_tokens, capacity_factor=0.5)
    ids = batch()
    dslab, loss_d, grads_d = loss_and_grads(config, "dslab", ids)
    naive, loss_t, grads_t = loss_and_grads(config, "torch", ids)
    assert dslab.state_dict().keys() == naive.state_dict().keys()
    torch.testing.assert_close(loss_d, loss_t, rtol=1e-5, atol=1e-6)
    for name, grad in grads_d.items():
        torch.testing.assert_close(grad, grads_t[name], rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(dslab.moe_stats(), naive.moe_stats()):
        assert torch.equal(a["exp_counts"], b["exp_counts"]) and int(a["dropped"]) == int(b["dropped"])
    dropped = sum(int(s["dropped"]) for s in dslab.moe_stats())
    assert (dropped > 0) == drop_tokens


def test_moe_stats_report_the_routing_without_a_host_copy():
    config = tiny(k=2, drop_tokens=True, capacity_factor=0.5)
    model, _, _ = loss_and_grads(config, "dslab", batch())
    for s in model.moe_stats():
        counts = s["exp_counts"]
        assert isinstance(counts, torch.Tensor) and counts.shape == (4,) and counts.device == s["dropped"].device
        assert int(counts.sum()) == s["tokens"] * s["k"] == 48 * 2
        capacity = moe_capacity(config, s["tokens"], training=True)
        assert s["capacity"] == capacity == 12  # ceil(48 / 4 * 0.5 * 2)
        assert int(s["dropped"]) == int((counts - capacity).clamp(min=0).sum())
    model.eval()
    model(batch())
    assert model.moe_stats()[0]["capacity"] == 24  # eval_capacity_factor 1.0
    with pytest.raises(ValueError, match="no forward has run"):
        GPT2MoELMHeadModel(tiny(), "torch").moe_stats()


@pytest.mark.parametrize("kernels", ["dslab", "torch"])
def test_loss_includes_the_load_balancing_loss(kernels):
    ids = batch()
    with_aux, loss, _ = loss_and_grads(tiny(moe_loss_coeff=0.5), kernels, ids)
    without, lm_loss, _ = loss_and_grads(tiny(moe_loss_coeff=0.0), kernels, ids)
    aux = torch.stack([ffn.l_aux for _, ffn in with_aux.moe_feed_forwards()]).sum().detach()
    assert aux > 0
    torch.testing.assert_close(loss, lm_loss + 0.5 * aux, rtol=1e-5, atol=1e-6)
    router = next(p for n, p in with_aux.named_parameters() if n.endswith("gate.wg.weight"))
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_state_dict_moves_between_kernel_sets():
    torch.manual_seed(3)
    dslab = GPT2MoELMHeadModel(tiny(k=2), "dslab").eval()
    torch.manual_seed(4)
    naive = GPT2MoELMHeadModel(tiny(k=2), "torch").eval()
    naive.load_state_dict(dslab.state_dict())
    ids = batch()
    torch.testing.assert_close(dslab(ids), naive(ids), rtol=1e-5, atol=1e-5)


def test_cuda_graphs_are_refused_where_the_moe_syncs_and_hf_conversion_is_not_offered():
    model = GPT2MoELMHeadModel(tiny(), "torch")
    with pytest.raises(ValueError, match="cuda_graphs.enabled.*'torch' kernel set"):
        model.enable_cuda_graphs(True)
    model.enable_cuda_graphs(False)
    assert model.cuda_graph_stats == {}
    with pytest.raises(ValueError, match="ep_size=2.*cannot be captured"):
        check_graphable(tiny(ep_size=2), "dslab")
    with pytest.raises(NotImplementedError):
        model.to_hf_state_dict()


def test_graph_enabled_model_off_cuda_runs_eagerly_with_the_same_loss_and_keeps_no_graph():
    torch.manual_seed(5)
    plain = GPT2MoELMHeadModel(tiny(k=2), "dslab")
    graphed = GPT2MoELMHeadModel(tiny(k=2), "dslab")
    graphed.load_state_dict(plain.state_dict())
    graphed.enable_cuda_graphs(True)
    ids = batch()
    torch.manual_seed(6)
    loss_plain = plain(ids, labels=ids)
    torch.manual_seed(6)
    loss_graphed = graphed(ids, labels=ids)
    torch.testing.assert_close(loss_graphed, loss_plain)
    assert graphed.cuda_graph_stats == {"eager_not_cuda": 1}
    loss_graphed.backward()
    loss_plain.backward()
    gate = "layers.1.mlp.moe.deepspeed_moe.gate.wg.weight"
    grads = {name: p.grad for name, p in graphed.named_parameters()}
    torch.testing.assert_close(grads[gate], dict(plain.named_parameters())[gate].grad)
    for _, ffn in graphed.moe_feed_forwards():
        assert ffn._live_l_aux is None and ffn.l_aux.grad_fn is None
        assert ffn.moe.deepspeed_moe.l_aux.grad_fn is None
    expected = torch.stack([ffn.l_aux for _, ffn in plain.moe_feed_forwards()]).sum()
    torch.testing.assert_close(graphed.aux_loss(), expected)


@pytest.mark.parametrize("field,value,match", [
    ("k", 3, "k must be 1 or 2"), ("num_experts", 0, "num_experts must be a positive int"),
    ("ep_size", 3, "ep_size=3 must divide num_experts=4"), ("capacity_factor", 0, "capacity_factor must be"),
    ("noisy_gate_policy", "Gumbel", "noisy_gate_policy"), ("drop_tokens", 1, "drop_tokens must be a bool"),
    ("moe_loss_coeff", -1.0, "moe_loss_coeff"), ("heads", 5, "heads=5 must divide hidden=128"),
])
def test_config_checks_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(gpt2_moe_tiny(), **{field: value})


def test_naive_layer_refuses_expert_parallelism_and_kernels_are_checked():
    with pytest.raises(ValueError, match="ep_size=2"):
        NaiveMoE(16, 32, num_experts=4, ep_size=2)
    with pytest.raises(ValueError, match="kernels='jax' is not a kernel set"):
        GPT2MoELMHeadModel(tiny(), "jax")
    with pytest.raises(ValueError, match="GPT2MoEConfig"):
        GPT2MoELMHeadModel(gpt2_tiny(), "torch")


@pytest.mark.parametrize("tokens,experts,factor,k,min_capacity",
                         [(10, 4, 1.2, 1, 1), (48, 4, 0.5, 2, 4), (7, 8, 1.0, 2, 4), (1000, 3, 1.1, 1, 4)])
def test_naive_capacity_is_deepspeeds(tokens, experts, factor, k, min_capacity):
    from dslab.moe.gating import gate_capacity

    layer = NaiveMoE(16, 32, num_experts=experts, k=k, capacity_factor=factor, min_capacity=min_capacity)
    assert layer.capacity(tokens) == gate_capacity(tokens, experts, factor * k, min_capacity)
