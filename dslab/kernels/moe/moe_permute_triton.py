"""Triton kernels for :mod:`dslab.kernels.moe.moe_permute` and the host code that launches them.

Token rows ``x`` [T, H] and expert-ordered rows [R, H] have unit stride along H; ``row_index``
[T, k] (int32 or int64, contiguous) maps assignment ``s = t * k + c`` to its row, -1 when dropped.
Tiles are up to 1024 columns wide (vectorised 16-byte loads) and 4096 elements; a grid axis runs
over column tiles, so any H works.

Four kernels serve the two ops and their gradients:

- ``_row_source_kernel`` inverts ``row_index``: ``source[row] = s``. ``source`` is not initialised:
  a row's entry counts only when it is in range and ``row_index[s] == row`` (the sparse-set check
  of Briggs and Torczon, 1993), so a row no assignment claims reads as unclaimed whatever the
  memory held, and no fill launch is needed. Reads and writes T*k ints.
- ``_gather_rows_kernel``, row-major over the R destination rows: each row copies its source
  token's row (optionally scaled by that assignment's gate weight) or writes zeros, so every
  output row is written exactly once and no atomics are needed. Permute forward (``x`` into
  ``x_perm``) and unpermute backward (``gate_weight * dy`` into ``dy_perm``). Reads kept*H,
  writes R*H elements.
- ``_gather_sum_kernel``, token-major: each token sums its kept rows, optionally weighted, in
  fp32. Unpermute forward (``y``) and permute backward (``dx``). Reads kept*H, writes T*H.
- ``_gate_grad_kernel``, token-major: ``dgate[t, c] = <dy[t], y_perm[row]>`` in fp32, looping
  over H. Reads T*H + kept*H, writes T*k.

``row_index`` entries outside ``[-1, R)`` and rows targeted twice break the caller's contract and
are not checked (that would need a device sync): here an entry >= R is treated as dropped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import device_guard as _device_guard
from dslab.kernels._grid import unit_stride_rows as _rows
from dslab.kernels._triton_compat import cast_rounding as _cast
from dslab.kernels.dispatch import interpreting

_TILE_ELEMENTS = 4096
_MAX_BLOCK_H = 1024
_SOURCE_BLOCK = 1024


@triton.jit
def _row_source_kernel(ROW_INDEX, SOURCE, n_assignments, num_rows, BLOCK: tl.constexpr):
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = s < n_assignments
    row = tl.load(ROW_INDEX + s, mask=in_range, other=-1)
    tl.store(SOURCE + row, s, mask=in_range & (row >= 0) & (row < num_rows))


@triton.jit
def _gather_rows_kernel(
    SRC, ROW_INDEX, SOURCE, SCALE, OUT, num_rows, n_assignments, H, stride_src, stride_out,
    K: tl.constexpr, HAS_SCALE: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    col_ok = cols < H
    s = tl.load(SOURCE + rows, mask=row_ok, other=-1)
    claimed = row_ok & (s >= 0) & (s < n_assignments)
    s = tl.where(claimed, s, 0)
    claimed = claimed & (tl.load(ROW_INDEX + s, mask=claimed, other=-1) == rows)
    token = (s // K).to(tl.int64)
    values = tl.load(SRC + token[:, None] * stride_src + cols[None, :],
                     mask=claimed[:, None] & col_ok[None, :], other=0.0)
    if HAS_SCALE:
        weight = tl.load(SCALE + s, mask=claimed, other=0.0)
        values = _cast(values.to(tl.float32) * weight[:, None], OUT.dtype.element_ty, BF16_BY_HAND)
    tl.store(OUT + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], values,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gather_sum_kernel(
    SRC, ROW_INDEX, WEIGHT, OUT, T, num_rows, H, stride_src, stride_out,
    K: tl.constexpr, HAS_WEIGHT: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_ok = tokens < T
    col_ok = cols < H
    tokens64 = tokens.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for c in tl.static_range(K):
        row = tl.load(ROW_INDEX + tokens64 * K + c, mask=token_ok, other=-1)
        kept = token_ok & (row >= 0) & (row < num_rows)
        values = tl.load(SRC + row.to(tl.int64)[:, None] * stride_src + cols[None, :],
                         mask=kept[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            values = values * tl.load(WEIGHT + tokens64 * K + c, mask=kept, other=0.0)[:, None]
        acc += values
    tl.store(OUT + tokens64[:, None] * stride_out + cols[None, :],
             _cast(acc, OUT.dtype.element_ty, BF16_BY_HAND), mask=token_ok[:, None] & col_ok[None, :])


@triton.jit
def _gate_grad_kernel(
    DY, Y_PERM, ROW_INDEX, DGATE, T, num_rows, H, stride_dy, stride_y,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < T
    tokens64 = tokens.to(tl.int64)
    choices = tl.arange(0, BLOCK_K)
    dots = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        dy = tl.load(DY + tokens64[:, None] * stride_dy + cols[None, :],
                     mask=token_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        for c in tl.static_range(K):
            row = tl.load(ROW_INDEX + tokens64 * K + c, mask=token_ok, other=-1)
            kept = token_ok & (row >= 0) & (row < num_rows)
            y = tl.load(Y_PERM + row.to(tl.int64)[:, None] * stride_y + cols[None, :],
                        mask=kept[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            dots += tl.where(choices[None, :] == c, tl.sum(dy * y, axis=1)[:, None], 0.0)
    tl.store(DGATE + tokens64[:, None] * K + choices[None, :], dots,
             mask=token_ok[:, None] & (choices < K)[None, :])


def _tiles(h: int) -> tuple[int, int]:
    """(rows per tile, BLOCK_H) for rows of ``h`` elements."""
    block_h = min(triton.next_power_of_2(max(h, 1)), _MAX_BLOCK_H)
    return max(1, _TILE_ELEMENTS // block_h), block_h


def _bf16_by_hand(dtype: torch.dtype) -> bool:
    return interpreting() and dtype == torch.bfloat16


def _row_sources(row_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``source`` [num_rows] int32 with ``source[row_index[s]] = s``; other entries unset."""
    source = torch.empty(num_rows, dtype=torch.int32, device=row_index.device)
    return _invert_row_index(row_index, source)


def _invert_row_index(row_index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Writes ``source[row_index[s]] = s`` for the kept assignments and returns ``source``."""
    n = row_index.numel()
    if n:
        _row_source_kernel[(triton.cdiv(n, _SOURCE_BLOCK),)](row_index, source, n, source.shape[0],
                                                              BLOCK=_SOURCE_BLOCK, num_warps=4)
    return source


def _gather_rows(src: torch.Tensor, row_index: torch.Tensor, scale: torch.Tensor | None,
                 num_rows: int) -> torch.Tensor:
    """[num_rows, H]: row ``row_index[t, c]`` = ``src[t]`` (times ``scale[t, c]``), zeros elsewhere."""
    h = src.shape[1]
    out = torch.empty((num_rows, h), dtype=src.dtype, device=src.device)
    if num_rows == 0 or h == 0:
        return out
    block_r, block_h = _tiles(h)
    with _device_guard(src):
        source = _row_sources(row_index, num_rows)
        _gather_rows_kernel[(triton.cdiv(num_rows, block_r), triton.cdiv(h, block_h))](
            src, row_index, source, scale, out, num_rows, row_index.numel(), h, src.stride(0), out.stride(0),
            K=row_index.shape[1], HAS_SCALE=scale is not None, BF16_BY_HAND=_bf16_by_hand(out.dtype),
            BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4,
        )
    return out


def _gather_sum(src: torch.Tensor, row_index: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """[T, H]: ``out[t] = sum_c weight[t, c] * src[row_index[t, c]]`` over kept c, in fp32."""
    t, h = row_index.shape[0], src.shape[1]
    out = torch.empty((t, h), dtype=src.dtype, device=src.device)
    if t == 0 or h == 0:
        return out
    block_t, block_h = _tiles(h)
    with _device_guard(src):
        _gather_sum_kernel[(triton.cdiv(t, block_t), triton.cdiv(h, block_h))](
            src, row_index, weight, out, t, src.shape[0], h, src.stride(0), out.stride(0),
            K=row_index.shape[1], HAS_WEIGHT=weight is not None, BF16_BY_HAND=_bf16_by_hand(out.dtype),
            BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
        )
    return out


def permute(x: torch.Tensor, row_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x_perm [num_rows, H] in x's dtype from ``x`` [T, H]."""
    return _gather_rows(_rows(x), row_index.contiguous(), None, num_rows)


def permute_backward(dx_perm: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """dx [T, H] = sum over kept c of ``dx_perm[row_index[t, c]]``, in dx_perm's dtype."""
    return _gather_sum(_rows(dx_perm), row_index.contiguous(), None)


def unpermute(y_perm: torch.Tensor, row_index: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """y [T, H] = sum over kept c of ``gate_weight[t, c] * y_perm[row_index[t, c]]``."""
    return _gather_sum(_rows(y_perm), row_index.contiguous(), gate_weight.contiguous())


def _gate_grad(dy: torch.Tensor, y_perm: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """dgate [T, k] fp32: ``<dy[t], y_perm[row_index[t, c]]>`` for kept c, 0 for dropped."""
    t, k = row_index.shape
    h = dy.shape[1]
    if t == 0 or h == 0:
        return torch.zeros((t, k), dtype=torch.float32, device=dy.device)
    dgate = torch.empty((t, k), dtype=torch.float32, device=dy.device)
    block_t, block_h = _tiles(h)
    with _device_guard(dy):
        _gate_grad_kernel[(triton.cdiv(t, block_t),)](
            dy, y_perm, row_index, dgate, t, y_perm.shape[0], h, dy.stride(0), y_perm.stride(0),
            K=k, BLOCK_K=max(2, triton.next_power_of_2(k)), BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
        )
    return dgate


def unpermute_backward(
    dy: torch.Tensor, y_perm: torch.Tensor, row_index: torch.Tensor, gate_weight: torch.Tensor,
    need_y_perm_grad: bool, need_gate_grad: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dy_perm [R, H] in y_perm's dtype, dgate [T, k] fp32); None where not needed."""
    dy, row_index = _rows(dy.to(y_perm.dtype)), row_index.contiguous()
    dy_perm = _gather_rows(dy, row_index, gate_weight.contiguous(), y_perm.shape[0]) if need_y_perm_grad else None
    dgate = _gate_grad(dy, _rows(y_perm), row_index) if need_gate_grad else None
    return dy_perm, dgate
