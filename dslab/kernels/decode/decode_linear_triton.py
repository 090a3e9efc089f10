"""The Triton kernel of :mod:`dslab.kernels.decode.decode_linear`: one weight-streaming GEMM for the few
rows of a decode step, with the small ops around it folded into its prologue and epilogue. At one
row the engine runs :mod:`dslab.kernels.decode.decode_row_triton`'s persistent kernel instead
(same prologue and epilogues); this kernel's one-row path stays for comparison
(``decode_linear.ROW_KERNEL = False``, ``benchmarks/decode_chain_bench.py``).

``_decode_linear_kernel``, grid ``(column tiles, cdiv(M, BLOCK_M), split_k)``. Each program
owns ``BLOCK_N`` output columns of ``BLOCK_M`` rows and walks its split's range of K:

prologue, per K block of its rows
    ``a = x (+ residual)``, rounded to the activations' dtype as the separate add would round it;
    ``x``'s and ``residual``'s rows may be gathered from tables (``x_rows``: token ids into the
    word embeddings; ``residual_rows - residual_row_offset``: positions into the position
    embeddings). Programs of column block 0 store ``a`` (the new residual stream); with a norm,
    ``h = LN(a)`` or ``h = RMSNorm(a)`` rounded to the dtype (statistics of the row in fp32: from
    the one tile when K fits a block, else one pass over K before the main loop), else ``h = a``.
    The first weight tile is requested before any of this, so its latency overlaps the prologue's.
main loop
    the ``[BLOCK_N, BLOCK_K]`` weight tile, contiguous along K, is loaded once and multiplied into
    an fp32 accumulator: ``tl.dot`` when ``BLOCK_M >= 16``, a broadcast multiply and row sum when
    ``BLOCK_M == 1`` (batch 1, where a tensor-core tile would be 15/16 padding). From 2 rows on
    the rows are padded to a tensor-core tile of 16: on an H200 at 8 rows and Llama-3.2-1B's
    widths that tile streams the weights at 1.0-1.2x cuBLAS's time, where products of 8 rows
    accumulated on CUDA cores (``[8, BLOCK_N, BLOCK_K]``, summed after the loop) took 1.6-3.0x
    (``benchmarks/decode_linear_bench.py --rows 8``). int8 weights
    convert exactly to fp32 (``|q| <= 127``) and their per-output-channel scale multiplies the
    accumulator once after the loop. A paired launch (``PAIRED``: SwiGLU, rotary QKV) gives each
    output column two weight rows, ``first(c) = (c // span) * 2 span + c % span`` and
    ``first(c) + span``, and two accumulators over the same K loop, both fed by one ``h``: the
    epilogue needs the two together (gate and up; the two halves of a rotary pair).
epilogue
    :mod:`dslab.kernels.decode.decode_linear_epilogues`: scale, bias, then a store of ``y``
    (after GELU, or SwiGLU of a pair), or the QKV scatter into ``q_out`` and the KV cache (rotary
    positions applied to q and k first) -- no qkv tensor, no scatter kernels, no copy of q.

Memory traffic: ``N * K`` weight elements read once (the cost at decode's row counts), ``M * K``
prologue elements read ``1 + column tiles`` times (from L2 after the first), ``M * N`` outputs
(``M * N / 2`` for SwiGLU), and ``2 * split_k * M * N`` fp32 partials when K is split.

Split-K: when the output tiles alone make fewer programs than the device wants (two per SM), K is
split in whole blocks; each split stores an fp32 partial of its tile (indexed by weight row), and
the split that finishes last (a per-tile counter, reset by that split) adds the partials in split
order and runs the epilogue: one launch, deterministic.

Programmatic dependent launch (``USE_GDC``, :func:`dslab.kernels.dispatch.dependent_launch`, off by
default): the launch may start while the kernel before it still runs. A program then requests its
first weight tile (no kernel of a step writes weights), waits for that kernel (``gdc_wait``, which
also means every kernel before it has finished) before its first read of activations, caches,
split-K partials or counters and before any store, and lets the next kernel launch
(``gdc_launch_dependents``). A decode step's chain of weight-streaming launches then overlaps each
launch's latency and first weight reads with the previous kernel's tail.

Block sizes are fixed by shape (:func:`block_config`, :func:`pair_block_n`); under the interpreter
one small configuration, so that CPU tests take several K and N blocks and split K.
"""

from __future__ import annotations

import contextlib

import triton
import triton.language as tl

from dslab.kernels._triton_compat import cast_rounding
from dslab.kernels.decode.decode_linear_epilogues import finish

#: The kernel's ``ACT`` codes by decode_linear's ``activation``.
ACTIVATION_CODES = {None: 0, "gelu": 1, "gelu_tanh": 2, "swiglu": 3}

#: (BLOCK_N, BLOCK_K, num_warps, num_stages) that benchmarks/decode_linear_bench.py sweeps at batch 1.
SWEEP_ROW = [
    (8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (32, 128, 4, 4), (64, 128, 4, 3),
    (4, 1024, 4, 3), (16, 256, 8, 4), (4, 2048, 4, 1), (8, 2048, 8, 1), (2, 2048, 4, 1), (8, 1024, 4, 2),
]
#: The same for the tensor-core path (BLOCK_M >= 16).
SWEEP_DOT = [(32, 128, 4, 3), (64, 128, 4, 3), (32, 256, 4, 3), (16, 256, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3),
               (16, 512, 4, 2), (32, 512, 4, 2), (16, 128, 4, 4), (32, 64, 4, 4)]
INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K = 16, 32
#: Most K splits of one output tile (each adds an fp32 partial of the tile).
MAX_SPLIT_K = 8


@triton.jit
def _load_a(X, x_base, R, r_base, ks, mask, HAS_R: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """``x (+ residual)`` over the ``[BLOCK_M, BLOCK_K]`` block ``ks``, in fp32, rounded to x's dtype
    when a residual is added (what ``x + residual`` stores)."""
    a = tl.load(X + x_base[:, None] + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        a += tl.load(R + r_base[:, None] + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        a = cast_rounding(a, X.dtype.element_ty, BF16_BY_HAND).to(tl.float32)
    return a


@triton.jit
def _row_stats(X, x_base, R, r_base, row_mask, K, eps, HAS_R: tl.constexpr, BF16_BY_HAND: tl.constexpr,
               BLOCK_M: tl.constexpr, STATS_BLOCK: tl.constexpr):
    """``(mean, rstd)`` of each row of ``a`` in one pass over K: per block, its mean and centred sum
    of squares, merged into the running ones (Chan et al.'s pairwise update), so no cancellation
    from ``E[a^2] - E[a]^2`` and one load of each element. A row fits one block up to 4096 / rows."""
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, STATS_BLOCK):
        ks = k0 + tl.arange(0, STATS_BLOCK)
        k_mask = ks < K
        mask = row_mask[:, None] & k_mask[None, :]
        a = _load_a(X, x_base, R, r_base, ks, mask, HAS_R, BF16_BY_HAND)
        n_block = tl.minimum(K - k0, STATS_BLOCK).to(tl.float32)
        block_mean = tl.sum(a, axis=1) / n_block
        centred = tl.where(mask, a - block_mean[:, None], 0.0)
        block_m2 = tl.sum(centred * centred, axis=1)
        n_before = k0 * 1.0
        n_after = n_before + n_block
        delta = block_mean - mean
        mean += delta * (n_block / n_after)
        m2 += block_m2 + delta * delta * (n_before * n_block / n_after)
    return mean, 1.0 / tl.sqrt(m2 / K + eps)


@triton.jit
def _row_rms(X, x_base, R, r_base, row_mask, K, eps, HAS_R: tl.constexpr, BF16_BY_HAND: tl.constexpr,
             BLOCK_M: tl.constexpr, STATS_BLOCK: tl.constexpr):
    """RMSNorm's ``rstd = 1 / sqrt(mean(a^2) + eps)`` of each row in one pass over K (a sum of
    squares: nothing cancels)."""
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, STATS_BLOCK):
        ks = k0 + tl.arange(0, STATS_BLOCK)
        mask = row_mask[:, None] & (ks < K)[None, :]
        a = _load_a(X, x_base, R, r_base, ks, mask, HAS_R, BF16_BY_HAND)
        squares += tl.sum(a * a, axis=1)
    return 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def _int8_to_fp32(q):
    """int8 -> fp32 exactly with integer ops and one subtraction: the bits ``0x4B000080 + q`` are
    the float ``2^23 + 128 + q`` (q in [-128, 127]); cheaper than the conversion instruction, which
    bounds a batch-1 int8 GEMV that converts every weight."""
    return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _prologue(a, ks, k_end, rows, row_mask, pid_n, X, x_base, R, r_base, A_OUT, stride_a, NORM_W, NORM_B,
              mean, rstd, A_GIVEN: tl.constexpr, HAS_R: tl.constexpr, WRITE_A: tl.constexpr,
              HAS_NORM: tl.constexpr, RMS_NORM: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """The prologue's ``h`` ``[BLOCK_M, BLOCK_K]`` of the K block ``ks``, in x's dtype (storing
    ``a`` from column block 0). ``a`` is loaded here unless ``A_GIVEN``."""
    k_mask = ks < k_end
    mask = row_mask[:, None] & k_mask[None, :]
    if not A_GIVEN:
        a = _load_a(X, x_base, R, r_base, ks, mask, HAS_R, BF16_BY_HAND)
    if WRITE_A:
        tl.store(A_OUT + rows.to(tl.int64)[:, None] * stride_a + ks[None, :],
                 cast_rounding(a, A_OUT.dtype.element_ty, BF16_BY_HAND), mask=mask & (ks * 0 + pid_n == 0)[None, :])
    if HAS_NORM:
        g = tl.load(NORM_W + ks, mask=k_mask, other=0.0).to(tl.float32)
        if RMS_NORM:
            a = a * rstd[:, None] * g[None, :]
        else:
            b = tl.load(NORM_B + ks, mask=k_mask, other=0.0).to(tl.float32)
            a = (a - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]
    return cast_rounding(a, X.dtype.element_ty, BF16_BY_HAND)


@triton.jit
def _row_bases(X_ROWS, R_ROWS, R_OFFSET, rows, row_mask, stride_x, stride_r, HAS_X_ROWS: tl.constexpr,
               HAS_R: tl.constexpr, HAS_R_ROWS: tl.constexpr, HAS_R_OFFSET: tl.constexpr):
    """The offsets of ``rows``' x (``x_rows`` gathered) and residual (``residual_rows -
    residual_row_offset`` gathered) in their tables."""
    if HAS_X_ROWS:
        x_base = tl.load(X_ROWS + rows, mask=row_mask, other=0).to(tl.int64) * stride_x
    else:
        x_base = rows.to(tl.int64) * stride_x
    r_base = x_base
    if HAS_R:
        if HAS_R_ROWS:
            r_index = tl.load(R_ROWS + rows, mask=row_mask, other=0).to(tl.int64)
            if HAS_R_OFFSET:
                r_index -= tl.load(R_OFFSET + rows, mask=row_mask, other=0).to(tl.int64)
            r_base = r_index * stride_r
        else:
            r_base = rows.to(tl.int64) * stride_r
    return x_base, r_base


@triton.jit
def _single_block_h(X, x_base, R, r_base, A_OUT, stride_a, NORM_W, NORM_B, ks, K, rows, row_mask, pid_n, eps,
                    HAS_R: tl.constexpr, WRITE_A: tl.constexpr, HAS_NORM: tl.constexpr, RMS_NORM: tl.constexpr,
                    BF16_BY_HAND: tl.constexpr):
    """``h`` of rows whose K is the one block ``ks``: ``a`` loaded once, the norm's statistics from it
    in registers (``a`` stored by the programs of column block 0)."""
    mask = row_mask[:, None] & (ks < K)[None, :]
    a = _load_a(X, x_base, R, r_base, ks, mask, HAS_R, BF16_BY_HAND)
    mean = tl.zeros((a.shape[0],), dtype=tl.float32)
    rstd = tl.zeros((a.shape[0],), dtype=tl.float32)
    if HAS_NORM:
        if RMS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(a * a, axis=1) / K + eps)
        else:
            mean = tl.sum(a, axis=1) / K
            centred = tl.where(mask, a - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / K + eps)
    return _prologue(a, ks, K, rows, row_mask, pid_n, X, x_base, R, r_base, A_OUT, stride_a, NORM_W, NORM_B,
                     mean, rstd, True, HAS_R, WRITE_A, HAS_NORM, RMS_NORM, BF16_BY_HAND)


@triton.jit
def _multiply(acc, w, h, INT8: tl.constexpr, BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr,
              PRECISION: tl.constexpr):
    """``h`` ``[BLOCK_M, BLOCK_K]`` times the weight tile ``w`` ``[BLOCK_N, BLOCK_K]`` into ``acc``
    (``[BLOCK_N, BLOCK_K]`` elementwise at batch 1, else ``[BLOCK_M, BLOCK_N]``)."""
    if BLOCK_M == 1:
        wf = _int8_to_fp32(w) if INT8 else w.to(tl.float32)
        acc += wf * h.to(tl.float32)
    else:
        if INT8:
            w = w.to(tl.float32) if DOT_FP32 else w.to(h.dtype)
        if DOT_FP32:  # the interpreter multiplies bf16 operands as integers: upcast (exact products)
            acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _store_partial(tile_partial, w_rows, acc, out_mask, BLOCK_M: tl.constexpr):
    """One split's fp32 partial sums of its tile (``acc`` summed over its K block first at batch 1)."""
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[None, :]
    tl.store(tile_partial + w_rows[None, :], acc, mask=out_mask)


@triton.jit
def _decode_linear_kernel(
    X, X_ROWS, R, R_ROWS, R_OFFSET, A_OUT, NORM_W, NORM_B, W, SCALE, BIAS, Y,
    Q_OUT, K_CACHE, V_CACHE, WRITE_POS, COS, SIN, PARTIAL, COUNTERS,
    M, N, K, stride_x, stride_r, stride_a, stride_y, stride_q,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_cos,
    eps, head_dim, q_width, kv_width, span, k_per_split,
    HAS_X_ROWS: tl.constexpr, HAS_R: tl.constexpr, HAS_R_ROWS: tl.constexpr, HAS_R_OFFSET: tl.constexpr,
    WRITE_A: tl.constexpr, HAS_NORM: tl.constexpr, RMS_NORM: tl.constexpr, INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, KV_SCATTER: tl.constexpr, ROPE: tl.constexpr,
    SPLIT_K: tl.constexpr, STATS_BLOCK: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PAIRED: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    if PAIRED:  # column c of the output pairs weight rows first(c) and first(c) + span
        col_mask = cols < N // 2
        w_rows = (cols // span) * (2 * span) + cols % span
    else:
        col_mask = cols < N
        w_rows = cols
    w_ptrs = W + w_rows.to(tl.int64)[:, None] * K
    w_ptrs_2 = W + (w_rows + span).to(tl.int64)[:, None] * K
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # The first K block's weight tile is requested before anything else: its latency overlaps the
    # row statistics' (at decode's widths K fits one block, and this is the whole stream) and, with
    # programmatic dependent launch, the tail of the kernel before this one, since no kernel of the
    # step writes weights.
    ks = k_begin + tl.arange(0, BLOCK_K)
    w_mask = col_mask[:, None] & (ks < k_end)[None, :]
    w_first = tl.load(w_ptrs + ks[None, :], mask=w_mask, other=0)
    w_first_2 = w_first
    if PAIRED:
        w_first_2 = tl.load(w_ptrs_2 + ks[None, :], mask=w_mask, other=0)
    if USE_GDC:
        # launched dependent on the kernel before it: wait for that kernel (and so every earlier
        # one) before reading activations, caches or counters or writing anything, then let the
        # next kernel start its own weight reads
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_base, r_base = _row_bases(X_ROWS, R_ROWS, R_OFFSET, rows, row_mask, stride_x, stride_r, HAS_X_ROWS, HAS_R,
                                HAS_R_ROWS, HAS_R_OFFSET)

    if BLOCK_M == 1:  # elementwise products summed once after the loop: no reduction per K block
        acc_2d = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_2d_2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # the pairs' second rows (PAIRED only)
    else:
        acc_2d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_2d_2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SINGLE_BLOCK:  # K is one block: the statistics come from the tile in registers, one load
        h = _single_block_h(X, x_base, R, r_base, A_OUT, stride_a, NORM_W, NORM_B, ks, K, rows, row_mask, pid_n, eps,
                            HAS_R, WRITE_A, HAS_NORM, RMS_NORM, BF16_BY_HAND)
        acc_2d = _multiply(acc_2d, w_first, h, INT8, BLOCK_M, DOT_FP32, PRECISION)
        if PAIRED:
            acc_2d_2 = _multiply(acc_2d_2, w_first_2, h, INT8, BLOCK_M, DOT_FP32, PRECISION)
    else:
        if HAS_NORM:
            if RMS_NORM:
                rstd = _row_rms(X, x_base, R, r_base, row_mask, K, eps, HAS_R, BF16_BY_HAND, BLOCK_M, STATS_BLOCK)
            else:
                mean, rstd = _row_stats(X, x_base, R, r_base, row_mask, K, eps, HAS_R, BF16_BY_HAND, BLOCK_M,
                                        STATS_BLOCK)
        h = _prologue(w_first, ks, k_end, rows, row_mask, pid_n, X, x_base, R, r_base, A_OUT, stride_a, NORM_W,
                      NORM_B, mean, rstd, False, HAS_R, WRITE_A, HAS_NORM, RMS_NORM, BF16_BY_HAND)
        acc_2d = _multiply(acc_2d, w_first, h, INT8, BLOCK_M, DOT_FP32, PRECISION)
        if PAIRED:
            acc_2d_2 = _multiply(acc_2d_2, w_first_2, h, INT8, BLOCK_M, DOT_FP32, PRECISION)
        for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            w_mask = col_mask[:, None] & (ks < k_end)[None, :]
            w = tl.load(w_ptrs + ks[None, :], mask=w_mask, other=0)  # [BLOCK_N, BLOCK_K]
            if PAIRED:
                w_2 = tl.load(w_ptrs_2 + ks[None, :], mask=w_mask, other=0)
            h = _prologue(w, ks, k_end, rows, row_mask, pid_n, X, x_base, R, r_base, A_OUT, stride_a, NORM_W,
                          NORM_B, mean, rstd, False, HAS_R, WRITE_A, HAS_NORM, RMS_NORM, BF16_BY_HAND)
            acc_2d = _multiply(acc_2d, w, h, INT8, BLOCK_M, DOT_FP32, PRECISION)
            if PAIRED:
                acc_2d_2 = _multiply(acc_2d_2, w_2, h, INT8, BLOCK_M, DOT_FP32, PRECISION)
    out_mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    if SPLIT_K > 1:
        # Each split leaves its partial sums; the program that finishes last (the tile's counter)
        # adds them in split order, so the result does not depend on who finished when, and resets
        # the counter for the next launch (CUDA graph replays included). Partials are indexed by
        # weight row, so a pair's two rows have their own.
        tile_partial = PARTIAL + rows64 * N
        _store_partial(tile_partial + split.to(tl.int64) * M * N, w_rows, acc_2d, out_mask, BLOCK_M)
        if PAIRED:
            _store_partial(tile_partial + split.to(tl.int64) * M * N, w_rows + span, acc_2d_2, out_mask, BLOCK_M)
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(COUNTERS + tile, 1)  # acq_rel: the stores above are visible to the last
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(tile_partial + s * M * N + w_rows[None, :], mask=out_mask, other=0.0,
                               cache_modifier=".cg")
                if PAIRED:
                    acc_2 += tl.load(tile_partial + s * M * N + (w_rows + span)[None, :], mask=out_mask, other=0.0,
                                     cache_modifier=".cg")
            tl.atomic_xchg(COUNTERS + tile, 0)
            finish(acc, acc_2, rows, cols, w_rows, row_mask, col_mask, rows64, SCALE, BIAS, Y, Q_OUT, K_CACHE,
                   V_CACHE, WRITE_POS, COS, SIN, span, stride_y, stride_q, stride_kb, stride_kh, stride_ks,
                   stride_vb, stride_vh, stride_vs, stride_cos, head_dim, q_width, kv_width, INT8, HAS_BIAS, ACT,
                   KV_SCATTER, ROPE, PAIRED, BF16_BY_HAND)
    else:
        acc = acc_2d
        acc_2 = acc_2d_2
        if BLOCK_M == 1:
            acc = tl.sum(acc_2d, axis=1)[None, :]
            if PAIRED:
                acc_2 = tl.sum(acc_2d_2, axis=1)[None, :]
        finish(acc, acc_2, rows, cols, w_rows, row_mask, col_mask, rows64, SCALE, BIAS, Y, Q_OUT, K_CACHE,
               V_CACHE, WRITE_POS, COS, SIN, span, stride_y, stride_q, stride_kb, stride_kh, stride_ks,
               stride_vb, stride_vh, stride_vs, stride_cos, head_dim, q_width, kv_width, INT8, HAS_BIAS, ACT,
               KV_SCATTER, ROPE, PAIRED, BF16_BY_HAND)


def plan_split_k(tiles: int, k: int, block_k: int, programs_wanted: int) -> tuple[int, int]:
    """``(split_k, k_per_split)``: split K in whole ``block_k`` steps (at most :data:`MAX_SPLIT_K`)
    until ``tiles`` output tiles make ``programs_wanted`` programs; ``k_per_split`` a multiple of
    ``block_k`` with ``split_k * k_per_split >= k``."""
    steps = triton.cdiv(k, block_k)
    split_k = max(1, min(steps, triton.cdiv(programs_wanted, tiles), MAX_SPLIT_K))
    k_per_split = triton.cdiv(steps, split_k) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


def block_config(block_m: int, n: int, k: int, int8: bool, has_norm: bool = False,
                 paired: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for a launch, fixed by shape (no autotuning:
    at 3-10 us a call, the tuner's timings rank configurations by noise; a CUDA-graph-timed sweep,
    ``benchmarks/decode_linear_bench.py``, chose these on an H200). Batch 1: a K block of a whole
    row up to 2048 elements loaded at once, 2 output rows a program (4 where N >= 4096); int8
    weights: 4 x 1024 tiles, three in flight, or a whole row with a norm in front (its statistics
    then come from the one tile); more rows: 32 x 128 tensor-core tiles (32 x 64 on 8 warps for a
    paired launch). ``BLOCK_N`` counts weight rows: a paired launch (:func:`pair_block_n`) gives
    each program half as many pairs."""
    if block_m >= 16:
        # a paired launch holds two weight tiles and two accumulators: at 32 x 128 with 4 warps it
        # spills (224 bytes a thread at 16 rows, 2 KB at 32, in ptxas for sm_90); 32 x 64 with 8
        # warps spills nothing up to 64 rows (tests/kernels/decode/test_decode_linear_registers.py)
        return (32, 64, 8, 3) if paired else (32, 128, 4, 3)
    if int8 and not has_norm:
        return 4, min(1024, triton.next_power_of_2(k)), 4, 3
    if int8:
        return 4, min(2048, triton.next_power_of_2(k)), 4, 1
    return (4 if n >= 4096 else 2), min(2048, triton.next_power_of_2(k)), 4, 1


def pair_block_n(block_n: int, block_m: int) -> int:
    """Output columns a program of a paired launch (SwiGLU, rotary QKV) owns for a ``block_n`` of
    weight rows: ``block_n / 2`` pairs, so that it streams the same ``block_n`` rows an unpaired
    launch of the shape would (at batch 1 Llama-3.2-1B's gate/up, N = 2 x 8192, K = 2048: 2 pairs,
    4096 programs; its QKV, N = 3072: 1 pair, 1536 programs; neither splits K on 132 SMs), and at
    least 16 on the tensor-core path, ``tl.dot``'s smallest N."""
    return max(16 if block_m >= 16 else 1, block_n // 2)


def tiles_n(n: int, block_n: int, block_m: int, paired: bool) -> int:
    """Column tiles of a launch over ``n`` weight rows with ``block_n`` rows a program."""
    return triton.cdiv(n // 2, pair_block_n(block_n, block_m)) if paired else triton.cdiv(n, block_n)


def partial_elements(m: int, n: int, k: int, block_m: int, programs_wanted: int, interpret: bool,
                     int8: bool, paired: bool = False) -> int:
    """fp32 elements of split-K partials the widest split of the launch's configuration (or of a
    swept one, :func:`forced_config`) needs."""
    blocks = [(INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K)] if interpret else \
        [block_config(block_m, n, k, int8, True, paired)[:2], block_config(block_m, n, k, int8, False, paired)[:2]] + \
        [c[:2] for c in sweep(block_m)]
    widest = max(plan_split_k(tiles_n(n, bn, block_m, paired) * triton.cdiv(m, block_m), k, bk, programs_wanted)[0]
                 for bn, bk in blocks)
    return widest * m * n if widest > 1 else 0


def row_block(m: int) -> int:
    """``BLOCK_M`` for ``m`` rows: 1 (the batch-1 path), else the next power of two of at least 16
    (tensor-core tiles)."""
    return 1 if m == 1 else max(16, 1 << (m - 1).bit_length())


def sweep(block_m: int) -> list[tuple[int, int, int, int]]:
    """The configurations ``benchmarks/decode_linear_bench.py`` sweeps for a ``block_m``."""
    return SWEEP_ROW if block_m == 1 else SWEEP_DOT


_forced: tuple | None = None


@contextlib.contextmanager
def forced_config(config: tuple[int, int, int, int] | None):
    """Launch with ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` instead of :func:`block_config`'s
    inside the block (kernel benchmarks compare configurations with it)."""
    global _forced
    previous, _forced = _forced, config
    try:
        yield
    finally:
        _forced = previous


def plan(block_m: int, interpret: bool, grid_m: int, n: int, k: int, programs_wanted: int, int8: bool,
         has_norm: bool, paired: bool) -> dict:
    """A launch's shape: ``grid``, the block constexprs (``BLOCK_M``, ``BLOCK_N`` in pairs for a
    paired launch, ``BLOCK_K``, ``SPLIT_K``, ``SINGLE_BLOCK``), ``k_per_split`` and the launch
    options (``num_warps``, ``num_stages``; none under the interpreter): :func:`block_config`'s
    blocks on the GPU (or the forced ones), the interpreter's small fixed blocks on CPU."""
    if interpret:
        block_n, block_k, options = INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K, {}
    else:
        block_n, block_k, warps, stages = _forced or block_config(block_m, n, k, int8, has_norm, paired)
        options = dict(num_warps=warps, num_stages=stages)
    columns = tiles_n(n, block_n, block_m, paired)
    split_k, k_per_split = plan_split_k(columns * grid_m, k, block_k, programs_wanted)
    return dict(grid=(columns, grid_m, split_k), k_per_split=k_per_split, options=options,
                constexprs=dict(BLOCK_M=block_m, BLOCK_N=pair_block_n(block_n, block_m) if paired else block_n,
                                BLOCK_K=block_k, SPLIT_K=split_k, SINGLE_BLOCK=split_k == 1 and k <= block_k))


def launch(block_m: int, interpret: bool, grid_m: int, n: int, k: int, programs_wanted: int, args: tuple,
           meta: dict, dependent: bool = False) -> None:
    """Launch the kernel over ``n`` weight rows as :func:`plan` lays it out; a paired launch's
    programs own :func:`pair_block_n` pairs. ``dependent``: a programmatic dependent launch
    (:func:`dslab.kernels.dispatch.dependent_launch`; never under the interpreter)."""
    shape = plan(block_m, interpret, grid_m, n, k, programs_wanted, meta["INT8"], meta["HAS_NORM"], meta["PAIRED"])
    options = dict(shape["options"])
    if dependent and not interpret:
        options.update(launch_pdl=True, USE_GDC=True)
    _decode_linear_kernel[shape["grid"]](*args, k_per_split=shape["k_per_split"], **shape["constexprs"], **options,
                                         **meta)
