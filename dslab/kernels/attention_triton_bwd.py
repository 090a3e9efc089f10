"""Triton flash attention backward (FlashAttention-2, Dao 2023, Algorithm 2, without atomics).

With ``P = softmax(S)`` rebuilt from the saved base-2 ``lse`` as ``P = exp2(S * scale * log2 e - lse)``,
dropout keep-mask ``Z`` and ``Pd = P * Z / (1 - p)``:

    dV = Pd^T dO          dPd = dO V^T          dP = dPd * Z / (1 - p)
    dS = P * (dP - delta)  with delta = rowsum(dO * O)   (equal to rowsum(dP * P))
    dQ = scale * dS K      dK = scale * dS^T Q

Two paths, both deterministic:

- ``seq_k <= BLOCK_N1`` (one key block, e.g. BERT's seq 128): one kernel. A program per
  (batch, head) holds all keys, loops over query blocks and writes that block's complete dQ as it
  goes; ``delta`` is computed in the loop from O and dO. Five matmuls per tile, one launch.
- otherwise: a ``delta`` kernel, then one launch whose programs take one of two roles. Programs
  ``[0, n_key_blocks)`` own ``BLOCK_N1`` keys and loop over query blocks accumulating dK, dV in
  registers; the rest own ``BLOCK_M2`` queries and loop over key blocks accumulating dQ. S and dP
  are computed in both roles (seven matmuls per tile instead of five) so that no two programs add
  into the same dQ rows.

Causal blocks above the diagonal are skipped; blocks crossing it run a masked loop, the rest an
unmasked one. Fully masked query rows have ``lse = +inf``, so their P, dS and dQ are exactly 0.

Memory traffic per (batch, head), general path: q, k, v, o, dO read and dq, dk, dv written once
from DRAM; the dK/dV role re-reads q, dO, lse, delta once per key block and the dQ role re-reads
k, v once per query block (mostly from L2).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels.attention_triton import (
    LOG2_E,
    _dot,
    _dropout_keep,
    dot_fp32,
    empty_rows_like,
    padding_as_bytes,
    seq_bucket,
    unit_last_stride,
)
from dslab.kernels.dispatch import interpreting


@triton.jit
def _delta_kernel(
    O, DO, DELTA, stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos,
    num_heads, seq_q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta[bh, i] = sum_d O[bh, i, d] * dO[bh, i, d] in fp32. Grid ``(ceil(seq_q / BLOCK_M), batch * heads)``."""
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < seq_q
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :], mask=rows, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * seq_q + offs_m, delta, mask=offs_m < seq_q)


@triton.jit
def _dkdv_query_loop(
    dk, dv, k, v, key_pad, offs_n, offs_d, q_base, do_base, o_base, dq_base, lse_base, delta_base,
    stride_qs, stride_dos, stride_os, stride_dqs, seq_q, seq_k, bh,
    qk_scale, sm_scale, dropout_p, seed, start, end,
    DIAGONAL: tl.constexpr, FUSED_DQ: tl.constexpr, EVEN_N: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks ``[start, end)``, in transposed tiles
    ``[BLOCK_N1 keys, BLOCK_M1 queries]``. ``DIAGONAL`` blocks apply the causal mask. Query rows past
    ``seq_q`` load q = dO = 0, lse = +inf, so they add nothing and need no mask."""
    for start_m in range(start, end, BLOCK_M1):
        offs_m = start_m + tl.arange(0, BLOCK_M1)
        row_valid = offs_m < seq_q
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dos + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_valid, other=float("inf"))
        s_t = _dot(k, tl.trans(q), tl.zeros([BLOCK_N1, BLOCK_M1], dtype=tl.float32), DOT_FP32)
        p_t = tl.math.exp2(s_t * qk_scale - lse[None, :])
        if DIAGONAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        if FUSED_DQ:
            # Masked keys would otherwise leak into dQ; without the fused dQ they only touch their
            # own dK/dV rows, which are zeroed or dropped at the store.
            if HAS_KPM:
                p_t = tl.where(key_pad[:, None], 0.0, p_t)
            if not EVEN_N:
                p_t = tl.where(offs_n[:, None] < seq_k, p_t, 0.0)
        if HAS_DROPOUT:
            keep_t = _dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], dropout_p)
            inv_keep = 1.0 / (1.0 - dropout_p)
            pd_t = tl.where(keep_t, p_t * inv_keep, 0.0)
        else:
            pd_t = p_t
        dv = _dot(pd_t.to(do.dtype), do, dv, DOT_FP32)
        if FUSED_DQ:
            o = tl.load(o_base + offs_m[:, None] * stride_os + offs_d[None, :], mask=row_valid[:, None], other=0.0)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        else:
            delta = tl.load(delta_base + offs_m, mask=row_valid, other=0.0)
        dp_t = _dot(v, tl.trans(do), tl.zeros([BLOCK_N1, BLOCK_M1], dtype=tl.float32), DOT_FP32)
        if HAS_DROPOUT:
            dp_t = tl.where(keep_t, dp_t * inv_keep, 0.0)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = _dot(ds_t, q, dk, DOT_FP32)
        if FUSED_DQ:
            dq = _dot(tl.trans(ds_t), k, tl.zeros([BLOCK_M1, k.shape[1]], dtype=tl.float32), DOT_FP32)
            dq_ptrs = dq_base + offs_m[:, None] * stride_dqs + offs_d[None, :]
            tl.store(dq_ptrs, (dq * sm_scale).to(dq_base.dtype.element_ty), mask=row_valid[:, None])
    return dk, dv


@triton.jit
def _dq_key_loop(
    dq, q, do, lse, delta, offs_m, offs_d, k_base, v_base, kpm_base, stride_ks, stride_vs,
    seq_k, bh, qk_scale, dropout_p, seed, start, end,
    BOUNDARY: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_FP32: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
):
    """Accumulate dQ of one query block over key blocks ``[start, end)``; ``BOUNDARY`` blocks mask
    keys past ``seq_k`` and (causal) above the diagonal."""
    for start_n in range(start, end, BLOCK_N2):
        offs_n = start_n + tl.arange(0, BLOCK_N2)
        k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d[None, :]
        if BOUNDARY:
            key_valid = offs_n < seq_k
            k = tl.load(k_ptrs, mask=key_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=key_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = _dot(q, tl.trans(k), tl.zeros([BLOCK_M2, BLOCK_N2], dtype=tl.float32), DOT_FP32)
        p = tl.math.exp2(s * qk_scale - lse[:, None])
        if BOUNDARY:
            visible = key_valid[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(visible, p, 0.0)
        if HAS_KPM:
            if BOUNDARY:
                pad = tl.load(kpm_base + offs_n, mask=key_valid, other=1)
            else:
                pad = tl.load(kpm_base + offs_n)
            p = tl.where(pad[None, :] != 0, 0.0, p)
        dp = _dot(do, tl.trans(v), tl.zeros([BLOCK_M2, BLOCK_N2], dtype=tl.float32), DOT_FP32)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], dropout_p)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, DOT_FP32)
    return dq


@triton.jit(do_not_specialize=["seed"])
def _attention_bwd_kernel(
    Q, K, V, O, DO, DQ, DK, DV, LSE, DELTA, KPM,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    stride_dkb, stride_dkh, stride_dks,
    stride_dvb, stride_dvh, stride_dvs,
    stride_kpm_b,
    num_heads, seq_q, seq_k, seq_q_bucket, seq_k_bucket,
    qk_scale, sm_scale, dropout_p, seed,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_FP32: tl.constexpr, FUSED_DQ: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
):
    """Grid ``(n_key_blocks + n_query_blocks, batch * heads)`` (no query-block programs when
    ``FUSED_DQ``). dK/dV programs go from the first key block (most causal work) up; dQ programs
    from the last query block (most causal work) down."""
    tl.static_assert(BLOCK_N1 % BLOCK_M1 == 0)
    tl.static_assert(BLOCK_M2 % BLOCK_N2 == 0)
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    do_base = DO + b * stride_dob + h * stride_doh
    kpm_base = KPM + b * stride_kpm_b
    lse_base = LSE + bh.to(tl.int64) * seq_q
    delta_base = DELTA + bh.to(tl.int64) * seq_q
    n_key_blocks = tl.cdiv(seq_k, BLOCK_N1)

    if pid < n_key_blocks:
        start_n = pid * BLOCK_N1
        offs_n = start_n + tl.arange(0, BLOCK_N1)
        key_valid = offs_n < seq_k
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        if HAS_KPM:
            key_pad = tl.load(kpm_base + offs_n, mask=key_valid, other=1) != 0
        else:
            key_pad = key_valid
        dk = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
        o_base = O + b * stride_ob + h * stride_oh
        dq_base = DQ + b * stride_dqb + h * stride_dqh
        if CAUSAL:
            # Queries before start_n see none of these keys; [start_n, start_n + BLOCK_N1) is the diagonal.
            diag_end = tl.minimum(start_n + BLOCK_N1, seq_q)
            dk, dv = _dkdv_query_loop(
                dk, dv, k, v, key_pad, offs_n, offs_d, q_base, do_base, o_base, dq_base, lse_base, delta_base,
                stride_qs, stride_dos, stride_os, stride_dqs, seq_q, seq_k, bh,
                qk_scale, sm_scale, dropout_p, seed, start_n, diag_end,
                True, FUSED_DQ, EVEN_N, HAS_KPM, HAS_DROPOUT, DOT_FP32, BLOCK_M1, BLOCK_N1,
            )
            rest_start = start_n + BLOCK_N1
        else:
            rest_start = 0
        dk, dv = _dkdv_query_loop(
            dk, dv, k, v, key_pad, offs_n, offs_d, q_base, do_base, o_base, dq_base, lse_base, delta_base,
            stride_qs, stride_dos, stride_os, stride_dqs, seq_q, seq_k, bh,
            qk_scale, sm_scale, dropout_p, seed, rest_start, seq_q,
            False, FUSED_DQ, EVEN_N, HAS_KPM, HAS_DROPOUT, DOT_FP32, BLOCK_M1, BLOCK_N1,
        )
        dk = dk * sm_scale
        if HAS_KPM and not FUSED_DQ:
            dk = tl.where(key_pad[:, None], 0.0, dk)
            dv = tl.where(key_pad[:, None], 0.0, dv)
        dk_ptrs = DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]
        dv_ptrs = DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :]
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=key_valid[:, None])
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_valid[:, None])
    else:
        pid_m = pid - n_key_blocks
        if CAUSAL:
            pid_m = tl.cdiv(seq_q, BLOCK_M2) - 1 - pid_m
        start_m = pid_m * BLOCK_M2
        offs_m = start_m + tl.arange(0, BLOCK_M2)
        row_valid = offs_m < seq_q
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dos + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_valid, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=row_valid, other=0.0)
        dq = tl.zeros([BLOCK_M2, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:
            full_end = tl.minimum(start_m, seq_k) // BLOCK_N2 * BLOCK_N2
            end = tl.minimum(start_m + BLOCK_M2, seq_k)
        else:
            full_end = seq_k // BLOCK_N2 * BLOCK_N2
            end = seq_k
        dq = _dq_key_loop(
            dq, q, do, lse, delta, offs_m, offs_d, k_base, v_base, kpm_base, stride_ks, stride_vs,
            seq_k, bh, qk_scale, dropout_p, seed, 0, full_end,
            False, CAUSAL, HAS_KPM, HAS_DROPOUT, DOT_FP32, BLOCK_M2, BLOCK_N2,
        )
        dq = _dq_key_loop(
            dq, q, do, lse, delta, offs_m, offs_d, k_base, v_base, kpm_base, stride_ks, stride_vs,
            seq_k, bh, qk_scale, dropout_p, seed, full_end, end,
            True, CAUSAL, HAS_KPM, HAS_DROPOUT, DOT_FP32, BLOCK_M2, BLOCK_N2,
        )
        dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :]
        tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_valid[:, None])


# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages) tried per head dim (general path).
_BWD_TILES = {
    32: [(64, 128, 128, 64, 8, 2), (32, 128, 64, 64, 8, 2), (32, 64, 64, 32, 4, 2)],
    64: [(64, 128, 128, 64, 8, 2), (32, 128, 128, 64, 8, 2), (64, 128, 128, 64, 8, 3), (32, 64, 64, 32, 4, 2)],
    128: [(32, 128, 64, 64, 8, 2), (32, 128, 128, 64, 8, 2), (64, 128, 128, 64, 8, 2), (32, 64, 64, 32, 4, 2)],
}
# The one-key-block path: (BLOCK_M1, num_warps, num_stages); BLOCK_N1 covers seq_k.
_FUSED_TILES = {
    32: [(64, 8, 2), (32, 8, 2), (16, 4, 2)],
    64: [(64, 8, 2), (32, 8, 2), (16, 4, 2), (32, 4, 2)],
    128: [(32, 8, 2), (64, 8, 1)],
}
_BWD_INTERPRET_TILE = (16, 32, 32, 16, 4, 1)
FUSED_MAX_SEQ_K = 128
FUSED_MAX_SEQ_Q = 512  # beyond this, the one-key-block path needs FUSED_MIN_PROGRAMS (batch, head) pairs
FUSED_MIN_PROGRAMS = 256
_AUTOTUNE_KEY = ["seq_q_bucket", "seq_k_bucket", "CAUSAL", "HAS_KPM", "HAS_DROPOUT"]


def _config(bm1: int, bn1: int, bm2: int, bn2: int, warps: int, stages: int) -> triton.Config:
    meta = {"BLOCK_M1": bm1, "BLOCK_N1": bn1, "BLOCK_M2": bm2, "BLOCK_N2": bn2}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


def fused_block_n(seq_k: int, seq_q: int, batch_heads: int) -> int | None:
    """BLOCK_N1 of the one-key-block path, or None when the general path runs: that path has one
    program per (batch, head), so long query sequences over few heads go to the general one."""
    limit = _BWD_INTERPRET_TILE[1] if interpreting() else FUSED_MAX_SEQ_K
    if seq_k > limit or (seq_q > FUSED_MAX_SEQ_Q and batch_heads < FUSED_MIN_PROGRAMS):
        return None
    return limit if interpreting() else max(64, seq_bucket(seq_k))


def bwd_configs(head_dim: int, block_n1: int | None) -> list[triton.Config]:
    """Autotune candidates: general path when ``block_n1`` is None, else the one-key-block path."""
    if interpreting():
        bm1, bn1, bm2, bn2, w, s = _BWD_INTERPRET_TILE
        return [_config(bm1, block_n1 or bn1, bm2, bn2, w, s)]
    if block_n1 is None:
        return [_config(*tile) for tile in _BWD_TILES[head_dim]]
    return [_config(bm1, block_n1, 64, 64, w, s) for bm1, w, s in _FUSED_TILES[head_dim] if block_n1 % bm1 == 0]


@functools.cache
def _bwd_kernel_for(head_dim: int, block_n1: int | None):
    heuristics = triton.heuristics({"EVEN_N": lambda args: args["seq_k"] % args["BLOCK_N1"] == 0})
    return triton.autotune(configs=bwd_configs(head_dim, block_n1), key=_AUTOTUNE_KEY)(
        heuristics(_attention_bwd_kernel)
    )


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    seed: int,
    causal: bool,
    dropout_p: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward; returns dq, dk, dv laid out like q, k, v (see ``empty_rows_like``)."""
    dq, dk, dv = empty_rows_like(q), empty_rows_like(k), empty_rows_like(v)
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    out, grad_out = unit_last_stride(out), unit_last_stride(grad_out)
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    kpm, stride_kpm_b = padding_as_bytes(key_padding_mask, q)
    block_n1 = fused_block_n(seq_k, seq_q, batch * heads)
    if block_n1 is None:
        delta = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
        block_m = 32 if interpreting() else 64
        _delta_kernel[(triton.cdiv(seq_q, block_m), batch * heads)](
            out, grad_out, delta, out.stride(0), out.stride(1), out.stride(2),
            grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
            heads, seq_q, HEAD_DIM=head_dim, BLOCK_M=block_m,
        )

        def grid(meta):
            return (triton.cdiv(seq_k, meta["BLOCK_N1"]) + triton.cdiv(seq_q, meta["BLOCK_M2"]), batch * heads)
    else:
        delta = lse  # not read on this path

        def grid(meta):
            return (1, batch * heads)

    _bwd_kernel_for(head_dim, block_n1)[grid](
        q, k, v, out, grad_out, dq, dk, dv, lse, delta, kpm,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        stride_kpm_b,
        heads, seq_q, seq_k, seq_bucket(seq_q), seq_bucket(seq_k),
        scale * LOG2_E, scale, dropout_p, seed,
        HEAD_DIM=head_dim, CAUSAL=causal, HAS_KPM=key_padding_mask is not None,
        HAS_DROPOUT=dropout_p > 0.0, DOT_FP32=dot_fp32(q.dtype), FUSED_DQ=block_n1 is not None,
    )
    return dq, dk, dv
