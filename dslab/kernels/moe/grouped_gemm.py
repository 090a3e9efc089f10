"""Grouped GEMM: one linear layer per group of rows, the expert matmuls of a mixture of experts.

    y[offsets[g]:offsets[g+1]] = x[offsets[g]:offsets[g+1]] @ w[g].T + bias[g]

``x`` [M, K] holds the rows sorted by group, ``w`` [G, N, K] each group's weight in ``nn.Linear``'s
[out, in] layout, ``bias`` [G, N] or None, ``group_offsets`` [G + 1] (int32 or int64, on x's device)
the groups' row boundaries: ``offsets[0] = 0``, ``offsets[G] = M``, nondecreasing; a group may be
empty. ``y`` is [M, N] in x's dtype. Gradients:

    dx[rows of g] = dy[rows of g] @ w[g]             [M, K]
    dw[g]         = dy[rows of g].T @ x[rows of g]   [N, K]   (zeros for an empty group)
    dbias[g]      = dy[rows of g].sum(0)             [N]

Forward and backward are ``2 * M * N * K`` flops each for y, dx and dw; they read ``x``, ``w`` and
``dy`` and write ``y``, ``dx`` and ``dw`` (``M*K + G*N*K + M*N`` elements each at the least).

x, w and bias share one dtype, or x is fp16/bf16 while w and bias are fp32 *master weights* (bf16
autocast over fp32 parameters): the op then casts w and bias to x's dtype for the products and
returns dw and dbias in fp32 straight from the kernel's fp32 accumulators, so that no bf16 copy of
the weight gradient is written and cast back (a cast's backward) on every step.

Layers: :func:`grouped_gemm_reference` (a per-group loop of ``F.linear``; it reads the offsets on
the host) → the ``dslab::grouped_gemm`` custom op with its autograd
(``dslab::grouped_gemm_backward_input`` for dx, ``dslab::grouped_gemm_backward_weight`` for dw and
dbias) under ``torch.compile`` and dispatch modes, and an ``autograd.Function`` making the same
launches in eager mode → the Triton kernels in :mod:`dslab.kernels.moe.grouped_gemm_triton`, which read
the offsets on the device and never synchronise with the host. :func:`grouped_gemm` picks between
them with :func:`dslab.kernels.dispatch.use_triton`. The experts' two-layer MLP runs on the same
kernels with its activation fused into their epilogues: :mod:`dslab.kernels.moe.grouped_mlp`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OFFSET_DTYPES = (torch.int32, torch.int64)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _compute_dtype(w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """w and bias in the products' dtype (a cast only for fp32 master weights)."""
    return w.to(dtype), (bias.to(dtype) if bias is not None else None)


def _check_offset_values(bounds: list[int], rows: int) -> None:
    if bounds[0] != 0 or bounds[-1] != rows:
        raise ValueError(f"group_offsets must run from 0 to x's {rows} rows, got {bounds[0]} .. {bounds[-1]}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"group_offsets must be nondecreasing, got {bounds}")


def grouped_gemm_reference(
    x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The PyTorch reference: ``F.linear`` on each group's rows, concatenated.

    Reads ``group_offsets`` on the host (a synchronisation on a GPU) and checks its values; one
    matmul launch per group. Gradients come from autograd through the loop.
    """
    bounds = group_offsets.tolist()
    _check_offset_values(bounds, x.shape[0])
    w = w.to(x.dtype)
    bias = bias.to(x.dtype) if bias is not None else None
    outputs = [
        F.linear(x[bounds[g]:bounds[g + 1]], w[g], bias[g] if bias is not None else None)
        for g in range(w.shape[0])
    ]
    return torch.cat(outputs) if outputs else x.new_empty((0, w.shape[1]))


@functools.cache
def _triton_module():
    from dslab.kernels.moe import grouped_gemm_triton

    return grouped_gemm_triton


@torch.library.custom_op("dslab::grouped_gemm", mutates_args=())
def _grouped_gemm_op(
    x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y [M, N] for x [M, K], w [G, N, K], group_offsets [G + 1], bias [G, N] or None."""
    w, bias = _compute_dtype(w, bias, x.dtype)
    return _triton_module().forward(x, w, group_offsets, bias)


@_grouped_gemm_op.register_fake
def _(x, w, group_offsets, bias):
    return x.new_empty((x.shape[0], w.shape[1]))


@torch.library.custom_op("dslab::grouped_gemm_backward_input", mutates_args=())
def _backward_input_op(dy: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """dx [M, K] for dy [M, N] and w [G, N, K]."""
    return _triton_module().backward_input(dy, w, group_offsets)


@_backward_input_op.register_fake
def _(dy, w, group_offsets):
    return dy.new_empty((dy.shape[0], w.shape[2]))


@torch.library.custom_op("dslab::grouped_gemm_backward_weight", mutates_args=())
def _backward_weight_op(
    dy: torch.Tensor, x: torch.Tensor, group_offsets: torch.Tensor, with_bias: bool, fp32_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dw [G, N, K], dbias [G, N]) for dy [M, N] and x [M, K], in fp32 with ``fp32_out`` else in
    x's dtype; dbias is an empty tensor without a bias."""
    out_dtype = torch.float32 if fp32_out else x.dtype
    dw, dbias = _triton_module().backward_weight(dy, x, group_offsets, with_bias, out_dtype)
    return dw, dbias if dbias is not None else x.new_empty(0, dtype=out_dtype)


@_backward_weight_op.register_fake
def _(dy, x, group_offsets, with_bias, fp32_out):
    groups, n = group_offsets.shape[0] - 1, dy.shape[1]
    dtype = torch.float32 if fp32_out else x.dtype
    dbias = x.new_empty((groups, n), dtype=dtype) if with_bias else x.new_empty(0, dtype=dtype)
    return x.new_empty((groups, n, x.shape[1]), dtype=dtype), dbias


def _setup(ctx, inputs, output):
    x, w, group_offsets, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, w, group_offsets)


def _backward(ctx, dy):
    x, w, group_offsets = ctx.saved_tensors
    needs_x, needs_w, _, needs_bias = ctx.needs_input_grad
    dx = _backward_input_op(dy, w.to(x.dtype), group_offsets) if needs_x else None
    dw = dbias = None
    if needs_w or (ctx.has_bias and needs_bias):
        dw, dbias = _backward_weight_op(dy, x, group_offsets, ctx.has_bias, w.dtype != x.dtype)
    return dx, dw, None, (dbias if ctx.has_bias else None)


_grouped_gemm_op.register_autograd(_backward, setup_context=_setup)


class _EagerGroupedGemm(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, x, w, group_offsets, bias):
        ctx.has_bias = bias is not None
        ctx.weight_dtype = w.dtype
        w, bias = _compute_dtype(w, bias, x.dtype)
        ctx.save_for_backward(x, w, group_offsets)
        return _triton_module().forward(x, w, group_offsets, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w, group_offsets = ctx.saved_tensors
        needs_x, needs_w, _, needs_bias = ctx.needs_input_grad
        dx = _triton_module().backward_input(dy, w, group_offsets) if needs_x else None
        dw = dbias = None
        if needs_w or (ctx.has_bias and needs_bias):
            dw, dbias = _triton_module().backward_weight(dy, x, group_offsets, ctx.has_bias, ctx.weight_dtype)
        return dx, dw, None, dbias


def _validate(x, w, group_offsets, bias, w_name: str = "w", bias_name: str = "bias") -> None:
    """Checks shapes, dtypes and devices; errors name the arguments as ``w_name`` and ``bias_name``
    (the grouped MLP's first layer calls them w1 and b1)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if w.dim() != 3:
        raise ValueError(f"{w_name} must be 3-D [G, N, K], got shape {tuple(w.shape)}")
    groups, n, k = w.shape
    if groups == 0:
        raise ValueError(f"{w_name} must hold at least one group (its first dimension is 0)")
    if k != x.shape[1]:
        raise ValueError(f"{w_name}'s last dimension {k} must equal x's K = {x.shape[1]} ({w_name} is [G, N, K])")
    if w.dtype != x.dtype and not (w.dtype == torch.float32 and x.dtype in HALF_DTYPES):
        raise ValueError(f"{w_name} must have x's dtype {x.dtype} (or be fp32 master weights for fp16/bf16 x), "
                         f"got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"{w_name} must be on x's device {x.device}, got {w.device}")
    if group_offsets.dim() != 1 or group_offsets.shape[0] != groups + 1:
        raise ValueError(f"group_offsets must have shape ({groups + 1},) (G + 1 for {w_name}'s G = {groups}), "
                         f"got {tuple(group_offsets.shape)}")
    if group_offsets.dtype not in OFFSET_DTYPES:
        raise ValueError(f"group_offsets must be int32 or int64, got {group_offsets.dtype}")
    if group_offsets.device != x.device:
        raise ValueError(f"group_offsets must be on x's device {x.device}, got {group_offsets.device}")
    if bias is not None:
        if tuple(bias.shape) != (groups, n):
            raise ValueError(f"{bias_name} must have shape ({groups}, {n}) ({w_name}'s [G, N]), "
                             f"got {tuple(bias.shape)}")
        if bias.dtype != w.dtype:
            raise ValueError(f"{bias_name} must have {w_name}'s dtype {w.dtype}, got {bias.dtype}")
        if bias.device != x.device:
            raise ValueError(f"{bias_name} must be on x's device {x.device}, got {bias.device}")


def grouped_gemm(
    x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g].T + bias[g]`` for x [M, K] (rows sorted by group),
    w [G, N, K], group_offsets [G + 1] (int32/int64 on x's device), bias [G, N] or None; y [M, N]
    in x's dtype.

    Gradients flow to x, w and bias. The Triton path runs on CUDA tensors (or under the ``triton``
    backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16 and never synchronises; it trusts the
    offsets' values (checking them would read them on the host). Otherwise, and for N = 0 or
    K = 0, the reference runs, which checks them. Shapes, dtypes and devices are checked here and
    raise ``ValueError`` naming the argument.
    """
    _validate(x, w, group_offsets, bias)
    if not (x.dtype in TRITON_DTYPES and w.shape[1] > 0 and w.shape[2] > 0
            and use_triton(x, w, group_offsets, bias)):
        return grouped_gemm_reference(x, w, group_offsets, bias)
    if use_custom_op():
        return _grouped_gemm_op(x, w, group_offsets, bias)
    return _EagerGroupedGemm.apply(x, w, group_offsets, bias)
