"""``greedy_step``: a greedy decode loop's work between two decode steps, in one launch.

After a decode step the generation loop (:mod:`dslab.inference.generate`) picks each row's token
(the argmax of its logits), pads the rows that finished, writes the tokens into the sequence, feeds
them to the next step, and, with eos ids, marks the rows that produced one. Op by op that is about
a dozen small kernels a token (on an H200 with Llama-3.2-1B, 27 us of kernels and as many launch
gaps against a 0.84 ms step, ``benchmarks/generate_gaps.py``); here it is one,
``_greedy_step_kernel``, grid ``(rows, ceil(vocab / BLOCK))``:

1. each program takes :data:`BLOCK` logits of a row (every block in parallel, where one argmax over
   a 128,256-wide row runs as one slow pass): their largest and where the first of it is (a NaN
   counts as largest, as in ``argmax``), stored as the block's partial; then it bumps its row's
   arrival counter (an atomic with acquire-release order, so its partial is visible to whoever
   reads the count);
2. the row's last program to arrive picks the first block holding the largest partial (the first
   holding a NaN), its position is the token; then ``pad`` for a finished row, the stores into
   ``sequence[:, length]`` and ``next_tokens``, and with eos ids ``done = token in eos``,
   ``finish_step = step`` where newly done, ``finished |= done``; and it resets the counter for the
   next launch.

The token is ``logits.argmax(-1)``'s exactly (the first largest logit; the first NaN). On an H200
(Llama-3.2-1B's 128,256 logits at batch 1, 2026-12-01) the two launches this replaces, PyTorch's
block maxima and a picking kernel, took 5.1 + 2.2 us a token. :func:`greedy_step_reference` is
the same op by op, the path on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import device_guard
from dslab.kernels.dispatch import use_triton

#: Logits a program reduces.
BLOCK = 1024
#: Rows a launch may have (the arrival counters kept per device).
MAX_ROWS = 1 << 14
_counter_buffers: dict = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The rows' arrival counters on ``device``, zero between launches (the last program of a row
    resets its own)."""
    key = (device.type, device.index)
    if key not in _counter_buffers:
        _counter_buffers[key] = torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)
    return _counter_buffers[key]


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


@triton.jit
def _first_largest(values, index, in_range, none):
    """(the largest of ``values`` where ``in_range``, NaN when one is NaN; the first ``index`` holding
    it, the first NaN's) with ``none`` as no index."""
    nan = (values != values) & in_range
    first_nan = tl.min(tl.where(nan, index, none), axis=0)
    largest = tl.max(tl.where(nan | ~in_range, float("-inf"), values), axis=0)
    first_largest = tl.min(tl.where(in_range & (values == largest), index, none), axis=0)
    has_nan = first_nan < none
    return tl.where(has_nan, float("nan"), largest), tl.where(has_nan, first_nan, first_largest)


@triton.jit(do_not_specialize=["length", "step", "pad"])  # one compile for every position
def _greedy_step_kernel(LOGITS, PART_VALUE, PART_INDEX, COUNTERS, TOKENS, SEQUENCE, NEXT, FINISHED, FINISH_STEP, EOS,
                        vocab, stride_logits, stride_sequence, length, n_eos, pad, step,
                        BLOCK: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK_P: tl.constexpr,
                        EOS_BLOCK: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_FINISHED: tl.constexpr,
                        HAS_EOS: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    index = block * BLOCK + tl.arange(0, BLOCK)
    in_range = index < vocab
    values = tl.load(LOGITS + row.to(tl.int64) * stride_logits + index, mask=in_range,
                     other=float("-inf")).to(tl.float32)
    value, where = _first_largest(values, index, in_range, vocab)
    last = True
    if PROGRAMS > 1:
        tl.store(PART_VALUE + row * PROGRAMS + block, value)
        tl.store(PART_INDEX + row * PROGRAMS + block, where)
        arrived = tl.atomic_add(COUNTERS + row, 1)  # acq_rel: the stores above are visible to the last
        last = arrived == PROGRAMS - 1
    if last:
        token = where.to(tl.int64)
        if PROGRAMS > 1:
            blocks = tl.arange(0, BLOCK_P)
            present = blocks < PROGRAMS
            partial = tl.load(PART_VALUE + row * PROGRAMS + blocks, mask=present, other=float("-inf"),
                              cache_modifier=".cg")
            _, chosen = _first_largest(partial, blocks, present, BLOCK_P)
            token = tl.load(PART_INDEX + row * PROGRAMS + chosen, cache_modifier=".cg").to(tl.int64)
            tl.atomic_xchg(COUNTERS + row, 0)
        was_finished = 0
        if HAS_FINISHED:
            was_finished = tl.load(FINISHED + row).to(tl.int32)
            token = tl.where(was_finished != 0, pad, token).to(tl.int64)
        tl.store(TOKENS + row, token)
        tl.store(SEQUENCE + row.to(tl.int64) * stride_sequence + length, token)
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
    if rows > MAX_ROWS:
        raise ValueError(f"greedy_step: at most {MAX_ROWS} rows a launch, got {rows}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    programs = triton.cdiv(vocab, BLOCK)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    part_value = torch.empty(rows * programs, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(rows * programs, dtype=torch.int32, device=logits.device)
    has_eos = eos is not None and eos.numel() > 0
    with device_guard(logits):
        _greedy_step_kernel[(rows, programs)](
            logits, part_value, part_index, _counters(logits.device), tokens, sequence,
            tokens if next_tokens is None else next_tokens,
            tokens if finished is None else finished.view(torch.uint8), tokens if finish_step is None else finish_step,
            eos if has_eos else tokens, vocab, logits.stride(0), sequence.stride(0), length,
            eos.numel() if has_eos else 0, pad, step,
            BLOCK=BLOCK, PROGRAMS=programs, BLOCK_P=triton.next_power_of_2(programs),
            EOS_BLOCK=triton.next_power_of_2(eos.numel() if has_eos else 1),
            HAS_NEXT=next_tokens is not None, HAS_FINISHED=finished is not None, HAS_EOS=has_eos,
            num_warps=4,
        )
    return tokens
