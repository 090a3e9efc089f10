"""Tensor parallelism over 2 real gloo processes (torchrun): tp_size 2 gives tp_size 1's logits
(fp32, within 4e-6 of the largest logit, ~32 units in its last place: only the order of the
partial sums differs; measured 1e-6 to 2.1e-5 absolute on logits up to 13.6, by CPU) and the same
greedy tokens, for GPT-2 (pre-LN, causal, left-padded batch) and BERT (post-LN); each rank holds
half the heads and half the MLP columns; the comm layer sees two all_reduces per layer per
forward (tp_worker.py)."""

from pathlib import Path

import pytest

from torchrun_workers import run_workers

HERE = Path(__file__).parent
HIDDEN, LAYERS, INTERMEDIATE = 128, 2, 512  # dslab's gpt2_tiny
RELATIVE_TOLERANCE = 4e-6  # of the largest logit (fp32's epsilon is 1.2e-7)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_workers(HERE / "tp_worker.py", tmp_path_factory.mktemp("tp2"))


@pytest.mark.world_size(2)
def test_tp2_equals_tp1(two_ranks):
    for result in two_ranks:
        label = f"rank {result['rank']}"
        assert (result["tp_size"], result["tp_rank"]) == (2, result["rank"]), label
        for model in ("gpt2", "bert"):
            error, scale = result[f"{model}_logit_error"], result[f"{model}_logit_scale"]
            assert error <= RELATIVE_TOLERANCE * scale, f"{label}: {model} logits differ by {error} (largest {scale})"
        assert result["gpt2_tokens_equal"], label
    assert two_ranks[0]["gpt2_tokens"] == two_ranks[1]["gpt2_tokens"]


@pytest.mark.world_size(2)
def test_each_rank_holds_half_the_heads_and_columns(two_ranks):
    for result in two_ranks:
        assert result["shapes"] == {"qkv": (3 * HIDDEN // 2, HIDDEN), "out_proj": (HIDDEN, HIDDEN // 2),
                                    "fc_in": (INTERMEDIATE // 2, HIDDEN), "fc_out": (HIDDEN, INTERMEDIATE // 2)}
        assert result["row_bias"] == (result["rank"] == 0)  # the row-parallel bias is added once


@pytest.mark.world_size(2)
def test_all_reduces_go_through_the_comm_layer(two_ranks):
    for result in two_ranks:
        calls = result["calls"]
        assert len(calls) == 2 * LAYERS and {c["op"] for c in calls} == {"all_reduce"}
        assert all(c["group_size"] == 2 and c["numel"] == 3 * 10 * HIDDEN for c in calls)  # [batch, seq, hidden]


@pytest.mark.world_size(2)
def test_tp_size_must_divide_the_heads(two_ranks):
    for result in two_ranks:
        assert "tensor_parallel.tp_size=2 does not divide the model's 3 attention heads" in result["indivisible_error"]
