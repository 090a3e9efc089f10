"""Triton kernels for :mod:`dslab.kernels.moe.grouped_gemm` and the host code that launches them.

Rows ``offsets[g]:offsets[g+1]`` of ``x`` [M, K] belong to group g; ``w`` is [G, N, K] (each group's
``nn.Linear`` weight), ``bias`` [G, N]. Three kernels, each on a persistent grid (as many programs as
fit on the device, each looping over tiles) that reads ``group_offsets`` on the device, so that no
launch needs the group sizes on the host:

- rows kernel, ``C[rows of g] = A[rows of g] @ B[g] (+ bias[g])``: the forward (A = x, B[g] = w[g].T,
  C = y [M, N]) and the input gradient (A = dy, B[g] = w[g], C = dx [M, K]). Tiles are BLOCK_M rows
  of one group by BLOCK_N output columns; group g has ``cdiv(rows_g, BLOCK_M) * cdiv(cols, BLOCK_N)``
  tiles. Each program computes every group's tile count from the offsets (a [BLOCK_G] vector and its
  cumulative sum), maps a tile id to its group by counting the groups that end at or before it, and
  orders a group's tiles GROUP_M row tiles at a time so that programs running together share
  operands in L2. The last row tile of a group reads rows of the next group (clamped into the
  tensor), whose results are never stored: the main loop needs no row mask (and no column or
  contraction mask where the tile divides N and K). Memory traffic per output tile: reads
  ``(BLOCK_M + BLOCK_N) * contraction`` elements, writes ``BLOCK_M * BLOCK_N``; in all,
  ``2 * M * N * K`` flops and at least ``M*K + G*N*K + M*N`` elements.
- weight-gradient kernel, ``dw[g] = dy[rows of g].T @ x[rows of g]`` [N, K] and (with a bias)
  ``dbias[g] = dy[rows of g].sum(0)``: a contraction over each group's rows. Tiles are
  BLOCK_N x BLOCK_K of one group's ``dw[g]``; the loop walks the group's rows BLOCK_M at a time,
  full blocks unmasked, then one masked block for the rest, so no row of another group is summed.
  An empty group's tiles store zeros. The programs holding a group's first K tile also sum the
  ``dy`` blocks they load into ``dbias``, as a narrow product ``dy.T @ ones`` on the tensor cores.
  Reads ``(BLOCK_N + BLOCK_K) * rows_g`` elements per tile, writes ``BLOCK_N * BLOCK_K``;
  ``2 * M * N * K`` flops in all.

Activation epilogues (the rows kernel's ``ACTIVATION`` and ``ACTIVATION_GRAD`` flags), for the
expert MLP of :mod:`dslab.kernels.moe.grouped_mlp`: the forward writes both ``pre = x @ w[g].T +
bias[g]`` and ``act = activation(pre)`` from the accumulator, where a separate activation kernel
would read pre back to write act; the input gradient of the second layer multiplies its
accumulator by ``activation'(pre)``, loading the matching tile of ``pre``, and writes ``d_pre``,
where the unfused layers would write ``d_act`` and read it back with pre. The activations are
GELU (erf, and its tanh form, with :mod:`dslab.kernels.activation.bias_gelu_triton`'s formulas), ReLU and
SiLU, in fp32.

Operand loads: on Hopper-class devices (compute capability 9+) the main loops read A and B
through tensor descriptors built on the device (``tl.make_tensor_descriptor``, the bulk tensor
copy engine: no per-element address arithmetic or masks, zeros past the tensor's edge) and the
rows kernel's tile loop is flattened into its contraction loop so that the next tile's loads are
issued under the current tile's epilogue. Measured on an H100 at the MoE anchor's shapes: a plain
persistent GEMM of [16384, 1024] x [1024, 4096] went from 544 TFLOP/s with pointer loads to 665 with
descriptors and the flattened loop (cuBLAS: 669). Operands whose base or row stride is not a
16-byte multiple (the copy engine's rule), and every launch under the interpreter unless
:data:`TMA_MODE` is ``"on"``, use pointer loads; both paths compute the same products in the same
order. The descriptors need Triton's allocator for their 128-byte scratch (set where none is).

Accumulation is fp32 (``tl.dot`` on tensor cores for fp16/bf16; for fp32 inputs IEEE fp32 unless
``torch.backends.cuda.matmul.allow_tf32`` is set, as for ``torch.matmul``); outputs are written in
the inputs' dtype. Results are deterministic: every output element is summed by one program in a
fixed order.

Tile configs: on CUDA each launch (forward, input gradient, weight gradient) is autotuned
(``triton.autotune``) over a small fixed set of Hopper-class tiles (:data:`_TILES_16BIT`: 128x256
and 256x128 with a contraction step of 64, 3 stages, 8 warps; 128x128 with 4 stages and 8 warps,
or 3 stages, 4 warps and two programs per multiprocessor), keyed on the output width and the
contraction length and the dtypes only, never on M or the group sizes: the choice is made on the
first call of each layer shape (which compiles, times each candidate and synchronises the device)
and reused by every later call (the launches with an activation epilogue tune apart from the plain
ones, keyed on the activation too). Under the Triton interpreter one 16x16x16 tile is used. Each
expert's weight must have fewer than 2**31 elements (in-tile offsets are int32); row offsets are
64-bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import device_guard as _device_guard
from dslab.kernels._grid import unit_stride_rows as _rows
from dslab.kernels._triton_compat import cast_rounding
from dslab.kernels.activation.bias_gelu_triton import _gelu_and_grad
from dslab.kernels.dispatch import interpreting


@triton.jit
def _swizzle(local, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile ``local`` of a tiles_m x tiles_n grid walked GROUP_M rows at a time."""
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (local % width) % size_m
    pid_n = (local % width) // size_m
    return pid_m, pid_n


@triton.jit
def _activation_and_grad(u, ACTIVATION: tl.constexpr, PRECISE_ERF: tl.constexpr, NEED_GRAD: tl.constexpr):
    """(activation(u), activation'(u)) in fp32 for ``ACTIVATION`` "gelu" (erf), "gelu_tanh", "relu"
    or "silu"; the GELUs are :mod:`dslab.kernels.activation.bias_gelu_triton`'s (the second is 0 there unless
    NEED_GRAD). relu's derivative is 1 where u > 0 (0 at 0, as torch's); silu(u) = u * sigmoid(u),
    silu'(u) = sigmoid(u) * (1 + u * (1 - sigmoid(u)))."""
    if ACTIVATION == "gelu":
        y, grad = _gelu_and_grad(u, False, PRECISE_ERF, NEED_GRAD)
    elif ACTIVATION == "gelu_tanh":
        y, grad = _gelu_and_grad(u, True, PRECISE_ERF, NEED_GRAD)
    elif ACTIVATION == "relu":
        y = tl.where(u < 0.0, 0.0, u)  # NaN stays NaN, as in torch.relu
        grad = tl.where(u > 0.0, 1.0, 0.0)
    else:
        sig = 1.0 / (1.0 + tl.exp(-u))
        y = u * sig
        grad = sig * (1.0 + u * (1.0 - sig))
    return y, grad


@triton.jit
def _grouped_rows_kernel(
    A, B, BIAS, C, AUX, OFFSETS,
    M, N, K, G,
    stride_am, stride_bg, stride_bk, stride_bn, stride_biasg, stride_cm, stride_auxm,
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    ACTIVATION: tl.constexpr, ACTIVATION_GRAD: tl.constexpr, PRECISE_ERF: tl.constexpr,
    USE_TMA: tl.constexpr, B_K_MAJOR: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr,
):
    """C[rows of g] = A[rows of g] @ B[g] (+ BIAS[g]) for A [M, K] and C [M, N] (unit stride along
    their last dimension), B[g] a [K, N] view with strides (stride_bk, stride_bn). PROGRAMS_PER_SM
    is read by the launch grid only (a grid function sees a config's constexprs, not its stages).

    Epilogues, on the fp32 accumulator, selected by ``ACTIVATION`` (``"none"`` or an activation's
    name) and ``ACTIVATION_GRAD``; AUX [M, N] has row stride stride_auxm:

    - ``"none"``: C is the product (plus the bias); AUX is unused.
    - an activation, forward: C = pre (the product plus the bias, rounded to C's dtype) and
      AUX = activation(pre), computed from the rounded pre so that the backward's activation'(pre)
      is the derivative of exactly what the forward applied.
    - an activation with ``ACTIVATION_GRAD``: AUX holds pre (an input) and C = product *
      activation'(pre), the gradient through the activation without its input gradient ever
      being written.

    ``USE_TMA``: the operand tiles come through tensor descriptors (Hopper's bulk tensor copies:
    no address arithmetic or masks in the main loop, and the tile loop is flattened into the
    contraction loop so that the next tile's loads overlap this tile's epilogue). A's descriptor
    covers [M, K] (rows past M and columns past K read as zeros); B's covers all groups as one
    [G * R, C] matrix (``B_K_MAJOR``: w[g] [N, K] with R = N, the forward; else w[g] [K, N] with
    R = K, the input gradient). A tile of B that crosses into group g + 1 is harmless: K-major, the
    extra rows only make output columns past N, which are not stored; N-major the host uses TMA for
    B only when BLOCK_K divides K, so no tile crosses.
    """
    groups = tl.arange(0, BLOCK_G)
    in_range = groups < G
    starts = tl.load(OFFSETS + groups, mask=in_range, other=0).to(tl.int32)
    ends = tl.load(OFFSETS + groups + 1, mask=in_range, other=0).to(tl.int32)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_tiles = tl.cdiv(ends - starts, BLOCK_M) * tiles_n
    group_tile_ends = tl.cumsum(group_tiles, axis=0)
    total_tiles = tl.sum(group_tiles, axis=0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    TMA_B: tl.constexpr = USE_TMA and (B_K_MAJOR or EVEN_K)
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if TMA_B:
        if B_K_MAJOR:
            b_desc = tl.make_tensor_descriptor(B, shape=[G * N, K], strides=[stride_bn, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(B, shape=[G * K, N], strides=[stride_bk, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
    for tile in tl.range(tl.program_id(0), total_tiles, tl.num_programs(0), flatten=USE_TMA):
        g = tl.sum((group_tile_ends <= tile).to(tl.int32), axis=0)
        local = tile - tl.sum(tl.where(groups == g, group_tile_ends - group_tiles, 0), axis=0)
        row_start = tl.load(OFFSETS + g).to(tl.int32)
        row_end = tl.load(OFFSETS + g + 1).to(tl.int32)
        pid_m, pid_n = _swizzle(local, tl.cdiv(row_end - row_start, BLOCK_M), tiles_n, GROUP_M)
        rows = row_start + pid_m * BLOCK_M + offs_m
        cols = pid_n * BLOCK_N + offs_n
        col_mask = cols < N
        a_rows = tl.minimum(rows, M - 1).to(tl.int64)
        a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = B + g.to(tl.int64) * stride_bg + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            if USE_TMA:
                a = a_desc.load([row_start + pid_m * BLOCK_M, k * BLOCK_K])
            elif EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            if TMA_B:
                if B_K_MAJOR:
                    b = b_desc.load([g * N + pid_n * BLOCK_N, k * BLOCK_K]).T
                else:
                    b = b_desc.load([g * K + k * BLOCK_K, pid_n * BLOCK_N])
            elif EVEN_K and EVEN_N:
                b = tl.load(b_ptrs)
            elif EVEN_K:
                b = tl.load(b_ptrs, mask=col_mask[None, :], other=0.0)
            else:
                b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_mask[None, :], other=0.0)
            if DOT_FP32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            bias = tl.load(BIAS + g * stride_biasg + cols, mask=col_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        c_ptrs = C + rows64 * stride_cm + cols[None, :]
        c_mask = (rows < row_end)[:, None] & col_mask[None, :]
        if ACTIVATION == "none":
            tl.store(c_ptrs, cast_rounding(acc, C.dtype.element_ty, BF16_BY_HAND), mask=c_mask)
        elif ACTIVATION_GRAD:
            pre = tl.load(AUX + rows64 * stride_auxm + cols[None, :], mask=c_mask, other=0.0)
            _, grad = _activation_and_grad(pre.to(tl.float32), ACTIVATION, PRECISE_ERF, True)
            tl.store(c_ptrs, cast_rounding(acc * grad, C.dtype.element_ty, BF16_BY_HAND), mask=c_mask)
        else:
            pre = cast_rounding(acc, C.dtype.element_ty, BF16_BY_HAND)
            tl.store(c_ptrs, pre, mask=c_mask)
            act, _ = _activation_and_grad(pre.to(tl.float32), ACTIVATION, PRECISE_ERF, False)
            aux_ptrs = AUX + rows64 * stride_auxm + cols[None, :]
            tl.store(aux_ptrs, cast_rounding(act, AUX.dtype.element_ty, BF16_BY_HAND), mask=c_mask)


@triton.jit
def _weight_grad_tile(
    DY, X, dy_desc, x_desc, cols_n, cols_k, N, K, row_start, row_end, stride_dym, stride_xm,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    USE_TMA: tl.constexpr, SUM_DY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(dy[rows].T @ x[rows] [BLOCK_N, BLOCK_K], dy[rows].sum(0) [BLOCK_N] or zeros) over the rows
    row_start:row_end and the columns cols_n of dy, cols_k of x, in fp32.

    The column sums are a second, narrow product ``dy.T @ ones`` [BLOCK_N, 16] (its columns are
    equal; the first is kept): on tensor cores from the ``dy`` tile already in shared memory, with
    8 accumulator registers per thread where a reduction of the tile in registers spills. With
    ``USE_TMA`` the full row blocks come through the tensor descriptors ``dy_desc`` [M, N] and
    ``x_desc`` [M, K] (columns past N or K read as zeros); the last, partial block is masked.
    """
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    sums = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    rows = (row_start + offs_m).to(tl.int64)
    dy_ptrs = DY + rows[:, None] * stride_dym + cols_n[None, :]
    x_ptrs = X + rows[:, None] * stride_xm + cols_k[None, :]
    n_mask = (cols_n < N)[None, :]
    k_mask = (cols_k < K)[None, :]
    full_blocks = (row_end - row_start) // BLOCK_M
    first_n = tl.min(cols_n, axis=0)
    first_k = tl.min(cols_k, axis=0)
    for block in range(0, full_blocks):
        if USE_TMA:
            dy = dy_desc.load([row_start + block * BLOCK_M, first_n])
            x = x_desc.load([row_start + block * BLOCK_M, first_k])
        else:
            if EVEN_N:
                dy = tl.load(dy_ptrs)
            else:
                dy = tl.load(dy_ptrs, mask=n_mask, other=0.0)
            if EVEN_K:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs, mask=k_mask, other=0.0)
        if DOT_FP32:
            dy, x = dy.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
        if SUM_DY:
            sums = tl.dot(tl.trans(dy), tl.full((BLOCK_M, 16), 1.0, dy.dtype), sums, input_precision="ieee")
        if not USE_TMA:
            dy_ptrs += BLOCK_M * stride_dym
            x_ptrs += BLOCK_M * stride_xm
    if USE_TMA:
        done = (full_blocks * BLOCK_M).to(tl.int64)
        dy_ptrs += done * stride_dym
        x_ptrs += done * stride_xm
    tail_start = row_start + full_blocks * BLOCK_M
    if tail_start < row_end:
        tail = (tail_start + offs_m < row_end)[:, None]
        if EVEN_N:
            dy = tl.load(dy_ptrs, mask=tail, other=0.0)
        else:
            dy = tl.load(dy_ptrs, mask=tail & n_mask, other=0.0)
        if EVEN_K:
            x = tl.load(x_ptrs, mask=tail, other=0.0)
        else:
            x = tl.load(x_ptrs, mask=tail & k_mask, other=0.0)
        if DOT_FP32:
            dy, x = dy.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
        if SUM_DY:
            sums = tl.dot(tl.trans(dy), tl.full((BLOCK_M, 16), 1.0, dy.dtype), sums, input_precision="ieee")
    return acc, tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, sums, 0.0), axis=1)


@triton.jit
def _grouped_weight_grad_kernel(
    DY, X, DW, DBIAS, OFFSETS,
    N, K, G,
    stride_dym, stride_xm, stride_dwg, stride_dwn, stride_dbiasg,
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, BF16_BY_HAND: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,
):
    """DW[g] = DY[rows of g].T @ X[rows of g] for DY [M, N], X [M, K] (unit stride along their last
    dimension), DW [G, N, K] (unit stride along K); DBIAS[g] = DY[rows of g].sum(0).
    PROGRAMS_PER_SM is read by the launch grid only; M = OFFSETS[G]."""
    dy_desc = None
    x_desc = None
    if USE_TMA:
        m = tl.load(OFFSETS + G).to(tl.int32)
        dy_desc = tl.make_tensor_descriptor(DY, shape=[m, N], strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_N])
        x_desc = tl.make_tensor_descriptor(X, shape=[m, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    group_tiles = tiles_n * tiles_k
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), G * group_tiles, tl.num_programs(0)):
        g = tile // group_tiles
        pid_n, pid_k = _swizzle(tile % group_tiles, tiles_n, tiles_k, GROUP_M)
        row_start = tl.load(OFFSETS + g).to(tl.int32)
        row_end = tl.load(OFFSETS + g + 1).to(tl.int32)
        cols_n = pid_n * BLOCK_N + offs_n
        cols_k = pid_k * BLOCK_K + offs_k
        if HAS_BIAS:
            if pid_k == 0:
                acc, dy_sum = _weight_grad_tile(
                    DY, X, dy_desc, x_desc, cols_n, cols_k, N, K, row_start, row_end, stride_dym, stride_xm,
                    EVEN_N, EVEN_K, INPUT_PRECISION, DOT_FP32, USE_TMA, True, BLOCK_N, BLOCK_K, BLOCK_M,
                )
                db_ptrs = DBIAS + g * stride_dbiasg + cols_n
                tl.store(db_ptrs, cast_rounding(dy_sum, DBIAS.dtype.element_ty, BF16_BY_HAND), mask=cols_n < N)
            else:
                acc, dy_sum = _weight_grad_tile(
                    DY, X, dy_desc, x_desc, cols_n, cols_k, N, K, row_start, row_end, stride_dym, stride_xm,
                    EVEN_N, EVEN_K, INPUT_PRECISION, DOT_FP32, USE_TMA, False, BLOCK_N, BLOCK_K, BLOCK_M,
                )
        else:
            acc, dy_sum = _weight_grad_tile(
                DY, X, dy_desc, x_desc, cols_n, cols_k, N, K, row_start, row_end, stride_dym, stride_xm,
                EVEN_N, EVEN_K, INPUT_PRECISION, DOT_FP32, USE_TMA, False, BLOCK_N, BLOCK_K, BLOCK_M,
            )
        dw_ptrs = DW + g.to(tl.int64) * stride_dwg + cols_n[:, None] * stride_dwn + cols_k[None, :]
        dw_mask = (cols_n < N)[:, None] & (cols_k < K)[None, :]
        tl.store(dw_ptrs, cast_rounding(acc, DW.dtype.element_ty, BF16_BY_HAND), mask=dw_mask)


# Tiles as (output tile rows, output tile columns, contraction step, num_warps, num_stages,
# programs per multiprocessor). For the rows kernel the first three are (BLOCK_M, BLOCK_N,
# BLOCK_K); for the weight-gradient kernel dw[g]'s [N, K] tile and the step over a group's rows,
# (BLOCK_N, BLOCK_K, BLOCK_M). The 16-bit tiles are Hopper-sized: 96 to 144 KB of shared memory for
# the operand pipeline, one program per multiprocessor, or two of the 96 KB tile so that one
# program's epilogue overlaps the other's main loop. The programs per multiprocessor fit both the
# shared memory and the registers of every kernel compiled for sm_90 (at most 255 registers a
# thread: two 4-warp programs, or one 8-warp program, per 64K registers). Tiles whose programs do
# not fit the device's shared memory are pruned before tuning.
_TILES_16BIT = [
    (128, 256, 64, 8, 3, 1), (256, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1), (128, 128, 64, 4, 3, 2),
]
_TILES_FP32 = [(128, 128, 32, 8, 3, 1), (64, 128, 32, 4, 4, 2), (64, 64, 32, 4, 4, 2)]
_INTERPRETER_TILE = (16, 16, 16, 1, 1, 1)
_INTERPRETER_PROGRAMS = 4
_ROWS_NAMES = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
_WEIGHT_GRAD_NAMES = ("BLOCK_N", "BLOCK_K", "BLOCK_M")
_GROUP_M = 8


def _config(tile, names, group_m: int = _GROUP_M) -> triton.Config:
    rows, cols, step, warps, stages, per_sm = tile
    meta = dict(zip(names, (rows, cols, step)), GROUP_M=group_m, PROGRAMS_PER_SM=per_sm)
    return triton.Config(meta, num_warps=warps, num_stages=stages)


@functools.cache
def _device_limits(index: int) -> tuple[int, int]:
    """(multiprocessors, shared memory one program may use, in bytes) of CUDA device ``index``."""
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    return props["multiprocessor_count"], props["max_shared_mem"]


def _even(dims):
    """Heuristics setting ``EVEN_<dim>`` when the tile ``BLOCK_<dim>`` divides ``<dim>``."""
    return {f"EVEN_{dim}": (lambda args, dim=dim: args[dim] % args[f"BLOCK_{dim}"] == 0) for dim in dims}


def _autotuned(kernel, names, operand: str, key=("N", "K", "USE_TMA")):
    """``kernel`` autotuned over the tiles of ``operand``'s dtype (fp32 or 16-bit) that fit the
    device, keyed on ``key`` (the output width N and contraction length K by default) and the
    dtypes."""
    configs_16bit = [_config(tile, names) for tile in _TILES_16BIT]
    configs_fp32 = [_config(tile, names) for tile in _TILES_FP32]

    def smem_bytes(config, element_size):
        rows, cols, step = (config.kwargs[name] for name in names)
        return config.num_stages * (rows * step + step * cols) * element_size

    def prune(configs, named_args, **kwargs):
        tensor = named_args[operand]
        element_size = tensor.element_size()
        _, smem = _device_limits(tensor.device.index)
        candidates = configs_fp32 if element_size == 4 else configs_16bit
        fits = [c for c in candidates if c.kwargs["PROGRAMS_PER_SM"] * smem_bytes(c, element_size) <= smem]
        return fits or [min(candidates, key=lambda c: smem_bytes(c, element_size))]

    return triton.autotune(
        configs=configs_16bit + configs_fp32, key=list(key), prune_configs_by={"early_config_prune": prune},
    )(kernel)


_rows_kernel = triton.heuristics(_even(("N", "K")))(_grouped_rows_kernel)
_weight_grad_kernel = triton.heuristics(_even(("N", "K")))(_grouped_weight_grad_kernel)
# The forward and the input gradient share the rows kernel but not its operand layouts (w[g].T is
# K-major, w[g] N-major), so each has its own choice of tile.
_forward_tuned = _autotuned(_rows_kernel, _ROWS_NAMES, "A")
_input_grad_tuned = _autotuned(_rows_kernel, _ROWS_NAMES, "A")
# The activation epilogues (two outputs forward; an extra input and the derivative backward) change
# what a tile costs beyond its main loop, so their launches choose their own tiles, per activation.
_forward_activation_tuned = _autotuned(_rows_kernel, _ROWS_NAMES, "A", key=("N", "K", "USE_TMA", "ACTIVATION"))
_input_grad_activation_tuned = _autotuned(_rows_kernel, _ROWS_NAMES, "A", key=("N", "K", "USE_TMA", "ACTIVATION"))
_weight_grad_tuned = _autotuned(_weight_grad_kernel, _WEIGHT_GRAD_NAMES, "DY")


def _on_interpreter(device: torch.device) -> bool:
    return device.type != "cuda" or interpreting()


# "auto": tensor descriptors on devices with the bulk tensor copy engine (compute capability 9+)
# where the operands' layouts allow them; "on" / "off" force the choice (the tests run both paths
# under the interpreter, which emulates descriptors).
TMA_MODE = "auto"


@functools.cache
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(tl, "make_tensor_descriptor")


def _tma_ready(tensor: torch.Tensor, row_stride: int) -> bool:
    """Whether a descriptor may cover ``tensor`` with rows ``row_stride`` elements apart: the
    copy engine needs a 16-byte aligned base and 16-byte multiples between rows."""
    size = tensor.element_size()
    return tensor.data_ptr() % 16 == 0 and (row_stride * size) % 16 == 0


def _use_tma(device: torch.device, *operands: tuple[torch.Tensor, int]) -> bool:
    if TMA_MODE == "off":
        return False
    if TMA_MODE != "on" and (_on_interpreter(device) or not _has_tma(device.index)):
        return False
    return all(_tma_ready(t, stride) for t, stride in operands)


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the descriptors a kernel builds on the device (128 bytes each)."""
    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def _ensure_tma_allocator() -> None:
    """Kernels that build tensor descriptors need Triton's allocator for their scratch. It is a
    context variable, so it is set in each thread that launches (autograd's backward runs in its
    own), and only where none is set."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)


def _launch(tuned, kernel, names, tiles_for, args: tuple, flags: dict, device: torch.device):
    """Launch on a persistent grid: ``PROGRAMS_PER_SM`` programs per multiprocessor, never more
    than ``tiles_for(meta)``, an upper bound on the launch's tiles. Autotuned on CUDA; under the
    interpreter one small tile and 4 programs, so that programs loop over tiles."""
    if _on_interpreter(device):
        rows, cols, step, warps, stages, per_sm = _INTERPRETER_TILE
        meta = dict(zip(names, (rows, cols, step)), GROUP_M=2, PROGRAMS_PER_SM=per_sm)
        grid = (max(1, min(_INTERPRETER_PROGRAMS, tiles_for(meta))),)
        kernel[grid](*args, **flags, **meta, num_warps=warps, num_stages=stages)
        return
    multiprocessors, _ = _device_limits(device.index)

    def grid(meta):
        return (max(1, min(multiprocessors * meta["PROGRAMS_PER_SM"], tiles_for(meta))),)

    tuned[grid](*args, **flags)


def _flags(dtype: torch.dtype, device: torch.device) -> dict:
    """The interpreter multiplies bf16 operands as raw integers, so there ``DOT_FP32`` upcasts them
    first (a 16-bit product is exact in fp32), and its fp32 -> bf16 cast truncates, so
    ``BF16_BY_HAND`` rounds bf16 outputs to nearest even as the GPU does."""
    interpret = _on_interpreter(device)
    strict_fp32 = dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return dict(
        INPUT_PRECISION="ieee" if strict_fp32 or interpret else "tf32",
        DOT_FP32=interpret,
        BF16_BY_HAND=interpret and dtype == torch.bfloat16,
    )


def _grouped_rows(tuned, a: torch.Tensor, b: torch.Tensor, b_strides: tuple[int, int], out_cols: int,
                  group_offsets: torch.Tensor, bias: torch.Tensor | None, activation: str = "none",
                  aux: torch.Tensor | None = None, activation_grad: bool = False) -> torch.Tensor:
    """``c[rows of g] = a[rows of g] @ B[g] (+ bias[g])`` with ``B[g]`` the [contraction, out_cols]
    view of ``b[g]`` of strides ``b_strides``; ``c`` [M, out_cols] in a's dtype. With an
    ``activation``, ``aux`` [M, out_cols] (unit stride along its rows) receives activation(c), or,
    with ``activation_grad``, holds the pre-activation and c is multiplied by its derivative (see
    the rows kernel's epilogues)."""
    m, contraction = a.shape
    groups = b.shape[0]
    c = torch.empty((m, out_cols), dtype=a.dtype, device=a.device)
    if m == 0 or out_cols == 0:
        return c

    def tiles_for(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) + groups) * triton.cdiv(out_cols, meta["BLOCK_N"])

    args = (
        a, b, bias, c, aux, group_offsets, m, out_cols, contraction, groups,
        a.stride(0), b.stride(0), b_strides[0], b_strides[1], bias.stride(0) if bias is not None else 0, c.stride(0),
        aux.stride(0) if aux is not None else 0,
    )
    b_k_major = b_strides[0] == 1
    b_rows = out_cols if b_k_major else contraction
    b_row_stride = b_strides[1] if b_k_major else b_strides[0]
    use_tma = b.stride(0) == b_rows * b_row_stride and _use_tma(a.device, (a, a.stride(0)), (b, b_row_stride))
    if use_tma:
        _ensure_tma_allocator()
    flags = dict(_flags(a.dtype, a.device), USE_TMA=use_tma, B_K_MAJOR=b_k_major,
                 HAS_BIAS=bias is not None, BLOCK_G=max(16, triton.next_power_of_2(groups)),
                 ACTIVATION=activation, ACTIVATION_GRAD=activation_grad, PRECISE_ERF=a.dtype == torch.float32)
    with _device_guard(a):
        _launch(tuned, _rows_kernel, _ROWS_NAMES, tiles_for, args, flags, a.device)
    return c


def _unit_stride_last(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def forward(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] with y[rows of g] = x[rows of g] @ w[g].T + bias[g], in x's dtype; x [M, K],
    w [G, N, K], bias [G, N] or None, group_offsets [G + 1] on x's device."""
    x, w, bias = _rows(x), _unit_stride_last(w), _unit_stride_last(bias)
    return _grouped_rows(_forward_tuned, x, w, (w.stride(2), w.stride(1)), w.shape[1], group_offsets, bias)


def backward_input(dy: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """dx [M, K] with dx[rows of g] = dy[rows of g] @ w[g], in dy's dtype; dy [M, N], w [G, N, K]."""
    dy, w = _rows(dy), _unit_stride_last(w)
    return _grouped_rows(_input_grad_tuned, dy, w, (w.stride(1), w.stride(2)), w.shape[2], group_offsets, None)


def forward_activation(
    x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pre, act), both [M, N] in x's dtype, with pre[rows of g] = x[rows of g] @ w[g].T + bias[g]
    and act = activation(pre) (``"gelu"``, ``"gelu_tanh"``, ``"relu"`` or ``"silu"``), written by one
    launch from its accumulators; x [M, K], w [G, N, K], bias [G, N] or None."""
    x, w, bias = _rows(x), _unit_stride_last(w), _unit_stride_last(bias)
    act = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
    pre = _grouped_rows(_forward_activation_tuned, x, w, (w.stride(2), w.stride(1)), w.shape[1], group_offsets,
                        bias, activation, act)
    return pre, act


def backward_input_activation(
    dy: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, pre: torch.Tensor, activation: str
) -> torch.Tensor:
    """d_pre [M, K] with d_pre[rows of g] = (dy[rows of g] @ w[g]) * activation'(pre[rows of g]), in
    dy's dtype: the input gradient of a grouped GEMM whose input was activation(pre), taken through
    the activation in the epilogue; dy [M, N], w [G, N, K], pre [M, K]."""
    dy, w, pre = _rows(dy), _unit_stride_last(w), _rows(pre)
    return _grouped_rows(_input_grad_activation_tuned, dy, w, (w.stride(1), w.stride(2)), w.shape[2], group_offsets,
                         None, activation, pre, activation_grad=True)


def backward_weight(
    dy: torch.Tensor, x: torch.Tensor, group_offsets: torch.Tensor, with_bias: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dw [G, N, K], dbias [G, N] or None) with dw[g] = dy[rows of g].T @ x[rows of g] and
    dbias[g] = dy[rows of g].sum(0), in ``out_dtype`` (x's dtype by default; fp32 stores the fp32
    accumulators as they are, the gradient of fp32 master weights); dy [M, N], x [M, K]. Empty
    groups get zeros. Needs N >= 1 and K >= 1 (the dispatch sends zero widths to the reference)."""
    dy, x = _rows(dy), _rows(x)
    (m, n), k = dy.shape, x.shape[1]
    groups = group_offsets.shape[0] - 1
    out_dtype = out_dtype or x.dtype
    if m == 0:
        dbias = torch.zeros((groups, n), dtype=out_dtype, device=x.device) if with_bias else None
        return torch.zeros((groups, n, k), dtype=out_dtype, device=x.device), dbias
    dw = torch.empty((groups, n, k), dtype=out_dtype, device=x.device)
    dbias = torch.empty((groups, n), dtype=out_dtype, device=x.device) if with_bias else None

    def tiles_for(meta):
        return groups * triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"])

    args = (
        dy, x, dw, dbias, group_offsets, n, k, groups,
        dy.stride(0), x.stride(0), dw.stride(0), dw.stride(1), dbias.stride(0) if dbias is not None else 0,
    )
    use_tma = _use_tma(x.device, (dy, dy.stride(0)), (x, x.stride(0)))
    if use_tma:
        _ensure_tma_allocator()
    flags = dict(_flags(x.dtype, x.device), HAS_BIAS=with_bias, USE_TMA=use_tma)
    flags["BF16_BY_HAND"] = flags["BF16_BY_HAND"] and out_dtype == torch.bfloat16
    with _device_guard(x):
        _launch(_weight_grad_tuned, _weight_grad_kernel, _WEIGHT_GRAD_NAMES, tiles_for, args, flags, x.device)
    return dw, dbias
