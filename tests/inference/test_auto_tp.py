"""Automatic tensor parallelism (DeepSpeed's AutoTP) over 2 real gloo processes (torchrun,
auto_tp_worker.py): a tiny transformers Llama (grouped-query, 4 heads over 2 key/value heads), OPT
(biases on every linear layer) and GPT-2 (``Conv1D``, fused ``c_attn``), not injected and split
with ``tensor_parallel={"tp_size": 2}``, give the unsplit model's logits (fp32, within 4e-6 of the
largest logit; measured 5e-7 to 8e-7 relative: only the order of the partial sums differs) and its
greedy tokens on both ranks; each rank holds half of every split weight; one forward makes two
all_reduces per layer; key/value heads that 2 does not divide, a model without decoder layers and
int8 without a policy are refused. In-process: which linear layers are row-parallel, and that a
refused split changes nothing."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dslab.inference.auto_tp import RowParallelLinear, apply_auto_tp, linear_role
from dslab.inference.tensor_parallel import TensorParallel

from torchrun_workers import run_workers

HERE = Path(__file__).parent
MODELS = ("llama", "opt", "gpt2")
HIDDEN, LAYERS, BATCH, SEQ = 128, 2, 3, 10
RELATIVE_TOLERANCE = 4e-6  # of the largest logit (fp32's epsilon is 1.2e-7)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_workers(HERE / "auto_tp_worker.py", tmp_path_factory.mktemp("auto_tp2"))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("model", MODELS)
def test_split_model_gives_the_unsplit_logits_and_tokens(two_ranks, model):
    for result in two_ranks:
        label = f"{model}, rank {result['rank']}"
        record = result[model]
        assert record["tp"] == (result["rank"], 2) and not record["injected"] and record["module_is_model"], label
        error, scale = record["logit_error"], record["logit_scale"]
        assert error <= RELATIVE_TOLERANCE * scale, f"{label}: logits differ by {error} (largest {scale})"
        assert record["tokens_equal"] and record["varied"], label
    assert two_ranks[0][model]["tokens"] == two_ranks[1][model]["tokens"]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("model,row,column", [("llama", 4, 10), ("opt", 4, 8), ("gpt2", 4, 4)])
def test_each_rank_holds_half_of_the_split_layers(two_ranks, model, row, column):
    for result in two_ranks:
        record = result[model]
        before, after = record["before"], record["after"]
        assert after["weights"] * 2 == before["weights"]
        total = (after["weights"] + after["biases"]) / (before["weights"] + before["biases"])
        assert abs(total - 0.5) < 0.01  # row-parallel biases stay whole
        assert record["notes"] == [f"automatic tensor parallelism: {row} row-parallel, {column} column-parallel "
                                   f"Linear layers in {LAYERS} layers over tp_size=2 ranks; embeddings, norms and "
                                   f"lm_head are replicated"]
        calls = record["calls"]
        assert len(calls) == 2 * LAYERS and {c["op"] for c in calls} == {"all_reduce"}
        assert all(c["group_size"] == 2 and c["numel"] == BATCH * SEQ * HIDDEN for c in calls)


@pytest.mark.world_size(2)
def test_heads_and_attributes_are_split(two_ranks):
    for result in two_ranks:
        llama = result["llama"]
        assert llama["shapes"] == {"q_proj": (64, 128), "k_proj": (32, 128), "v_proj": (32, 128), "o_proj": (128, 64),
                                   "gate_proj": (80, 128), "up_proj": (80, 128), "down_proj": (128, 80)}
        assert llama["o_proj_class"] == "RowParallelLinear"
        assert result["opt"]["attention"] == {"num_heads": 2, "embed_dim": 64, "head_dim": 32}
        assert result["opt"]["row_bias"] == (HIDDEN,)  # whole, added once after the all_reduce
        assert result["gpt2"]["attention"] == {"num_heads": 2, "split_size": 64, "c_attn": (HIDDEN, 3 * HIDDEN // 2)}


@pytest.mark.world_size(2)
def test_refusals(two_ranks):
    for result in two_ranks:
        assert ("tensor_parallel.tp_size=2 does not divide the model's 3 key/value heads "
                "(config.num_key_value_heads=3, config.num_attention_heads=6)") in result["kv_error"]
        assert "automatic tensor parallelism found no decoder layers in Sequential" in result["layers_error"]
        assert "dtype=torch.int8 quantises the layers dslab injects" in result["int8_error"]


@pytest.mark.parametrize("path,role", [
    ("self_attn.o_proj", "row"), ("mlp.down_proj", "row"), ("self_attn.q_proj", "column"), ("mlp.gate_proj", "column"),
    ("fc1", "column"), ("fc2", "row"), ("attn.c_attn", "column"), ("attn.c_proj", "row"), ("mlp.c_fc", "column"),
    ("mlp.c_proj", "row"), ("attention.dense", "row"), ("self_attention.dense", "row"),
    ("attention.output.dense", "row"), ("intermediate.dense", "column"), ("output.dense", "row"),
    ("mlp.dense_h_to_4h", "column"), ("mlp.dense_4h_to_h", "row"), ("mlp.fc_in", "column"), ("mlp.fc_out", "row"),
    ("layer.1.EncDecAttention.o", "row"), ("layer.2.DenseReluDense.wo", "row"), ("block_sparse_moe.gate", "whole"),
    ("experts.0.w2", "row"), ("experts.0.w1", "column"),
])
def test_linear_roles(path, role):
    assert linear_role(path) == role


class _Block(nn.Module):
    def __init__(self, fused: bool, mlp: int):
        super().__init__()
        self.attention = nn.Module()
        if fused:
            self.attention.query_key_value = nn.Linear(8, 24)
        else:
            self.attention.q_proj = nn.Linear(8, 8)
        self.attention.dense = nn.Linear(8, 8)
        self.fc1 = nn.Linear(8, mlp)
        self.fc2 = nn.Linear(mlp, 8)


class _Net(nn.Module):
    def __init__(self, fused: bool = False, mlp: int = 16):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([_Block(fused, mlp) for _ in range(2)])
        self.head = nn.Linear(8, 10)


@pytest.mark.parametrize("net,message", [
    (lambda: _Net(fused=True), "layers.0.attention.query_key_value is a fused QKV projection"),
    (lambda: _Net(mlp=7), "tensor_parallel.tp_size=2 does not divide the 7 output features of layers.0.fc1"),
], ids=["fused-qkv", "indivisible"])
def test_a_refused_split_changes_nothing(net, message):
    model = net()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        apply_auto_tp(model, TensorParallel(2, 1, None))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()) and state.keys() == \
        model.state_dict().keys()


def test_split_shapes_of_one_rank_and_tp1_is_a_no_op():
    model = _Net()
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_auto_tp(model, TensorParallel()).layers == 0 and isinstance(model.layers[0].fc2, nn.Linear)
    split = apply_auto_tp(model, TensorParallel(2, 1, None))
    layer = model.layers[0]
    assert split.row_parallel == ["layers.0.attention.dense", "layers.0.fc2", "layers.1.attention.dense",
                                  "layers.1.fc2"]
    assert split.column_parallel == ["layers.0.attention.q_proj", "layers.0.fc1", "layers.1.attention.q_proj",
                                     "layers.1.fc1"]
    assert isinstance(layer.fc2, RowParallelLinear)
    assert torch.equal(layer.fc2.weight, whole["layers.0.fc2.weight"][:, 8:])  # rank 1's input columns
    assert torch.equal(layer.fc2.bias, whole["layers.0.fc2.bias"])  # whole: added once, after the all_reduce
    assert torch.equal(layer.fc1.weight, whole["layers.0.fc1.weight"][8:]) and layer.fc1.out_features == 8
    assert torch.equal(layer.fc1.bias, whole["layers.0.fc1.bias"][8:])
    assert torch.equal(model.head.weight, whole["head.weight"])  # outside the layers: whole
    assert torch.equal(model.embed.weight, whole["embed.weight"])
