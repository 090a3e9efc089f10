"""``decode_linear``'s prologue as a kernel of its own, for launches of several rows with a norm.

In :mod:`dslab.kernels.decode.decode_linear_triton` every program of a launch computes the norm's
row statistics itself: one pass over K of its ``BLOCK_M`` rows before its weight stream starts
(from the tile in registers when K is one block, as at batch 1). At 16-row tiles and split K that
pass is as long as the program's share of the weights: on an H200 at 8 rows and hidden 2048, QKV
with its residual add and LayerNorm in front took 25 us against 11 without
(``benchmarks/decode_linear_bench.py --rows 8``). Here one program per row computes ``a = x
(+ residual)`` (rows gathered from tables as the fused prologue gathers them), stores it when the
caller wants the sum, and stores ``h = norm(a)``, both rounded as the fused prologue rounds them
(the same helpers); the linear then runs on ``h`` with no prologue. One more launch of a few
microseconds, against every column program's pass over the rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dslab.kernels.decode.decode_linear_triton import _prologue, _row_rms, _row_stats

#: Elements of a row each program handles at a time (the whole row up to this width).
MAX_BLOCK_K = 4096
INTERPRETER_BLOCK_K = 32


@triton.jit
def _decode_prologue_kernel(
    X, X_ROWS, R, R_ROWS, R_OFFSET, A_OUT, H_OUT, NORM_W, NORM_B,
    K, stride_x, stride_r, stride_a, stride_h, eps,
    HAS_X_ROWS: tl.constexpr, HAS_R: tl.constexpr, HAS_R_ROWS: tl.constexpr, HAS_R_OFFSET: tl.constexpr,
    WRITE_A: tl.constexpr, RMS_NORM: tl.constexpr, BF16_BY_HAND: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    rows = row + tl.arange(0, 1)
    row_mask = rows >= 0
    if HAS_X_ROWS:
        x_base = tl.load(X_ROWS + rows).to(tl.int64) * stride_x
    else:
        x_base = rows.to(tl.int64) * stride_x
    r_base = x_base
    if HAS_R:
        if HAS_R_ROWS:
            r_index = tl.load(R_ROWS + rows).to(tl.int64)
            if HAS_R_OFFSET:
                r_index -= tl.load(R_OFFSET + rows).to(tl.int64)
            r_base = r_index * stride_r
        else:
            r_base = rows.to(tl.int64) * stride_r
    mean = tl.zeros((1,), dtype=tl.float32)
    if RMS_NORM:
        rstd = _row_rms(X, x_base, R, r_base, row_mask, K, eps, HAS_R, BF16_BY_HAND, 1, BLOCK_K)
    else:
        mean, rstd = _row_stats(X, x_base, R, r_base, row_mask, K, eps, HAS_R, BF16_BY_HAND, 1, BLOCK_K)
    h_base = rows.to(tl.int64)[:, None] * stride_h
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        h = _prologue(0.0, ks, K, rows, row_mask, 0, X, x_base, R, r_base, A_OUT, stride_a, NORM_W, NORM_B,
                      mean, rstd, False, HAS_R, WRITE_A, True, RMS_NORM, BF16_BY_HAND)
        tl.store(H_OUT + h_base + ks[None, :], h, mask=(ks < K)[None, :])


def plan(interpret: bool, k: int) -> tuple[int, dict]:
    """``(BLOCK_K, launch options)`` for rows of width ``k``: the whole row up to
    :data:`MAX_BLOCK_K`, on 4 warps up to 2048 elements and 16 above (the RMSNorm variant at 4096
    spills 8 bytes a thread on 8 warps in ptxas for sm_90, none on 16:
    ``benchmarks/register_audit.py --only decode``); the interpreter's small block."""
    if interpret:
        return INTERPRETER_BLOCK_K, {}
    block_k = min(MAX_BLOCK_K, triton.next_power_of_2(k))
    return block_k, dict(num_warps=4 if block_k <= 2048 else 16, num_stages=1)


def launch(interpret: bool, m: int, k: int, args: tuple, meta: dict) -> None:
    """One program per row over ``m`` rows of width ``k``."""
    block_k, options = plan(interpret, k)
    _decode_prologue_kernel[(m,)](*args, **meta, BLOCK_K=block_k, **options)
