"""CUDA graphs over stacks holding dslab MoE layers (GPT-2-MoE, the MoE layer benchmark's model):
graphed training matches eager training step for step, the load-balancing loss reaches the gate
through the graph, and the routing statistics follow the replays."""

import pytest
import torch

from dslab.bench.moe_layer import MoELayerModel, moe_layer_tiny
from dslab.models.gpt2_moe import GPT2MoELMHeadModel, gpt2_moe_tiny

pytestmark = pytest.mark.gpu


def _ids(seed, batch=3, seq=40):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 1000, (batch, seq), generator=g).cuda()


def _gpt2_pair(**overrides):
    torch.manual_seed(0)
    cfg = gpt2_moe_tiny(dropout=0.0, moe_loss_coeff=0.5, **overrides)
    graphed = GPT2MoELMHeadModel(cfg, "dslab").cuda()
    eager = GPT2MoELMHeadModel(cfg, "dslab").cuda()
    eager.load_state_dict(graphed.state_dict())
    graphed.enable_cuda_graphs()
    return graphed, eager


def _train(model, steps, autocast_dtype, batch_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(**batch_fn(step))
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _lm_batch(step):
    ids = _ids(step)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("drop_tokens", [False, True])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_graphed_gpt2_moe_training_matches_eager(drop_tokens, autocast_dtype):
    graphed, eager = _gpt2_pair(k=1, drop_tokens=drop_tokens, use_rts=False)
    got = _train(graphed, 5, autocast_dtype, _lm_batch)
    want = _train(eager, 5, autocast_dtype, _lm_batch)
    tol = 1e-4 if autocast_dtype is None else 2e-2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=tol, atol=tol)
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=name)
    stats = graphed.cuda_graph_stats
    assert stats["captures"] == 1 and stats["replays"] == 5, stats
    for got_layer, want_layer in zip(graphed.moe_stats(), eager.moe_stats()):
        got_counts, want_counts = got_layer["exp_counts"], want_layer["exp_counts"]
        assert int(got_counts.sum()) == int(want_counts.sum())
        if autocast_dtype is None:
            assert torch.equal(got_counts, want_counts)
            assert torch.equal(got_layer["dropped"], want_layer["dropped"])
        else:  # bf16 rounding (atomics in the attention backward) may flip a near-tied token's expert
            assert int((got_counts - want_counts).abs().sum()) <= 2 * max(1, int(want_counts.sum()) // 100)


def test_load_balancing_loss_reaches_the_gate_through_the_graph():
    graphed, eager = _gpt2_pair(k=1, drop_tokens=False)
    gate = "layers.1.mlp.moe.deepspeed_moe.gate.wg.weight"
    for model in (graphed, eager):
        for _ in range(2):  # the graphed model captures on its first call, replays on the second
            model.zero_grad(set_to_none=True)
            loss = model(**_lm_batch(0))
            loss.backward()
    got = dict(graphed.named_parameters())[gate].grad
    want = dict(eager.named_parameters())[gate].grad
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(graphed.aux_loss(), eager.aux_loss(), rtol=1e-5, atol=1e-6)
    assert graphed.cuda_graph_stats["replays"] == 2


def test_routing_stats_follow_replays_after_an_eager_call():
    graphed, eager = _gpt2_pair(k=1, drop_tokens=False)
    for model in (graphed, eager):
        _train(model, 1, None, _lm_batch)
        model.eval()
        with torch.no_grad():
            model(_ids(50))
        model.train()
        _train(model, 1, None, lambda step: _lm_batch(7))
    assert graphed.cuda_graph_stats["eager_eval"] == 1
    for got_layer, want_layer in zip(graphed.moe_stats(), eager.moe_stats()):
        assert torch.equal(got_layer["exp_counts"], want_layer["exp_counts"])


def test_graphed_top2_trains_with_fresh_second_choice_noise():
    graphed, _ = _gpt2_pair(k=2, drop_tokens=False)
    losses = _train(graphed, 4, torch.bfloat16, lambda step: _lm_batch(0))
    assert graphed.cuda_graph_stats["replays"] == 4
    assert all(torch.isfinite(torch.tensor(losses)))
    for layer in graphed.moe_stats():
        assert int(layer["exp_counts"].sum()) == 2 * 3 * 40


def test_graphed_moe_layer_model_matches_eager():
    torch.manual_seed(0)
    cfg = moe_layer_tiny(k=1)
    graphed = MoELayerModel(cfg, "dslab").cuda()
    eager = MoELayerModel(cfg, "dslab").cuda()
    eager.load_state_dict(graphed.state_dict())
    graphed.enable_cuda_graphs()

    def batch(step):
        g = torch.Generator(device="cpu").manual_seed(step)
        return {"hidden_states": torch.randn(4, 32, cfg.hidden, generator=g).cuda()}

    got = _train(graphed, 4, None, batch)
    want = _train(eager, 4, None, batch)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)
    assert graphed.cuda_graph_stats["replays"] == 4
    assert torch.equal(graphed.moe_stats()[0]["exp_counts"], eager.moe_stats()[0]["exp_counts"])
