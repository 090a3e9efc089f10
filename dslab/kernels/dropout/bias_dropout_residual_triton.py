"""Triton kernels for :mod:`dslab.kernels.dropout.bias_dropout_residual` and the host code that launches
them.

Rows are ``x2d[M, N]`` with unit stride along N; ``bias`` is ``[N]``; math is fp32, outputs are in
x's dtype. With scale = 1 / (1 - p):

    out = residual + keep * (x + bias) * scale          (keep = 1 everywhere when p == 0)
    dx  = keep * dout * scale,  dresidual = dout,  dbias = sum_rows(dx)

The keep mask is never stored: element (r, c) is kept when its 16-bit draw is at least
``threshold = p * 2**16``, the draw being half ``c % 2`` (low, then high) of output ``(c % 8) // 2``
of Philox-4x32-10 (``tl.philox``) with key ``seed`` and counter ``(c // 8, r, 0, 0)``: one call
serves eight neighbouring elements. The rate applied is p rounded to a multiple of ``2**-16``
(:func:`kernel_p`), and the kept values are scaled by ``1 / (1 - kernel_p(p))``, so the expected
output is exact. The seed is a 1-element int64 tensor on the device that each program loads
(``SEED``), never a host scalar: a CUDA graph that captured the launch reads the value the captured
``torch.randint`` wrote on that replay, so every replay draws a new mask. The mask depends only on
(seed, row, column), not on block sizes, so forward and backward (and any recomputation)
regenerate the same one.

Forward reads x, residual (and bias, cached), writes out: 3 * M * N elements. Backward reads dout,
writes dx: 2 * M * N; dbias is accumulated per program in fp32 over a grid sized to the programs
resident on the device and the ``[programs, N]`` partials are summed in a fixed order
(:mod:`dslab.kernels._grid`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import column_sums, resident_programs
from dslab.kernels._grid import device_guard as _device_guard
from dslab.kernels._grid import unit_stride_rows as _rows


@triton.jit
def _keep_mask(seed, rows, col_start, threshold, BLOCK_N: tl.constexpr):
    """Boolean [len(rows), BLOCK_N]: keep element (row, col_start + j)? ``col_start % 8 == 0``."""
    groups = col_start // 8 + tl.arange(0, BLOCK_N // 8)
    counter_col = (rows[:, None] * 0 + groups[None, :]).to(tl.uint32)
    counter_row = (rows[:, None] + groups[None, :] * 0).to(tl.uint32)
    zero = counter_col * 0
    r0, r1, r2, r3 = tl.philox(seed, counter_col, counter_row, zero, zero)
    # Compared before they are spread out, so that bytes move between layouts, not words: v_k
    # holds output k's two keep bits (bit h: half h); w [rows, 4 * groups] puts v_k of group g at
    # 4g + k, and bit h of it goes to column 2 (4g + k) + h = 8g + 2k + h.
    v0 = ((r0 & 0xFFFF) >= threshold).to(tl.int8) | (((r0 >> 16) >= threshold).to(tl.int8) << 1)
    v1 = ((r1 & 0xFFFF) >= threshold).to(tl.int8) | (((r1 >> 16) >= threshold).to(tl.int8) << 1)
    v2 = ((r2 & 0xFFFF) >= threshold).to(tl.int8) | (((r2 >> 16) >= threshold).to(tl.int8) << 1)
    v3 = ((r3 & 0xFFFF) >= threshold).to(tl.int8) | (((r3 >> 16) >= threshold).to(tl.int8) << 1)
    w = tl.interleave(tl.interleave(v0, v2), tl.interleave(v1, v3))
    return tl.interleave(w & 1, w >> 1) != 0


@triton.jit
def _bias_dropout_residual_fwd_kernel(
    X, B, R, OUT, SEED, M, N, stride_x, stride_r, stride_out, threshold, scale,
    HAS_BIAS: tl.constexpr, APPLY_DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_start = tl.program_id(1) * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    h = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if APPLY_DROPOUT:
        seed = tl.load(SEED)
        h = tl.where(_keep_mask(seed, rows, col_start, threshold, BLOCK_N), h * scale, 0.0)
    out = tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32) + h
    tl.store(OUT + rows64 * stride_out + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bias_dropout_residual_bwd_kernel(
    DOUT, DX, DB_partial, SEED, M, N, stride_dout, stride_dx, threshold, scale,
    COMPUTE_DB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    col_start = tl.program_id(1) * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    seed = tl.load(SEED)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in tl.range(pid_m, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dout = tl.load(DOUT + rows64 * stride_dout + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = tl.where(_keep_mask(seed, rows, col_start, threshold, BLOCK_N), dout * scale, 0.0)
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DB:
            db_acc += dx
    if COMPUTE_DB:
        tl.store(DB_partial + pid_m * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@functools.cache
def _config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tiles of 4K elements, up to 1024 wide, 32 per thread."""
    block_n = max(8, min(triton.next_power_of_2(n), 1024))
    return max(1, 4096 // block_n), block_n, 4


#: Each keep draw is 16 bits of a Philox output.
DROPOUT_LEVELS = 2**16


def _threshold(p: float) -> int:
    """The 16-bit draw a kept element reaches at least: ``p * 2**16``, rounded (``2**16`` drops all)."""
    return min(round(p * DROPOUT_LEVELS), DROPOUT_LEVELS)


def kernel_p(p: float) -> float:
    """The dropout rate the kernels apply for ``p``: rounded to a multiple of ``2**-16``."""
    return _threshold(p) / DROPOUT_LEVELS


def _scale(p: float) -> float:
    """``1 / (1 - kernel_p(p))``, the kept values' scale (0 when everything is dropped)."""
    kept = DROPOUT_LEVELS - _threshold(p)
    return 0.0 if kept == 0 else DROPOUT_LEVELS / kept


def forward(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, seed: torch.Tensor | None
) -> torch.Tensor:
    """residual + dropout(x + bias, p) for ``x``, ``residual`` [M, N]; no dropout when p == 0.
    ``seed``: int64 ``[1]`` on x's device (read by the kernel), or None when p == 0."""
    m, n = x.shape
    x, residual = _rows(x), _rows(residual)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, num_warps = _config(n)
    with _device_guard(x):
        _bias_dropout_residual_fwd_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            x, bias, residual, out, seed if p > 0.0 else x, m, n, x.stride(0), residual.stride(0),
            out.stride(0), _threshold(p), _scale(p),
            HAS_BIAS=bias is not None, APPLY_DROPOUT=p > 0.0,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return out


def backward(
    dout: torch.Tensor, bias: torch.Tensor | None, p: float, seed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dbias) of the dropout part for ``dout`` [M, N] and p > 0, the mask regenerated from the
    forward's ``seed`` tensor; dbias is None without a bias, else in bias's dtype. (The residual's
    gradient is ``dout`` itself.)"""
    assert p > 0.0
    m, n = dout.shape
    dout = _rows(dout)
    dx = torch.empty((m, n), dtype=dout.dtype, device=dout.device)
    if m == 0 or n == 0:
        return dx, (torch.zeros_like(bias) if bias is not None else None)
    block_m, block_n, num_warps = _config(n)
    row_tiles, col_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    meta = dict(COMPUTE_DB=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    scalars = (m, n, dout.stride(0), dx.stride(0), _threshold(p), _scale(p))
    with _device_guard(dout):
        if bias is None:
            _bias_dropout_residual_bwd_kernel[(row_tiles, col_tiles)](dout, dx, None, seed, *scalars, **meta)
            return dx, None

        # The partials' size depends on the grid: the occupancy query compiles the same
        # specialization with an aligned fp32 tensor standing in for them.
        def probe_args():
            return dout, dx, torch.empty(1, dtype=torch.float32, device=dout.device), seed, *scalars

        key = ("bias_dropout_residual_bwd", n, dout.dtype)
        resident = resident_programs(_bias_dropout_residual_bwd_kernel, probe_args, meta, key, dout.device)
        row_programs = min(row_tiles, max(1, resident // col_tiles))
        db_partial = torch.empty((1, row_programs, n), dtype=torch.float32, device=dout.device)
        _bias_dropout_residual_bwd_kernel[(row_programs, col_tiles)](dout, dx, db_partial, seed, *scalars, **meta)
        (db,) = column_sums(db_partial, (bias.dtype,))
    return dx, db
