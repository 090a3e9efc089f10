"""The Evoformer's CUDA-graph switch off CUDA: the graphed stack runs eagerly with the eager
stack's loss and gradients, says why, and refuses activation checkpointing."""

import pytest
import torch

from dslab.bench.evoformer import EvoformerTrainModel, evoformer_batch
from dslab.models.evoformer import evoformer_tiny


def test_graph_switch_off_cuda_runs_eagerly_with_the_same_results():
    torch.manual_seed(0)
    cfg = evoformer_tiny()
    graphed, eager = EvoformerTrainModel(cfg, "torch"), EvoformerTrainModel(cfg, "torch")
    eager.load_state_dict(graphed.state_dict())
    graphed.enable_cuda_graphs()
    batch = evoformer_batch(cfg, 1, torch.float32, seed=1, device="cpu")
    losses = []
    for model in (graphed, eager):
        loss = model(**batch)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    assert graphed.cuda_graph_stats == {"eager_not_cuda": 1}
    graphed.eval()
    with torch.no_grad():
        graphed(**batch)
    assert graphed.cuda_graph_stats["eager_eval"] == 1
    graphed.enable_cuda_graphs(False)
    assert graphed.cuda_graph_stats == {}


def test_graphs_refuse_activation_checkpointing():
    model = EvoformerTrainModel(evoformer_tiny(checkpoint_blocks=True), "torch")
    with pytest.raises(ValueError, match="checkpoint_blocks"):
        model.enable_cuda_graphs()


def test_engine_config_switches_the_evoformer_graphs_on():
    import dslab

    model = EvoformerTrainModel(evoformer_tiny(), "torch")
    engine, *_ = dslab.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                                       "cuda_graphs": {"enabled": True}},
                                  dist_init_required=False)
    batch = evoformer_batch(evoformer_tiny(), 1, torch.float32, seed=0, device="cpu")
    engine.backward(engine(**batch))
    engine.step()
    assert model.cuda_graph_stats == {"eager_not_cuda": 1}
