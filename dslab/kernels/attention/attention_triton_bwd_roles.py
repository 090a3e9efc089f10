"""The two program roles of the attention backward (:mod:`dslab.kernels.attention.attention_triton_bwd`
holds the kernel that runs them, its launch plans and tiles): ``_dq_role``, dQ of a query block over
key blocks, and ``_dkdv_role``, dK and dV of a key block over query blocks, which can also write or
add its tiles' dQ. The formulas are those of the backward module's docstring.

Grouped-query attention (``KV_GROUP = heads_q // heads_kv`` query heads per key/value head, query
head ``h`` reading kv head ``h // KV_GROUP``): a dQ program reads its query head's kv head; a dK/dV
program owns a key block of one kv head and adds up the contributions of the group's query heads
one after the other in head order (:func:`_dkdv_query_blocks`), so dK and dV are the sums over the group
with no extra memory and no atomics, in the same order on every run."""

from __future__ import annotations

import triton
import triton.language as tl

from dslab.kernels.attention.attention_triton import _dot, _dropout_keep
from dslab.kernels.attention.attention_triton_dq import store_bias_sum


@triton.jit
def _dkdv_query_loop(
    dk, dv, dq_sum, k, v, key_pad, key_start, offs_n, offs_d, q_base, do_base, o_base, dq_base, lse_base, delta_base,
    stride_qs, stride_dos, stride_os, stride_dqs, seq_q, seq_k, bh,
    qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups, keep_rows, start, end,
    DIAGONAL: tl.constexpr, FUSED_DQ: tl.constexpr, DELTA_FROM_O: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, KEEP_MODE: tl.constexpr, DOT_FP32: tl.constexpr,
    HAS_DB: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks ``[start, end)``, in transposed tiles
    ``[BLOCK_N1 keys, BLOCK_M1 queries]``. ``DIAGONAL`` blocks apply the causal mask. Query rows past
    ``seq_q`` load q = dO = 0, lse = +inf, so they add nothing and need no mask. ``delta`` is read
    from ``delta_base``, or with ``DELTA_FROM_O`` recomputed from O and dO of each query block.
    ``key_start`` is the block's first key (``offs_n[0]``), where its dropout draws start. With
    ``FUSED_DQ`` and ``HAS_DB``, ``dq_sum`` [BLOCK_M1, HEAD_DIM] adds up the (unscaled) dQ tiles it
    writes, elementwise: the row reduction runs once, after the loop. With ``ATOMIC_DQ`` the dQ tiles
    (unscaled, fp32) are added into ``dq_base``, the fp32 accumulator, instead of stored."""
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
            keep_t = _dropout_keep(seed, bh, offs_m, key_start, dropout_p, keep_base, n_groups,
                                   keep_rows, KEEP_MODE, BLOCK_N1, True)
            inv_keep = 1.0 / (1.0 - dropout_p)
            pd_t = tl.where(keep_t, p_t * inv_keep, 0.0)
        else:
            pd_t = p_t
        dv = _dot(pd_t.to(do.dtype), do, dv, DOT_FP32)
        if DELTA_FROM_O:
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
            if ATOMIC_DQ:
                tl.atomic_add(dq_ptrs, dq, mask=row_valid[:, None], sem="relaxed")
            else:
                tl.store(dq_ptrs, (dq * sm_scale).to(dq_base.dtype.element_ty), mask=row_valid[:, None])
                if HAS_DB:
                    dq_sum += dq  # reduced over rows once, after the loop
    return dk, dv, dq_sum


@triton.jit
def _dq_key_loop(
    dq, q, do, lse, delta, offs_m, offs_d, k_base, v_base, kpm_base, stride_ks, stride_vs,
    seq_k, bh, qk_scale, dropout_p, seed, keep_base, n_groups, keep_rows, start, end,
    BOUNDARY: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, KEEP_MODE: tl.constexpr,
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
            keep = _dropout_keep(seed, bh, offs_m, start_n, dropout_p, keep_base, n_groups, keep_rows,
                                 KEEP_MODE, BLOCK_N2, False)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, DOT_FP32)
    return dq


@triton.jit
def _dq_role(
    Q, K, V, O, DO, DQ, LSE, DELTA, KPM, DB, stride_db_slot, stride_db_b,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
    stride_kpm_b, num_heads, seq_q, seq_k, qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups, keep_rows, pid_m, bh,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, KEEP_MODE: tl.constexpr,
    DOT_FP32: tl.constexpr, STORE_DELTA: tl.constexpr, HAS_DB: tl.constexpr, DB_SLOT: tl.constexpr,
    KV_GROUP: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
):
    """dQ of the ``pid_m``-th query block of query head ``bh`` (``batch * num_heads + head``;
    counted from the last when ``CAUSAL``), over the keys of kv head ``head // KV_GROUP``, from
    ``delta = rowsum(dO * O)`` of its rows (stored for the dK/dV programs when ``STORE_DELTA``).
    Three matmuls per tile: S, dP, dQ. ``HAS_DB``: also its columns' sums."""
    if CAUSAL:
        pid_m = tl.cdiv(seq_q, BLOCK_M2) - 1 - pid_m
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    kv_h = h // KV_GROUP
    start_m = pid_m * BLOCK_M2
    offs_m = start_m + tl.arange(0, BLOCK_M2)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_m < seq_q
    rows = offs_m[:, None]
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows * stride_qs + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows * stride_dos + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows * stride_os + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if STORE_DELTA:
        tl.store(DELTA + bh.to(tl.int64) * seq_q + offs_m, delta, mask=row_valid)
    lse = tl.load(LSE + bh.to(tl.int64) * seq_q + offs_m, mask=row_valid, other=float("inf"))
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh
    kpm_base = KPM + b * stride_kpm_b
    dq = tl.zeros([BLOCK_M2, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        full_end = tl.minimum(start_m, seq_k) // BLOCK_N2 * BLOCK_N2
        end = tl.minimum(start_m + BLOCK_M2, seq_k)
    else:
        full_end = seq_k // BLOCK_N2 * BLOCK_N2
        end = seq_k
    dq = _dq_key_loop(
        dq, q, do, lse, delta, offs_m, offs_d, k_base, v_base, kpm_base, stride_ks, stride_vs,
        seq_k, bh, qk_scale, dropout_p, seed, keep_base, n_groups, keep_rows, 0, full_end,
        False, CAUSAL, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, BLOCK_M2, BLOCK_N2,
    )
    dq = _dq_key_loop(
        dq, q, do, lse, delta, offs_m, offs_d, k_base, v_base, kpm_base, stride_ks, stride_vs,
        seq_k, bh, qk_scale, dropout_p, seed, keep_base, n_groups, keep_rows, full_end, end,
        True, CAUSAL, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, BLOCK_M2, BLOCK_N2,
    )
    dq = dq * sm_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqs + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_valid[:, None])
    if HAS_DB:
        store_bias_sum(DB, tl.sum(dq, 0), start_m, b, 0, h, offs_d, stride_db_slot, stride_db_b, num_heads, HEAD_DIM, DB_SLOT)


@triton.jit
def _dkdv_query_blocks(
    dk, dv, dq_sum, k, v, key_pad, start_n, offs_n, offs_d, q_base, do_base, o_base, dq_base, lse_base, delta_base,
    stride_qs, stride_dos, stride_os, stride_dqs, seq_q, seq_k, bh,
    qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups, keep_rows,
    CAUSAL: tl.constexpr, FUSED_DQ: tl.constexpr, DELTA_FROM_O: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, KEEP_MODE: tl.constexpr, DOT_FP32: tl.constexpr,
    HAS_DB: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
):
    """Add one query head (flattened ``bh``, its tensors at the ``*_base`` pointers) to dK, dV of the
    key block at ``start_n``: the causal diagonal's query blocks with the mask, the rest without
    (see :func:`_dkdv_query_loop`)."""
    if CAUSAL:
        # Queries before start_n see none of these keys; [start_n, start_n + BLOCK_N1) is the diagonal.
        diag_end = tl.minimum(start_n + BLOCK_N1, seq_q)
        dk, dv, dq_sum = _dkdv_query_loop(
            dk, dv, dq_sum, k, v, key_pad, start_n, offs_n, offs_d, q_base, do_base, o_base, dq_base, lse_base, delta_base,
            stride_qs, stride_dos, stride_os, stride_dqs, seq_q, seq_k, bh,
            qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups, keep_rows, start_n, diag_end,
            True, FUSED_DQ, DELTA_FROM_O, EVEN_N, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, HAS_DB, ATOMIC_DQ,
            BLOCK_M1, BLOCK_N1,
        )
        rest_start = start_n + BLOCK_N1
    else:
        rest_start = 0
    dk, dv, dq_sum = _dkdv_query_loop(
        dk, dv, dq_sum, k, v, key_pad, start_n, offs_n, offs_d, q_base, do_base, o_base, dq_base, lse_base, delta_base,
        stride_qs, stride_dos, stride_os, stride_dqs, seq_q, seq_k, bh,
        qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups, keep_rows, rest_start, seq_q,
        False, FUSED_DQ, DELTA_FROM_O, EVEN_N, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, HAS_DB, ATOMIC_DQ,
        BLOCK_M1, BLOCK_N1,
    )
    return dk, dv, dq_sum


@triton.jit
def _dkdv_role(
    Q, K, V, O, DO, DQ, DK, DV, LSE, DELTA, KPM, KEEP, DB, stride_db_slot, stride_db_b,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
    stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    stride_kpm_b, num_heads, seq_q, seq_k, qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups, keep_rows,
    pid_n, bh,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, KEEP_MODE: tl.constexpr,
    DOT_FP32: tl.constexpr, FUSED_DQ: tl.constexpr, DELTA_FROM_O: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_DB: tl.constexpr, DB_SLOT: tl.constexpr, ATOMIC_DQ: tl.constexpr, KV_GROUP: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
):
    """dK, dV of key block ``pid_n`` of kv head ``bh`` (``batch * (num_heads // KV_GROUP) + kv
    head``), looping over query blocks (S^T, dV, dP^T, dK: four matmuls per tile) of each of the
    group's ``KV_GROUP`` query heads in turn. With ``FUSED_DQ`` (one key block covers ``seq_k``) it
    also writes each query block's complete dQ (a fifth matmul); with ``ATOMIC_DQ`` too, its dQ
    tiles are added into the fp32 accumulator ``DQ`` (any number of key blocks). ``keep_base`` is
    the dropout bits of query head ``bh`` when ``KV_GROUP == 1``; grouped, each query head's are
    found in ``KEEP``. ``HAS_DB`` (only without grouping): also the column sums of what it writes
    (those of dQ, with ``ATOMIC_DQ``, are the finishing launch's)."""
    tl.static_assert(not HAS_DB or KV_GROUP == 1)
    kv_heads = num_heads // KV_GROUP
    b = (bh // kv_heads).to(tl.int64)
    h = (bh % kv_heads).to(tl.int64)  # the kv head; the query head too without grouping
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    o_base = O + b * stride_ob + h * stride_oh
    dq_base = DQ + b * stride_dqb + h * stride_dqh
    kpm_base = KPM + b * stride_kpm_b
    lse_base = LSE + bh.to(tl.int64) * seq_q
    delta_base = DELTA + bh.to(tl.int64) * seq_q

    start_n = pid_n * BLOCK_N1
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    key_valid = offs_n < seq_k
    k_ptrs = K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :]
    k = tl.load(k_ptrs, mask=key_valid[:, None], other=0.0)
    v = tl.load(v_ptrs, mask=key_valid[:, None], other=0.0)
    if HAS_KPM:
        key_pad = tl.load(kpm_base + offs_n, mask=key_valid, other=1) != 0
    else:
        key_pad = key_valid
    dk = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    dq_sum = tl.zeros([BLOCK_M1, HEAD_DIM], dtype=tl.float32)
    if KV_GROUP == 1:
        dk, dv, dq_sum = _dkdv_query_blocks(
            dk, dv, dq_sum, k, v, key_pad, start_n, offs_n, offs_d, q_base, do_base, o_base, dq_base, lse_base,
            delta_base, stride_qs, stride_dos, stride_os, stride_dqs, seq_q, seq_k, bh,
            qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups, keep_rows,
            CAUSAL, FUSED_DQ, DELTA_FROM_O, EVEN_N, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, HAS_DB, ATOMIC_DQ,
            BLOCK_M1, BLOCK_N1,
        )
    else:
        # Query head h * KV_GROUP + r, flattened as int32 like the program ids that key the dQ
        # programs' dropout draws.
        first_bh = (bh // kv_heads) * num_heads + (bh % kv_heads) * KV_GROUP
        for r in range(KV_GROUP):
            hq = h * KV_GROUP + r
            bhq = first_bh + r
            dk, dv, dq_sum = _dkdv_query_blocks(
                dk, dv, dq_sum, k, v, key_pad, start_n, offs_n, offs_d,
                Q + b * stride_qb + hq * stride_qh, DO + b * stride_dob + hq * stride_doh,
                O + b * stride_ob + hq * stride_oh, DQ + b * stride_dqb + hq * stride_dqh,
                LSE + bhq.to(tl.int64) * seq_q, DELTA + bhq.to(tl.int64) * seq_q,
                stride_qs, stride_dos, stride_os, stride_dqs, seq_q, seq_k, bhq,
                qk_scale, sm_scale, dropout_p, seed, KEEP + bhq.to(tl.int64) * seq_q * n_groups, n_groups, keep_rows,
                CAUSAL, FUSED_DQ, DELTA_FROM_O, EVEN_N, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, HAS_DB, ATOMIC_DQ,
                BLOCK_M1, BLOCK_N1,
            )
    dk = dk * sm_scale
    if HAS_KPM and not FUSED_DQ:
        dk = tl.where(key_pad[:, None], 0.0, dk)
        dv = tl.where(key_pad[:, None], 0.0, dv)
    dk_ptrs = DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]
    dv_ptrs = DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :]
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=key_valid[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_valid[:, None])
    if HAS_DB:
        # dK's rows sum to 0 (see attention_triton_dq.bias_partials): that slot is written as zeros,
        # not summed. Rows past seq_k are not stored, so they are not summed either.
        dv_sum = tl.sum(tl.where(key_valid[:, None], dv, 0.0), 0)
        store_bias_sum(DB, dv_sum * 0.0, start_n, b, 1, h, offs_d, stride_db_slot, stride_db_b, num_heads,
                       HEAD_DIM, DB_SLOT)
        store_bias_sum(DB, dv_sum, start_n, b, 2, h, offs_d, stride_db_slot, stride_db_b, num_heads, HEAD_DIM, DB_SLOT)
        if FUSED_DQ and not ATOMIC_DQ:
            store_bias_sum(DB, tl.sum(dq_sum, 0) * sm_scale, start_n, b, 0, h, offs_d, stride_db_slot, stride_db_b,
                           num_heads, HEAD_DIM, DB_SLOT)
