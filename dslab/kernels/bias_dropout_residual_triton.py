"""Triton kernels for :mod:`dslab.kernels.bias_dropout_residual` and the host code that launches
them.

Rows are ``x2d[M, N]`` with unit stride along N; ``bias`` is ``[N]``; math is fp32, outputs are in
x's dtype. With scale = 1 / (1 - p):

    out = residual + keep * (x + bias) * scale          (keep = 1 everywhere when p == 0)
    dx  = keep * dout * scale,  dresidual = dout,  dbias = sum_rows(dx)

The keep mask is never stored: element (r, c) is kept when u >= p, u being output ``c % 4`` of
Philox-4x32-10 (``tl.philox``) with key ``seed`` and counter ``(c // 4, r, 0, 0)``, turned into a
uniform [0, 1) number from its top 24 bits. The seed is a 1-element int64 tensor on the device that
each program loads (``SEED``), never a host scalar: a CUDA graph that captured the launch reads the
value the captured ``torch.randint`` wrote on that replay, so every replay draws a new mask. One Philox call serves four neighbouring elements. The
mask depends only on (seed, row, column), not on block sizes, so forward and backward (and any
recomputation) regenerate the same one.

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
def _keep_mask(seed, rows, col_start, p, BLOCK_N: tl.constexpr):
    """Boolean [len(rows), BLOCK_N]: keep element (row, col_start + j)? ``col_start % 4 == 0``."""
    groups = col_start // 4 + tl.arange(0, BLOCK_N // 4)
    counter_col = (rows[:, None] * 0 + groups[None, :]).to(tl.uint32)
    counter_row = (rows[:, None] + groups[None, :] * 0).to(tl.uint32)
    zero = counter_col * 0
    r0, r1, r2, r3 = tl.philox(seed, counter_col, counter_row, zero, zero)
    # Column 4 * g + k takes r_k of group g.
    bits = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
    uniform = (bits >> 8).to(tl.float32) * (1.0 / 16777216.0)
    return uniform >= p


@triton.jit
def _bias_dropout_residual_fwd_kernel(
    X, B, R, OUT, SEED, M, N, stride_x, stride_r, stride_out, p, scale,
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
        h = tl.where(_keep_mask(seed, rows, col_start, p, BLOCK_N), h * scale, 0.0)
    out = tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32) + h
    tl.store(OUT + rows64 * stride_out + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bias_dropout_residual_bwd_kernel(
    DOUT, DX, DB_partial, SEED, M, N, stride_dout, stride_dx, p, scale,
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
        dx = tl.where(_keep_mask(seed, rows, col_start, p, BLOCK_N), dout * scale, 0.0)
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DB:
            db_acc += dx
    if COMPUTE_DB:
        tl.store(DB_partial + pid_m * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@functools.cache
def _config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tiles of 4K elements, up to 1024 wide, 32 per thread."""
    block_n = max(4, min(triton.next_power_of_2(n), 1024))
    return max(1, 4096 // block_n), block_n, 4


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


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
            out.stride(0), p, _scale(p),
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
    scalars = (m, n, dout.stride(0), dx.stride(0), p, _scale(p))
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
