"""Column sums of a matrix in fp32: the bias gradient of a Linear, ``dbias = dy.sum(0)``.

    out[n] = sum_m x[m, n]        x [M, N] (unit column stride), out [N] in ``out_dtype``

PyTorch reduces such a tall, narrow matrix along its rows slowly: on an H100, ``dy.sum(0)`` of a
bf16 ``[65536, 128]`` takes ~64 us (5x a copy of it), and the Evoformer's pair stack has dozens
per step. Here a grid sized to the programs resident on the device has each program sum its row
tiles in fp32, and the ``[programs, N]`` partials are added in a fixed order
(:mod:`dslab.kernels._grid`): one read of x, deterministic.

:func:`linear` uses it: ``F.linear`` whose backward computes the bias gradient this way (the
input and weight gradients are cuBLAS matmuls, as autograd's).

Layers: :func:`column_sum_reference` → the ``dslab::column_sum`` custom op (under
``torch.compile``) or a direct launch in eager mode → the Triton kernel below.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def column_sum_reference(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch reference: ``x.sum(0)`` accumulated in fp32, cast to ``out_dtype``."""
    return x.sum(0, dtype=torch.float32).to(out_dtype)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _column_partials_kernel(X, PARTIAL, M, N, stride_x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for tile in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            mask = (rows < M)[:, None] & col_mask[None, :]
            acc += tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        tl.store(PARTIAL + pid * N + cols, tl.sum(acc, axis=0), mask=col_mask)

    return _column_partials_kernel


def _triton_column_sum(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    import triton

    from dslab.kernels._grid import column_sums, device_guard, resident_programs

    m, n = x.shape
    if m == 0 or n == 0:
        return torch.zeros(n, dtype=out_dtype, device=x.device)
    kernel = _kernel()
    block_n = min(triton.next_power_of_2(n), 256)
    block_m = max(1, 4096 // block_n)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    row_tiles, col_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    with device_guard(x):
        def probe_args():
            return x, torch.empty(1, dtype=torch.float32, device=x.device), m, n, x.stride(0)

        resident = resident_programs(kernel, probe_args, meta, ("column_sum", n, x.dtype), x.device)
        programs = min(row_tiles, max(1, resident // col_tiles))
        partial = torch.empty((1, programs, n), dtype=torch.float32, device=x.device)
        kernel[(programs, col_tiles)](x, partial, m, n, x.stride(0), **meta)
        (out,) = column_sums(partial, (out_dtype,))
    return out


@torch.library.custom_op("dslab::column_sum", mutates_args=())
def _column_sum_op(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Column sums of ``x`` [M, N] in ``out_dtype``."""
    return _triton_column_sum(x, out_dtype)


@_column_sum_op.register_fake
def _(x, out_dtype):
    return x.new_empty(x.shape[1], dtype=out_dtype)


def column_sum(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x.sum(0)`` of ``x`` [M, N] accumulated in fp32, in ``out_dtype`` (default x's dtype).
    Not differentiable (it serves backward passes). Triton on CUDA tensors (or under the
    ``triton`` backend with ``TRITON_INTERPRET=1``), else the reference."""
    if x.dim() != 2:
        raise ValueError(f"x must be a matrix [M, N], got shape {tuple(x.shape)}")
    out_dtype = out_dtype or x.dtype
    if not (x.dtype in TRITON_DTYPES and use_triton(x)):
        return column_sum_reference(x, out_dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if use_custom_op():
        return _column_sum_op(x, out_dtype)
    return _triton_column_sum(x, out_dtype)


class _Linear(torch.autograd.Function):
    """``F.linear`` whose bias gradient is :func:`column_sum` of the output gradient."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        w = weight.to(dy.dtype)
        dx = torch.matmul(dy, w) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.mm(dy2d.t(), x.reshape(-1, x.shape[-1]).to(dy.dtype)).to(weight.dtype)
        db = column_sum(dy2d, bias.dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the bias gradient from :func:`column_sum` (fp32 sums,
    returned in the bias's dtype). Without a bias, or off the Triton path, plain ``F.linear``."""
    if bias is None or not use_triton(x):
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias)
