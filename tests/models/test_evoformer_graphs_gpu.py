"""CUDA graphs over the Evoformer stack: graphed training matches eager training step for step
(two differentiable streams, m and z, and two mask constants), dropout draws fresh masks on every
replay, and a change of crop captures again."""

import pytest
import torch

from dslab.bench.evoformer import EvoformerTrainModel, evoformer_batch
from dslab.models.evoformer import evoformer_tiny

pytestmark = pytest.mark.gpu


def _pair(**overrides):
    torch.manual_seed(0)
    cfg = evoformer_tiny(n_seq=6, n_res=20, **overrides)
    graphed = EvoformerTrainModel(cfg, "dslab").cuda()
    eager = EvoformerTrainModel(cfg, "dslab").cuda()
    eager.load_state_dict(graphed.state_dict())
    graphed.enable_cuda_graphs()
    return cfg, graphed, eager


def _train(model, cfg, steps, autocast_dtype, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    dtype = autocast_dtype or torch.float32
    losses = []
    for step in range(steps):
        batch = evoformer_batch(cfg, 1, dtype, seed=step, device="cuda")
        with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(**batch)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_graphed_evoformer_training_matches_eager(autocast_dtype):
    cfg, graphed, eager = _pair()
    got = _train(graphed, cfg, 5, autocast_dtype)
    want = _train(eager, cfg, 5, autocast_dtype)
    tol = 1e-4 if autocast_dtype is None else 3e-2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=tol, atol=tol)
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=name)
    stats = graphed.cuda_graph_stats
    assert stats["captures"] == 1 and stats["replays"] == 5, stats


def test_input_gradients_flow_through_the_graph():
    cfg, graphed, eager = _pair()
    for model in (graphed, eager):
        for _ in range(2):  # capture on the first call, replay on the second
            model.zero_grad(set_to_none=True)
            model(**evoformer_batch(cfg, 1, torch.float32, seed=3, device="cuda")).backward()
    for name in ("m_scale", "z_scale"):
        got, want = getattr(graphed, name).grad, getattr(eager, name).grad
        assert got is not None and float(got.abs()) > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_dropout_draws_new_masks_on_every_replay():
    cfg, graphed, _ = _pair(msa_dropout=0.15, pair_dropout=0.25)
    losses = _train(graphed, cfg, 4, None, lr=0.0)
    batch = evoformer_batch(cfg, 1, torch.float32, seed=0, device="cuda")
    replayed = []
    for _ in range(3):
        loss = graphed(**batch)
        loss.backward()
        replayed.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert len(set(replayed)) == 3, replayed  # fixed weights and batch: only the masks differ
    assert graphed.cuda_graph_stats["captures"] == 1


def test_new_crop_captures_again():
    cfg, graphed, eager = _pair()
    _train(graphed, cfg, 2, None)
    other = evoformer_tiny(n_seq=4, n_res=12)
    batch = evoformer_batch(other, 1, torch.float32, seed=9, device="cuda")
    graphed.zero_grad(set_to_none=True)
    graphed(**batch).backward()
    assert graphed.cuda_graph_stats["captures"] == 2
