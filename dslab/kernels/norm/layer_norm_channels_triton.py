"""Triton kernels for :mod:`dslab.kernels.norm.layer_norm_channels` and the host code that launches them.

``x`` is ``[B, C, P]`` (channels first, unit stride along the positions P, any batch and channel
strides); ``y`` and its gradient ``dy`` are ``[B, P, C]`` (channels last; y contiguous, dy with any
strides); ``mean``/``rstd`` are fp32 ``[B, P]``; ``weight``/``bias`` ``[C]`` in x's dtype or fp32.
All math is fp32.

Forward: one program per ``[C, BLOCK_P]`` tile of one batch element (grid ``(P tiles, B)``), the
whole channel column of each position in registers. The tile is loaded along P (each channel's
BLOCK_P positions are contiguous in x) and stored along C (the tile is one contiguous
``BLOCK_P * C`` run of y): the store's pointers are contiguous along the channel axis, so Triton's
coalescing pass gives the store its own layout, and the transpose between the two happens in
shared memory.
    mean = sum_c(x) / C,  rstd = 1 / sqrt(sum_c((x - mean)^2) / C + eps)
    y    = (x - mean) * rstd * weight + bias
Memory traffic: reads x, writes y (2 B C P elements), plus 8 bytes of statistics per position.

Backward (persistent: a grid sized to the programs resident on the device, each looping over the
``(b, P tile)`` tiles), with xhat = (x - mean) * rstd and g = dy * weight; dy is loaded along C, dx
stored along P:
    dx = rstd * (g - xhat * mean_c(g * xhat) - mean_c(g))
    dweight = sum_{b,p}(dy * xhat),  dbias = sum_{b,p}(dy)
Each program keeps its share of dweight/dbias in fp32 and writes one ``[C]`` row of partials per
parameter; :func:`dslab.kernels._grid.column_sums` adds them up in a fixed order (deterministic).
Memory traffic: reads x and dy, writes dx (3 B C P elements), plus the statistics and
``2 * programs * C * 4`` bytes of partials.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import column_sums, resident_programs
from dslab.kernels._grid import device_guard as _device_guard
from dslab.kernels._triton_compat import cast_rounding
from dslab.kernels.dispatch import interpreting

# Whole channel columns live in registers; wider ones are refused (see layer_norm_channels.py).
MAX_CHANNELS = 256


@triton.jit
def _ln_channels_fwd_kernel(
    X, W, Bias, Y, Mean, Rstd,
    C, P, stride_xb, stride_xc, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.arange(0, BLOCK_C)
    p_mask = p < P
    c_mask = c < C
    mask = c_mask[:, None] & p_mask[None, :]
    c64 = c.to(tl.int64)[:, None]
    p64 = p.to(tl.int64)[None, :]
    x = tl.load(X + b * stride_xb + c64 * stride_xc + p64, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / C
    centered = tl.where(mask, x - mean[None, :], 0.0)
    var = tl.sum(centered * centered, axis=0) / C
    rstd = tl.math.rsqrt(var + eps)
    tl.store(Mean + b * P + p, mean, mask=p_mask)
    tl.store(Rstd + b * P + p, rstd, mask=p_mask)
    y = centered * rstd[None, :]
    if HAS_WEIGHT:
        y = y * tl.load(W + c, mask=c_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        y = y + tl.load(Bias + c, mask=c_mask, other=0.0).to(tl.float32)[:, None]
    # y[b, p, c]: contiguous along c, so the store is laid out (and coalesced) along the channels.
    tl.store(Y + b * P * C + p64 * C + c64, cast_rounding(y, Y.dtype.element_ty, BF16_BY_HAND), mask=mask)


@triton.jit
def _ln_channels_bwd_kernel(
    DY, X, W, Mean, Rstd, DX, Partials,
    B, C, P, stride_xb, stride_xc, sd_b, sd_p, sd_c,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BF16_BY_HAND: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    c_mask = c < C
    c64 = c.to(tl.int64)[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + c, mask=c_mask, other=0.0).to(tl.float32)
    # Accumulated in the tiles' own layout and reduced over positions once at the end (as in
    # layer_norm_triton): no reduction inside the loop beyond the two per-position ones dx needs.
    dw_acc = tl.zeros([BLOCK_C, BLOCK_P], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_C, BLOCK_P], dtype=tl.float32)
    p_tiles = tl.cdiv(P, BLOCK_P)
    for tile in tl.range(pid, B * p_tiles, tl.num_programs(0)):
        b = (tile // p_tiles).to(tl.int64)
        p = (tile % p_tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
        p_mask = p < P
        mask = c_mask[:, None] & p_mask[None, :]
        p64 = p.to(tl.int64)[None, :]
        x = tl.load(X + b * stride_xb + c64 * stride_xc + p64, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + b * sd_b + p64 * sd_p + c64 * sd_c, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + b * P + p, mask=p_mask, other=0.0)
        rstd = tl.load(Rstd + b * P + p, mask=p_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[None, :]) * rstd[None, :], 0.0)
        if HAS_WEIGHT:
            g = dy * w[:, None]
        else:
            g = dy
        mean_gx = tl.sum(g * xhat, axis=0) / C
        mean_g = tl.sum(g, axis=0) / C
        dx = (g - (xhat * mean_gx[None, :] + mean_g[None, :])) * rstd[None, :]
        tl.store(DX + b * C * P + c64 * P + p64, cast_rounding(dx, DX.dtype.element_ty, BF16_BY_HAND),
                 mask=mask)
        if COMPUTE_DW:
            dw_acc += dy * xhat
        if COMPUTE_DB:
            db_acc += dy
    # Partials [COMPUTE_DW + COMPUTE_DB, programs, C]: dweight's slice first.
    if COMPUTE_DW:
        tl.store(Partials + pid * C + c, tl.sum(dw_acc, axis=1), mask=c_mask)
    if COMPUTE_DB:
        db_row = pid + tl.num_programs(0) if COMPUTE_DW else pid
        tl.store(Partials + db_row.to(tl.int64) * C + c, tl.sum(db_acc, axis=1), mask=c_mask)


@functools.cache
def _forward_config(c: int) -> tuple[int, int, int]:
    """(BLOCK_C, BLOCK_P, num_warps) of the forward: ~8K-element tiles, 32 elements per thread.

    For C = 128 that is 64 positions (a 128-byte line of each bf16 channel row read, a contiguous
    16 KB run of y written) and 8 warps.
    """
    block_c = triton.next_power_of_2(c)
    block_p = max(16, min(128, 8192 // block_c))
    num_warps = max(1, min(8, block_c * block_p // 1024))
    return block_c, block_p, num_warps


@functools.cache
def _backward_config(c: int) -> tuple[int, int, int]:
    """(BLOCK_C, BLOCK_P, num_warps) of the backward: ~4K-element steps, 16 per thread.

    Backward holds x, dy, weight and two accumulators per element, so the steps are half the
    forward's tiles: for C = 128, 32 positions (64 bytes of each bf16 channel row) and 8 warps.
    """
    block_c = triton.next_power_of_2(c)
    block_p = max(16, min(128, 4096 // block_c))
    num_warps = max(1, min(8, block_c * block_p // 512))
    return block_c, block_p, num_warps


def _bf16_by_hand(dtype: torch.dtype) -> bool:
    return interpreting() and dtype == torch.bfloat16


def channels_first_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, C, P]`` with unit stride along P (a copy only when it lacks one)."""
    return x if x.shape[2] <= 1 or x.stride(2) == 1 else x.contiguous()


def forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y ``[B, P, C]`` contiguous in x's dtype, mean, rstd fp32 ``[B, P]``) for ``x`` ``[B, C, P]``."""
    assert x.dim() == 3 and 0 < x.shape[1] <= MAX_CHANNELS
    b, c, p = x.shape
    x = channels_first_rows(x)
    y = torch.empty((b, p, c), dtype=x.dtype, device=x.device)
    mean = torch.empty((b, p), dtype=torch.float32, device=x.device)
    rstd = torch.empty((b, p), dtype=torch.float32, device=x.device)
    if b == 0 or p == 0:
        return y, mean, rstd
    block_c, block_p, num_warps = _forward_config(c)
    with _device_guard(x):
        _ln_channels_fwd_kernel[(triton.cdiv(p, block_p), b)](
            x, weight, bias, y, mean, rstd, c, p, x.stride(0), x.stride(1), eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BF16_BY_HAND=_bf16_by_hand(x.dtype),
            BLOCK_C=block_c, BLOCK_P=block_p, num_warps=num_warps,
        )
    return y, mean, rstd


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx ``[B, C, P]`` contiguous in x's dtype, dweight, dbias) for ``x`` ``[B, C, P]`` and
    ``dy`` ``[B, P, C]`` (any strides). dweight (dbias) is None when ``weight`` (``bias``) is None,
    else in that parameter's dtype."""
    b, c, p = x.shape
    x = channels_first_rows(x)
    dx = torch.empty((b, c, p), dtype=x.dtype, device=x.device)
    if b == 0 or p == 0:
        dw = torch.zeros_like(weight) if weight is not None else None
        db = torch.zeros_like(bias) if bias is not None else None
        return dx, dw, db
    block_c, block_p, num_warps = _backward_config(c)
    grads = [t for t in (weight, bias) if t is not None]
    meta = dict(
        HAS_WEIGHT=weight is not None, COMPUTE_DW=weight is not None, COMPUTE_DB=bias is not None,
        BF16_BY_HAND=_bf16_by_hand(x.dtype), BLOCK_C=block_c, BLOCK_P=block_p, num_warps=num_warps,
    )
    sizes = (b, c, p, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dy.stride(2))
    tiles = b * triton.cdiv(p, block_p)
    with _device_guard(x):
        if not grads:
            _ln_channels_bwd_kernel[(tiles,)](dy, x, weight, mean, rstd, dx, None, *sizes, **meta)
            return dx, None, None

        # The partials' size depends on the grid: the occupancy query compiles the same
        # specialization with `mean` (fp32, aligned) standing in for them.
        def probe_args():
            return dy, x, weight, mean, rstd, dx, mean, *sizes

        key = ("layer_norm_channels_first_bwd", c, dy.dtype, x.dtype,
               weight.dtype if weight is not None else None, weight is not None, bias is not None)
        resident = resident_programs(_ln_channels_bwd_kernel, probe_args, meta, key, x.device)
        programs = min(tiles, resident)
        partials = torch.empty((len(grads), programs, c), dtype=torch.float32, device=x.device)
        _ln_channels_bwd_kernel[(programs,)](dy, x, weight, mean, rstd, dx, partials, *sizes, **meta)
        sums = column_sums(partials, tuple(t.dtype for t in grads))
    if weight is None:
        return dx, None, sums[0]
    return dx, sums[0], sums[1] if bias is not None else None
