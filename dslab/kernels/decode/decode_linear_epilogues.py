"""The epilogues of :mod:`dslab.kernels.decode.decode_linear_triton`: what a program does with its
finished fp32 tile ``[BLOCK_M, BLOCK_N]`` (after split-K's partials are added).

All of them first multiply int8 weights' per-output-channel scales into the accumulator and add
the bias, each indexed by the tile's weight rows; then, by the launch's constexprs:

plain (``ACT`` 0-2, no ``KV_SCATTER``)
    GELU (exact or tanh) or nothing, and a store of ``y [M, N]``.
QKV scatter (``KV_SCATTER``, GPT-2's and any projection whose q, k and v need no rotation)
    column ``n`` is part q (``n < q_width``), k (the next ``kv_width``) or v (the last
    ``kv_width``), head ``within // head_dim`` of its part; q goes to ``q_out [M, q_width]``, k
    and v into the layer's caches ``[batch, kv_heads, max_seq, head_dim]`` at row ``m``'s
    ``write_pos[m]``. GPT-2: ``q_width = kv_width = N / 3``.
SwiGLU (``ACT == 3``, paired)
    output column ``c`` holds gate row ``c`` and up row ``c + span`` (``span = I``, Llama's stacked
    ``[gate; up]`` weight): ``y[:, c] = silu(gate) * up``, one rounding, ``y [M, I]``.
rotary QKV scatter (``ROPE``, paired)
    column ``c`` is half-column ``c % span`` of head ``c // span`` (``span = head_dim / 2``): the
    pair holds that head's columns ``j`` and ``j + head_dim / 2``, which rotate-half rotates
    together: ``(x1 cos - x2 sin, x2 cos + x1 sin)`` with the row's fp32 tables ``cos``/``sin``
    ``[M, head_dim / 2]``, for q and k heads (v heads pass unrotated); then the QKV scatter.

Each acts on the fp32 accumulator and rounds once, to the output's (or the cache's) dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dslab.kernels._triton_compat import cast_rounding
from dslab.kernels.activation.bias_gelu_triton import _gelu_and_grad, _sigmoid_parts


@triton.jit
def _scatter_qkv(value, cols, rows64, out_mask, pos, Q_OUT, K_CACHE, V_CACHE, stride_q, stride_kb, stride_kh,
                 stride_ks, stride_vb, stride_vh, stride_vs, head_dim, q_width, kv_width,
                 BF16_BY_HAND: tl.constexpr):
    """``value`` ``[BLOCK_M, BLOCK_N]`` at QKV columns ``cols``: q columns into ``q_out``, k and v
    columns into the caches at ``pos`` ``[BLOCK_M, 1]``."""
    v_begin = q_width + kv_width
    part = (cols >= q_width).to(tl.int32) + (cols >= v_begin).to(tl.int32)
    within = cols - tl.where(part == 0, 0, tl.where(part == 1, q_width, v_begin))
    head = within // head_dim
    dim = within - head * head_dim
    tl.store(Q_OUT + rows64 * stride_q + within[None, :],
             cast_rounding(value, Q_OUT.dtype.element_ty, BF16_BY_HAND), mask=out_mask & (part == 0)[None, :])
    kv = cast_rounding(value, K_CACHE.dtype.element_ty, BF16_BY_HAND)
    tl.store(K_CACHE + rows64 * stride_kb + (head * stride_kh + dim)[None, :] + pos * stride_ks, kv,
             mask=out_mask & (part == 1)[None, :])
    tl.store(V_CACHE + rows64 * stride_vb + (head * stride_vh + dim)[None, :] + pos * stride_vs, kv,
             mask=out_mask & (part == 2)[None, :])


@triton.jit
def operands(rows, cols, w_rows, row_mask, col_mask, rows64, SCALE, BIAS, WRITE_POS, COS, SIN, span, stride_cos,
             INT8: tl.constexpr, HAS_BIAS: tl.constexpr, KV_SCATTER: tl.constexpr, ROPE: tl.constexpr,
             PAIRED: tl.constexpr):
    """What a tile's epilogue reads besides its sums: ``(scale, scale_2, bias, bias_2, cos, sin,
    pos)``, the int8 scales and the biases of its weight rows ``w_rows`` (and ``w_rows + span``),
    the rows' rotary tables at its half-columns, and the rows' cache positions (zeros where the
    launch has none). Loaded apart from :func:`finish_with` so that a kernel may request them
    before its sums are reduced."""
    out_mask = row_mask[:, None] & col_mask[None, :]
    scale = tl.zeros(cols.shape, tl.float32)
    scale_2 = scale
    bias = scale
    bias_2 = scale
    if INT8:
        scale = tl.load(SCALE + w_rows, mask=col_mask, other=0.0)
        if PAIRED:
            scale_2 = tl.load(SCALE + w_rows + span, mask=col_mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(BIAS + w_rows, mask=col_mask, other=0.0).to(tl.float32)
        if PAIRED:
            bias_2 = tl.load(BIAS + w_rows + span, mask=col_mask, other=0.0).to(tl.float32)
    cos = tl.zeros((rows.shape[0], cols.shape[0]), tl.float32) + 1.0
    sin = tl.zeros((rows.shape[0], cols.shape[0]), tl.float32)
    pos = tl.zeros((rows.shape[0], 1), tl.int64)
    if ROPE:
        tables = rows64 * stride_cos + (cols - (cols // span) * span)[None, :]
        cos = tl.load(COS + tables, mask=out_mask, other=1.0)
        sin = tl.load(SIN + tables, mask=out_mask, other=0.0)
    if ROPE or KV_SCATTER:
        pos = tl.load(WRITE_POS + rows, mask=row_mask, other=0).to(tl.int64)[:, None]
    return scale, scale_2, bias, bias_2, cos, sin, pos


@triton.jit
def finish(acc, acc_2, rows, cols, w_rows, row_mask, col_mask, rows64, SCALE, BIAS, Y, Q_OUT, K_CACHE, V_CACHE,
           WRITE_POS, COS, SIN, span, stride_y, stride_q, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
           stride_vs, stride_cos, head_dim, q_width, kv_width, INT8: tl.constexpr, HAS_BIAS: tl.constexpr,
           ACT: tl.constexpr, KV_SCATTER: tl.constexpr, ROPE: tl.constexpr, PAIRED: tl.constexpr,
           BF16_BY_HAND: tl.constexpr):
    """The epilogue of a finished tile (see the module docstring): ``acc`` the sums of weight rows
    ``w_rows``, and of a paired launch ``acc_2`` those of rows ``w_rows + span``; ``cols`` the
    output columns (weight rows, or pairs). Its :func:`operands` loaded here."""
    scale, scale_2, bias, bias_2, cos, sin, pos = operands(
        rows, cols, w_rows, row_mask, col_mask, rows64, SCALE, BIAS, WRITE_POS, COS, SIN, span, stride_cos, INT8,
        HAS_BIAS, KV_SCATTER, ROPE, PAIRED)
    finish_with(acc, acc_2, scale, scale_2, bias, bias_2, cos, sin, pos, cols, row_mask, col_mask, rows64, Y, Q_OUT,
                K_CACHE, V_CACHE, span, stride_y, stride_q, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                stride_vs, head_dim, q_width, kv_width, INT8, HAS_BIAS, ACT, KV_SCATTER, ROPE, PAIRED, BF16_BY_HAND)


@triton.jit
def finish_with(acc, acc_2, scale, scale_2, bias, bias_2, cos, sin, pos, cols, row_mask, col_mask, rows64, Y, Q_OUT,
                K_CACHE, V_CACHE, span, stride_y, stride_q, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                stride_vs, head_dim, q_width, kv_width, INT8: tl.constexpr, HAS_BIAS: tl.constexpr,
                ACT: tl.constexpr, KV_SCATTER: tl.constexpr, ROPE: tl.constexpr, PAIRED: tl.constexpr,
                BF16_BY_HAND: tl.constexpr):
    """:func:`finish` with its :func:`operands` given."""
    out_mask = row_mask[:, None] & col_mask[None, :]
    if INT8:
        acc = acc * scale[None, :]
        if PAIRED:
            acc_2 = acc_2 * scale_2[None, :]
    if HAS_BIAS:
        acc += bias[None, :]
        if PAIRED:
            acc_2 += bias_2[None, :]
    if ACT == 3:
        sig, _ = _sigmoid_parts(acc, True)
        y = acc * sig * acc_2
        tl.store(Y + rows64 * stride_y + cols[None, :], cast_rounding(y, Y.dtype.element_ty, BF16_BY_HAND),
                 mask=out_mask)
    elif ROPE:
        head = cols // span
        half = cols - head * span
        rotated = (head < (q_width + kv_width) // head_dim)[None, :]
        first = tl.where(rotated, acc * cos - acc_2 * sin, acc)
        second = tl.where(rotated, acc_2 * cos + acc * sin, acc_2)
        first_cols = head * head_dim + half
        _scatter_qkv(first, first_cols, rows64, out_mask, pos, Q_OUT, K_CACHE, V_CACHE, stride_q, stride_kb,
                     stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, head_dim, q_width, kv_width, BF16_BY_HAND)
        _scatter_qkv(second, first_cols + span, rows64, out_mask, pos, Q_OUT, K_CACHE, V_CACHE, stride_q, stride_kb,
                     stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, head_dim, q_width, kv_width, BF16_BY_HAND)
    else:
        if ACT != 0:
            acc, _ = _gelu_and_grad(acc, ACT == 2, True, False)
        if KV_SCATTER:
            _scatter_qkv(acc, cols, rows64, out_mask, pos, Q_OUT, K_CACHE, V_CACHE, stride_q, stride_kb, stride_kh,
                         stride_ks, stride_vb, stride_vh, stride_vs, head_dim, q_width, kv_width, BF16_BY_HAND)
        else:
            tl.store(Y + rows64 * stride_y + cols[None, :], cast_rounding(acc, Y.dtype.element_ty, BF16_BY_HAND),
                     mask=out_mask)
