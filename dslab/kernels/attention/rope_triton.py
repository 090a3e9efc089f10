"""Triton kernel for :mod:`dslab.kernels.attention.rope` and the host code that launches it.

One launch rotates q ``[B, S, Hq, D]`` and k ``[B, S, Hk, D]`` (any strides, unit stride along D)
by the fp32 half tables cos/sin ``[B, S, D/2]`` (a ``[S, D/2]`` table is read with batch stride 0)
and writes contiguous outputs. The grid is ``(row tiles, q head tiles + k head tiles)`` over the
``B * S`` rows: a program loads its rows' cos and sin once and rotates a ``[BLOCK_R, BLOCK_H, D]``
tile of q's heads or of k's. With x1 = x[..., :D/2], x2 = x[..., D/2:], in fp32:

    forward:   y1 = x1 * cos - x2 * sin        y2 = x2 * cos + x1 * sin
    backward:  the same with sin negated (the rotation by the opposite angle)

Memory traffic: every element of q and k is read once and written once (2 (Hq + Hk) D elements a
row) plus the tables, ``2 * D/2`` fp32 values a row, read by each head tile of the row (from L2
after the first).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from dslab.kernels._launch import FastJit
from dslab.kernels._grid import device_guard as _device_guard


@triton.jit
def _rotate_heads(
    X, Y, b, s, rows64, row_mask, d, d_mask, cos, sin, head_start, heads, half,
    stride_b, stride_s, stride_h, BLOCK_H: tl.constexpr,
):
    """Rotates heads ``[head_start, head_start + BLOCK_H)`` of the tile's rows of X into Y (contiguous)."""
    h = head_start + tl.arange(0, BLOCK_H)
    mask = row_mask[:, None, None] & (h < heads)[None, :, None] & d_mask[None, None, :]
    h64 = h.to(tl.int64)[None, :, None]
    src = X + (b * stride_b + s * stride_s)[:, None, None] + h64 * stride_h + d[None, None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    c = cos[:, None, :]
    sn = sin[:, None, :]
    y1 = x1 * c - x2 * sn
    y2 = x2 * c + x1 * sn
    dst = Y + (rows64 * heads * 2 * half)[:, None, None] + h64 * (2 * half) + d[None, None, :]
    tl.store(dst, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(dst + half, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, QO, KO,
    rows, seq, heads_q, heads_k, half, q_tiles,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_cb, stride_cs, stride_sb, stride_ss,
    HAS_K: tl.constexpr, INVERSE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    pid_h = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = r < rows
    rows64 = r.to(tl.int64)
    b = rows64 // seq
    s = rows64 % seq
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half
    table_mask = row_mask[:, None] & d_mask[None, :]
    cos = tl.load(COS + (b * stride_cb + s * stride_cs)[:, None] + d[None, :], mask=table_mask, other=0.0)
    sin = tl.load(SIN + (b * stride_sb + s * stride_ss)[:, None] + d[None, :], mask=table_mask, other=0.0)
    if INVERSE:
        sin = -sin
    if pid_h < q_tiles:
        _rotate_heads(Q, QO, b, s, rows64, row_mask, d, d_mask, cos, sin, pid_h * BLOCK_H, heads_q, half,
                      stride_qb, stride_qs, stride_qh, BLOCK_H)
    else:
        if HAS_K:
            _rotate_heads(K, KO, b, s, rows64, row_mask, d, d_mask, cos, sin, (pid_h - q_tiles) * BLOCK_H,
                          heads_k, half, stride_kb, stride_ks, stride_kh, BLOCK_H)


_FAST_ROPE = FastJit(_rope_kernel)


@functools.cache
def _config(half: int, heads_q: int, heads_k: int) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_H, BLOCK_HALF, num_warps): head tiles of the largest power of two dividing
    both head counts (8 for 32 q and 8 k heads: no tile runs past its tensor's heads), capped so
    that ``BLOCK_H * BLOCK_HALF`` is at most 2K, and stacked over ``BLOCK_R`` rows up to 2K
    elements a half (4K rotated elements a program, 32 a thread)."""
    block_half = triton.next_power_of_2(half)
    common = math.gcd(heads_q, heads_k) if heads_k else heads_q
    block_h = min(common & -common, max(1, 2048 // block_half))
    block_r = max(1, 2048 // (block_h * block_half))
    return block_r, block_h, block_half, 4


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _table(t: torch.Tensor, batch: int) -> torch.Tensor:
    """A ``[seq, D/2]`` or ``[batch, seq, D/2]`` table as a ``[batch, seq, D/2]`` view (batch stride 0
    for the shared one), unit stride along D/2."""
    t = _unit_stride(t)
    return t.expand(batch, *t.shape) if t.dim() == 2 else t


def rotate(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q and k ``[B, S, H, D]`` rotated by the angles of cos/sin (by their opposites when
    ``inverse``: the backward), as new contiguous tensors; the second is None when k is None."""
    batch, seq, heads_q, head_dim = q.shape
    heads_k = k.shape[2] if k is not None else 0
    half = head_dim // 2
    q = _unit_stride(q)
    k = _unit_stride(k) if k is not None else None
    q_out = torch.empty((batch, seq, heads_q, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((batch, seq, heads_k, head_dim), dtype=k.dtype, device=k.device) if k is not None else None
    rows = batch * seq
    if rows == 0 or half == 0 or heads_q + heads_k == 0:
        return q_out, k_out
    cos, sin = _table(cos, batch), _table(sin, batch)
    block_r, block_h, block_half, num_warps = _config(half, heads_q, heads_k)
    q_tiles, k_tiles = triton.cdiv(heads_q, block_h), triton.cdiv(heads_k, block_h)
    k_strides = (k.stride(0), k.stride(1), k.stride(2)) if k is not None else (0, 0, 0)
    with _device_guard(q):
        _FAST_ROPE[(triton.cdiv(rows, block_r), q_tiles + k_tiles)](
            q, k, cos, sin, q_out, k_out,
            rows, seq, heads_q, heads_k, half, q_tiles,
            q.stride(0), q.stride(1), q.stride(2), *k_strides,
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            HAS_K=k is not None, INVERSE=inverse,
            BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=num_warps,
        )
    return q_out, k_out
