"""BERT split over 2 (post-LN) and 4 (pre-LN) tensor-parallel gloo ranks gives the dense model's
weights from the same seed, its loss, logits and gradients (a padded row included), and trains as
the dense model does through the engine with the grid as mpu (bert_tp_worker.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.models.tensor_parallel_layers import bert_tp_state_dict

HERE = Path(__file__).parent


@pytest.mark.world_size(4)
@pytest.mark.parametrize("tp, pre_ln", [(2, 0), (4, 1)])
def test_bert_split_over_ranks_computes_and_trains_as_dense(tmp_path, tp, pre_ln):
    out = tmp_path / "found.pt"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(tp),
                           str(HERE / "bert_tp_worker.py"), str(out), str(pre_ln)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = torch.load(out, weights_only=True)
    assert found["init_max_diff"] == 0.0
    insides = [tuple(inside) for inside, _ in found["fork_draws"]]
    outsides = [tuple(outside) for _, outside in found["fork_draws"]]
    assert len(set(insides)) == tp and len(set(outsides)) == 1
    dense, split = found["loss"]
    assert split == pytest.approx(dense, rel=1e-6)
    assert found["logits_max_diff"] < 1e-5
    worst = max(found["grad_rel_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-5, worst
    assert len(found["grad_rel_diff"]) > 20  # every parameter was compared
    for dense_loss, split_loss in found["engine_losses"]:
        assert split_loss == pytest.approx(dense_loss, rel=1e-5)


def test_bert_tensor_parallel_refusals_and_slicing():
    with pytest.raises(ValueError, match="vocab_size=1001 does not divide by tp_size=2"):
        bert_tiny(vocab_size=1001, tp_size=2)
    with pytest.raises(ValueError, match="heads=4 does not divide by tp_size=3"):
        bert_tiny(tp_size=3, intermediate=516, vocab_size=999)
    with pytest.raises(ValueError, match="tp_size=2 needs a process group"):
        BertForPreTraining(bert_tiny(tp_size=2), "torch")
    dense = BertForPreTraining(bert_tiny(), "torch").state_dict()
    shards = [bert_tp_state_dict(dense, r, 2) for r in range(2)]
    assert shards[1]["mlm_bias"].shape == (500,) and shards[0]["embeddings.word_embeddings.weight"].shape == (500, 128)
    assert torch.equal(torch.cat([s["layers.0.mlp.fc_out.weight"] for s in shards], 1), dense["layers.0.mlp.fc_out.weight"])
    # q, k, v blocks: rank 1 holds the second half of each
    qkv = dense["layers.0.attention.qkv.weight"].view(3, 128, 128)
    assert torch.equal(shards[1]["layers.0.attention.qkv.weight"].view(3, 64, 128), qkv[:, 64:])
