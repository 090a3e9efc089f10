"""Triton Evoformer attention backward: dQ, dK, dV, the pair-bias gradient and the mask-bias gradient.

With the base-2 scores ``s`` of :mod:`dslab.kernels.evoformer.evoformer_attention_triton`, the probabilities
are rebuilt from the forward's ``lse`` as ``P = exp2(s - lse)``, and (FlashAttention-2, Dao 2023,
Algorithm 2)

    dV = P^T dO       dP = dO V^T       dS = P * (dP - delta),  delta = rowsum(dO * O)
    dQ = D**-0.5 * dS K      dK = D**-0.5 * dS^T Q
    dpair[h, i, j] = sum over b, s of dS[b, s, h, i, j]      dmask[s, j] = sum over h, i of dS[s, h, i, j]

where dS is the gradient of the natural-unit scores ``q.k * D**-0.5 + mask + pair``. (Broadcast
batch or head dims of a bias are summed too.) Two launches, each with its own tiles, on 1-D grids
with the block index fastest:

1. dQ kernel, one program per (query block, sequence, head): computes its rows' ``delta`` from O and
   dO and stores it, then walks the key blocks (three matmuls per tile: S, dP, dQ).
2. dK/dV kernel, one program per (key block, sequence, head): walks every query block (four matmuls
   per tile: S^T, dV, dP^T, dK), reading delta. Its mask-bias gradient is the sum of dS^T over the
   query rows it sees, so each program owns ``[BLOCK_N]`` entries of an fp32 ``[B, N_seq, H, N_res]``
   buffer, stored once; the host sums it over heads (``4 * B * N_seq * H * N_res`` bytes, 8 MiB at
   N_seq = N_res = 512, H = 8). Only when the mask bias requires a gradient.

The pair-bias gradient sums dS over every sequence, so no single program owns an element of it.
:data:`PAIR_GRAD_MODES`, chosen by :data:`pair_grad_mode` (default ``"atomic"``):

- ``"atomic"``: the dK/dV kernel adds each dS^T tile into an fp32 ``[B, H, N_res, N_res]`` buffer
  with relaxed ``atomic_add`` (no extra matmul, no extra pass over q, k, v, dO); the host then sums
  the bias's broadcast dims and casts. Cost: ``B * N_seq * H * N_res**2`` fp32 reductions in L2
  (1.07e9 at 512 x 512 x 8 heads), which Triton emits for sm_90 as 16-byte vector reductions without
  a return value (``red.global.add.v4.f32``), into a buffer that stays in L2 (8 MiB at that size).
  For comparison, FlashAttention-2's atomic dQ issues ``D / BLOCK_N`` times as many (half as many
  at D = 32 with 64-key blocks). The
  programs that add into the same elements work on other sequences: the 1-D grid runs the key
  blocks and heads of a few sequences at a time, and each program starts its walk over the query
  blocks at block ``s % n_query_blocks``, so programs of neighbouring sequences write different
  rows at any moment. The summation order varies from run to run, so the pair-bias gradient is
  reproducible only to fp32 rounding (dQ, dK, dV and the mask gradient are deterministic).
- ``"recompute"``: a third kernel, one program per ``(query block x key block)`` tile of one
  (batch, head) and a chunk of sequences, recomputes S and dP for each sequence of its chunk and
  keeps the tile's sum in registers, then stores it once into an fp32 ``[chunks, B, H, N_res,
  N_res]`` buffer that the host sums. Deterministic and atomic-free, but it computes S and dP once
  more (nine matmuls per tile in the backward instead of the dQ and dK/dV kernels' seven, i.e.
  4.5x the forward's matmul work instead of 3.5x) and reads q, k, v, dO, lse and delta once more.
  ``chunks`` is the fewest that gives about four programs per multiprocessor.

Neither mode writes a per-sequence ``[N_seq, H, N_res, N_res]`` tensor. Extra memory of the
backward, besides dq, dk, dv: delta (like lse), the fp32 pair-gradient buffer and its cast to the
bias's dtype, and the mask-gradient buffer.

Memory traffic per (sequence, head): q, k, v, o, dO read and dq, dk, dv written once from DRAM;
the dK/dV programs re-read q, dO, lse and delta once per key block and the dQ programs k and v once
per query block (mostly from L2); the pair bias is read once per tile in each kernel, as in the
forward.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import device_guard
from dslab.kernels.dispatch import interpreting
from dslab.kernels.evoformer.evoformer_layout import output_like
from dslab.kernels.evoformer.evoformer_attention_triton import (
    LOG2_E,
    bias_args,
    configs,
    dims,
    dot,
    kernel_flags,
    mask_view,
    n_res_bucket,
    pair_view,
    program_coordinates,
    rows_view,
    tiles_for,
)

PAIR_GRAD_MODES = ("atomic", "recompute")
#: How the pair-bias gradient is reduced over sequences (see the module docstring).
pair_grad_mode = "atomic"


@triton.jit
def _dq_key_loop(
    dq, q, do, lse, delta, k_base, v_base, mask_base, pair_rows, row_valid,
    stride_kn, stride_vn, stride_mn, stride_pj, n_res, qk_scale, start, end, offs_d,
    BOUNDARY: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Accumulate dQ of one query block over the key blocks ``[start, end)``; ``BOUNDARY`` blocks
    mask keys past ``n_res``."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
        if BOUNDARY:
            key_valid = offs_n < n_res
            k = tl.load(k_ptrs, mask=key_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=key_valid[:, None], other=0.0)
        else:
            key_valid = offs_n >= 0
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_FP32, PRECISION) * qk_scale
        if HAS_MASK:
            if BOUNDARY:
                mask_bias = tl.load(mask_base + offs_n * stride_mn, mask=key_valid, other=0.0)
            else:
                mask_bias = tl.load(mask_base + offs_n * stride_mn)
            s += mask_bias.to(tl.float32)[None, :] * 1.4426950408889634
        if HAS_PAIR:
            pair_mask = row_valid[:, None] & key_valid[None, :]
            pair = tl.load(pair_rows + offs_n[None, :] * stride_pj, mask=pair_mask, other=0.0)
            s += pair.to(tl.float32) * 1.4426950408889634
        p = tl.math.exp2(s - lse[:, None])
        if BOUNDARY:
            p = tl.where(key_valid[None, :], p, 0.0)
        dp = dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_FP32, PRECISION)
        ds = p * (dp - delta[:, None])
        dq = dot(ds.to(k.dtype), k, dq, DOT_FP32, PRECISION)
    return dq


@triton.jit
def _evoformer_dq_kernel(
    Q, K, V, O, DO, DQ, LSE, DELTA, MASK, PAIR,
    stride_qb, stride_qs, stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kn, stride_kh,
    stride_vb, stride_vs, stride_vn, stride_vh,
    stride_ob, stride_os, stride_on, stride_oh,
    stride_dob, stride_dos, stride_don, stride_doh,
    stride_dqb, stride_dqs, stride_dqn, stride_dqh,
    stride_mb, stride_ms, stride_mn,
    stride_pb, stride_ph, stride_pi, stride_pj,
    n_seq, n_res, num_heads, n_res_bucket, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ and delta of one query block; 1-D grid of ``cdiv(n_res, BLOCK_M) * B * n_seq * num_heads``
    programs. Query rows past ``n_res`` load q = dO = O = 0 and lse = +inf, so they add nothing."""
    pid_m, bsh, b, seq, h = program_coordinates(tl.program_id(0), tl.cdiv(n_res, BLOCK_M), num_heads, n_seq)
    b = b.to(tl.int64)
    seq = seq.to(tl.int64)
    h = h.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_m < n_res
    rows = offs_m[:, None]
    q = tl.load(Q + b * stride_qb + seq * stride_qs + h * stride_qh + rows * stride_qn + offs_d[None, :],
                mask=row_valid[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + seq * stride_dos + h * stride_doh + rows * stride_don + offs_d[None, :],
                 mask=row_valid[:, None], other=0.0)
    o = tl.load(O + b * stride_ob + seq * stride_os + h * stride_oh + rows * stride_on + offs_d[None, :],
                mask=row_valid[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_stats = bsh.to(tl.int64) * n_res + offs_m
    tl.store(DELTA + row_stats, delta, mask=row_valid)
    lse = tl.load(LSE + row_stats, mask=row_valid, other=float("inf"))
    k_base = K + b * stride_kb + seq * stride_ks + h * stride_kh
    v_base = V + b * stride_vb + seq * stride_vs + h * stride_vh
    mask_base = MASK + b * stride_mb + seq * stride_ms
    pair_rows = PAIR + b * stride_pb + h * stride_ph + rows * stride_pi
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end = n_res // BLOCK_N * BLOCK_N
    dq = _dq_key_loop(
        dq, q, do, lse, delta, k_base, v_base, mask_base, pair_rows, row_valid,
        stride_kn, stride_vn, stride_mn, stride_pj, n_res, qk_scale, 0, full_end, offs_d,
        False, HAS_MASK, HAS_PAIR, DOT_FP32, PRECISION, BLOCK_M, BLOCK_N,
    )
    dq = _dq_key_loop(
        dq, q, do, lse, delta, k_base, v_base, mask_base, pair_rows, row_valid,
        stride_kn, stride_vn, stride_mn, stride_pj, n_res, qk_scale, full_end, n_res, offs_d,
        True, HAS_MASK, HAS_PAIR, DOT_FP32, PRECISION, BLOCK_M, BLOCK_N,
    )
    dq_ptrs = DQ + b * stride_dqb + seq * stride_dqs + h * stride_dqh + rows * stride_dqn + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _evoformer_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, MASK, PAIR, DPAIR, DMASK,
    stride_qb, stride_qs, stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kn, stride_kh,
    stride_vb, stride_vs, stride_vn, stride_vh,
    stride_dob, stride_dos, stride_don, stride_doh,
    stride_dkb, stride_dks, stride_dkn, stride_dkh,
    stride_dvb, stride_dvs, stride_dvn, stride_dvh,
    stride_mb, stride_ms, stride_mn,
    stride_pb, stride_ph, stride_pi, stride_pj,
    n_seq, n_res, num_heads, n_res_bucket, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr,
    PAIR_GRAD_ATOMIC: tl.constexpr, MASK_GRAD: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
):
    """dK, dV of one key block, walking every query block in transposed ``[BLOCK_N1, BLOCK_M1]``
    tiles, from block ``seq % n_query_blocks`` round to the one before it. With
    ``PAIR_GRAD_ATOMIC`` each dS^T tile is added into ``DPAIR`` (fp32, contiguous ``[B, H, n_res,
    n_res]``); with ``MASK_GRAD`` the program stores the column sums of dS into ``DMASK`` (fp32
    ``[B, n_seq, H, n_res]``). Query rows past ``n_res`` load q = dO = 0 and lse = +inf, so they add
    nothing; keys past ``n_res`` are computed and never stored."""
    pid_n, bsh, b, seq, h = program_coordinates(tl.program_id(0), tl.cdiv(n_res, BLOCK_N1), num_heads, n_seq)
    n_query_blocks = tl.cdiv(n_res, BLOCK_M1)
    first_block = seq % n_query_blocks
    b = b.to(tl.int64)
    seq = seq.to(tl.int64)
    h = h.to(tl.int64)
    offs_n = pid_n * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    offs_d = tl.arange(0, HEAD_DIM)
    key_valid = offs_n < n_res
    keys = offs_n[:, None]
    k = tl.load(K + b * stride_kb + seq * stride_ks + h * stride_kh + keys * stride_kn + offs_d[None, :],
                mask=key_valid[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + seq * stride_vs + h * stride_vh + keys * stride_vn + offs_d[None, :],
                mask=key_valid[:, None], other=0.0)
    if HAS_MASK:
        mask_bias = tl.load(MASK + b * stride_mb + seq * stride_ms + offs_n * stride_mn, mask=key_valid, other=0.0)
        mask_bias = mask_bias.to(tl.float32) * 1.4426950408889634
    q_base = Q + b * stride_qb + seq * stride_qs + h * stride_qh
    do_base = DO + b * stride_dob + seq * stride_dos + h * stride_doh
    pair_cols = PAIR + b * stride_pb + h * stride_ph + keys * stride_pj
    dpair_cols = DPAIR + (b * num_heads + h) * n_res * n_res + keys
    row_stats = LSE + bsh.to(tl.int64) * n_res
    delta_base = DELTA + bsh.to(tl.int64) * n_res
    dk = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    dmask = tl.zeros([BLOCK_N1], dtype=tl.float32)
    for step in range(0, n_query_blocks):
        block = first_block + step
        block = tl.where(block >= n_query_blocks, block - n_query_blocks, block)
        offs_m = block * BLOCK_M1 + tl.arange(0, BLOCK_M1)
        row_valid = offs_m < n_res
        q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        lse = tl.load(row_stats + offs_m, mask=row_valid, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=row_valid, other=0.0)
        s_t = dot(k, tl.trans(q), tl.zeros([BLOCK_N1, BLOCK_M1], dtype=tl.float32), DOT_FP32, PRECISION) * qk_scale
        if HAS_MASK:
            s_t += mask_bias[:, None]
        tile_valid = key_valid[:, None] & row_valid[None, :]
        if HAS_PAIR:
            pair_t = tl.load(pair_cols + offs_m[None, :] * stride_pi, mask=tile_valid, other=0.0)
            s_t += pair_t.to(tl.float32) * 1.4426950408889634
        p_t = tl.math.exp2(s_t - lse[None, :])
        dv = dot(p_t.to(do.dtype), do, dv, DOT_FP32, PRECISION)
        dp_t = dot(v, tl.trans(do), tl.zeros([BLOCK_N1, BLOCK_M1], dtype=tl.float32), DOT_FP32, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = dot(ds_t.to(q.dtype), q, dk, DOT_FP32, PRECISION)
        if PAIR_GRAD_ATOMIC:
            tl.atomic_add(dpair_cols + offs_m[None, :] * n_res, ds_t, mask=tile_valid, sem="relaxed")
        if MASK_GRAD:
            dmask += tl.sum(ds_t, 1)
    dk_ptrs = DK + b * stride_dkb + seq * stride_dks + h * stride_dkh + keys * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + b * stride_dvb + seq * stride_dvs + h * stride_dvh + keys * stride_dvn + offs_d[None, :]
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_valid[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_valid[:, None])
    if MASK_GRAD:
        tl.store(DMASK + bsh.to(tl.int64) * n_res + offs_n, dmask, mask=key_valid)


@triton.jit
def _evoformer_dpair_kernel(
    Q, K, V, DO, LSE, DELTA, MASK, PAIR, PARTIAL,
    stride_qb, stride_qs, stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kn, stride_kh,
    stride_vb, stride_vs, stride_vn, stride_vh,
    stride_dob, stride_dos, stride_don, stride_doh,
    stride_mb, stride_ms, stride_mn,
    stride_pb, stride_ph, stride_pi, stride_pj,
    n_seq, n_res, num_heads, batch, n_chunks, n_res_bucket, qk_scale,
    HEAD_DIM: tl.constexpr, HAS_MASK: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The ``"recompute"`` pair-bias gradient: program ``pid`` owns tile ``pid % tiles`` of (batch,
    head) ``(pid // tiles) % (batch * num_heads)`` and chunk ``pid // (tiles * batch * num_heads)``
    of ``cdiv(n_seq, n_chunks)`` sequences; it sums dS over them in registers and stores the tile
    into ``PARTIAL`` (fp32, contiguous ``[n_chunks, batch, num_heads, n_res, n_res]``)."""
    tiles_n = tl.cdiv(n_res, BLOCK_N)
    tiles = tl.cdiv(n_res, BLOCK_M) * tiles_n
    pid = tl.program_id(0)
    tile = pid % tiles
    bh = (pid // tiles) % (batch * num_heads)
    chunk = pid // (tiles * batch * num_heads)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_m = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_m < n_res
    key_valid = offs_n < n_res
    tile_valid = row_valid[:, None] & key_valid[None, :]
    pair = tl.load(PAIR + b * stride_pb + h * stride_ph + offs_m[:, None] * stride_pi + offs_n[None, :] * stride_pj,
                   mask=tile_valid, other=0.0)
    pair = pair.to(tl.float32) * 1.4426950408889634
    per_chunk = tl.cdiv(n_seq, n_chunks)
    seq_start = (chunk * per_chunk).to(tl.int64)  # the loop counter is then 64-bit
    seq_end = tl.minimum(n_seq, seq_start + per_chunk)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for seq in range(seq_start, seq_end):
        q = tl.load(Q + b * stride_qb + seq * stride_qs + h * stride_qh + offs_m[:, None] * stride_qn
                    + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        do = tl.load(DO + b * stride_dob + seq * stride_dos + h * stride_doh + offs_m[:, None] * stride_don
                     + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        k = tl.load(K + b * stride_kb + seq * stride_ks + h * stride_kh + offs_n[:, None] * stride_kn
                    + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        v = tl.load(V + b * stride_vb + seq * stride_vs + h * stride_vh + offs_n[:, None] * stride_vn
                    + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        row_stats = ((b * n_seq + seq) * num_heads + h) * n_res + offs_m
        lse = tl.load(LSE + row_stats, mask=row_valid, other=float("inf"))
        delta = tl.load(DELTA + row_stats, mask=row_valid, other=0.0)
        s = dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_FP32, PRECISION) * qk_scale
        s += pair
        if HAS_MASK:
            mask_bias = tl.load(MASK + b * stride_mb + seq * stride_ms + offs_n * stride_mn, mask=key_valid, other=0.0)
            s += mask_bias.to(tl.float32)[None, :] * 1.4426950408889634
        p = tl.math.exp2(s - lse[:, None])
        dp = dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_FP32, PRECISION)
        acc += p * (dp - delta[:, None])
    out = PARTIAL + ((chunk.to(tl.int64) * batch + b) * num_heads + h) * n_res * n_res
    tl.store(out + offs_m[:, None] * n_res + offs_n[None, :], acc, mask=tile_valid)


# Tiles (block sizes..., num_warps, num_stages) per head dim. dQ: (BLOCK_M, BLOCK_N); dK/dV:
# (BLOCK_M1, BLOCK_N1), the key block the wider (it carries dK and dV); pair gradient:
# (BLOCK_M, BLOCK_N), whose fp32 accumulator tile lives across the sequence loop.
DQ_TILES = {
    16: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4), (128, 32, 4, 3)],
    32: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4), (128, 32, 4, 3)],
    64: [(64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 4)],
    128: [(64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3)],
}
DKDV_TILES = {
    16: [(32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2)],
    32: [(32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2)],
    64: [(32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2)],
    128: [(64, 64, 8, 2), (32, 64, 4, 3), (32, 128, 8, 2)],
}
DPAIR_TILES = {
    16: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3)],
    32: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3)],
    64: [(64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3)],
    128: [(64, 64, 4, 2), (64, 32, 4, 3), (32, 64, 4, 2)],
}
# fp32 inputs (see evoformer_attention_triton.FWD_TILES_FP32): small tiles that compile without
# spills for sm_90 with IEEE dots.
DQ_TILES_FP32 = {
    16: [(32, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)],
    32: [(32, 32, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2)],
    64: [(32, 32, 4, 2), (16, 32, 4, 2)],
    128: [(32, 16, 4, 2)],
}
DKDV_TILES_FP32 = {
    16: [(32, 32, 4, 2), (32, 64, 4, 2)],
    32: [(32, 32, 4, 2), (16, 32, 4, 2)],
    64: [(16, 32, 4, 2), (32, 16, 4, 2)],
    128: [(16, 32, 4, 2)],
}
DPAIR_TILES_FP32 = {
    16: [(32, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)],
    32: [(32, 32, 4, 2), (32, 16, 4, 2)],
    64: [(32, 32, 4, 2), (16, 32, 4, 2)],
    128: [(32, 16, 4, 2), (16, 32, 4, 2)],
}
# Under the interpreter: 16-residue query blocks and 32-residue key blocks in dK/dV, so that test
# shapes span several blocks with partial ones at both ends.
DQ_INTERPRET_TILE = (16, 16, 4, 1)
DKDV_INTERPRET_TILE = (16, 32, 4, 1)
DPAIR_INTERPRET_TILE = (16, 16, 4, 1)
#: Programs per multiprocessor the ``"recompute"`` mode's sequence chunks aim for.
DPAIR_PROGRAMS_PER_SM = 4
_DPAIR_CHUNK_TILE = 64  # the tile size assumed when choosing the chunk count
_KEY = ["n_res_bucket", "HAS_MASK", "HAS_PAIR"]


@functools.cache
def _dq_kernel(head_dim: int, interpret: bool, fp32: bool = False):
    tiles = tiles_for(DQ_TILES, DQ_TILES_FP32, DQ_INTERPRET_TILE, head_dim, fp32, interpret)
    return triton.autotune(configs=configs(tiles, ("BLOCK_M", "BLOCK_N")), key=_KEY)(_evoformer_dq_kernel)


@functools.cache
def _dkdv_kernel(head_dim: int, interpret: bool, fp32: bool = False):
    tiles = tiles_for(DKDV_TILES, DKDV_TILES_FP32, DKDV_INTERPRET_TILE, head_dim, fp32, interpret)
    # The autotuner runs every candidate on the real buffers: DPAIR, which the atomic mode adds
    # into, is zeroed before each run and after the last.
    return triton.autotune(
        configs=configs(tiles, ("BLOCK_M1", "BLOCK_N1")), key=[*_KEY, "PAIR_GRAD_ATOMIC", "MASK_GRAD"],
        reset_to_zero=["DPAIR"],
    )(_evoformer_dkdv_kernel)


@functools.cache
def _dpair_kernel(head_dim: int, interpret: bool, fp32: bool = False):
    tiles = tiles_for(DPAIR_TILES, DPAIR_TILES_FP32, DPAIR_INTERPRET_TILE, head_dim, fp32, interpret)
    return triton.autotune(configs=configs(tiles, ("BLOCK_M", "BLOCK_N")), key=["n_res_bucket", "HAS_MASK"])(
        _evoformer_dpair_kernel
    )


def recompute_chunks(n_seq: int, n_res: int, batch_heads: int, device: torch.device) -> int:
    """Sequence chunks of the ``"recompute"`` pair gradient: enough programs for
    :data:`DPAIR_PROGRAMS_PER_SM` per multiprocessor at 64 x 64 tiles, at most one per sequence;
    two under the interpreter (so that tests cover the sum over chunks)."""
    if device.type != "cuda":
        return min(n_seq, 2)
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    programs = triton.cdiv(n_res, _DPAIR_CHUNK_TILE) ** 2 * batch_heads
    return max(1, min(n_seq, triton.cdiv(DPAIR_PROGRAMS_PER_SM * multiprocessors, programs)))


def _sum_pair_grad(full: torch.Tensor, pair_bias: torch.Tensor, batch_shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 ``[B, H, N_res, N_res]`` gradient summed over the pair bias's broadcast dims, in its
    dtype and shape."""
    heads, n_res = full.shape[1], full.shape[2]
    return full.view(*batch_shape, 1, heads, n_res, n_res).sum_to_size(pair_bias.shape).to(pair_bias.dtype)


def _sum_mask_grad(partial: torch.Tensor, mask_bias: torch.Tensor, batch_shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 ``[B, N_seq, H, N_res]`` column sums of dS summed over heads and the mask bias's
    broadcast dims, in its dtype and shape."""
    n_seq, n_res = partial.shape[1], partial.shape[3]
    per_key = partial.sum(2).view(*batch_shape, n_seq, 1, 1, n_res)
    return per_key.sum_to_size(mask_bias.shape).to(mask_bias.dtype)


def backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, mask_bias: torch.Tensor | None, pair_bias: torch.Tensor | None,
    mask_grad: bool, pair_grad: bool, mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dq, dk, dv, dmask, dpair): dq, dk, dv in q's, k's, v's memory layouts (as
    :func:`dslab.kernels.evoformer.evoformer_layout.output_like` allows); dmask and dpair in the
    biases' shapes and dtypes when ``mask_grad`` / ``pair_grad`` (else None). ``lse`` is the
    forward's; ``mode`` one of :data:`PAIR_GRAD_MODES`, by default :data:`pair_grad_mode`."""
    mode = pair_grad_mode if mode is None else mode
    if mode not in PAIR_GRAD_MODES:
        raise ValueError(f"pair_grad_mode must be one of {PAIR_GRAD_MODES}, got {mode!r}")
    batch_shape, batch, n_seq, n_res, heads, head_dim = dims(q)
    device = q.device
    q5, k5, v5, o5, do5 = (rows_view(t) for t in (q, k, v, out, grad_out))
    dq, dk, dv = (output_like(t) for t in (q, k, v))
    dq5, dk5, dv5 = (t.view(batch, n_seq, n_res, heads, head_dim) for t in (dq, dk, dv))
    delta = torch.empty_like(lse)
    mask = None if mask_bias is None else mask_view(mask_bias, batch_shape, n_seq, n_res)
    pair = None if pair_bias is None else pair_view(pair_bias, batch_shape, heads, n_res)
    (mask_ptr, pair_ptr), bias_strides = bias_args(mask, pair, lse)
    atomic = pair_grad and mode == "atomic"
    dpair_full = torch.zeros((batch, heads, n_res, n_res), dtype=torch.float32, device=device) if atomic else None
    dmask_partial = torch.empty((batch, n_seq, heads, n_res), dtype=torch.float32, device=device) if mask_grad else None
    standin = torch.zeros(1, dtype=torch.float32, device=device)  # for an unused DPAIR / DMASK (zeroed, not read)
    programs = batch * n_seq * heads
    flags = dict(HEAD_DIM=head_dim, HAS_MASK=mask is not None, HAS_PAIR=pair is not None, **kernel_flags(q.dtype))
    shape_args = (n_seq, n_res, heads, n_res_bucket(n_res), head_dim**-0.5 * LOG2_E, head_dim**-0.5)
    kernel_key = (head_dim, interpreting(), q.dtype == torch.float32)

    def strides(*tensors):
        return [st for t in tensors for st in t.stride()[:4]]

    with device_guard(q):
        _dq_kernel(*kernel_key)[lambda meta: (triton.cdiv(n_res, meta["BLOCK_M"]) * programs,)](
            q5, k5, v5, o5, do5, dq5, lse, delta, mask_ptr, pair_ptr,
            *strides(q5, k5, v5, o5, do5, dq5), *bias_strides, *shape_args, **flags,
        )
        _dkdv_kernel(*kernel_key)[lambda meta: (triton.cdiv(n_res, meta["BLOCK_N1"]) * programs,)](
            q5, k5, v5, do5, dk5, dv5, lse, delta, mask_ptr, pair_ptr,
            dpair_full if atomic else standin, dmask_partial if mask_grad else standin,
            *strides(q5, k5, v5, do5, dk5, dv5), *bias_strides, *shape_args,
            PAIR_GRAD_ATOMIC=atomic, MASK_GRAD=mask_grad, **flags,
        )
        if pair_grad and not atomic:
            chunks = recompute_chunks(n_seq, n_res, batch * heads, device)
            partial = torch.empty((chunks, batch, heads, n_res, n_res), dtype=torch.float32, device=device)

            def grid(meta):
                tiles = triton.cdiv(n_res, meta["BLOCK_M"]) * triton.cdiv(n_res, meta["BLOCK_N"])
                return (tiles * batch * heads * chunks,)

            _dpair_kernel(*kernel_key)[grid](
                q5, k5, v5, do5, lse, delta, mask_ptr, pair_ptr, partial,
                *strides(q5, k5, v5, do5), *bias_strides,
                n_seq, n_res, heads, batch, chunks, n_res_bucket(n_res), head_dim**-0.5 * LOG2_E,
                HEAD_DIM=head_dim, HAS_MASK=mask is not None, **kernel_flags(q.dtype),
            )
            dpair_full = partial.sum(0) if chunks > 1 else partial[0]
    dpair = _sum_pair_grad(dpair_full, pair_bias, batch_shape) if pair_grad else None
    dmask = _sum_mask_grad(dmask_partial, mask_bias, batch_shape) if mask_grad else None
    return dq, dk, dv, dmask, dpair
