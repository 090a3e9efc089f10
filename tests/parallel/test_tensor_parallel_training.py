"""Tensor parallelism for training (dslab.parallel.tensor_parallel, tensor_parallel_regions,
vocab_parallel; GPT-2 with ``tp_size``).

Over 2 and 4 real gloo processes (torchrun, tp_training_worker.py), every region, layer, the
vocabulary-parallel loss and GPT-2 are held against the dense computation they replace, on fresh
random inputs: outputs, input and weight gradients, the loss and every gradient of GPT-2 gathered
whole, with and without sequence parallelism, and SGD and AdamW steps; here the worker's GPT-2
losses are held once more against a dense run of this process. In one process (no group): the
identity behaviour, the shard layout and the refusals by name.

(Not ``test_tensor_parallel.py``: tests/inference has a module of that name, and without package
files pytest cannot import two test modules of one name in one run.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.gpt2_moe import gpt2_moe_tiny
from dslab.models.tensor_parallel_layers import gpt2_dense_state_dict, gpt2_tp_state_dict
from dslab.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads, gather_tensor_parallel_state_dict,
    tensor_parallel_grad_norm_sq,
)
from dslab.parallel.tensor_parallel_regions import (
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region, shard_tensor, tensor_parallel_rank,
    tensor_parallel_world_size, unshard_tensors,
)
from dslab.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import tp_training_worker as worker  # noqa: E402

CHECKS = [
    "copy_to_sums_gradients", "reduce_from_sums_values", "scatter_and_gather_last_dim", "sequence_regions",
    "mlp_matches_dense", "gather_output_and_unsplit_input", "sequence_parallel_mlp_matches_dense",
    "initialisation_slices_the_dense_draw", "vocab_parallel_embedding_matches_dense",
    "indivisible_sizes_are_refused_by_name", "vocab_parallel_cross_entropy_matches_dense", "gpt2_matches_dense",
    "gpt2_sequence_parallel_matches_dense", "gpt2_trains_as_dense", "gpt2_loads_a_dense_state_dict",
    "gpt2_group_size_is_checked", "gpt2_graphs_are_refused_with_dropout_only",
]


@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.world_size(2)),
                                        pytest.param(4, marks=pytest.mark.world_size(4))])
def ranks(request, tmp_path_factory):
    nproc = request.param
    out_dir = tmp_path_factory.mktemp(f"tp{nproc}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE / "tp_training_worker.py"), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_every_rank_passes_every_check(ranks):
    world = len(ranks)
    expected = CHECKS + (["gpt2_over_two_subgroups"] if world == 4 else [])
    for result in ranks:
        assert result["world"] == world
        assert result["passed"] == expected, f"rank {result['rank']}"


def test_gpt2_losses_match_a_dense_run_of_this_process(ranks):
    for optimizer_name in ("sgd", "adamw"):
        torch.manual_seed(0)
        dense = GPT2LMHeadModel(worker.CONFIG, "torch")
        expected = torch.tensor(worker.train(dense, None, worker.TRAIN_STEPS, optimizer_name))
        for result in ranks:
            for sp in (0, 1):
                losses = torch.tensor(result[f"losses_{optimizer_name}_sp{sp}"])
                torch.testing.assert_close(losses, expected, **worker.STEPS_TOL,
                                           msg=f"rank {result['rank']}, {optimizer_name}, sequence_parallel={sp}")
        assert expected[-1] < expected[0]  # it trains


def test_a_forward_issues_its_all_reduces_through_the_comm_layer(ranks):
    # the embedding's sum, two per layer (attention and MLP outputs), and the loss's max,
    # target logit and sum of exponentials
    for result in ranks:
        assert result["forward_collectives"] == ["all_reduce"] * (1 + 2 * worker.CONFIG.layers + 3)


# ---- one process, no group ----------------------------------------------------------------------


def test_without_a_group_the_regions_are_the_identity():
    assert tensor_parallel_world_size() == 1 and tensor_parallel_rank() == 0
    x = torch.randn(2, 6, 4, requires_grad=True)
    for region in (copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region,
                   scatter_to_tensor_parallel_region, gather_from_tensor_parallel_region,
                   scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region,
                   reduce_scatter_to_sequence_parallel_region):
        assert region(x) is x, region.__name__


def test_without_a_group_the_layers_are_the_dense_ones():
    torch.manual_seed(0)
    dense = nn.Linear(10, 6)
    torch.manual_seed(0)
    column = ColumnParallelLinear(10, 6)
    torch.manual_seed(0)
    row = RowParallelLinear(10, 6)
    torch.manual_seed(0)
    embedding = nn.Embedding(12, 5)
    torch.manual_seed(0)
    vocab = VocabParallelEmbedding(12, 5)
    for layer in (column, row):
        assert torch.equal(layer.weight, dense.weight) and torch.equal(layer.bias, dense.bias)
    assert torch.equal(vocab.weight, embedding.weight)
    x = torch.randn(3, 10)
    assert torch.equal(column(x), dense(x)) and torch.equal(row(x), dense(x))
    ids = torch.tensor([[0, 11, 5]])
    assert torch.equal(vocab(ids), embedding(ids))
    assert column.weight.tensor_model_parallel and row.weight.partition_dim == 1
    assert row.bias.tensor_model_parallel is False
    row(x).sum().backward()
    before = row.bias.grad.clone()
    allreduce_sequence_parallel_grads(row)
    assert torch.equal(row.bias.grad, before)
    expected = sum(p.grad.pow(2).sum() for p in row.parameters())
    torch.testing.assert_close(tensor_parallel_grad_norm_sq(row.parameters()), expected)
    state = gather_tensor_parallel_state_dict(row)
    assert state.keys() == row.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in row.state_dict().items())
    with pytest.raises(ValueError, match="sequence_parallel"):
        ColumnParallelLinear(10, 6, sequence_parallel=True)


@pytest.mark.parametrize("vocab", [12, 9])
def test_vocab_parallel_cross_entropy_is_cross_entropy(vocab):
    logits = (torch.randn(7, 12) * 4).requires_grad_()
    target = torch.randint(0, vocab, (7,))
    target[3] = -100
    reference = logits.detach().clone().requires_grad_()
    losses = vocab_parallel_cross_entropy(logits, target, vocab_size=vocab)
    expected = F.cross_entropy(reference[:, :vocab], target, reduction="none")
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)
    assert losses[3] == 0
    (losses.sum() / 6).backward()
    F.cross_entropy(reference[:, :vocab], target).backward()
    torch.testing.assert_close(logits.grad, reference.grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(logits.grad[:, vocab:], torch.zeros(7, 12 - vocab))  # padding: no gradient


def test_vocab_parallel_cross_entropy_refuses_a_second_backward_and_bad_shapes():
    logits = torch.randn(4, 6, requires_grad=True)
    losses = vocab_parallel_cross_entropy(logits, torch.tensor([0, 1, 2, 3]))
    losses.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        losses.sum().backward()
    with pytest.raises(ValueError, match="target"):
        vocab_parallel_cross_entropy(logits, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="vocab_size=7"):
        vocab_parallel_cross_entropy(logits, torch.tensor([0, 1, 2, 3]), vocab_size=7)


def test_a_strided_shard_holds_its_heads_of_q_k_and_v():
    hidden, heads, tp = 8, 4, 2
    head_dim = hidden // heads
    qkv = torch.arange(3 * hidden * 3, dtype=torch.float32).view(3 * hidden, 3)
    for rank in range(tp):
        shard = shard_tensor(qkv, 0, rank, tp, stride=3)
        rows = [block * hidden + head * head_dim + i for block in range(3)
                for head in range(rank * heads // tp, (rank + 1) * heads // tp) for i in range(head_dim)]
        assert torch.equal(shard, qkv[rows])
    shards = [shard_tensor(qkv, 0, r, tp, stride=3) for r in range(tp)]
    assert torch.equal(unshard_tensors(shards, 0, stride=3), qkv)
    with pytest.raises(ValueError, match="does not split into 3 blocks of 5"):
        shard_tensor(qkv, 0, 0, 5, stride=3)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_state_dicts_convert_both_ways(tp):
    config = gpt2_tiny(dropout=0.0, vocab_pad_multiple=64)
    torch.manual_seed(0)
    dense = GPT2LMHeadModel(config, "torch").state_dict()
    shards = [gpt2_tp_state_dict(dense, r, tp, config) for r in range(tp)]
    hidden, inner = config.hidden, config.intermediate
    assert shards[1]["wte.weight"].shape == (config.padded_vocab_size // tp, hidden)
    assert shards[1]["layers.0.attention.qkv.weight"].shape == (3 * hidden // tp, hidden)
    assert shards[1]["layers.0.attention.out_proj.weight"].shape == (hidden, hidden // tp)
    assert shards[1]["layers.0.mlp.fc_in_bias"].shape == (inner // tp,)
    assert shards[1]["layers.0.mlp.fc_out.weight"].shape == (hidden, inner // tp)
    assert shards[1]["layers.0.attention.out_bias"] is dense["layers.0.attention.out_bias"]
    q_rows = dense["layers.1.attention.qkv.bias"][:hidden].chunk(tp)[tp - 1]
    assert torch.equal(shards[tp - 1]["layers.1.attention.qkv.bias"][:hidden // tp], q_rows)
    whole = gpt2_dense_state_dict(shards, config)
    assert whole.keys() == dense.keys() and all(torch.equal(whole[k], v) for k, v in dense.items())
    with pytest.raises(ValueError, match="tp_rank"):
        gpt2_tp_state_dict(dense, tp, tp, config)


def test_gpt2_refuses_tensor_parallel_sizes_by_name():
    with pytest.raises(ValueError, match="heads=4 does not divide by tp_size=8"):
        gpt2_tiny(tp_size=8)
    with pytest.raises(ValueError, match="padded_vocab_size=1001 .* vocab_pad_multiple"):
        gpt2_tiny(vocab_size=1001, tp_size=2)
    with pytest.raises(ValueError, match="sequence_parallel needs tp_size > 1"):
        gpt2_tiny(sequence_parallel=True)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="tp_size must be a positive int"):
            gpt2_tiny(tp_size=bad)
    with pytest.raises(ValueError, match="tp_size=2: GPT-2-MoE"):
        gpt2_moe_tiny(tp_size=2)
    with pytest.raises(ValueError, match="tp_size=2 needs a process group"):
        GPT2LMHeadModel(gpt2_tiny(tp_size=2), "torch")
    with pytest.raises(ValueError, match="heads=3 does not divide by tp_size=2"):
        gpt2_tiny(hidden=96, heads=3, tp_size=2)
    with pytest.raises(ValueError, match="padded_vocab_size"):
        gpt2_tp_state_dict({}, 0, 3, gpt2_tiny(heads=3, hidden=96))


def test_gpt2_with_tp_size_1_converts_as_itself():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), "torch")
    state = model.state_dict()
    assert all(torch.equal(model.dense_state_dict()[k], v) for k, v in state.items())
    torch.manual_seed(1)
    other = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), "torch")
    other.load_dense_state_dict(state)
    ids = torch.randint(0, 1000, (2, 9))
    assert torch.equal(other(ids, ids), model(ids, ids))
