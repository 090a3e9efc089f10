"""Triton kernels for :mod:`dslab.kernels.embedding.embedding`: the weight gradient of an embedding lookup,
deterministic (no atomics), with a tied head's gradient folded into the same pass.

For token ids ``ids`` ``[N]``, the lookup's output gradient ``rows`` ``[N, H]`` and a table of
``V`` rows, the result ``out`` ``[V, H]`` is

    out[v] = head(v) + sum_{i : ids[i] == v} rows[i]          (fp32 sums, stored in out's dtype)

where ``head(v)`` is 0 without a head gradient, ``head_grad[v]`` without a scale, and
``round(head_grad[v] * scale)`` with one (the product computed in fp32 and rounded to
``head_grad``'s dtype, as ``head_grad * scale`` rounds in PyTorch, whose CUDA kernels round the
one-element ``scale`` to that dtype first).

Segment path (any call with a head gradient, and vocabularies above :data:`SMALL_VOCAB`), two
passes over an fp32 ``[V, H]`` buffer. First ``head(v)`` is written to it (one read of the head
gradient, scaled and rounded in the same pass), or zeros without a head. The host sorts the ids
(stable, int32 keys: half the radix passes of int64). Then program ``(s, j)`` of the segment
kernel looks at sorted position ``s``: where a segment of equal ids starts there, it gathers the
segment's rows (``CHUNK`` sorted positions a step, masked to the segment, each chunk reduced by a
fixed tree) and adds their sum into that id's row, columns ``[j BLOCK_H, (j + 1) BLOCK_H)``; the
other programs return at once. One program owns each (row, column block), so no two programs
write the same elements, and which chunks a segment takes depends on the ids alone: the result
is the same bits on every run. Traffic: ``V H`` head elements read and ``V H`` fp32 written,
``N H`` gradient elements read once each, and one read and write of the fp32 row of each id that
occurs (no separate scale, cast or add).

Small-vocabulary kernel (``V <= SMALL_VOCAB`` without a head gradient: BERT's token types). A
segment kernel there would leave one program to walk nearly all N tokens. Instead a grid sized
to the programs resident on the device has each program sum its token tiles into ``V`` fp32
accumulators (masked sums, one per row), and the ``[programs, V, H]`` partials are added in a
fixed order (:mod:`dslab.kernels._grid`): one read of ``rows``, deterministic.

Ids outside ``[0, V)`` (which the forward lookup already refuses) fall outside every segment and
are ignored.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import column_sums, device_guard, resident_programs, unit_stride_rows
from dslab.kernels._triton_compat import cast_rounding as _cast
from dslab.kernels.dispatch import interpreting

#: Tables up to this many rows take the small-vocabulary kernel when no head gradient is folded in.
SMALL_VOCAB = 16


@triton.jit
def _head_init_kernel(HEAD, SCALE, OUT, V, H, stride_head, stride_out,
                      HAS_SCALE: tl.constexpr, ROUND_HEAD: tl.constexpr, ROUND_SCALE: tl.constexpr,
                      HEAD_BF16_BY_HAND: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """``OUT[v] = head(v)`` in fp32 for a ``[BLOCK_V, BLOCK_H]`` block: the first pass.
    ``ROUND_SCALE``: the scale is rounded to the head's dtype first, as PyTorch's CUDA kernels
    convert a one-element tensor operand to the product's dtype (its CPU kernels take it as an
    fp32 scalar)."""
    rows = (tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < V)[:, None] & (cols < H)[None, :]
    head = tl.load(HEAD + rows[:, None] * stride_head + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(SCALE).to(tl.float32)
        if ROUND_SCALE:
            scale = _cast(scale, HEAD.dtype.element_ty, HEAD_BF16_BY_HAND).to(tl.float32)
        head = head * scale
        if ROUND_HEAD:
            head = _cast(head, HEAD.dtype.element_ty, HEAD_BF16_BY_HAND).to(tl.float32)
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], head, mask=mask)


@triton.jit
def _segment_add_kernel(SORTED, ORDER, ROWS, OUT, N, V, H, stride_rows, stride_out,
                        CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program ``(s, j)``: if sorted position ``s`` starts a segment (its id differs from the one
    before, and lies in ``[0, V)``), add the segment's rows, columns ``[j BLOCK_H, (j + 1)
    BLOCK_H)``, into that id's fp32 row of ``OUT``; other programs return at once. The segment is
    read ``CHUNK`` sorted positions at a time (masked gathers of its tokens' rows, summed by a
    fixed tree) until a chunk ends it."""
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    row_id = tl.load(SORTED + s)
    prev = tl.load(SORTED + s - 1, mask=s > 0, other=-1)
    if (row_id != prev) & (row_id >= 0) & (row_id < V):
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        start = s
        more = True
        while more:
            t = start + tl.arange(0, CHUNK)
            in_segment = tl.load(SORTED + t, mask=t < N, other=-1) == row_id
            token = tl.load(ORDER + t, mask=in_segment, other=0).to(tl.int64)
            tile = tl.load(ROWS + token[:, None] * stride_rows + cols[None, :],
                           mask=in_segment[:, None] & col_mask[None, :], other=0.0)
            acc += tl.sum(tile.to(tl.float32), axis=0)
            more = tl.sum(in_segment.to(tl.int32), axis=0) == CHUNK
            start += CHUNK
        out_ptrs = OUT + row_id.to(tl.int64) * stride_out + cols
        tl.store(out_ptrs, tl.load(out_ptrs, mask=col_mask, other=0.0) + acc, mask=col_mask)


@triton.jit
def _small_vocab_partials_kernel(IDS, ROWS, PARTIAL, N, H, stride_rows, V: tl.constexpr, BLOCK_V: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    local = tl.arange(0, BLOCK_V)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=tl.float32)
    for tile_index in tl.range(pid, tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        t = tile_index * BLOCK_N + tl.arange(0, BLOCK_N)
        t_mask = t < N
        row = tl.load(IDS + t, mask=t_mask, other=-1)
        tile = tl.load(ROWS + t.to(tl.int64)[:, None] * stride_rows + cols[None, :],
                       mask=t_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(tl.where(row[None, :, None] == local[:, None, None], tile[None, :, :], 0.0), axis=1)
    tl.store(PARTIAL + (pid * V + local)[:, None] * H + cols[None, :], acc,
             mask=(local < V)[:, None] & col_mask[None, :])


@functools.cache
def _segment_config(h: int) -> tuple[int, int, int]:
    """(CHUNK, BLOCK_H, num_warps) of the segment pass: the whole row (up to 1024 columns) per
    program, 16 sorted positions per chunk; under the interpreter chunks of 4 and 32 columns, so
    that the tests' segments span several chunks and rows several column blocks."""
    if interpreting():
        return 4, min(triton.next_power_of_2(h), 32), 1
    return 16, min(triton.next_power_of_2(h), 1024), 4


def _segment_sums(ids, rows, num_rows, out_dtype, head_grad, head_scale) -> torch.Tensor:
    n, h = rows.shape
    sorted_ids, order = torch.sort(ids.to(torch.int32), stable=True)
    if head_grad is None:
        out = torch.zeros((num_rows, h), dtype=torch.float32, device=rows.device)
    else:
        head_grad = unit_stride_rows(head_grad)
        out = torch.empty((num_rows, h), dtype=torch.float32, device=rows.device)
        block_v, block_h = (4, 32) if interpreting() else (8, min(triton.next_power_of_2(h), 256))
        with device_guard(rows):
            _head_init_kernel[(triton.cdiv(num_rows, block_v), triton.cdiv(h, block_h))](
                head_grad, head_scale, out, num_rows, h, head_grad.stride(0), out.stride(0),
                HAS_SCALE=head_scale is not None, ROUND_HEAD=head_grad.dtype in (torch.float16, torch.bfloat16),
                ROUND_SCALE=head_grad.is_cuda and head_grad.dtype in (torch.float16, torch.bfloat16),
                HEAD_BF16_BY_HAND=interpreting() and head_grad.dtype == torch.bfloat16,
                BLOCK_V=block_v, BLOCK_H=block_h, num_warps=4,
            )
    chunk, block_h, num_warps = _segment_config(h)
    with device_guard(rows):
        _segment_add_kernel[(n, triton.cdiv(h, block_h))](
            sorted_ids, order, rows, out, n, num_rows, h, rows.stride(0), out.stride(0),
            CHUNK=chunk, BLOCK_H=block_h, num_warps=num_warps,
        )
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def _small_vocab_sums(ids, rows, num_rows, out_dtype) -> torch.Tensor:
    n, h = rows.shape
    block_v, block_h = triton.next_power_of_2(num_rows), min(triton.next_power_of_2(h), 128)
    # A [BLOCK_V, BLOCK_N, BLOCK_H] masked sum of 8K elements per tile (64 a thread at 4 warps).
    block_n = 4 if interpreting() else max(1, 8192 // (block_v * block_h))
    meta = dict(V=num_rows, BLOCK_V=block_v, BLOCK_N=block_n, BLOCK_H=block_h, num_warps=4)
    row_tiles, col_tiles = triton.cdiv(n, block_n), triton.cdiv(h, block_h)
    with device_guard(rows):
        def probe_args():
            return ids, rows, torch.empty(1, dtype=torch.float32, device=rows.device), n, h, rows.stride(0)

        key = ("embedding_small_vocab", num_rows, h, rows.dtype, ids.dtype)
        resident = resident_programs(_small_vocab_partials_kernel, probe_args, meta, key, rows.device)
        programs = min(row_tiles, max(1, resident // col_tiles))
        partial = torch.empty((1, programs, num_rows * h), dtype=torch.float32, device=rows.device)
        _small_vocab_partials_kernel[(programs, col_tiles)](ids, rows, partial, n, h, rows.stride(0), **meta)
        (out,) = column_sums(partial, (out_dtype,))
    return out.view(num_rows, h)


def embedding_grad(ids: torch.Tensor, rows: torch.Tensor, num_rows: int, out_dtype: torch.dtype,
                   head_grad: torch.Tensor | None, head_scale: torch.Tensor | None) -> torch.Tensor:
    """``out`` ``[num_rows, H]`` in ``out_dtype`` (module docstring) for ``ids`` ``[N]`` (N >= 1)
    and ``rows`` ``[N, H]`` (H >= 1), checked by the caller. No host synchronisation."""
    rows = unit_stride_rows(rows)
    if head_grad is None and num_rows <= SMALL_VOCAB:
        return _small_vocab_sums(ids.contiguous(), rows, num_rows, out_dtype)
    return _segment_sums(ids, rows, num_rows, out_dtype, head_grad, head_scale)
