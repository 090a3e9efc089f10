"""The Triton kernel of :mod:`dslab.kernels.decode.decode_linear`: one weight-streaming GEMM for the few
rows of a decode step, with the small ops around it folded into its prologue and epilogue.

``_decode_linear_kernel``, grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), split_k)``. Each program
owns ``BLOCK_N`` output columns of ``BLOCK_M`` rows and walks its split's range of K:

prologue, per K block of its rows
    ``a = x (+ residual)``, rounded to the activations' dtype as the separate add would round it;
    ``x``'s and ``residual``'s rows may be gathered from tables (``x_rows``: token ids into the
    word embeddings; ``residual_rows - residual_row_offset``: positions into the position
    embeddings). Programs of column block 0 store ``a`` (the new residual stream); with a norm,
    ``h = LN(a)`` rounded to the dtype (statistics of the row in fp32: from the one tile when K
    fits a block, else one pass over K before the main loop), else ``h = a``. The first weight
    tile is requested before any of this, so its latency overlaps the prologue's.
main loop
    the ``[BLOCK_N, BLOCK_K]`` weight tile, contiguous along K, is loaded once and multiplied into
    an fp32 accumulator: ``tl.dot`` when ``BLOCK_M >= 16``, a broadcast multiply and row sum when
    ``BLOCK_M == 1`` (batch 1, where a tensor-core tile would be 15/16 padding). int8 weights
    convert exactly to fp32 (``|q| <= 127``) and their per-output-channel scale multiplies the
    accumulator once after the loop.
epilogue
    ``+ bias``, GELU (exact or tanh), rounded to the output dtype; then either a plain store of
    ``y [M, N]`` or, for a fused QKV projection (``KV_SCATTER``), a scatter: column ``n`` is part
    ``n // (N / 3)`` (q, k, v), head ``(n % (N / 3)) // head_dim``; q goes to ``q_out [M, N / 3]``,
    k and v into the layer's cache ``[batch, heads, max_seq, head_dim]`` at row ``m``'s
    ``write_pos[m]`` -- no qkv tensor, no scatter kernels, no copy of q.

Memory traffic: ``N * K`` weight elements read once (the cost at decode's row counts), ``M * K``
prologue elements read ``1 + cdiv(N, BLOCK_N)`` times (from L2 after the first), ``M * N``
outputs (and ``2 * split_k * M * N`` fp32 partials when K is split).

Split-K: when the output tiles alone make fewer programs than the device wants (two per SM), K is
split in whole blocks; each split stores an fp32 partial of its tile, and the split that finishes
last (a per-tile counter, reset by that split) adds the partials in split order and runs the
epilogue: one launch, deterministic.

Block sizes are fixed by shape (:func:`block_config`); under the interpreter one small
configuration, so that CPU tests take several K and N blocks and split K.
"""

from __future__ import annotations

import contextlib

import triton
import triton.language as tl

from dslab.kernels._triton_compat import cast_rounding
from dslab.kernels.activation.bias_gelu_triton import _gelu_and_grad

#: The kernel's ``ACT`` codes by decode_linear's ``activation``.
ACTIVATION_CODES = {None: 0, "gelu": 1, "gelu_tanh": 2}

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
def _int8_to_fp32(q):
    """int8 -> fp32 exactly with integer ops and one subtraction: the bits ``0x4B000080 + q`` are
    the float ``2^23 + 128 + q`` (q in [-128, 127]); cheaper than the conversion instruction, which
    bounds a batch-1 int8 GEMV that converts every weight."""
    return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _accumulate(acc, w, a, ks, k_end, rows, row_mask, pid_n, X, x_base, R, r_base, A_OUT, stride_a, LN_W, LN_B,
                mean, rstd, A_GIVEN: tl.constexpr, HAS_R: tl.constexpr, WRITE_A: tl.constexpr,
                HAS_NORM: tl.constexpr, INT8: tl.constexpr, BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr,
                PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """One K block: the prologue's ``h`` for the block ``ks`` (storing ``a`` from column block 0)
    times the weight tile ``w`` ``[BLOCK_N, BLOCK_K]``, into ``acc`` (``[BLOCK_N, BLOCK_K]``
    elementwise at batch 1, else ``[BLOCK_M, BLOCK_N]``). ``a`` is loaded here unless
    ``A_GIVEN``."""
    k_mask = ks < k_end
    mask = row_mask[:, None] & k_mask[None, :]
    if not A_GIVEN:
        a = _load_a(X, x_base, R, r_base, ks, mask, HAS_R, BF16_BY_HAND)
    if WRITE_A:
        tl.store(A_OUT + rows.to(tl.int64)[:, None] * stride_a + ks[None, :],
                 cast_rounding(a, A_OUT.dtype.element_ty, BF16_BY_HAND), mask=mask & (ks * 0 + pid_n == 0)[None, :])
    if HAS_NORM:
        g = tl.load(LN_W + ks, mask=k_mask, other=0.0).to(tl.float32)
        b = tl.load(LN_B + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = (a - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]
    h = cast_rounding(a, X.dtype.element_ty, BF16_BY_HAND)
    if BLOCK_M == 1:
        wf = _int8_to_fp32(w) if INT8 else w.to(tl.float32)
        acc += wf * h.to(tl.float32)
    else:
        if INT8:
            w = w.to(tl.float32) if DOT_FP32 else w.to(X.dtype.element_ty)
        if DOT_FP32:  # the interpreter multiplies bf16 operands as integers: upcast (exact products)
            acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _decode_linear_kernel(
    X, X_ROWS, R, R_ROWS, R_OFFSET, A_OUT, LN_W, LN_B, W, SCALE, BIAS, Y,
    Q_OUT, K_CACHE, V_CACHE, WRITE_POS, PARTIAL, COUNTERS,
    M, N, K, stride_x, stride_r, stride_a, stride_y, stride_q,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    eps, head_dim, k_per_split,
    HAS_X_ROWS: tl.constexpr, HAS_R: tl.constexpr, HAS_R_ROWS: tl.constexpr, HAS_R_OFFSET: tl.constexpr,
    WRITE_A: tl.constexpr, HAS_NORM: tl.constexpr, INT8: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, KV_SCATTER: tl.constexpr, SPLIT_K: tl.constexpr, STATS_BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
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

    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # The first K block's weight tile is requested before the row statistics are computed, so its
    # latency overlaps theirs (at decode's widths K fits one block, and this is the whole stream).
    ks = k_begin + tl.arange(0, BLOCK_K)
    w_first = tl.load(W + cols.to(tl.int64)[:, None] * K + ks[None, :],
                      mask=col_mask[:, None] & (ks < k_end)[None, :], other=0)
    if BLOCK_M == 1:  # elementwise products summed once after the loop: no reduction per K block
        acc_2d = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc_2d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SINGLE_BLOCK:  # K is one block: the statistics come from the tile in registers, one load
        mask = row_mask[:, None] & (ks < K)[None, :]
        a = _load_a(X, x_base, R, r_base, ks, mask, HAS_R, BF16_BY_HAND)
        if HAS_NORM:
            mean = tl.sum(a, axis=1) / K
            centred = tl.where(mask, a - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / K + eps)
        acc_2d = _accumulate(acc_2d, w_first, a, ks, k_end, rows, row_mask, pid_n, X, x_base, R, r_base, A_OUT,
                             stride_a, LN_W, LN_B, mean, rstd, True, HAS_R, WRITE_A, HAS_NORM, INT8, BLOCK_M, DOT_FP32,
                             PRECISION, BF16_BY_HAND)
    else:
        if HAS_NORM:
            mean, rstd = _row_stats(X, x_base, R, r_base, row_mask, K, eps, HAS_R, BF16_BY_HAND, BLOCK_M,
                                    STATS_BLOCK)
        acc_2d = _accumulate(acc_2d, w_first, w_first, ks, k_end, rows, row_mask, pid_n, X, x_base, R, r_base,
                             A_OUT, stride_a, LN_W, LN_B, mean, rstd, False, HAS_R, WRITE_A, HAS_NORM, INT8, BLOCK_M,
                             DOT_FP32, PRECISION, BF16_BY_HAND)
        for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(W + cols.to(tl.int64)[:, None] * K + ks[None, :],
                        mask=col_mask[:, None] & (ks < k_end)[None, :], other=0)  # [BLOCK_N, BLOCK_K]
            acc_2d = _accumulate(acc_2d, w, w, ks, k_end, rows, row_mask, pid_n, X, x_base, R, r_base, A_OUT,
                                 stride_a, LN_W, LN_B, mean, rstd, False, HAS_R, WRITE_A, HAS_NORM, INT8, BLOCK_M,
                                 DOT_FP32, PRECISION, BF16_BY_HAND)
    if BLOCK_M == 1:
        acc = tl.sum(acc_2d, axis=1)[None, :]
    else:
        acc = acc_2d
    out_mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    if SPLIT_K > 1:
        # Each split leaves its partial sums; the program that finishes last (the tile's counter)
        # adds them in split order, so the result does not depend on who finished when, and resets
        # the counter for the next launch (CUDA graph replays included).
        tile_partial = PARTIAL + rows64 * N + cols[None, :]
        tl.store(tile_partial + split.to(tl.int64) * M * N, acc, mask=out_mask)
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(COUNTERS + tile, 1)  # acq_rel: the stores above are visible to the last
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(tile_partial + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(COUNTERS + tile, 0)
            _epilogue(acc, rows, cols, row_mask, col_mask, rows64, SCALE, BIAS, Y, Q_OUT, K_CACHE, V_CACHE, WRITE_POS,
                      N, stride_y, stride_q, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                      head_dim, INT8, HAS_BIAS, ACT, KV_SCATTER, BF16_BY_HAND)
    else:
        _epilogue(acc, rows, cols, row_mask, col_mask, rows64, SCALE, BIAS, Y, Q_OUT, K_CACHE, V_CACHE, WRITE_POS,
                  N, stride_y, stride_q, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                  head_dim, INT8, HAS_BIAS, ACT, KV_SCATTER, BF16_BY_HAND)


@triton.jit
def _epilogue(acc, rows, cols, row_mask, col_mask, rows64, SCALE, BIAS, Y, Q_OUT, K_CACHE, V_CACHE, WRITE_POS,
              N, stride_y, stride_q, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, head_dim,
              INT8: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, KV_SCATTER: tl.constexpr,
              BF16_BY_HAND: tl.constexpr):
    """Scale, bias, activation and the store (or the QKV scatter) of a finished ``[BLOCK_M, BLOCK_N]``."""
    if INT8:
        acc = acc * tl.load(SCALE + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if ACT != 0:
        acc, _ = _gelu_and_grad(acc, ACT == 2, True, False)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if KV_SCATTER:
        width = N // 3
        part = cols // width
        within = cols - part * width
        head = within // head_dim
        dim = within - head * head_dim
        pos = tl.load(WRITE_POS + rows, mask=row_mask, other=0).to(tl.int64)[:, None]
        tl.store(Q_OUT + rows64 * stride_q + within[None, :],
                 cast_rounding(acc, Q_OUT.dtype.element_ty, BF16_BY_HAND), mask=out_mask & (part == 0)[None, :])
        kv = cast_rounding(acc, K_CACHE.dtype.element_ty, BF16_BY_HAND)
        tl.store(K_CACHE + rows64 * stride_kb + (head * stride_kh + dim)[None, :] + pos * stride_ks, kv,
                 mask=out_mask & (part == 1)[None, :])
        tl.store(V_CACHE + rows64 * stride_vb + (head * stride_vh + dim)[None, :] + pos * stride_vs, kv,
                 mask=out_mask & (part == 2)[None, :])
    else:
        tl.store(Y + rows64 * stride_y + cols[None, :], cast_rounding(acc, Y.dtype.element_ty, BF16_BY_HAND),
                 mask=out_mask)


def plan_split_k(tiles: int, k: int, block_k: int, programs_wanted: int) -> tuple[int, int]:
    """``(split_k, k_per_split)``: split K in whole ``block_k`` steps (at most :data:`MAX_SPLIT_K`)
    until ``tiles`` output tiles make ``programs_wanted`` programs; ``k_per_split`` a multiple of
    ``block_k`` with ``split_k * k_per_split >= k``."""
    steps = triton.cdiv(k, block_k)
    split_k = max(1, min(steps, triton.cdiv(programs_wanted, tiles), MAX_SPLIT_K))
    k_per_split = triton.cdiv(steps, split_k) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


def block_config(block_m: int, n: int, k: int, int8: bool, has_norm: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for a launch, fixed by shape (no autotuning:
    at 3-10 us a call, the tuner's timings rank configurations by noise; a CUDA-graph-timed sweep,
    ``benchmarks/decode_linear_bench.py``, chose these on an H200). Batch 1: a K block of a whole
    row up to 2048 elements loaded at once, 2 output rows a program (4 where N >= 4096); int8
    weights: 4 x 1024 tiles, three in flight, or a whole row with a norm in front (its statistics
    then come from the one tile); more rows: 32 x 128 tensor-core tiles."""
    if block_m > 1:
        return 32, 128, 4, 3
    if int8 and not has_norm:
        return 4, min(1024, triton.next_power_of_2(k)), 4, 3
    if int8:
        return 4, min(2048, triton.next_power_of_2(k)), 4, 1
    return (4 if n >= 4096 else 2), min(2048, triton.next_power_of_2(k)), 4, 1


def partial_elements(m: int, n: int, k: int, block_m: int, programs_wanted: int, interpret: bool,
                     int8: bool) -> int:
    """fp32 elements of split-K partials the widest split of the launch's configuration (or of a
    swept one, :func:`forced_config`) needs."""
    blocks = [(INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K)] if interpret else \
        [block_config(block_m, n, k, int8, True)[:2], block_config(block_m, n, k, int8)[:2]] + [c[:2] for c in (SWEEP_ROW if block_m == 1 else SWEEP_DOT)]
    widest = max(plan_split_k(triton.cdiv(n, bn) * triton.cdiv(m, block_m), k, bk, programs_wanted)[0]
                 for bn, bk in blocks)
    return widest * m * n if widest > 1 else 0


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


def launch(block_m: int, interpret: bool, grid_m: int, n: int, programs_wanted: int, args: tuple,
           meta: dict) -> None:
    """Launch the kernel: :func:`block_config`'s blocks on the GPU (or the forced ones), the
    interpreter's small fixed blocks on CPU."""
    if interpret:
        tiles = triton.cdiv(n, INTERPRETER_BLOCK_N) * grid_m
        split_k, k_per_split = plan_split_k(tiles, args[20], INTERPRETER_BLOCK_K, programs_wanted)
        grid = (triton.cdiv(n, INTERPRETER_BLOCK_N), grid_m, split_k)
        _decode_linear_kernel[grid](*args, k_per_split=k_per_split, BLOCK_M=block_m, BLOCK_N=INTERPRETER_BLOCK_N,
                                    BLOCK_K=INTERPRETER_BLOCK_K, SPLIT_K=split_k,
                                    SINGLE_BLOCK=split_k == 1 and args[20] <= INTERPRETER_BLOCK_K, **meta)
        return
    block_n, block_k, warps, stages = _forced or block_config(block_m, n, args[20], meta["INT8"], meta["HAS_NORM"])
    tiles = triton.cdiv(n, block_n) * grid_m
    split_k, k_per_split = plan_split_k(tiles, args[20], block_k, programs_wanted)
    _decode_linear_kernel[(triton.cdiv(n, block_n), grid_m, split_k)](
        *args, k_per_split=k_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        SINGLE_BLOCK=split_k == 1 and args[20] <= block_k, num_warps=warps, num_stages=stages, **meta)
