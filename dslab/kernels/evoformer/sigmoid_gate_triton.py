"""Triton kernels for :mod:`dslab.kernels.evoformer.sigmoid_gate` and the host code that launches them.

The rows of ``gate`` and ``x`` are ``[M, N]`` with unit stride along N (any row stride: a column
slice of a wider projection is read in place), ``M = B * P``. The output and its gradient are
addressed as ``[B, P, N]`` through three strides, so one kernel writes either layout:

    rows            y[b, p, n] at (b * P + p) * N + n        (x's shape)
    channels_first  y[b, n, p] at b * N * P + n * P + p      (``[B, N, *S]``)

The grid is ``(P tiles, N tiles, B)``, so that the row index within a batch is a contiguous range
and Triton's coalescing pass can lay a channels-first store out along P. Math is fp32; with
``s = sigmoid(g + gb)``, ``u = x + xb`` and ``m`` the row's mask:

    y  = s * u * m
    dx = dy * m * s          dg = dy * m * u * s * (1 - s)
    dxb = sum_rows dx        dgb = sum_rows dg

Forward reads g, x and writes y (3 M N elements); backward reads dy, g, x and writes dg, dx (5 M N).
The bias gradients are accumulated per program in fp32 over a grid sized to the programs resident
on the device and summed in a fixed order (:mod:`dslab.kernels._grid`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import column_sums, resident_programs
from dslab.kernels._grid import device_guard as _device_guard


@triton.jit
def _gate_tile(G, X, GB, XB, MASK, rows64, cols, mask, col_mask, stride_g, stride_x,
               HAS_GB: tl.constexpr, HAS_XB: tl.constexpr, HAS_MASK: tl.constexpr, row_mask):
    """(sigmoid(g + gb), x + xb, m) for one tile, fp32."""
    g = tl.load(G + rows64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_GB:
        g += tl.load(GB + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_XB:
        u += tl.load(XB + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    s = 1.0 / (1.0 + tl.exp(-g))
    if HAS_MASK:
        m = tl.load(MASK + rows64, mask=row_mask[:, None], other=0.0).to(tl.float32)
    else:
        m = tl.full([1, 1], 1.0, tl.float32)
    return s, u, m


@triton.jit
def _sigmoid_gate_fwd_kernel(
    G, X, GB, XB, MASK, Y, P, N, stride_g, stride_x, sy_b, sy_p, sy_n,
    HAS_GB: tl.constexpr, HAS_XB: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(2)
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    row_mask = p < P
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = (b.to(tl.int64) * P + p)[:, None]
    s, u, m = _gate_tile(G, X, GB, XB, MASK, rows64, cols, mask, col_mask, stride_g, stride_x,
                         HAS_GB, HAS_XB, HAS_MASK, row_mask)
    y = s * u * m
    offs = b.to(tl.int64) * sy_b + p.to(tl.int64)[:, None] * sy_p + cols[None, :] * sy_n
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _sigmoid_gate_bwd_kernel(
    DY, G, X, GB, XB, MASK, DG, DX, PARTIAL, B, P, N, stride_g, stride_x, sd_b, sd_p, sd_n,
    HAS_GB: tl.constexpr, HAS_XB: tl.constexpr, HAS_MASK: tl.constexpr, BIAS_GRADS: tl.constexpr,
    TILE_SUMS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    p_tiles = tl.cdiv(P, BLOCK_P)
    if TILE_SUMS:
        dgb = tl.zeros([BLOCK_N], dtype=tl.float32)
        dxb = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        dgb = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        dxb = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for tile in tl.range(pid, B * p_tiles, tl.num_programs(0)):
        b = tile // p_tiles
        p = (tile % p_tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
        row_mask = p < P
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = (b.to(tl.int64) * P + p)[:, None]
        s, u, m = _gate_tile(G, X, GB, XB, MASK, rows64, cols, mask, col_mask, stride_g, stride_x,
                             HAS_GB, HAS_XB, HAS_MASK, row_mask)
        offs = b.to(tl.int64) * sd_b + p.to(tl.int64)[:, None] * sd_p + cols[None, :] * sd_n
        t = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32) * m
        dx = t * s
        dg = dx * u * (1.0 - s)
        tl.store(DX + rows64 * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DG + rows64 * N + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
        if BIAS_GRADS:
            if TILE_SUMS:
                dgb += tl.sum(dg, axis=0)
                dxb += tl.sum(dx, axis=0)
            else:
                dgb += dg
                dxb += dx
    if BIAS_GRADS:
        programs = tl.num_programs(0)
        if TILE_SUMS:
            tl.store(PARTIAL + pid * N + cols, dgb, mask=col_mask)
            tl.store(PARTIAL + (programs + pid) * N + cols, dxb, mask=col_mask)
        else:
            tl.store(PARTIAL + pid * N + cols, tl.sum(dgb, axis=0), mask=col_mask)
            tl.store(PARTIAL + (programs + pid) * N + cols, tl.sum(dxb, axis=0), mask=col_mask)


def _config(n: int, channels_first: bool) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_N, num_warps): 4K-element tiles; channels-first tiles are square-ish, so
    that the transposed store writes 64 contiguous elements or more per column."""
    block_n = min(triton.next_power_of_2(n), 64 if channels_first else 1024)
    return max(1, 4096 // block_n), block_n, 4


def _bwd_config(n: int, channels_first: bool) -> tuple[int, int, int, bool]:
    """(BLOCK_P, BLOCK_N, num_warps, TILE_SUMS) of the backward. Channels first it reads dy
    transposed and keeps 2K-element tiles whose bias-gradient partials are summed per tile
    (``[BLOCK_N]`` accumulators): on an H200 at ``[65536, 128]`` bf16 with both biases and a mask
    this took 38 us a call against 53 us with 4K tiles and ``[BLOCK_P, BLOCK_N]`` accumulators
    (CUDA-graph timing; 21 us is the traffic at 4 TB/s). Rows keep the forward's tiles, where
    that change measured slower."""
    if channels_first:
        block_n = min(triton.next_power_of_2(n), 64)
        return max(1, 2048 // block_n), block_n, 4, True
    return (*_config(n, channels_first), False)


def forward(gate, x, gate_bias, x_bias, row_mask, batch: int, channels_first: bool) -> torch.Tensor:
    """y for ``gate``, ``x`` [M, N] (unit column stride), ``row_mask`` [M] or None, M = batch * P:
    ``[M, N]`` (rows) or ``[batch, N, P]`` (channels first), contiguous, in x's dtype."""
    m, n = x.shape
    p = m // batch if batch else 0
    if channels_first:
        y = torch.empty((batch, n, p), dtype=x.dtype, device=x.device)
        strides = (n * p, 1, p)
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        strides = (p * n, n, 1)
    if m == 0 or n == 0:
        return y
    block_p, block_n, num_warps = _config(n, channels_first)
    with _device_guard(x):
        _sigmoid_gate_fwd_kernel[(triton.cdiv(p, block_p), triton.cdiv(n, block_n), batch)](
            gate, x, gate_bias, x_bias, row_mask, y, p, n, gate.stride(0), x.stride(0), *strides,
            HAS_GB=gate_bias is not None, HAS_XB=x_bias is not None, HAS_MASK=row_mask is not None,
            BLOCK_P=block_p, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y


def backward(dy, gate, x, gate_bias, x_bias, row_mask, batch: int, channels_first: bool):
    """(dgate, dx, dgate_bias, dx_bias): dgate and dx ``[M, N]`` contiguous in their inputs'
    dtypes, the bias gradients ``[N]`` in the biases' dtypes (None where a bias is None). ``dy``
    is y's gradient in y's layout (any strides)."""
    m, n = x.shape
    p = m // batch if batch else 0
    if channels_first:
        dy3 = dy.view(batch, n, p) if dy.dim() == 3 else dy.reshape(batch, n, p)
        strides = (dy3.stride(0), dy3.stride(2), dy3.stride(1))
    else:
        dy3 = dy.reshape(m, n)
        strides = (p * dy3.stride(0), dy3.stride(0), dy3.stride(1))
    dgate = torch.empty((m, n), dtype=gate.dtype, device=x.device)
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bias_grads = gate_bias is not None or x_bias is not None

    def zeros_like(bias):
        return None if bias is None else torch.zeros_like(bias)

    if m == 0 or n == 0:
        return dgate, dx, zeros_like(gate_bias), zeros_like(x_bias)
    block_p, block_n, num_warps, tile_sums = _bwd_config(n, channels_first)
    tiles, col_tiles = batch * triton.cdiv(p, block_p), triton.cdiv(n, block_n)
    meta = dict(HAS_GB=gate_bias is not None, HAS_XB=x_bias is not None, HAS_MASK=row_mask is not None,
                BIAS_GRADS=bias_grads, TILE_SUMS=tile_sums, BLOCK_P=block_p, BLOCK_N=block_n,
                num_warps=num_warps)
    args = (gate, x, gate_bias, x_bias, row_mask, dgate, dx)
    sizes = (batch, p, n, gate.stride(0), x.stride(0), *strides)
    with _device_guard(x):
        if not bias_grads:
            _sigmoid_gate_bwd_kernel[(tiles, col_tiles)](dy3, *args, None, *sizes, **meta)
            return dgate, dx, None, None

        def probe_args():
            stand_in = torch.empty(1, dtype=torch.float32, device=x.device)
            return (dy3, *args, stand_in, *sizes)

        key = ("sigmoid_gate_bwd", n, dy.dtype, x.dtype, gate.dtype, meta["HAS_GB"], meta["HAS_XB"],
               meta["HAS_MASK"], channels_first)
        resident = resident_programs(_sigmoid_gate_bwd_kernel, probe_args, meta, key, x.device)
        programs = min(tiles, max(1, resident // col_tiles))
        partial = torch.empty((2, programs, n), dtype=torch.float32, device=x.device)
        _sigmoid_gate_bwd_kernel[(programs, col_tiles)](dy3, *args, partial, *sizes, **meta)
        dgb, dxb = column_sums(partial, (
            gate_bias.dtype if gate_bias is not None else torch.float32,
            x_bias.dtype if x_bias is not None else torch.float32))
    return dgate, dx, (dgb if gate_bias is not None else None), (dxb if x_bias is not None else None)
