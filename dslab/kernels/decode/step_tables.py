"""``step_tables``: what a rotary decode step computes once before its layers, in one launch.

A Llama-layout step (:mod:`dslab.inference.fused_decode_llama`) needs, per row, the end of its
valid cache range (``write_pos + 1``, int32, the attention kernels' bound) and the rotary tables of
its position id ``write_pos - valid_start`` (``cos`` and ``sin`` of ``position * inv_freq``, fp32
``[rows, head_dim / 2]``, every layer's QKV epilogue reads them). Op by op that is seven small
kernels a step (add, cast, subtract, cast, multiply, cos, sin: about 10 us of an H200's 0.85 ms
batch-1 Llama-3.2-1B step, ``benchmarks/decode_profile.py``); ``_step_tables_kernel`` is one, a
program a row.

The arithmetic is :func:`step_tables_reference`'s: the position converted to fp32 once (round to
nearest), one fp32 multiply by ``inv_freq``, then ``tl.cos``/``tl.sin``, which Triton compiles
to libdevice's ``cosf``/``sinf`` at fp32 (the CUDA math library's, as PyTorch's ``cos``/``sin`` on
a GPU; not the approximate instructions, which lose accuracy at the large angles of long
contexts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import device_guard
from dslab.kernels.attention.rope import rope_tables
from dslab.kernels.dispatch import use_triton


def step_tables_reference(write_pos: torch.Tensor, valid_start: torch.Tensor, inv_freq: torch.Tensor):
    """:func:`step_tables` op by op."""
    return (write_pos + 1).to(torch.int32), *rope_tables(write_pos - valid_start, inv_freq)


@triton.jit
def _step_tables_kernel(WRITE_POS, VALID_START, INV_FREQ, VALID_END, COS, SIN, half, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    write_pos = tl.load(WRITE_POS + row).to(tl.int64)
    tl.store(VALID_END + row, (write_pos + 1).to(tl.int32))
    position = (write_pos - tl.load(VALID_START + row).to(tl.int64)).to(tl.float32)
    index = tl.arange(0, BLOCK)
    mask = index < half
    angle = position * tl.load(INV_FREQ + index, mask=mask, other=0.0)
    tl.store(COS + row * half + index, tl.cos(angle), mask=mask)
    tl.store(SIN + row * half + index, tl.sin(angle), mask=mask)


def step_tables(write_pos: torch.Tensor, valid_start: torch.Tensor, inv_freq: torch.Tensor):
    """``(valid_end, cos, sin)``: ``write_pos + 1`` as int32 ``[rows]`` and the fp32 rotary tables
    ``[rows, head_dim / 2]`` of positions ``write_pos - valid_start`` (integer ``[rows]`` each) and
    ``inv_freq`` (fp32 ``[head_dim / 2]``)."""
    if write_pos.dim() != 1 or valid_start.shape != write_pos.shape:
        raise ValueError(f"step_tables: write_pos and valid_start must be [rows] alike, got "
                         f"{tuple(write_pos.shape)} and {tuple(valid_start.shape)}")
    if write_pos.dtype.is_floating_point or valid_start.dtype.is_floating_point:
        raise ValueError(f"step_tables: positions must be integers, got {write_pos.dtype} and {valid_start.dtype}")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise ValueError(f"step_tables: inv_freq must be fp32 [head_dim / 2], got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")
    if not use_triton(write_pos, valid_start, inv_freq):
        return step_tables_reference(write_pos, valid_start, inv_freq)
    rows, half = write_pos.shape[0], inv_freq.shape[0]
    valid_end = torch.empty(rows, dtype=torch.int32, device=write_pos.device)
    cos = torch.empty((rows, half), dtype=torch.float32, device=write_pos.device)
    sin = torch.empty_like(cos)
    with device_guard(write_pos):
        _step_tables_kernel[(rows,)](write_pos, valid_start, inv_freq.contiguous(), valid_end, cos, sin, half,
                                     BLOCK=triton.next_power_of_2(half), num_warps=1)
    return valid_end, cos, sin
