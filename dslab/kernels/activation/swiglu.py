"""SwiGLU, the gated activation of a Llama MLP, on the fused gate and up projections.

    x = [g | u]            x [..., 2I]: gate_proj's output g in the first I columns, up_proj's u
                           in the last I (the two matmuls fused into one, gate rows first)
    y = silu(g) * u        y [..., I],  silu(g) = g * sigmoid(g)

Backward recomputes sigmoid(g) from the saved x (no activation output is saved), with
s = sigmoid(g) and 1 - s = sigmoid(-g) each evaluated directly (no subtraction from 1):

    dg = dy * u * silu'(g),   silu'(g) = s + g * s * (1 - s)
    du = dy * silu(g)

and returns dx = [dg | du], ``[..., 2I]``, contiguous.

x's rows may have a row stride larger than 2I (a column slice of a wider projection output),
provided the last dimension has unit stride: the kernels read them in place.

Layers: :func:`swiglu_reference` (PyTorch) → the ``dslab::swiglu`` custom op with its autograd
(``dslab::swiglu_backward``) under ``torch.compile``, and an ``autograd.Function`` making the same
launches in eager mode with less host time than the custom ops' Python dispatch (see
:mod:`dslab.kernels.norm.layer_norm`) → the Triton kernels in
:mod:`dslab.kernels.activation.swiglu_triton`. :func:`swiglu` picks between them with
:func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(x: torch.Tensor) -> int:
    """I, half of x's last dimension; ValueError when x cannot hold ``[g | u]``."""
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the fused gate and up columns, 2I)")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must have a floating-point dtype, got {x.dtype}")
    width = x.shape[-1]
    if width % 2:
        raise ValueError(
            f"x's last dimension must be even (gate and up halves, 2I), got {width}"
        )
    return width // 2


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference: ``F.silu(g) * u`` with ``g, u = x.chunk(2, dim=-1)``, x ``[..., 2I]``
    → ``[..., I]`` in x's dtype."""
    _check(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.library.custom_op("dslab::swiglu", mutates_args=())
def _swiglu_op(x: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for ``x`` [M, 2I] (unit last stride, any row stride) → [M, I]."""
    from dslab.kernels.activation import swiglu_triton

    return swiglu_triton.forward(x)


@_swiglu_op.register_fake
def _(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@torch.library.custom_op("dslab::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dx = [dg | du] [M, 2I] for ``dy`` [M, I] and the saved ``x`` [M, 2I]."""
    from dslab.kernels.activation import swiglu_triton

    return swiglu_triton.backward(dy, x)


@_swiglu_backward_op.register_fake
def _(dy, x):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    (x,) = inputs
    ctx.save_for_backward(x)


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return _swiglu_backward_op(dy, x)


_swiglu_op.register_autograd(_backward, setup_context=_setup)


@functools.cache
def _triton_module():
    from dslab.kernels.activation import swiglu_triton

    return swiglu_triton


class _EagerSwiglu(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _triton_module().forward(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _triton_module().backward(dy, x)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``x = [g | u]`` ``[..., 2I]`` → ``[..., I]``, in x's dtype.

    Gradients flow to x. Rows may be strided (unit last stride). The Triton path runs on CUDA
    tensors (or under the ``triton`` backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16;
    otherwise the reference runs.
    """
    half = _check(x)
    if not (x.dtype in TRITON_DTYPES and use_triton(x)):
        return swiglu_reference(x)
    x2d = x.reshape(x.shape[:-1].numel(), 2 * half)
    out_shape = (*x.shape[:-1], half)
    if use_custom_op():
        return _swiglu_op(x2d).view(out_shape)
    return _EagerSwiglu.apply(x2d).view(out_shape)
