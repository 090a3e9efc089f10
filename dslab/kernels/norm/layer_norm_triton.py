"""Triton kernels for :mod:`dslab.kernels.norm.layer_norm` and the host code that launches them.

Rows are ``x2d[M, N]`` with unit stride along N; ``weight``/``bias`` are ``[N]``; statistics are
fp32 and the outputs are in the input's dtype.

Forward (one pass, each program normalizes ``BLOCK_M`` whole rows held in registers):
    h    = x + residual                      (only with a residual; stored, rounded to x's dtype)
    mean = sum(h) / N,  rstd = 1 / sqrt(sum((h - mean)^2) / N + eps)
    y    = (h - mean) * rstd * weight + bias
Memory traffic: reads x (and residual), writes y (and h), plus 8 bytes per row of statistics.

Backward (persistent: a grid sized to the programs that fit on the device at once, each looping
over row tiles), with xhat = (h - mean) * rstd and g = dy * weight:
    dh = rstd * (g - xhat * mean(g * xhat) - mean(g))  (+ the incoming gradient of h)
    dweight = sum_rows(dy * xhat),  dbias = sum_rows(dy)
Each program accumulates its rows' dweight/dbias in fp32 and writes one partial row of each into a
``[2, programs, N]`` buffer; :func:`dslab.kernels._grid.column_sums` sums both in one more launch,
in a fixed order, so results are deterministic.
Memory traffic: reads dy, h (and the gradient of h), writes dx, plus 2 * programs * N * 4 bytes of
partials written and read again.

The backward's row loop is software-pipelined (``num_stages``: the next rows' loads are in flight
while a row is reduced) and its grid is two programs per SM: on an H100 (bf16, with the incoming
gradient of h, fp32 weight and bias) this took 16384 x 768 from 51.5 to 40.3 us, 8192 x 1024 from
37.1 to 29.3 and 4096 x 1600 from 33.3 to 24.9 against one row per step, no pipelining and the
eight programs per SM that registers allow. The whole fwd+bwd is little device work next to its
host time (see :mod:`dslab.kernels.norm.layer_norm`), so each call makes few launches (forward 1,
backward 2) and few allocations.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels._launch import FastJit
from dslab.kernels._grid import column_sums, resident_programs
from dslab.kernels._grid import device_guard as _device_guard
from dslab.kernels._grid import unit_stride_rows as _rows
from dslab.kernels.dropout.bias_dropout_residual_triton import _keep_mask, _scale, _threshold

# Whole rows live in registers; wider rows go to the PyTorch reference (see layer_norm.py).
MAX_FUSED_N = 8192


@triton.jit
def _layer_norm_fwd_kernel(
    X, R, W, B, Y, H, Mean, Rstd, XB, SEED,
    M, N, stride_x, stride_r, stride_y, stride_h, eps, threshold, scale,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_XBIAS: tl.constexpr, APPLY_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    h = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_XBIAS:
        h += tl.load(XB + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if APPLY_DROPOUT:
        h = tl.where(_keep_mask(tl.load(SEED), rows, 0, threshold, BLOCK_N), h * scale, 0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h_out = (h + r).to(H.dtype.element_ty)
        tl.store(H + rows64 * stride_h + cols[None, :], h_out, mask=mask)
        # Normalize the stored (rounded) h so that backward, which reads it, sees the same input.
        h = h_out.to(tl.float32)
    mean = tl.sum(h, axis=1) / N
    centered = tl.where(mask, h - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / N
    rstd = tl.math.rsqrt(var + eps)
    tl.store(Mean + rows, mean, mask=row_mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)
    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


_FAST_LAYER_NORM_FWD = FastJit(_layer_norm_fwd_kernel)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, Hin, W, Mean, Rstd, DH, DX, Partials, DXD, SEED,
    M, N, stride_dy, stride_h, stride_dh, stride_dx, stride_dxd, threshold, scale,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr, APPLY_DROPOUT: tl.constexpr, COMPUTE_DXB: tl.constexpr,
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
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dxb_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if APPLY_DROPOUT:
        seed = tl.load(SEED)
    for tile in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=STAGES):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        h = tl.load(Hin + rows64 * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        mean_gx = tl.sum(g * xhat, axis=1) / N
        mean_g = tl.sum(g, axis=1) / N
        dx = (g - (xhat * mean_gx[:, None] + mean_g[:, None])) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(DH + rows64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx_out = dx.to(DX.dtype.element_ty)
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx_out, mask=mask)
        # The dropout side (h = residual + dropout(x + x_bias)) starts from the stored, rounded dx,
        # as a separate dropout backward reading it would.
        if APPLY_DROPOUT:
            keep = _keep_mask(seed, rows, 0, threshold, BLOCK_N)
            dxd = tl.where(keep, dx_out.to(tl.float32) * scale, 0.0)
            tl.store(DXD + rows64 * stride_dxd + cols[None, :], dxd.to(DXD.dtype.element_ty), mask=mask)
            if COMPUTE_DXB:
                dxb_acc += dxd
        elif COMPUTE_DXB:
            dxb_acc += tl.where(mask, dx_out.to(tl.float32), 0.0)
        if COMPUTE_DW:
            dw_acc += dy * xhat
        if COMPUTE_DB:
            db_acc += dy
    # Partials [COMPUTE_DW + COMPUTE_DB + COMPUTE_DXB, programs, N], slices in that order.
    if COMPUTE_DW:
        tl.store(Partials + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if COMPUTE_DB:
        db_row = pid + tl.num_programs(0) if COMPUTE_DW else pid
        tl.store(Partials + db_row.to(tl.int64) * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    if COMPUTE_DXB:
        dxb_row = pid + (COMPUTE_DW + COMPUTE_DB) * tl.num_programs(0)
        tl.store(Partials + dxb_row.to(tl.int64) * N + cols, tl.sum(dxb_acc, axis=0), mask=col_mask)


_FAST_LAYER_NORM_BWD = FastJit(_layer_norm_bwd_kernel)


@functools.cache
def _forward_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the forward: ~4K elements per program, 32 per thread.

    For N = 1024 in bf16 that is 4 rows, 4 warps, ~56 registers: 9 programs (72 KB of loads in
    flight) per Hopper SM, by sm_90 compiles of the kernel.
    """
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(64, 4096 // block_n))
    num_warps = max(1, min(16, block_m * block_n // 1024))
    return block_m, block_n, num_warps


@functools.cache
def _backward_config(n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, STAGES) of the backward: 2K elements per loop step, 4 warps up
    to rows of 1024 (8 at 2048), and four stages of loads in flight. The best of a sweep on an H100
    at 16384 x 768, 8192 x 1024 and 4096 x 1600 (1 or 2 rows, 4 or 8 warps, 1 to 4 stages, 2 to 8
    programs per SM)."""
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(64, 2048 // block_n))
    num_warps = max(4, min(16, block_n // 256))
    return block_m, block_n, num_warps, _backward_stages(block_m * block_n)


#: Shared memory the backward's pipelined loads may take: ``STAGES - 1`` tiles in flight of up to
#: three 4-byte inputs (h, dy, the gradient of h) per element. Hopper gives one program 227 KB.
_PIPELINE_BYTES = 160 * 1024


def _backward_stages(tile_elements: int) -> int:
    """Four stages while their buffered loads fit :data:`_PIPELINE_BYTES` (rows up to 4096),
    fewer for wider rows: rows of 5120 (tiles of 8192) with four stages asked for 288 KB of
    shared memory and failed to compile on an H200; they get two."""
    per_tile = 3 * 4 * tile_elements
    return max(1, min(4, 1 + _PIPELINE_BYTES // per_tile))


#: The backward's programs per SM: with pipelined loads two keep the memory busy, and fewer
#: programs write fewer dweight/dbias partials.
BACKWARD_PROGRAMS_PER_SM = 2


def forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    x_bias: torch.Tensor | None = None,
    p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(y, h or None, mean, rstd) for ``x`` [M, N]; ``h = residual + dropout(x + x_bias, p)`` when a
    residual is given (``x_bias`` [N] or None; dropout when p > 0, its mask that of
    :mod:`dslab.kernels.dropout.bias_dropout_residual_triton` for ``seed``, int64 ``[1]`` on x's device)."""
    assert x.dim() == 2 and x.shape[1] <= MAX_FUSED_N
    assert residual is not None or (x_bias is None and p == 0.0)
    m, n = x.shape
    x = _rows(x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    h = None
    if residual is not None:
        residual = _rows(residual)
        h = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y, h, mean, rstd
    block_m, block_n, num_warps = _forward_config(n)
    with _device_guard(x):
        _FAST_LAYER_NORM_FWD[(triton.cdiv(m, block_m),)](
            x, residual, weight, bias, y, h, mean, rstd, x_bias, seed if p > 0.0 else None,
            m, n, x.stride(0), residual.stride(0) if residual is not None else 0,
            y.stride(0), h.stride(0) if h is not None else 0, eps, _threshold(p), _scale(p),
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, HAS_XBIAS=x_bias is not None, APPLY_DROPOUT=p > 0.0,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y, h, mean, rstd


def backward(
    dy: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dh: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias) for the normalized input ``h`` [M, N]; ``dh`` is added to dx.

    dweight (dbias) is None when ``weight`` (``bias``) is None, else in that parameter's dtype.
    """
    dx, _, dw, db, _ = _backward(dy, h, weight, bias, mean, rstd, dh, None, 0.0, None, False)
    return dx, dw, db


def backward_dropout_add(
    dy: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dh: torch.Tensor | None,
    x_bias: torch.Tensor | None,
    p: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The backward of ``forward`` with a residual, ``x_bias`` and dropout ``p``:
    ``(dresidual, dx, dweight, dbias, dx_bias)``. ``dresidual`` is h's whole gradient (the layer
    norm's plus ``dh``); ``dx = dropout_mask * dresidual / (1 - p)`` (``dresidual`` itself when
    p == 0); ``dx_bias`` its column sums, None without an ``x_bias``."""
    return _backward(dy, h, weight, bias, mean, rstd, dh, x_bias, p, seed, True)


def _backward(dy, h, weight, bias, mean, rstd, dh, x_bias, p, seed, dropout_side):
    m, n = h.shape
    dy, h = _rows(dy), _rows(h)
    dh = _rows(dh) if dh is not None else None
    dx = torch.empty((m, n), dtype=h.dtype, device=h.device)
    apply_dropout = dropout_side and p > 0.0
    dxd = torch.empty((m, n), dtype=h.dtype, device=h.device) if apply_dropout else dx
    if m == 0:
        zeros = [torch.zeros_like(t) if t is not None else None for t in (weight, bias, x_bias)]
        return dx, dxd, *zeros
    block_m, block_n, num_warps, stages = _backward_config(n)
    grads = [t for t in (weight, bias, x_bias) if t is not None]
    meta = dict(
        HAS_DH=dh is not None, HAS_WEIGHT=weight is not None, COMPUTE_DW=weight is not None,
        COMPUTE_DB=bias is not None, APPLY_DROPOUT=apply_dropout, COMPUTE_DXB=x_bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, num_warps=num_warps,
    )
    strides = (dy.stride(0), h.stride(0), dh.stride(0) if dh is not None else 0, dx.stride(0), dxd.stride(0))
    scalars = (*strides, _threshold(p), _scale(p))
    seed = seed if apply_dropout else None
    with _device_guard(h):
        # The partials' size depends on the grid: the occupancy query compiles the same
        # specialization with `mean` (fp32, aligned) standing in for them.
        def probe_args():
            return dy, h, weight, mean, rstd, dh, dx, mean if grads else None, dxd, seed, m, n, *scalars

        key = ("layer_norm_bwd", n, dy.dtype, h.dtype, weight.dtype if weight is not None else None,
               dh is not None, weight is not None, bias is not None, apply_dropout, x_bias is not None)
        resident = resident_programs(_layer_norm_bwd_kernel, probe_args, meta, key, h.device)
        if h.device.type == "cuda":
            sms = torch.cuda.get_device_properties(h.device).multi_processor_count
            resident = min(resident, BACKWARD_PROGRAMS_PER_SM * sms)
        programs = min(triton.cdiv(m, block_m), resident)
        partials = (torch.empty((len(grads), programs, n), dtype=torch.float32, device=h.device)
                    if grads else None)
        _FAST_LAYER_NORM_BWD[(programs,)](
            dy, h, weight, mean, rstd, dh, dx, partials, dxd, seed, m, n, *scalars, **meta)
        sums = iter(column_sums(partials, tuple(t.dtype for t in grads)) if grads else ())
    dw, db, dxb = (next(sums) if t is not None else None for t in (weight, bias, x_bias))
    return dx, dxd, dw, db, dxb
