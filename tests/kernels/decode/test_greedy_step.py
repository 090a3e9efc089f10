"""greedy_step (the greedy loop's work between two decode steps) under the Triton interpreter
against its op-by-op reference on fresh random logits: the token is argmax's (ties across and
within blocks: the first; NaN: the first NaN; rows of -inf; a vocabulary that does not fill whole
blocks; one block and several, whose last program picks), finished rows get the pad, the sequence column and the next step's tokens are written,
and eos ids mark rows finished at this step (only rows not finished before)."""

from __future__ import annotations

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.decode.greedy_step import BLOCK, MAX_ROWS, greedy_step, greedy_step_reference
from dslab.kernels.dispatch import interpreting

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="the Triton interpreter runs on CPU (TRITON_INTERPRET=1)")


def _logits(rows, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    logits[1, [3, vocab - 2, (BLOCK + 1) % vocab]] = 40.0  # a tie within and across blocks
    logits[2, [vocab - 1, 9]] = float("nan")
    logits[3] = float("-inf")
    logits[4, vocab - 1] = 50.0  # the last logit, in the padded block
    return logits


def _state(rows, seed):
    g = torch.Generator().manual_seed(seed)
    sequence = torch.randint(0, 100, (rows, 12), generator=g)
    finished = torch.tensor([False, False, False, True, False, True][:rows])
    finish_step = torch.tensor([20, 20, 20, 2, 20, 1][:rows])
    return sequence, finished, finish_step


@needs_interpreter
@pytest.mark.parametrize("vocab", [3 * BLOCK, 3 * BLOCK + 37, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_eos", [True, False])
def test_greedy_step_matches_the_reference(vocab, dtype, with_eos):
    rows = 6
    logits = _logits(rows, vocab, dtype, vocab)
    assert greedy_step_reference(logits, torch.zeros(rows, 1, dtype=torch.long), 0).tolist()[1:5] == \
        [3, 9, 0, vocab - 1]
    eos = torch.tensor([vocab - 1, 3]) if with_eos else None  # rows 1 and 4 produce an eos id
    results = []
    for backend in ("torch", "triton"):
        sequence, finished, finish_step = _state(rows, 1)
        next_tokens = torch.full((rows,), -5)
        with kernel_backend(backend):
            tokens = greedy_step(logits, sequence, 7, next_tokens, finished if with_eos else None, finish_step, eos,
                                 pad=99, step=6)
        results.append((tokens, sequence, next_tokens, finished, finish_step))
    for got, want in zip(*results):
        assert torch.equal(got, want), (got, want)
    tokens, sequence, next_tokens, finished, finish_step = results[1]
    assert torch.equal(sequence[:, 7], tokens) and torch.equal(next_tokens, tokens)
    if with_eos:
        assert tokens[3] == 99 and tokens[5] == 99  # finished before: the pad
        assert finished.tolist() == [False, True, False, True, True, True]
        assert finish_step.tolist() == [20, 6, 20, 2, 6, 1]  # newly finished at this step only


@needs_interpreter
def test_without_next_tokens_or_finished_rows():
    logits = _logits(5, 700, torch.float32, 3)
    for backend in ("torch", "triton"):
        sequence = torch.zeros(5, 3, dtype=torch.long)
        with kernel_backend(backend):
            tokens = greedy_step(logits, sequence, 2)
        assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(sequence[:, 2], tokens)


@needs_interpreter
def test_consecutive_launches_each_pick_their_own_tokens():
    """The rows' arrival counters are reset by each row's last program: launch after launch (with
    other row counts between) the last program of every row picks that launch's argmax."""
    for call, rows in enumerate((3, 5, 3, 1)):
        logits = torch.randn(rows, 3 * BLOCK + 5, generator=torch.Generator().manual_seed(call))
        logits[:, (call * 997) % logits.shape[1]] = 30.0
        sequence = torch.zeros(rows, 2, dtype=torch.long)
        with kernel_backend("triton"):
            tokens = greedy_step(logits, sequence, 1)
        assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(sequence[:, 1], tokens)


def test_bad_arguments_name_the_problem():
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="sequence must be int64 \\[2, > 3\\]"):
        greedy_step(logits, torch.zeros(2, 3, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="eos needs finished and finish_step"):
        greedy_step(logits, torch.zeros(2, 5, dtype=torch.long), 1, eos=torch.tensor([1]))
    with kernel_backend("triton"), pytest.raises(ValueError, match="at most 16384 rows"):
        greedy_step(torch.randn(MAX_ROWS + 1, 4), torch.zeros(MAX_ROWS + 1, 2, dtype=torch.long), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_step_on_a_gpu_matches_the_reference(dtype):
    """Llama's vocabulary (501 blocks) and GPT-2's (padded), with eos ids and finished rows."""
    for vocab in (128256, 50257):
        logits = _logits(6, vocab, dtype, vocab).cuda()
        eos = torch.tensor([vocab - 1, 3], device="cuda")
        results = []
        for backend in ("torch", "triton"):
            sequence, finished, finish_step = (t.cuda() for t in _state(6, 2))
            next_tokens = torch.full((6,), -5, device="cuda")
            with kernel_backend(backend):
                tokens = greedy_step(logits, sequence, 5, next_tokens, finished, finish_step, eos, pad=7, step=3)
            results.append((tokens, sequence, next_tokens, finished, finish_step))
        for got, want in zip(*results):
            assert torch.equal(got, want), (vocab, got, want)
