"""Bias add fused with GELU, the activation after a transformer MLP's first matmul.

    y = gelu(x + bias)        x [..., N], bias [N] (or None), broadcast over the rows of x

``approximate`` is ``"none"`` (exact, erf) or ``"tanh"``, as in :func:`torch.nn.functional.gelu`.
Backward recomputes ``x + bias`` from the saved inputs instead of storing it: dx = dy * gelu'(x + b)
and dbias = sum over rows of dx.

Layers: :func:`bias_gelu_reference` (PyTorch) → the ``dslab::bias_gelu`` custom op with its
autograd (``dslab::bias_gelu_backward``) under ``torch.compile``, and an ``autograd.Function``
making the same launches in eager mode with less host time than the custom ops' Python dispatch
(see :mod:`dslab.kernels.norm.layer_norm`) → the Triton kernels in
:mod:`dslab.kernels.activation.bias_gelu_triton`. :func:`bias_gelu` picks between them with
:func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton

APPROXIMATIONS = ("none", "tanh")
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bias_gelu_reference(
    x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """The PyTorch reference: ``F.gelu(x + bias, approximate=approximate)``."""
    return F.gelu(x + bias if bias is not None else x, approximate=approximate)


@torch.library.custom_op("dslab::bias_gelu", mutates_args=())
def _bias_gelu_op(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """gelu(x + bias) for ``x`` [M, N]."""
    from dslab.kernels.activation import bias_gelu_triton

    return bias_gelu_triton.forward(x, bias, approximate)


@_bias_gelu_op.register_fake
def _(x, bias, approximate):
    return x.new_empty(x.shape)


@torch.library.custom_op("dslab::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward_op(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias) for ``x`` [M, N]; dbias is an empty tensor when there is no bias."""
    from dslab.kernels.activation import bias_gelu_triton

    dx, dbias = bias_gelu_triton.backward(dy, x, bias, approximate)
    return dx, dbias if dbias is not None else x.new_empty(0)


@_bias_gelu_backward_op.register_fake
def _(dy, x, bias, approximate):
    return x.new_empty(x.shape), torch.empty_like(bias) if bias is not None else x.new_empty(0)


def _setup(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.approximate = approximate
    ctx.save_for_backward(x, bias)


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, dbias = _bias_gelu_backward_op(dy, x, bias, ctx.approximate)
    return dx, (dbias if bias is not None else None), None


_bias_gelu_op.register_autograd(_backward, setup_context=_setup)


@functools.cache
def _triton_module():
    from dslab.kernels.activation import bias_gelu_triton

    return bias_gelu_triton


class _EagerBiasGelu(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.approximate = approximate
        ctx.save_for_backward(x, bias)
        return _triton_module().forward(x, bias, approximate)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, dbias = _triton_module().backward(dy, x, bias, ctx.approximate)
        return dx, dbias, None


def bias_gelu(
    x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """``gelu(x + bias)`` for ``x`` [..., N] and ``bias`` [N] (or None), in x's dtype.

    Gradients flow to x and bias. The Triton path runs on CUDA tensors (or under the ``triton``
    backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16; otherwise the reference runs.
    """
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the bias's)")
    n = x.shape[-1]
    if bias is not None:
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},) to match x's last dimension, got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise ValueError(f"bias must have x's dtype {x.dtype}, got {bias.dtype}")
    if not (x.dtype in TRITON_DTYPES and use_triton(x, bias)):
        return bias_gelu_reference(x, bias, approximate)
    x2d = x.reshape(-1, n)
    if use_custom_op():
        return _bias_gelu_op(x2d, bias, approximate).view(x.shape)
    return _EagerBiasGelu.apply(x2d, bias, approximate).view(x.shape)
