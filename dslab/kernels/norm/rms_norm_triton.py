"""Triton kernels for :mod:`dslab.kernels.norm.rms_norm` and the host code that launches them.

Rows are ``x2d[M, N]`` with unit stride along N (any row stride); ``weight`` is ``[N]``; ``rstd``
is fp32 ``[M]`` and the outputs are in the input's dtype.

Forward (one pass, each program normalizes ``BLOCK_M`` whole rows held in registers):
    h    = x + residual                      (only with a residual; stored, rounded to x's dtype)
    rstd = 1 / sqrt(sum(h^2) / N + eps)
    y    = h * rstd * weight
Memory traffic: reads x (and residual), writes y (and h), plus 4 bytes per row of ``rstd``.

Backward (persistent: a grid sized to the programs that fit on the device at once, each looping
over row tiles), with g = dy * weight:
    dh = rstd * (g - h * rstd^2 * mean(g * h))     (+ the incoming gradient of h)
    dweight = sum_rows(dy * h * rstd)
Each program accumulates its rows' dweight in fp32 and writes one partial row into a
``[1, programs, N]`` buffer; :func:`dslab.kernels._grid.column_sums` sums it in one more launch, in
a fixed order, so results are deterministic.
Memory traffic: reads dy, h (and the gradient of h), writes dx, plus 2 * programs * N * 4 bytes of
partials written and read again.

The launch configurations (rows per program, warps, pipeline stages, programs per SM) are layer
norm's (:mod:`dslab.kernels.norm.layer_norm_triton`, where they were measured): per element the
kernels load and store the same tensors, with one row reduction fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dslab.kernels._launch import FastJit
from dslab.kernels._grid import column_sums, resident_programs
from dslab.kernels._grid import device_guard as _device_guard
from dslab.kernels._grid import unit_stride_rows as _rows
from dslab.kernels.norm.layer_norm_triton import BACKWARD_PROGRAMS_PER_SM, _backward_config, _forward_config

# Whole rows live in registers; wider rows go to the PyTorch reference (see rms_norm.py).
MAX_FUSED_N = 8192


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, W, Y, H, Rstd,
    M, N, stride_x, stride_r, stride_y, stride_h, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    h = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h_out = (h + r).to(H.dtype.element_ty)
        tl.store(H + rows64 * stride_h + cols[None, :], h_out, mask=mask)
        # Normalize the stored (rounded) h so that backward, which reads it, sees the same input.
        h = h_out.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / N + eps)
    tl.store(Rstd + rows, rstd, mask=row_mask)
    y = h * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


_FAST_RMS_NORM_FWD = FastJit(_rms_norm_fwd_kernel)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, Hin, W, Rstd, DH, DX, Partials,
    M, N, stride_dy, stride_h, stride_dh, stride_dx,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    # Accumulated in the tiles' own layout and reduced over rows once at the end: a per-step
    # reduction would cross warps (shared memory and barriers) on every iteration.
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=STAGES):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        h = tl.load(Hin + rows64 * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)[:, None]
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        mean_gh = tl.sum(g * h, axis=1)[:, None] / N
        dx = rstd * (g - h * (rstd * rstd * mean_gh))
        if HAS_DH:
            dx += tl.load(DH + rows64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw_acc += dy * h * rstd
    if HAS_WEIGHT:
        tl.store(Partials + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


_FAST_RMS_NORM_BWD = FastJit(_rms_norm_bwd_kernel)


def forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, h or None, rstd) for ``x`` [M, N]; ``h = x + residual`` when a residual is given."""
    assert x.dim() == 2 and x.shape[1] <= MAX_FUSED_N
    m, n = x.shape
    x = _rows(x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    h = None
    if residual is not None:
        residual = _rows(residual)
        h = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y, h, rstd
    block_m, block_n, num_warps = _forward_config(n)
    with _device_guard(x):
        _FAST_RMS_NORM_FWD[(triton.cdiv(m, block_m),)](
            x, residual, weight, y, h, rstd,
            m, n, x.stride(0), residual.stride(0) if residual is not None else 0,
            y.stride(0), h.stride(0) if h is not None else 0, eps,
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y, h, rstd


def backward(
    dy: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dh: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dweight) for the normalized input ``h`` [M, N]; ``dh`` is added to dx.

    dweight is None when ``weight`` is None, else in the weight's dtype.
    """
    m, n = h.shape
    dy, h = _rows(dy), _rows(h)
    dh = _rows(dh) if dh is not None else None
    dx = torch.empty((m, n), dtype=h.dtype, device=h.device)
    if m == 0:
        return dx, torch.zeros_like(weight) if weight is not None else None
    block_m, block_n, num_warps, stages = _backward_config(n)
    meta = dict(
        HAS_DH=dh is not None, HAS_WEIGHT=weight is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, num_warps=num_warps,
    )
    strides = (dy.stride(0), h.stride(0), dh.stride(0) if dh is not None else 0, dx.stride(0))
    with _device_guard(h):
        # The partials' size depends on the grid: the occupancy query compiles the same
        # specialization with `rstd` (fp32, aligned) standing in for them.
        def probe_args():
            return dy, h, weight, rstd, dh, dx, rstd if weight is not None else None, m, n, *strides

        key = ("rms_norm_bwd", n, dy.dtype, h.dtype, weight.dtype if weight is not None else None,
               dh is not None, weight is not None)
        resident = resident_programs(_rms_norm_bwd_kernel, probe_args, meta, key, h.device)
        if h.device.type == "cuda":
            sms = torch.cuda.get_device_properties(h.device).multi_processor_count
            resident = min(resident, BACKWARD_PROGRAMS_PER_SM * sms)
        programs = min(triton.cdiv(m, block_m), resident)
        partials = (torch.empty((1, programs, n), dtype=torch.float32, device=h.device)
                    if weight is not None else None)
        _FAST_RMS_NORM_BWD[(programs,)](dy, h, weight, rstd, dh, dx, partials, m, n, *strides, **meta)
        dw = column_sums(partials, (weight.dtype,))[0] if weight is not None else None
    return dx, dw
