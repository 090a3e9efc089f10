"""``greedy_step``: a greedy decode loop's work between two steps, in two launches.

After a decode step the generation loop (:mod:`dslab.inference.generate`) picks each row's token
(the argmax of its logits), pads the rows that finished, writes the tokens into the sequence, feeds
them to the next step, and, with eos ids, marks the rows that produced one. Op by op that is about
a dozen small kernels a token (on an H200 with Llama-3.2-1B, 27 us of kernels and as many launch
gaps against a 0.84 ms step, ``benchmarks/generate_gaps.py``); here it is two:

1. the logits' maximum over blocks of :data:`BLOCK` (PyTorch's ``max(dim=-1)`` over ``[rows,
   vocab / BLOCK, BLOCK]``, the vocabulary padded with -inf): every block reduced in parallel,
   where one argmax over a 128,256-wide row runs as one slow pass;
2. ``_greedy_step_kernel``, one program a row: the first block holding the largest maximum (a NaN
   counts as largest, as in ``argmax``), the token ``block * BLOCK + where in it``; then ``pad``
   for a finished row, the stores into ``sequence[:, length]`` and ``next_tokens``, and with eos
   ids ``done = token in eos``, ``finish_step = step`` where newly done, ``finished |= done``.

The token is ``logits.argmax(-1)``'s exactly (the first largest logit; the first NaN).
:func:`greedy_step_reference` is the same op by op, the path on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import device_guard
from dslab.kernels.dispatch import use_triton

#: Logits per block of the first pass.
BLOCK = 256


def greedy_step_reference(logits, sequence, length, next_tokens=None, finished=None, finish_step=None, eos=None,
                          pad=0, step=0):
    """:func:`greedy_step` op by op."""
    tokens = logits.argmax(dim=-1)
    if finished is not None:
        tokens = torch.where(finished, torch.full_like(tokens, pad), tokens)
    sequence[:, length] = tokens
    if next_tokens is not None:
        next_tokens.copy_(tokens)
    if finished is not None and eos is not None:
        done = torch.isin(tokens, eos)
        finish_step.copy_(torch.where(done & ~finished, step, finish_step))
        finished |= done
    return tokens


@triton.jit(do_not_specialize=["length", "step", "pad"])  # one compile for every position
def _greedy_step_kernel(VALUES, WITHIN, TOKENS, SEQUENCE, NEXT, FINISHED, FINISH_STEP, EOS,
                        blocks, stride_values, stride_sequence, length, n_eos, pad, step, block,
                        BLOCKS: tl.constexpr, EOS_BLOCK: tl.constexpr, HAS_NEXT: tl.constexpr,
                        HAS_FINISHED: tl.constexpr, HAS_EOS: tl.constexpr):
    row = tl.program_id(0)
    index = tl.arange(0, BLOCKS)
    in_range = index < blocks
    values = tl.load(VALUES + row * stride_values + index, mask=in_range, other=float("-inf")).to(tl.float32)
    nan = (values != values) & in_range
    first_nan = tl.min(tl.where(nan, index, BLOCKS), axis=0)
    largest = tl.max(tl.where(nan, float("-inf"), values), axis=0)
    first_largest = tl.min(tl.where(in_range & (values == largest), index, BLOCKS), axis=0)
    chosen = tl.where(first_nan < BLOCKS, first_nan, first_largest)
    token = chosen.to(tl.int64) * block + tl.load(WITHIN + row * stride_values + chosen)
    was_finished = 0
    if HAS_FINISHED:
        was_finished = tl.load(FINISHED + row).to(tl.int32)
        token = tl.where(was_finished != 0, pad, token).to(tl.int64)
    tl.store(TOKENS + row, token)
    tl.store(SEQUENCE + row * stride_sequence + length, token)
    if HAS_NEXT:
        tl.store(NEXT + row, token)
    if HAS_EOS:
        ids = tl.arange(0, EOS_BLOCK)
        eos = tl.load(EOS + ids, mask=ids < n_eos, other=-1)
        done = (tl.sum((eos == token).to(tl.int32), axis=0) > 0).to(tl.int32)
        previous = tl.load(FINISH_STEP + row)
        tl.store(FINISH_STEP + row, tl.where(done * (1 - was_finished) != 0, step, previous).to(tl.int64))
        tl.store(FINISHED + row, (done | was_finished).to(tl.uint8))


def greedy_step(logits: torch.Tensor, sequence: torch.Tensor, length: int, next_tokens: torch.Tensor | None = None,
                finished: torch.Tensor | None = None, finish_step: torch.Tensor | None = None,
                eos: torch.Tensor | None = None, pad: int = 0, step: int = 0) -> torch.Tensor:
    """The rows' tokens, int64 ``[rows]``: ``logits`` ``[rows, vocab]``'s argmax, ``pad`` where
    ``finished`` (bool ``[rows]``, when given). Writes them into ``sequence[:, length]`` (int64
    ``[rows, >length]``) and ``next_tokens`` (int64 ``[rows]``, when given); with ``finished``,
    ``finish_step`` (int64 ``[rows]``) and ``eos`` (int64 ids), a row whose token is an eos id is
    marked finished and, if it was not before, its ``finish_step`` set to ``step``."""
    rows, vocab = logits.shape
    if sequence.dtype != torch.int64 or sequence.shape[0] != rows or not 0 <= length < sequence.shape[1]:
        raise ValueError(f"greedy_step: sequence must be int64 [{rows}, > {length}], got {sequence.dtype} "
                         f"{tuple(sequence.shape)}")
    if eos is not None and (finished is None or finish_step is None):
        raise ValueError("greedy_step: eos needs finished and finish_step")
    if not use_triton(logits, sequence):
        return greedy_step_reference(logits, sequence, length, next_tokens, finished, finish_step, eos, pad, step)
    padding = -vocab % BLOCK
    blocked = torch.nn.functional.pad(logits, (0, padding), value=float("-inf")) if padding else logits
    values, within = blocked.reshape(rows, -1, BLOCK).max(dim=-1)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    blocks = values.shape[1]
    has_eos = eos is not None and eos.numel() > 0
    with device_guard(logits):
        _greedy_step_kernel[(rows,)](
            values, within, tokens, sequence, tokens if next_tokens is None else next_tokens,
            tokens if finished is None else finished.view(torch.uint8), tokens if finish_step is None else finish_step,
            eos if has_eos else tokens, blocks, values.stride(0), sequence.stride(0), length,
            eos.numel() if has_eos else 0, pad, step, BLOCK,
            BLOCKS=triton.next_power_of_2(blocks), EOS_BLOCK=triton.next_power_of_2(eos.numel() if has_eos else 1),
            HAS_NEXT=next_tokens is not None, HAS_FINISHED=finished is not None, HAS_EOS=has_eos,
        )
    return tokens
