"""Triton kernels for :mod:`dslab.kernels.evoformer.outer_product_linear` and the host code that launches them.

Layout. x is the contiguous ``[B, R, C, R, C]`` product of the outer product mean; the GEMM rows
are the ``M = B * R * R`` pairs ``g = (b * R + i) * R + j`` and its columns the ``C * C`` pairs
``(c, d)``. Row g starts at ``x[b, i, 0, j, 0] = (b * R + i) * C * R * C + j * C`` and column
``(c, d)`` sits ``c * R * C + d`` past it, so every tile is loaded through a pointer tensor built
per row; rows may cross an i (or b) boundary anywhere. A K tile covers ``C_STEP`` whole c's of
``BLOCK_D = next_power_of_two(C)`` d's each (padding masked), so its columns are runs of ``C``
contiguous elements; rows of one i are contiguous in memory too (``j * C``), so a tile within one
i reads ``BLOCK_M * C`` contiguous elements per c.

Kernels (fp32 accumulation with ``tl.dot``; a weight in fp32 under autocast is cast once to x's
dtype on the host, as ``F.linear`` under autocast does):

- forward, one program per (row block, E block): ``out[g, e] = sum_{c,d} x[g, (c, d)] W[e, c*C+d]
  (+ bias[e] in fp32)``, times ``scale[g]`` in fp32 with a row scale.
- input gradient, one program per (row block, c block): ``dx[g, (c, d)] = sum_e dout[g, e] W[e, c*C+d]``,
  times ``scale[g]`` in fp32 with a row scale (a program's rows are dx's rows, so the scale goes on
  its accumulator once, not on every dout tile), stored straight into x's layout.
- weight gradient, split over rows: program (E block, c block, split) sums its ``rows_per_split``
  rows into an fp32 partial ``[split, E, C*C]``; the programs of the first c block also sum their
  rows of dout into a bias partial ``[split, E]``. With a row scale, each dout tile is scaled in fp32
  as it is loaded: the bias sums take it so, the products after rounding it to x's dtype, as
  ``tl.dot`` takes its operands. Both partials are added up in a fixed order by
  :func:`dslab.kernels._grid.column_sums`, so the gradients are deterministic.

The row scale (the outer product mean's ``1 / (count + eps)``) is a contiguous ``[B, R, R]`` in
fp32 or x's dtype, so row g's factor sits at offset g: one masked load per row block.

Tiles: each launch is autotuned over a few sm_90 tiles (16-bit inputs on tensor cores; fp32
inputs, IEEE dot products on the FMA units unless ``torch.backends.cuda.matmul.allow_tf32``, in
smaller tiles), keyed on C, E and the dtypes. Under the interpreter one small tile is used, so that
test shapes span several row blocks, c blocks and splits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import column_sums, device_guard
from dslab.kernels._triton_compat import cast_rounding
from dslab.kernels.dispatch import interpreting
from dslab.kernels.evoformer.evoformer_attention_triton import dot, kernel_flags

# (BLOCK_M rows, BLOCK_N outputs, K target (columns per step), num_warps, num_stages)
FWD_TILES = [(128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 64, 64, 4, 3), (64, 128, 64, 4, 4),
             (256, 128, 64, 8, 3)]
FWD_TILES_FP32 = [(64, 64, 32, 4, 2), (32, 64, 32, 4, 2), (64, 128, 32, 8, 2)]
FWD_INTERPRET_TILE = (16, 16, 32, 1, 1)
# (BLOCK_M rows, N target ((c, d) columns), BLOCK_E, num_warps, num_stages)
DX_TILES = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (128, 128, 128, 8, 2), (64, 128, 64, 4, 3),
            (256, 64, 64, 8, 3)]
DX_TILES_FP32 = [(64, 64, 32, 4, 2), (32, 64, 32, 4, 2), (64, 32, 32, 4, 3)]
DX_INTERPRET_TILE = (16, 32, 16, 1, 1)
# (BLOCK_E, N target ((c, d) columns), BLOCK_M rows per step, num_warps, num_stages)
DW_TILES = [(128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3)]
DW_TILES_FP32 = [(64, 64, 32, 4, 2), (32, 64, 32, 4, 2), (64, 32, 32, 4, 3)]
DW_INTERPRET_TILE = (16, 32, 16, 1, 1)
AUTOTUNE_KEY = ["C", "E"]
# Rows per weight-gradient split are a multiple of this (every BLOCK_M above divides it).
SPLIT_ALIGN = 128
INTERPRET_SPLITS = 4


@triton.jit
def _row_bases(rows, R, C: tl.constexpr):
    """int64 offset of ``x[b, i, 0, j, 0]`` for rows ``g = (b * R + i) * R + j``."""
    bi = rows // R
    j = rows - bi * R
    return bi.to(tl.int64) * (C * R * C) + j * C


@triton.jit
def _columns(c0, R, C: tl.constexpr, BLOCK_D: tl.constexpr, C_STEP: tl.constexpr):
    """(offset past a row base in x, offset in a weight row, mask) of the columns ``(c, d)``,
    ``c0 <= c < c0 + C_STEP``, ``d < BLOCK_D``."""
    kk = tl.arange(0, C_STEP * BLOCK_D)
    c = c0 + kk // BLOCK_D
    d = kk % BLOCK_D
    return c * (R * C) + d, c * C + d, (c < C) & (d < C)


@triton.jit
def _fwd_kernel(
    X, W, BIAS, SCALE, OUT, M, R, E,
    C: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C_STEP: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(E, BLOCK_N)
    rows = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < E
    base = _row_bases(rows, R, C)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for c0 in range(0, C, C_STEP):
        x_offs, w_offs, k_mask = _columns(c0, R, C, BLOCK_D, C_STEP)
        x_ptrs = X + base[:, None] + x_offs[None, :]
        w_ptrs = W + cols[None, :] * (C * C) + w_offs[:, None]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_mask[None, :], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        acc = dot(x, w, acc, DOT_FP32, PRECISION)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        acc *= tl.load(SCALE + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = OUT + rows.to(tl.int64)[:, None] * E + cols[None, :]
    tl.store(out_ptrs, cast_rounding(acc, OUT.dtype.element_ty, BF16_BY_HAND),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _dx_kernel(
    DOUT, W, SCALE, DX, M, R, E,
    C: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, C_STEP: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    c_tiles = tl.cdiv(C, C_STEP)
    rows = (pid // c_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_offs, w_offs, k_mask = _columns((pid % c_tiles) * C_STEP, R, C, BLOCK_D, C_STEP)
    acc = tl.zeros([BLOCK_M, C_STEP * BLOCK_D], dtype=tl.float32)
    for e0 in range(0, E, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        e_mask = es < E
        dout = tl.load(DOUT + rows.to(tl.int64)[:, None] * E + es[None, :],
                       mask=row_mask[:, None] & e_mask[None, :], other=0.0)
        w_ptrs = W + es[:, None] * (C * C) + w_offs[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs, mask=e_mask[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=e_mask[:, None] & k_mask[None, :], other=0.0)
        acc = dot(dout, w, acc, DOT_FP32, PRECISION)
    if HAS_SCALE:
        acc *= tl.load(SCALE + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    dx_ptrs = DX + _row_bases(rows, R, C)[:, None] + x_offs[None, :]
    dx = cast_rounding(acc, DX.dtype.element_ty, BF16_BY_HAND)
    if EVEN_K:
        tl.store(dx_ptrs, dx, mask=row_mask[:, None])
    else:
        tl.store(dx_ptrs, dx, mask=row_mask[:, None] & k_mask[None, :])


@triton.jit
def _dw_kernel(
    DOUT, X, SCALE, PARTIAL, BIAS_PARTIAL, M, R, E, rows_per_split,
    C: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    BLOCK_E: tl.constexpr, C_STEP: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    c_tiles = tl.cdiv(C, C_STEP)
    pid_c = pid % c_tiles
    es = (pid // c_tiles) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = es < E
    x_offs, w_offs, k_mask = _columns(pid_c * C_STEP, R, C, BLOCK_D, C_STEP)
    acc = tl.zeros([BLOCK_E, C_STEP * BLOCK_D], dtype=tl.float32)
    bias_acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    start = split * rows_per_split
    end = tl.minimum(start + rows_per_split, M)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        dout_t = tl.load(DOUT + rows.to(tl.int64)[None, :] * E + es[:, None],
                         mask=e_mask[:, None] & row_mask[None, :], other=0.0)
        if HAS_SCALE:
            scale = tl.load(SCALE + rows, mask=row_mask, other=0.0).to(tl.float32)
            scaled = dout_t.to(tl.float32) * scale[None, :]
            if HAS_BIAS:
                bias_acc += tl.sum(scaled, axis=1)
            dout_t = cast_rounding(scaled, DOUT.dtype.element_ty, BF16_BY_HAND)
        elif HAS_BIAS:
            bias_acc += tl.sum(dout_t.to(tl.float32), axis=1)
        x_ptrs = X + _row_bases(rows, R, C)[:, None] + x_offs[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = dot(dout_t, x, acc, DOT_FP32, PRECISION)
    partial_ptrs = PARTIAL + split.to(tl.int64) * E * (C * C) + es[:, None] * (C * C) + w_offs[None, :]
    tl.store(partial_ptrs, acc, mask=e_mask[:, None] & k_mask[None, :])
    if HAS_BIAS:
        if pid_c == 0:
            tl.store(BIAS_PARTIAL + split * E + es, bias_acc, mask=e_mask)


def _c_step(target: int, block_d: int, c: int) -> int:
    """Whole c's per K step: about ``target`` columns, no more c's than C's power of two, and at
    least 16 columns (the smallest ``tl.dot`` operand)."""
    step = min(max(1, target // block_d), triton.next_power_of_2(c))
    return max(step, 16 // block_d if block_d < 16 else 1)


def _configs(tiles: list[tuple], names: tuple[str, str, str], c: int) -> list[triton.Config]:
    """``triton.Config`` s of the tiles for C = ``c``: the K-target entry (named ``C_STEP``) becomes
    a whole number of c's, and ``EVEN_K`` says that no column of a step is padding."""
    block_d = triton.next_power_of_2(c)
    seen, out = set(), []
    for tile in tiles:
        blocks = list(tile[:3])
        index = names.index("C_STEP")
        blocks[index] = _c_step(blocks[index], block_d, c)
        key = (*blocks, *tile[3:])
        if key in seen:
            continue
        seen.add(key)
        meta = dict(zip(names, blocks), EVEN_K=block_d == c and c % blocks[index] == 0)
        out.append(triton.Config(meta, num_warps=tile[3], num_stages=tile[4]))
    return out


def _tiles(tables: tuple, fp32: bool, interpret: bool) -> list[tuple]:
    tiles, tiles_fp32, interpret_tile = tables
    return [interpret_tile] if interpret else (tiles_fp32 if fp32 else tiles)


@functools.cache
def _tuned(kind: str, c: int, fp32: bool, interpret: bool):
    """The autotuned ``kind`` kernel ("fwd", "dx", "dw") for C = ``c`` and the input width."""
    kernel, tables, names = {
        "fwd": (_fwd_kernel, (FWD_TILES, FWD_TILES_FP32, FWD_INTERPRET_TILE), ("BLOCK_M", "BLOCK_N", "C_STEP")),
        "dx": (_dx_kernel, (DX_TILES, DX_TILES_FP32, DX_INTERPRET_TILE), ("BLOCK_M", "C_STEP", "BLOCK_E")),
        "dw": (_dw_kernel, (DW_TILES, DW_TILES_FP32, DW_INTERPRET_TILE), ("BLOCK_E", "C_STEP", "BLOCK_M")),
    }[kind]
    configs = _configs(_tiles(tables, fp32, interpret), names, c)
    return triton.autotune(configs=configs, key=AUTOTUNE_KEY)(kernel)


def _kernel(kind: str, c: int, dtype: torch.dtype):
    return _tuned(kind, c, dtype == torch.float32, interpreting())


def _flags(dtype: torch.dtype) -> dict:
    """``DOT_FP32`` and ``PRECISION`` (see ``evoformer_attention_triton.kernel_flags``) and
    ``BF16_BY_HAND``: the interpreter's fp32 -> bf16 cast truncates, so bf16 outputs are rounded
    to nearest even by hand there, as the GPU rounds."""
    return dict(**kernel_flags(dtype), BF16_BY_HAND=interpreting() and dtype == torch.bfloat16)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _dims(x5: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(B, R, C, E, M = B * R * R)."""
    batch, res, c = x5.shape[:3]
    return batch, res, c, weight.shape[0], batch * res * res


def _weight_in(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in the inputs' dtype, contiguous (one small copy for fp32 master weights)."""
    return weight.to(dtype).contiguous()


def forward(x5: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out [B, R, R, E]`` in x's dtype for contiguous x ``[B, R, C, R, C]`` (not empty), weight
    ``[E, C*C]``, bias ``[E]`` or None and contiguous row_scale ``[B, R, R]`` or None, each in x's
    dtype or fp32."""
    batch, res, c, e, m = _dims(x5, weight)
    out = torch.empty((batch, res, res, e), dtype=x5.dtype, device=x5.device)
    w = _weight_in(weight, x5.dtype)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(e, meta["BLOCK_N"]),)

    with device_guard(x5):
        _kernel("fwd", c, x5.dtype)[grid](
            x5, w, bias, row_scale, out, m, res, e, C=c, BLOCK_D=triton.next_power_of_2(c),
            HAS_BIAS=bias is not None, HAS_SCALE=row_scale is not None, **_flags(x5.dtype),
        )
    return out


def _split_rows(m: int, e: int, c: int, device: torch.device) -> tuple[int, int]:
    """(rows per split, splits) of the weight gradient: about two programs per multiprocessor over
    the nominal 128 x 128 output tiles (a few splits under the interpreter)."""
    if device.type == "cuda":
        tiles = triton.cdiv(e, 128) * triton.cdiv(c * c, 128)
        target = max(1, 2 * _multiprocessors(device.index) // tiles)
    else:
        target = INTERPRET_SPLITS
    rows = triton.cdiv(triton.cdiv(m, target), SPLIT_ALIGN) * SPLIT_ALIGN
    return rows, triton.cdiv(m, rows)


def backward(dout: torch.Tensor, x5: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             row_scale: torch.Tensor | None = None):
    """(dx, dweight, dbias): dx contiguous in x's layout and dtype, dweight and dbias in their own
    dtypes from fp32 sums (dbias None without a bias), all from ``dout * row_scale[..., None]``
    with a row scale. ``dout`` is the output's gradient ``[B, R, R, E]`` (any strides)."""
    batch, res, c, e, m = _dims(x5, weight)
    dout2d = dout.reshape(m, e).to(x5.dtype).contiguous()
    w = _weight_in(weight, x5.dtype)
    dx = torch.empty_like(x5, memory_format=torch.contiguous_format)
    block_d = triton.next_power_of_2(c)
    flags = _flags(x5.dtype)
    rows_per_split, splits = _split_rows(m, e, c, x5.device)
    partial = torch.empty((1, splits, e * c * c), dtype=torch.float32, device=x5.device)
    bias_partial = torch.empty((1, splits, e), dtype=torch.float32, device=x5.device) if bias is not None else None

    def dx_grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(c, meta["C_STEP"]),)

    def dw_grid(meta):
        return (triton.cdiv(e, meta["BLOCK_E"]) * triton.cdiv(c, meta["C_STEP"]), splits)

    with device_guard(x5):
        _kernel("dx", c, x5.dtype)[dx_grid](
            dout2d, w, row_scale, dx, m, res, e, C=c, BLOCK_D=block_d, HAS_SCALE=row_scale is not None,
            **flags,
        )
        _kernel("dw", c, x5.dtype)[dw_grid](
            dout2d, x5, row_scale, partial, bias_partial, m, res, e, rows_per_split, C=c, BLOCK_D=block_d,
            HAS_BIAS=bias is not None, HAS_SCALE=row_scale is not None, **flags,
        )
        # fp32 sums, cast by torch: column_sums' own cast truncates to bf16 under the interpreter.
        (dweight,) = column_sums(partial, (torch.float32,))
        dbias = None if bias is None else column_sums(bias_partial, (torch.float32,))[0].to(bias.dtype)
    return dx, dweight.view(e, c * c).to(weight.dtype), dbias
