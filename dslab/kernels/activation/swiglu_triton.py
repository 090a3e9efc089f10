"""Triton kernels for :mod:`dslab.kernels.activation.swiglu` and the host code that launches them.

Rows are ``x2d[M, 2I]`` with unit stride along the columns and any row stride; column ``c < I``
of a row is the gate g, column ``I + c`` the up projection u. Math is fp32, outputs are in x's
dtype. With s = sigmoid(g) and sigmoid(-g) = 1 - s taken from ``_sigmoid_parts`` (of
:mod:`dslab.kernels.activation.bias_gelu_triton`; neither by subtraction from 1):

    y  = silu(g) * u = g * s * u
    dg = dy * u * silu'(g),  silu'(g) = s + g * s * sigmoid(-g)
    du = dy * silu(g)

fp32 outputs take the precise sigmoid (two exponentials, IEEE divisions); 16-bit outputs the
one-exponential, approximate-reciprocal one, whose error (2 ulp of fp32) is far below their
rounding, so that their kernels stay bound by memory rather than by instruction issue.

Each program owns a ``BLOCK_M x BLOCK_N`` tile of the ``[M, I]`` output columns and reads the
matching g and u tiles. Forward reads g and u and writes y: 3 * M * I elements. Backward reads
dy, g and u and writes dg and du (dx ``[M, 2I]``, contiguous): 5 * M * I elements. Neither
reduces across rows, so both are one launch on a plain 2-D grid.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels._launch import FastJit
from dslab.kernels._grid import device_guard as _device_guard
from dslab.kernels._grid import unit_stride_rows as _rows
from dslab.kernels.activation.bias_gelu_triton import _sigmoid_parts


@triton.jit
def _swiglu_fwd_kernel(
    X, Y, M, I, stride_x, stride_y,
    PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate_ptrs = X + rows64 * stride_x + cols[None, :]
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    sig, _ = _sigmoid_parts(g, PRECISE)
    y = g * sig * u
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


_FAST_SWIGLU_FWD = FastJit(_swiglu_fwd_kernel)


@triton.jit
def _swiglu_bwd_kernel(
    DY, X, DX, M, I, stride_dy, stride_x, stride_dx,
    PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate_ptrs = X + rows64 * stride_x + cols[None, :]
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig, sig_neg = _sigmoid_parts(g, PRECISE)
    silu = g * sig
    dsilu = sig + silu * sig_neg
    dgate_ptrs = DX + rows64 * stride_dx + cols[None, :]
    tl.store(dgate_ptrs, (dy * u * dsilu).to(DX.dtype.element_ty), mask=mask)
    tl.store(dgate_ptrs + I, (dy * silu).to(DX.dtype.element_ty), mask=mask)


_FAST_SWIGLU_BWD = FastJit(_swiglu_bwd_kernel)


@functools.cache
def _config(half: int, backward: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): output tiles of 4K elements, up to 1024 wide; 4 warps
    forward (two fp32 input tiles, 32 elements each per thread) and 8 backward (three input
    tiles, 16 elements each per thread)."""
    block_n = min(triton.next_power_of_2(half), 1024)
    return max(1, 4096 // block_n), block_n, 8 if backward else 4


def _split_width(x: torch.Tensor) -> int:
    width = x.shape[1]
    assert width % 2 == 0, "x must have an even last dimension (checked by swiglu)"
    return width // 2


def forward(x: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for ``x`` [M, 2I] → y [M, I], contiguous."""
    m, half = x.shape[0], _split_width(x)
    x = _rows(x)
    y = torch.empty((m, half), dtype=x.dtype, device=x.device)
    if m == 0 or half == 0:
        return y
    block_m, block_n, num_warps = _config(half, False)
    with _device_guard(x):
        _FAST_SWIGLU_FWD[(triton.cdiv(m, block_m), triton.cdiv(half, block_n))](
            x, y, m, half, x.stride(0), y.stride(0),
            PRECISE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y


def backward(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dx = [dg | du] [M, 2I], contiguous, for ``dy`` [M, I] and the forward's ``x`` [M, 2I]."""
    m, half = x.shape[0], _split_width(x)
    dy, x = _rows(dy), _rows(x)
    dx = torch.empty((m, 2 * half), dtype=x.dtype, device=x.device)
    if m == 0 or half == 0:
        return dx
    block_m, block_n, num_warps = _config(half, True)
    with _device_guard(x):
        _FAST_SWIGLU_BWD[(triton.cdiv(m, block_m), triton.cdiv(half, block_n))](
            dy, x, dx, m, half, dy.stride(0), x.stride(0), dx.stride(0),
            PRECISE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return dx
