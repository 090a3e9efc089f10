"""Persistent grids and their per-program partial sums, shared by the kernels whose backward
reduces a gradient over rows (layer_norm's weight and bias, bias_gelu's and
bias_dropout_residual's bias).

Such a backward launches :func:`resident_programs` programs, each looping over row tiles and
accumulating its rows' share of the gradient in fp32; each writes one ``[N]`` row of partials, and
:func:`column_sums` adds the ``[programs, N]`` partials up in a fixed order, so the result is
deterministic. The launch helpers those kernels share (device guard, unit-stride rows) sit here
too.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

_resident_cache: dict[tuple, int] = {}


def resident_programs(kernel, make_args, meta: dict, key: tuple, device: torch.device) -> int:
    """How many programs of ``kernel`` with ``meta`` fit on the whole device at once.

    Compiled once with ``warmup`` on ``make_args()`` (the same specialization as the launch) to
    read its registers and shared memory, then cached per ``(key, device)``: the query costs no
    device work after the first call. Off CUDA (the interpreter) a small fixed number, so that
    programs loop.
    """
    if device.type != "cuda":
        return 4
    cache_key = (key, device.index)
    resident = _resident_cache.get(cache_key)
    if resident is None:
        compiled = kernel.warmup(*make_args(), grid=(1,), **meta)
        compiled._init_handles()
        props = triton.runtime.driver.active.utils.get_device_properties(device.index)
        warps = meta["num_warps"]
        regs_per_thread = -(-compiled.n_regs // 8) * 8  # allocated in units of 8 per thread
        by_regs = props["max_num_regs"] // max(1, regs_per_thread * 32 * warps)
        by_smem = props["max_shared_mem"] // max(1, compiled.metadata.shared)
        per_sm = max(1, min(by_regs, by_smem, 64 // warps, 32))
        resident = per_sm * props["multiprocessor_count"]
        _resident_cache[cache_key] = resident
    return resident


@triton.jit
def _column_sums_kernel(P, OUT0, OUT1, OUT2, G, N, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT_k[n] = sum_g P[k, g, n] for P [K, G, N] fp32 (K = program_id(1) + 1 slices), in order."""
    k = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    base = P + k.to(tl.int64) * G * N
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for start in tl.range(0, G, BLOCK_G):
        g = start + tl.arange(0, BLOCK_G)
        mask = (g < G)[:, None] & col_mask[None, :]
        acc += tl.load(base + g[:, None] * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if k == 0:
        tl.store(OUT0 + cols, total.to(OUT0.dtype.element_ty), mask=col_mask)
    elif k == 1:
        tl.store(OUT1 + cols, total.to(OUT1.dtype.element_ty), mask=col_mask)
    else:
        tl.store(OUT2 + cols, total.to(OUT2.dtype.element_ty), mask=col_mask)


def column_sums(partials: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> tuple[torch.Tensor, ...]:
    """Column sums of each ``[G, N]`` slice of the fp32 ``partials`` ``[K, G, N]`` (K = 1 to 3),
    slice k returned as an ``[N]`` tensor in ``dtypes[k]``; one launch for all slices.

    Narrow column strips (16 floats, 64 bytes a row) give K * N / 16 programs; tall steps (256
    rows) keep 16 KB of loads in flight per step, as the steps do not overlap. Reads K * G * N * 4
    bytes, writes K * N elements.
    """
    k, groups, n = partials.shape
    assert partials.dtype == torch.float32 and partials.is_contiguous() and len(dtypes) == k in (1, 2, 3)
    outs = tuple(torch.empty(n, dtype=dtype, device=partials.device) for dtype in dtypes)
    block_n = 16
    _column_sums_kernel[(triton.cdiv(n, block_n), k)](
        partials, outs[0], outs[min(1, k - 1)], outs[-1], groups, n, BLOCK_G=256, BLOCK_N=block_n, num_warps=4
    )
    return outs


def device_guard(t: torch.Tensor):
    """Launch on ``t``'s GPU (a no-op context on CPU, where the interpreter runs)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) with unit stride along the last dimension (a copy only when it lacks one)."""
    return t if t.stride(-1) == 1 else t.contiguous()
