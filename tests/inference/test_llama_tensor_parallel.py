"""Tensor parallelism of the Llama layout over 2 real gloo processes (torchrun,
llama_tp_worker.py): tp_size 2 gives tp_size 1's logits (fp32, within 4e-6 of the largest logit,
as tests/inference/test_tensor_parallel.py) and greedy tokens on a left-padded batch of a tiny
grouped-query Llama with attention and MLP biases; each rank holds half the query heads, half the
key/value heads (its KV cache too) and half the MLP columns, the row-parallel biases on rank 0 only;
two all_reduces per layer per forward; int8 at tp_size 2 is no further from fp32 than int8 at
tp_size 1; a tp_size that does not divide the key/value heads is refused."""

from pathlib import Path

import pytest
from tiny_models import HEADS, HIDDEN, LAYERS, LLAMA_INTERMEDIATE, LLAMA_KV_HEADS

from torchrun_workers import run_workers

HERE = Path(__file__).parent
HEAD_DIM = HIDDEN // HEADS
RELATIVE_TOLERANCE = 4e-6  # of the largest logit, as tests/inference/test_tensor_parallel.py


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_workers(HERE / "llama_tp_worker.py", tmp_path_factory.mktemp("llama_tp2"))


@pytest.mark.world_size(2)
def test_tp2_equals_tp1(two_ranks):
    for result in two_ranks:
        label = f"rank {result['rank']}"
        assert (result["tp_size"], result["tp_rank"]) == (2, result["rank"]), label
        error, scale = result["logit_error"], result["logit_scale"]
        assert error <= RELATIVE_TOLERANCE * scale, f"{label}: logits differ by {error} (largest {scale})"
        assert result["tokens_equal"], label
        # int8 against fp32: the row-parallel weights get a scale per half row, so not tp 1's int8
        # logits, but no larger an error (a wrong slice of the scales is off by tens of percent)
        assert 0 < result["int8_error"] < 1.2 * result["int8_tp1_error"], label
    assert two_ranks[0]["tokens"] == two_ranks[1]["tokens"]


@pytest.mark.world_size(2)
def test_each_rank_holds_half_the_heads_kv_heads_and_columns(two_ranks):
    q, kv = HEADS // 2 * HEAD_DIM, LLAMA_KV_HEADS // 2 * HEAD_DIM
    for result in two_ranks:
        assert result["shapes"] == {"qkv": (q + 2 * kv, HIDDEN), "out_proj": (HIDDEN, q),
                                    "gate_up": (LLAMA_INTERMEDIATE, HIDDEN), "down": (HIDDEN, LLAMA_INTERMEDIATE // 2)}
        assert result["cache_heads"] == LLAMA_KV_HEADS // 2
        assert result["row_bias"] == (result["rank"] == 0)  # o_proj's and down_proj's biases added once
        calls = result["calls"]
        assert len(calls) == 2 * LAYERS and {c["op"] for c in calls} == {"all_reduce"}


@pytest.mark.world_size(2)
def test_tp_size_must_divide_the_kv_heads_across_ranks(two_ranks):
    for result in two_ranks:
        assert "tensor_parallel.tp_size=2 does not divide the model's 1 key/value heads" in result["indivisible_error"]
