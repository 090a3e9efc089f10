"""Triton Evoformer attention: the layout helpers shared with the backward, and the forward kernel.

Layout. q, k, v and the output are viewed as ``[B, N_seq, N_res, H, D]`` (the leading batch dims
flattened into B, unit stride along D, any other strides passed to the kernels). The mask bias is
viewed as ``[B, N_seq, N_res]`` and the pair bias as ``[B, H, N_res, N_res]``, both through
``expand`` so that a broadcast batch, sequence or head dimension has stride 0 and is not copied.
Per-row statistics (the
log-sum-exp here, ``delta`` in the backward) are fp32 ``[B, N_seq, H, N_res]``, so that the row
statistics of program ``bsh = (b * N_seq + s) * H + h`` start at ``bsh * N_res``.

Forward (FlashAttention-2 loop order, Dao 2023): one program per (query block of ``BLOCK_M``
residues, ``bsh``), on a 1-D grid with the query block fastest so that programs running together
share one (sequence, head)'s k and v in L2. It keeps the running row maximum, normaliser and output
accumulator in fp32 registers and walks the key blocks of ``BLOCK_N`` residues. Each score tile is
built in base-2 units as it is formed,

    s = (q @ k^T) * D**-0.5 * log2(e) + (mask[s, j] + pair[h, i, j]) * log2(e),

so every probability costs one ``exp2``; full key blocks run unmasked and the one partial block
(``N_res`` not a multiple of ``BLOCK_N``) masks its keys to ``-inf``. The program stores its rows'
output and ``lse = m + log2(l)`` (base 2). A row whose every score is ``-inf`` (a bias of ``-inf``
on every key) gets output 0 and ``lse = +inf``, so the backward's recomputed probabilities
``exp2(s - lse)`` are exactly 0 there (the naive reference gives NaN for such a row).

Memory traffic of the forward per (sequence, head): q, o once; k, v once per query block (mostly
from L2); the pair bias tile ``[BLOCK_M, BLOCK_N]`` once per (sequence, query block, key block), so
the ``H * N_res**2`` pair bias is read ``N_seq`` times, from L2 at Evoformer sizes (4 MiB in bf16 at
H = 8, N_res = 512); lse ``4 * N_res`` bytes. Flops: ``4 * B * N_seq * N_res**2 * H * D``.

Tiles: each launch is autotuned (``triton.autotune``) over a few tiles per head dim and input
width (16-bit inputs on tensor cores; fp32 inputs, whose IEEE dot products run on the FMA units,
in smaller tiles), keyed on the bucketed ``N_res`` (next power of two), the bias flags and the
dtypes; the first call of each key compiles, times every candidate and synchronises. Every tile
in the tables compiles for sm_90 without register spills and within the shared memory of one
block. Under the interpreter one small tile is used, so that test shapes span several blocks.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import device_guard
from dslab.kernels.dispatch import interpreting
from dslab.kernels.evoformer.evoformer_layout import output_like

LOG2_E = 1.4426950408889634


@triton.jit
def dot(a, b, acc, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` in fp32. ``DOT_FP32`` (set under the interpreter) upcasts the operands
    first: the interpreter multiplies bf16 operands as raw integers, and a 16-bit product is exact
    in fp32. ``PRECISION`` is ``"ieee"`` for fp32 inputs unless TF32 matmuls are allowed."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def program_coordinates(pid, n_blocks, num_heads, n_seq):
    """(block, bsh, b, s, h) of program ``pid`` of a 1-D grid of ``n_blocks`` blocks per ``bsh``,
    the block index fastest."""
    block = pid % n_blocks
    bsh = pid // n_blocks
    h = bsh % num_heads
    bs = bsh // num_heads
    return block, bsh, bs // n_seq, bs % n_seq, h


@triton.jit
def _fwd_key_loop(
    acc, l_i, m_i, q, k_base, v_base, mask_base, pair_rows, row_valid,
    stride_kn, stride_vn, stride_mn, stride_pj, n_res, qk_scale, start, end, offs_d,
    BOUNDARY: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Fold the key blocks ``[start, end)`` into the running (acc, l, m). ``BOUNDARY`` blocks may
    hold keys past ``n_res`` and mask them; the others load unmasked keys."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
        if BOUNDARY:
            key_valid = offs_n < n_res
            k = tl.load(k_ptrs, mask=key_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=key_valid[:, None], other=0.0)
        else:
            key_valid = offs_n >= 0
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_FP32, PRECISION) * qk_scale
        if HAS_MASK:
            if BOUNDARY:
                mask_bias = tl.load(mask_base + offs_n * stride_mn, mask=key_valid, other=0.0)
            else:
                mask_bias = tl.load(mask_base + offs_n * stride_mn)
            s += mask_bias.to(tl.float32)[None, :] * 1.4426950408889634
        if HAS_PAIR:
            pair_mask = row_valid[:, None] & key_valid[None, :]
            pair = tl.load(pair_rows + offs_n[None, :] * stride_pj, mask=pair_mask, other=0.0)
            s += pair.to(tl.float32) * 1.4426950408889634
        if BOUNDARY:
            s = tl.where(key_valid[None, :], s, float("-inf"))
        # m starts finite (-1e30), so a block whose scores are all -inf gives p = 0 and alpha = 1.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_FP32, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _evoformer_fwd_kernel(
    Q, K, V, O, LSE, MASK, PAIR,
    stride_qb, stride_qs, stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kn, stride_kh,
    stride_vb, stride_vs, stride_vn, stride_vh,
    stride_ob, stride_os, stride_on, stride_oh,
    stride_mb, stride_ms, stride_mn,
    stride_pb, stride_ph, stride_pi, stride_pj,
    n_seq, n_res, num_heads, n_res_bucket, qk_scale,
    HEAD_DIM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """1-D grid of ``cdiv(n_res, BLOCK_M) * B * n_seq * num_heads`` programs; ``n_res_bucket``
    only keys the autotuner. ``qk_scale`` is ``D**-0.5 * log2(e)``."""
    n_blocks = tl.cdiv(n_res, BLOCK_M)
    pid_m, bsh, b, s, h = program_coordinates(tl.program_id(0), n_blocks, num_heads, n_seq)
    b = b.to(tl.int64)
    s = s.to(tl.int64)
    h = h.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_m < n_res

    q_ptrs = Q + b * stride_qb + s * stride_qs + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0)
    k_base = K + b * stride_kb + s * stride_ks + h * stride_kh
    v_base = V + b * stride_vb + s * stride_vs + h * stride_vh
    mask_base = MASK + b * stride_mb + s * stride_ms
    pair_rows = PAIR + b * stride_pb + h * stride_ph + offs_m[:, None] * stride_pi

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end = n_res // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _fwd_key_loop(
        acc, l_i, m_i, q, k_base, v_base, mask_base, pair_rows, row_valid,
        stride_kn, stride_vn, stride_mn, stride_pj, n_res, qk_scale, 0, full_end, offs_d,
        False, HAS_MASK, HAS_PAIR, DOT_FP32, PRECISION, BLOCK_M, BLOCK_N,
    )
    acc, l_i, m_i = _fwd_key_loop(
        acc, l_i, m_i, q, k_base, v_base, mask_base, pair_rows, row_valid,
        stride_kn, stride_vn, stride_mn, stride_pj, n_res, qk_scale, full_end, n_res, offs_d,
        True, HAS_MASK, HAS_PAIR, DOT_FP32, PRECISION, BLOCK_M, BLOCK_N,
    )

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = O + b * stride_ob + s * stride_os + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_valid[:, None])
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))
    tl.store(LSE + bsh.to(tl.int64) * n_res + offs_m, lse, mask=row_valid)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim: FlashAttention-2-sized tiles for
# Hopper. Small head dims leave registers for the fp32 score tile and the pair-bias tile, so they
# also try 128-row query blocks; D = 128 keeps the key block narrow.
FWD_TILES = {
    16: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 32, 4, 4)],
    32: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 32, 4, 4)],
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4)],
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3)],
}
# fp32 inputs: IEEE dot products run on the FMA units (TF32 tensor cores only when
# torch.backends.cuda.matmul.allow_tf32), and their register tiles need small blocks. These compile
# without spills for sm_90 with IEEE dots.
FWD_TILES_FP32 = {
    16: [(32, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)],
    32: [(32, 32, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2)],
    64: [(32, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2)],
    128: [(32, 16, 4, 2), (32, 32, 4, 1)],
}
# Under the interpreter: 16-residue blocks, so that N_res = 17 or 33 spans a partial block.
FWD_INTERPRET_TILE = (16, 16, 4, 1)
FWD_AUTOTUNE_KEY = ["n_res_bucket", "HAS_MASK", "HAS_PAIR"]


def configs(tiles: list[tuple], names: tuple[str, ...]) -> list[triton.Config]:
    """``triton.Config`` s from tiles ``(*block sizes, num_warps, num_stages)``."""
    return [
        triton.Config(dict(zip(names, tile[:-2])), num_warps=tile[-2], num_stages=tile[-1]) for tile in tiles
    ]


def tiles_for(tables: dict, tables_fp32: dict, interpret_tile: tuple, head_dim: int, fp32: bool,
              interpret: bool) -> list[tuple]:
    """The autotune tiles of a launch: the interpreter's one tile, else the 16-bit or fp32 table's
    entry for ``head_dim``."""
    if interpret:
        return [interpret_tile]
    return (tables_fp32 if fp32 else tables)[head_dim]


@functools.cache
def _fwd_kernel(head_dim: int, interpret: bool, fp32: bool = False):
    tiles = tiles_for(FWD_TILES, FWD_TILES_FP32, FWD_INTERPRET_TILE, head_dim, fp32, interpret)
    return triton.autotune(configs=configs(tiles, ("BLOCK_M", "BLOCK_N")), key=FWD_AUTOTUNE_KEY)(
        _evoformer_fwd_kernel
    )


def fwd_kernel(head_dim: int, dtype: torch.dtype):
    """The autotuned forward kernel for ``head_dim`` and ``dtype`` (one small tile under the
    interpreter)."""
    return _fwd_kernel(head_dim, interpreting(), dtype == torch.float32)


def n_res_bucket(n: int) -> int:
    """Autotune bucket of a residue count: the next power of two, at least 16."""
    return max(16, 1 << (n - 1).bit_length()) if n > 0 else 16


def kernel_flags(dtype: torch.dtype) -> dict:
    """``DOT_FP32`` (under the interpreter) and ``PRECISION`` (``ieee`` for fp32 inputs unless
    ``torch.backends.cuda.matmul.allow_tf32``, as for ``torch.matmul``)."""
    strict = dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return dict(DOT_FP32=interpreting(), PRECISION="ieee" if strict else "tf32")


def dims(q: torch.Tensor) -> tuple[tuple[int, ...], int, int, int, int, int]:
    """(batch shape, B, N_seq, N_res, H, D) of q ``[*, N_seq, N_res, H, D]``."""
    batch_shape = tuple(q.shape[:-4])
    n_seq, n_res, heads, head_dim = q.shape[-4:]
    return batch_shape, math.prod(batch_shape), n_seq, n_res, heads, head_dim


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[*, N_seq, N_res, H, D]`` as ``[B, N_seq, N_res, H, D]`` with unit stride along D (a
    copy only when the batch dims cannot be merged or D is strided)."""
    batch = math.prod(t.shape[:-4])
    view = t.reshape(batch, *t.shape[-4:])
    return view if view.stride(-1) == 1 else view.contiguous()


def mask_view(mask_bias: torch.Tensor, batch_shape: tuple[int, ...], n_seq: int, n_res: int) -> torch.Tensor:
    """The mask bias ``[*, N_seq, 1, 1, N_res]`` (broadcastable) as ``[B, N_seq, N_res]``; broadcast
    dims get stride 0 (a copy only when the batch dims cannot be merged)."""
    full = mask_bias.expand(*batch_shape, n_seq, 1, 1, n_res)
    return full.reshape(math.prod(batch_shape), n_seq, n_res)


def pair_view(pair_bias: torch.Tensor, batch_shape: tuple[int, ...], heads: int, n_res: int) -> torch.Tensor:
    """The pair bias ``[*, 1, H, N_res, N_res]`` (broadcastable) as ``[B, H, N_res, N_res]`` with unit
    stride along the key residues (the kernels' tile loads are vectorised on it); broadcast batch
    and head dims get stride 0. A copy only when the batch dims cannot be merged or the last dim
    is strided or broadcast."""
    full = pair_bias.expand(*batch_shape, 1, heads, n_res, n_res)
    view = full.reshape(math.prod(batch_shape), heads, n_res, n_res)
    return view if view.stride(-1) == 1 else view.contiguous()


def bias_args(mask: torch.Tensor | None, pair: torch.Tensor | None, standin: torch.Tensor) -> tuple:
    """(MASK, PAIR) pointers and their strides ``(b, s, n)`` and ``(b, h, i, j)`` for a launch;
    ``standin`` (not read) and zero strides for a missing bias."""
    mask_ptr, mask_strides = (standin, (0, 0, 0)) if mask is None else (mask, mask.stride())
    pair_ptr, pair_strides = (standin, (0, 0, 0, 0)) if pair is None else (pair, pair.stride())
    return (mask_ptr, pair_ptr), (*mask_strides, *pair_strides)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    mask_bias: torch.Tensor | None, pair_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out like q ``[*, N_seq, N_res, H, D]`` (q's dtype and, where the kernel can write
    it, q's memory layout: :func:`dslab.kernels.evoformer.evoformer_layout.output_like`) and the fp32
    base-2 ``lse`` ``[B, N_seq, H, N_res]``. Inputs are validated by the caller."""
    batch_shape, batch, n_seq, n_res, heads, head_dim = dims(q)
    out = output_like(q)
    lse = torch.empty((batch, n_seq, heads, n_res), dtype=torch.float32, device=q.device)
    q5, k5, v5 = rows_view(q), rows_view(k), rows_view(v)
    o5 = out.view(batch, n_seq, n_res, heads, head_dim)
    mask = None if mask_bias is None else mask_view(mask_bias, batch_shape, n_seq, n_res)
    pair = None if pair_bias is None else pair_view(pair_bias, batch_shape, heads, n_res)
    (mask_ptr, pair_ptr), bias_strides = bias_args(mask, pair, lse)
    programs = batch * n_seq * heads

    def grid(meta):
        return (triton.cdiv(n_res, meta["BLOCK_M"]) * programs,)

    with device_guard(q):
        fwd_kernel(head_dim, q.dtype)[grid](
            q5, k5, v5, o5, lse, mask_ptr, pair_ptr,
            *[st for t in (q5, k5, v5, o5) for st in t.stride()[:4]], *bias_strides,
            n_seq, n_res, heads, n_res_bucket(n_res), head_dim**-0.5 * LOG2_E,
            HEAD_DIM=head_dim, HAS_MASK=mask is not None, HAS_PAIR=pair is not None, **kernel_flags(q.dtype),
        )
    return out, lse
