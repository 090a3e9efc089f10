"""Triton kernels for :mod:`dslab.kernels.activation.bias_gelu` and the host code that launches them.

Rows are ``x2d[M, N]`` with unit stride along N, ``bias`` is ``[N]``; math is fp32, outputs are in
x's dtype. With u = x + bias:

    exact ("none"):  gelu(u) = u * Phi(u) = 0.5 * u * (1 + erf(u / sqrt(2)))
                     gelu'(u) = Phi(u) + u * exp(-u^2 / 2) / sqrt(2 * pi)
    "tanh":          gelu(u) = 0.5 * u * (1 + tanh(s / 2)) = u * sigmoid(s),
                     s = 2 * sqrt(2 / pi) * (u + 0.044715 * u^3)
                     gelu'(u) = sig + u * sig * sigmoid(-s) * ds/du,  sig = sigmoid(s)

Forward reads x (and bias, cached) and writes y: 2 * M * N elements. Backward recomputes u from x
and bias, reads dy and x, writes dx: 3 * M * N elements. The bias gradient sum_rows(dx) is
accumulated per program in fp32 (a grid sized to the programs resident on the device, each
looping over row tiles) and the ``[programs, N]`` partials are summed in a fixed order
(:mod:`dslab.kernels._grid`).
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from dslab.kernels._launch import FastJit
from dslab.kernels._grid import column_sums, resident_programs
from dslab.kernels._grid import device_guard as _device_guard
from dslab.kernels._grid import unit_stride_rows as _rows

# div.approx.f32 (reciprocal and multiply) through tl.math.fdiv(approx=True), newer Triton only.
_HAS_APPROX_DIV = tl.constexpr("approx" in inspect.signature(tl.math.fdiv).parameters)


@triton.jit
def _erf_rational(x, APPROX_DIV: tl.constexpr):
    """erf(x) within 3e-6 (absolute) everywhere: x * P(x^2) / Q(x^2) on [-4, 4], a rational fit
    made for dslab (least squares with minimax reweighting); beyond 4 erf is 1 - 2e-8.

    Half the instructions of libdevice's erff (which selects between two coefficient sets per
    element); used for 16-bit outputs, whose rounding error (at least 2.4e-4 relative) dwarfs
    3e-6, so that the bf16 forward stays bound by memory rather than by instruction issue.
    """
    x = tl.minimum(tl.maximum(x, -4.0), 4.0)
    t = x * x
    p = tl.fma(t, -2.3219905415317044e-05, -0.0002643451443873346)
    p = tl.fma(p, t, 0.041155990213155746)
    p = tl.fma(p, t, 0.12682032585144043)
    p = tl.fma(p, t, 1.128393292427063)
    q = tl.fma(t, -0.0002571808872744441, 0.007660938426852226)
    q = tl.fma(q, t, 0.0847570151090622)
    q = tl.fma(q, t, 0.4458457827568054)
    q = tl.fma(q, t, 1.0)
    if APPROX_DIV:  # 2 ulp, and q is in [1, 45]: far below the 16-bit rounding this serves
        return tl.math.fdiv(x * p, q, approx=True)
    else:
        return x * p / q


@triton.jit
def _sigmoid_parts(s, PRECISE: tl.constexpr):
    """(sigmoid(s), sigmoid(-s)) in fp32, neither by subtraction from 1 (no cancellation where one
    is close to 1). ``PRECISE``: two exponentials and IEEE divisions; else one exponential, one
    approximate reciprocal (2 ulp, where 16-bit outputs round at 2**-9 or coarser) and
    ``sigmoid(-s) = e * sigmoid(s)`` with ``e = exp(-s)``, s clamped at -80 so that e stays finite
    (sigmoid(-80) is 2e-35: the clamp changes no 16-bit result)."""
    if PRECISE:
        return 1.0 / (1.0 + tl.exp(-s)), 1.0 / (1.0 + tl.exp(s))
    else:
        e = tl.exp(-tl.maximum(s, -80.0))
        if _HAS_APPROX_DIV:
            sig = tl.math.fdiv(1.0, 1.0 + e, approx=True)
        else:
            sig = 1.0 / (1.0 + e)
        return sig, e * sig


@triton.jit
def _gelu_and_grad(u, APPROX_TANH: tl.constexpr, PRECISE: tl.constexpr, NEED_GRAD: tl.constexpr):
    """(gelu(u), gelu'(u)) in fp32; the second is 0 unless NEED_GRAD. ``PRECISE`` (fp32 outputs):
    libdevice's erf and IEEE divisions; else the rational erf and the approximate sigmoid, which
    keep the 16-bit kernels bound by memory rather than by instruction issue."""
    if APPROX_TANH:
        # 1.5957691216057308 = 2 * sqrt(2 / pi)
        s = 1.5957691216057308 * (u + 0.044715 * u * u * u)
        sig, one_minus_sig = _sigmoid_parts(s, PRECISE)
        y = u * sig
        if NEED_GRAD:
            ds_du = 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * u * u)
            grad = sig + u * sig * one_minus_sig * ds_du
        else:
            grad = 0.0
    else:
        # 0.7071067811865476 = 1 / sqrt(2); 0.3989422804014327 = 1 / sqrt(2 * pi)
        if PRECISE:
            erf = tl.math.erf(u * 0.7071067811865476)
        else:
            erf = _erf_rational(u * 0.7071067811865476, _HAS_APPROX_DIV)
        cdf = 0.5 * (1.0 + erf)
        y = u * cdf
        if NEED_GRAD:
            grad = cdf + u * 0.3989422804014327 * tl.exp(-0.5 * u * u)
        else:
            grad = 0.0
    return y, grad


@triton.jit
def _bias_gelu_fwd_kernel(
    X, B, Y, M, N, stride_x, stride_y,
    HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr, PRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    u = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y, _ = _gelu_and_grad(u, APPROX_TANH, PRECISE, False)
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


_FAST_BIAS_GELU_FWD = FastJit(_bias_gelu_fwd_kernel)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY, X, B, DX, DB_partial, M, N, stride_dy, stride_x, stride_dx,
    HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr, PRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in tl.range(pid_m, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        u = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            u += b[None, :]
        _, grad = _gelu_and_grad(u, APPROX_TANH, PRECISE, True)
        dx = dy * grad
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            db_acc += dx
    if HAS_BIAS:
        tl.store(DB_partial + pid_m * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


_FAST_BIAS_GELU_BWD = FastJit(_bias_gelu_bwd_kernel)


@functools.cache
def _config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tiles of 4K elements, up to 1024 wide, 32 per thread."""
    block_n = min(triton.next_power_of_2(n), 1024)
    return max(1, 4096 // block_n), block_n, 4


def forward(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """gelu(x + bias) for ``x`` [M, N]."""
    m, n = x.shape
    x = _rows(x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n, num_warps = _config(n)
    with _device_guard(x):
        _FAST_BIAS_GELU_FWD[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            x, bias, y, m, n, x.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, APPROX_TANH=approximate == "tanh",
            PRECISE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y


def backward(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dbias) for ``x`` [M, N]; dbias is None without a bias, else in bias's dtype."""
    m, n = x.shape
    dy, x = _rows(dy), _rows(x)
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return dx, (torch.zeros_like(bias) if bias is not None else None)
    block_m, block_n, num_warps = _config(n)
    row_tiles, col_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    meta = dict(HAS_BIAS=bias is not None, APPROX_TANH=approximate == "tanh",
                PRECISE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=num_warps)
    strides = (dy.stride(0), x.stride(0), dx.stride(0))
    with _device_guard(x):
        if bias is None:
            _FAST_BIAS_GELU_BWD[(row_tiles, col_tiles)](dy, x, None, dx, None, m, n, *strides, **meta)
            return dx, None
        # The partials' size depends on the grid: the occupancy query compiles the same
        # specialization with an aligned fp32 tensor standing in for them.
        def probe_args():
            stand_in = torch.empty(1, dtype=torch.float32, device=x.device)
            return dy, x, bias, dx, stand_in, m, n, *strides

        key = ("bias_gelu_bwd", n, dy.dtype, x.dtype, bias.dtype, approximate)
        resident = resident_programs(_bias_gelu_bwd_kernel, probe_args, meta, key, x.device)
        row_programs = min(row_tiles, max(1, resident // col_tiles))
        db_partial = torch.empty((1, row_programs, n), dtype=torch.float32, device=x.device)
        _FAST_BIAS_GELU_BWD[(row_programs, col_tiles)](dy, x, bias, dx, db_partial, m, n, *strides, **meta)
        (db,) = column_sums(db_partial, (bias.dtype,))
    return dx, db
