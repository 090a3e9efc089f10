"""The flash attention backward's bias-gradient partials and the two small launches of its
``ATOMIC`` plan.

Bias partials (:func:`bias_partials`): with ``bias_sums``, each backward program also writes the
column sums of the dQ, dK, dV rows it owns into slot ``first row // DB_SLOT_ROWS`` of an fp32
buffer (:func:`store_bias_sum`), whose sum over slots is the gradient of a bias added to packed
q, k, v; no kernel reads the gradients again for it.

The ``ATOMIC`` plan:

In the ``ATOMIC`` plan (:mod:`dslab.kernels.attention.attention_triton_bwd`) one launch of dK/dV programs
also computes ``dQ = scale * dS K`` (FlashAttention-2's five matmuls per tile instead of the split
plan's seven), and each program adds its fp32 dQ tiles into an fp32 accumulator shared by all key
blocks. Around it:

- :func:`prepare_dq` (before): ``delta = rowsum(dO * O)`` per query row, fp32 ``[batch, heads,
  seq_q]``, for the dK/dV programs to read, and the accumulator ``[batch, heads, seq_q,
  head_dim]`` zeroed, one pass over O and dO;
- :func:`finish_dq` (after): ``dQ = scale * accumulator`` rounded once into the caller's dQ (any
  row strides, e.g. a view of a packed ``[batch, seq, 3 * hidden]`` gradient) and, when asked, the
  column sums of the fp32 ``scale * accumulator`` rows into the bias partials.

Traffic per (batch, head) beside the main launch: O and dO read once, the accumulator written
(zeros), added into by the main launch (in L2), read once, and dQ written once.

The adds land in an order that depends on scheduling, so dQ can differ in its last bits from run
to run (the split plan's is bitwise reproducible): the backward takes this plan only where
``torch.are_deterministic_algorithms_enabled()`` is False.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels.attention.attention_triton import CachedLaunch
from dslab.kernels.dispatch import interpreting

#: Rows (queries or keys) per slot of the bias-gradient partials: a program owning rows
#: ``[start, start + BLOCK)`` writes slot ``start // DB_SLOT_ROWS``; every block is at least this tall.
DB_SLOT_ROWS = 32
#: Query rows per program of the ATOMIC plan's two launches (a multiple of DB_SLOT_ROWS).
BLOCK_ROWS = 64
_INTERPRET_BLOCK_ROWS = 32


@triton.jit
def store_bias_sum(DB, total, start, b, part, h, offs_d, stride_db_slot, stride_db_b, num_heads,
                   HEAD_DIM: tl.constexpr, DB_SLOT: tl.constexpr):
    """One program's column sums ``total`` [HEAD_DIM] of q (``part`` 0), k (1) or v (2) gradient
    rows from ``start``, into the fp32 partials ``[slots, batch, 3 * heads * HEAD_DIM]``."""
    slot = (start // DB_SLOT).to(tl.int64)
    col = (part * num_heads + h) * HEAD_DIM + offs_d
    tl.store(DB + slot * stride_db_slot + b * stride_db_b + col, total)


def bias_partials(batch: int, heads: int, head_dim: int, seq_q: int, seq_k: int, one_program_per_head: bool,
                  device: torch.device) -> torch.Tensor:
    """The fp32 ``[slots, batch, 3 * heads * head_dim]`` buffer the backward's programs write the
    column sums of their dQ, dK, dV rows into: one slot per ``DB_SLOT_ROWS`` rows of the longer
    sequence, zeroed (blocks span several slots and leave the others at 0), or one slot, left
    unset, when ``one_program_per_head`` (the ``FUSED`` launch: each (batch, head) program writes
    all of it).

    The dK part is written as zeros: a bias ``b_k`` on the keys shifts every score of query ``i``
    by the same ``q_i . b_k``, which the softmax removes (whatever the masks; dropout acts after
    it), so the key bias's gradient is exactly 0 (the sum of dK's rows is that gradient with the
    rounding of dS to the inputs' dtype; Dao's and PyTorch's kernels leave it as that noise)."""
    width = 3 * heads * head_dim
    if one_program_per_head:
        return torch.empty((1, batch, width), dtype=torch.float32, device=device)
    slots = triton.cdiv(max(seq_q, seq_k), DB_SLOT_ROWS)
    return torch.zeros((slots, batch, width), dtype=torch.float32, device=device)


@triton.jit
def _prepare_dq_kernel(
    O, DO, DELTA, ACC,
    stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos,
    num_heads, seq_q,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid ``(cdiv(seq_q, BLOCK), batch * heads)``: delta of ``BLOCK`` rows, their accumulator rows zeroed."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_m = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = offs_m < seq_q
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                mask=valid[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
                 mask=valid[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    rows = bh.to(tl.int64) * seq_q + offs_m
    tl.store(DELTA + rows, delta, mask=valid)
    tl.store(ACC + rows[:, None] * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32),
             mask=valid[:, None])


@triton.jit
def _finish_dq_kernel(
    ACC, DQ, DB,
    stride_dqb, stride_dqh, stride_dqs, stride_db_slot, stride_db_b,
    num_heads, seq_q, sm_scale,
    HEAD_DIM: tl.constexpr, HAS_DB: tl.constexpr, DB_SLOT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid ``(cdiv(seq_q, BLOCK), batch * heads)``: ``BLOCK`` rows of dQ from the accumulator, and
    with ``HAS_DB`` their column sums into slot ``first row // DB_SLOT`` of the q part of ``DB``."""
    tl.static_assert(not HAS_DB or BLOCK % DB_SLOT == 0)
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    start_m = pid * BLOCK
    offs_m = start_m + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = offs_m < seq_q
    rows = bh.to(tl.int64) * seq_q + offs_m
    dq = tl.load(ACC + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0) * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=valid[:, None])
    if HAS_DB:
        store_bias_sum(DB, tl.sum(dq, 0), start_m, b, 0, h, offs_d, stride_db_slot, stride_db_b, num_heads,
                       HEAD_DIM, DB_SLOT)


def _block_rows() -> int:
    return _INTERPRET_BLOCK_ROWS if interpreting() else BLOCK_ROWS


@functools.cache
def _launcher(kernel) -> CachedLaunch:
    config = triton.Config({"BLOCK": _block_rows()}, num_warps=4, num_stages=1)
    return CachedLaunch(triton.autotune(configs=[config], key=[])(kernel))


def reset_kernels() -> None:
    """Forget the launchers (their block size follows the interpreter switch)."""
    _launcher.cache_clear()


def _grid(seq_q: int, batch_heads: int):
    return lambda meta: (triton.cdiv(seq_q, meta["BLOCK"]), batch_heads)


def prepare_dq(out: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(delta, accumulator)`` for ``out`` and ``grad_out`` ``[batch, heads, seq_q, head_dim]`` (unit
    last stride): fp32 ``rowsum(grad_out * out)`` ``[batch, heads, seq_q]`` and a zeroed fp32
    ``[batch, heads, seq_q, head_dim]``."""
    batch, heads, seq_q, head_dim = out.shape
    delta = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=out.device)
    acc = torch.empty((batch, heads, seq_q, head_dim), dtype=torch.float32, device=out.device)
    _launcher(_prepare_dq_kernel)(
        _grid(seq_q, batch * heads), (out, grad_out, delta, acc),
        (*out.stride()[:3], *grad_out.stride()[:3], heads, seq_q), (), dict(HEAD_DIM=head_dim),
    )
    return delta, acc


def finish_dq(acc: torch.Tensor, dq: torch.Tensor, scale: float, partials: torch.Tensor | None) -> None:
    """Write ``scale * acc`` into ``dq`` (``[batch, heads, seq_q, head_dim]``, unit last stride)
    and, given ``partials`` (fp32 ``[slots, batch, 3 * heads * head_dim]``), the column sums of
    each program's rows into the q part of slot ``first row // DB_SLOT_ROWS``."""
    batch, heads, seq_q, head_dim = acc.shape
    has_db = partials is not None
    db = partials if has_db else acc
    db_strides = partials.stride()[:2] if has_db else (0, 0)
    _launcher(_finish_dq_kernel)(
        _grid(seq_q, batch * heads), (acc, dq, db),
        (*dq.stride()[:3], *db_strides, heads, seq_q), (scale,),
        dict(HEAD_DIM=head_dim, HAS_DB=has_db, DB_SLOT=DB_SLOT_ROWS),
    )
