"""The generate loop's greedy choice: :func:`dslab.inference.generate.blocked_argmax` (two passes
over blocks of the vocabulary) gives ``argmax``'s index on fresh random logits, with ties (the
first largest), NaN (the first NaN), rows of -inf, and vocabularies that do or do not fill whole
blocks; on a GPU, ``greedy_tokens`` (which takes it for large vocabularies) the same over bf16 and
fp32 logits of Llama's vocabulary."""

from __future__ import annotations

import pytest
import torch

from dslab.inference.generate import BLOCKED_ARGMAX_MIN, blocked_argmax, greedy_tokens


@pytest.mark.parametrize("vocab, block", [(1000, 64), (1024, 64), (130, 256), (50257, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_argmax_is_argmax(vocab, block, dtype):
    g = torch.Generator().manual_seed(vocab + block)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    logits[1, :] = 0.0  # every logit tied: the first
    logits[2, [7, vocab - 3, vocab // 2]] = 50.0  # a tie across blocks: the first
    logits[3, [vocab - 1, 5]] = float("nan")  # NaN counts as largest: the first NaN
    logits[4, :] = float("-inf")
    logits[5, vocab - 1] = 60.0  # the last logit, in a padded block
    assert torch.equal(blocked_argmax(logits, block), logits.argmax(dim=-1))
    assert blocked_argmax(logits, block).tolist()[1:5] == [0, 7, 5, 0]


def test_a_cpu_takes_one_argmax(monkeypatch):
    import dslab.inference.generate as generate

    calls = []
    monkeypatch.setattr(generate, "blocked_argmax", lambda logits: calls.append(logits.shape) or logits.argmax(-1))
    logits = torch.randn(2, BLOCKED_ARGMAX_MIN * 2)
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1)) and calls == []  # a CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_tokens_on_a_gpu_is_argmax(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    for rows in (1, 8, 32):
        logits = torch.randn(rows, 128256, device="cuda", generator=g).to(dtype)
        logits[0, [100, 128000]] = 30.0
        if rows > 1:
            logits[1, [5000, 77]] = float("nan")
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
