"""The end of a transformer sublayer and the layer norm that reads it, as one op:

    h = residual + dropout(x + x_bias, p)          (the new residual stream)
    y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias

returns ``(y, h)``. A post-LN layer (BERT) keeps ``y``; a pre-LN layer (GPT-2) feeds ``y`` to its
next sublayer and ``h`` to the residual add after it.

Apart, :func:`dslab.kernels.dropout.bias_dropout_residual.bias_dropout_residual` writes h and the layer
norm reads it back; the backward's layer norm writes h's gradient and the dropout's backward reads
it back. Together, the forward kernel keeps h in registers between the two (one read of an
activation less) and the backward kernel writes both of the residual add's input gradients from
the row it has just computed, with the dropout, bias and layer-norm parameter gradients summed in
one finishing launch (:func:`dslab.kernels._grid.column_sums`): one read less and two launches
fewer each way.

The dropout mask is the one :mod:`dslab.kernels.dropout.bias_dropout_residual_triton` draws for the same
seed (a function of seed, row and column), and h is rounded to x's dtype before it is normalized,
so the op gives the unfused pair's outputs; its gradients differ from the pair's only in the order
the parameter gradients' partial sums are added.

Layers: :func:`dropout_add_layer_norm_reference` (PyTorch) → an ``autograd.Function`` over the
Triton kernels of :mod:`dslab.kernels.norm.layer_norm_triton` in eager mode. Under ``torch.compile``
(and off the Triton path) the op is the unfused pair, each through its own dispatch, so compiled
graphs see the two custom ops they already know.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dslab.kernels.dropout.bias_dropout_residual import (
    _check as _check_residual_add,
    bias_dropout_residual,
    bias_dropout_residual_reference,
    seed_tensor,
)
from dslab.kernels.dispatch import use_custom_op, use_triton
from dslab.kernels.norm.layer_norm import MAX_FUSED_N, TRITON_DTYPES, layer_norm
from dslab.kernels.norm.layer_norm import _check as _check_layer_norm


def dropout_add_layer_norm_reference(
    x: torch.Tensor,
    x_bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    seed: int | torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    keep_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference, ``(y, h)``; the mask as in
    :func:`dslab.kernels.dropout.bias_dropout_residual.bias_dropout_residual_reference`."""
    h = bias_dropout_residual_reference(x, x_bias, residual, p, training, seed, keep_mask)
    return F.layer_norm(h, h.shape[-1:], weight, bias, eps), h


@functools.cache
def _kernels():
    from dslab.kernels.dropout import bias_dropout_residual_triton
    from dslab.kernels.norm import layer_norm_triton

    return layer_norm_triton, bias_dropout_residual_triton


class _EagerDropoutAddLayerNorm(torch.autograd.Function):
    """``(y, h)`` from the fused forward kernel; the fused backward kernel when y gets a gradient."""

    @staticmethod
    def forward(ctx, x, x_bias, residual, weight, bias, eps, p, seed):
        layer_norm_triton, _ = _kernels()
        y, h, mean, rstd = layer_norm_triton.forward(x, weight, bias, residual, eps, x_bias, p, seed)
        ctx.set_materialize_grads(False)
        ctx.p = p
        ctx.save_for_backward(h, weight, bias, x_bias, mean, rstd, seed)
        return y, h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dh):
        h, weight, bias, x_bias, mean, rstd, seed = ctx.saved_tensors
        layer_norm_triton, residual_add_triton = _kernels()
        if dy is None:
            if dh is None:
                return (None,) * 8
            # Only h reached the loss: the residual add's backward alone.
            if ctx.p == 0:
                dx, dx_bias = dh, (dh.sum(dim=0) if x_bias is not None else None)
            else:
                dx, dx_bias = residual_add_triton.backward(dh, x_bias, ctx.p, seed)
            return dx, dx_bias, dh, None, None, None, None, None
        dresidual, dx, dw, db, dx_bias = layer_norm_triton.backward_dropout_add(
            dy, h, weight, bias, mean, rstd, dh, x_bias, ctx.p, seed
        )
        return dx, dx_bias, dresidual, dw, db, None, None, None


def dropout_add_layer_norm(
    x: torch.Tensor,
    x_bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    seed: int | torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(h, weight, bias, eps), h)`` with ``h = residual + dropout(x + x_bias, p)``.

    ``x``, ``residual`` [..., N] in one dtype, ``x_bias`` [N] in that dtype or None; ``weight`` and
    ``bias`` (the layer norm's) [N] or None, in any float dtype. Dropout applies when ``training``
    and ``p > 0``, its mask a function of ``seed`` as in
    :func:`dslab.kernels.dropout.bias_dropout_residual.bias_dropout_residual` (the same mask for the same
    seed). Gradients flow to every tensor argument. The fused Triton path runs on CUDA tensors (or
    under the ``triton`` backend with ``TRITON_INTERPRET=1``) in fp32/fp16/bf16 with N <= 8192 and
    outside ``torch.compile``; otherwise the two ops run one after the other.
    """
    _check_residual_add(x, x_bias, residual, p, training, seed)
    _check_layer_norm(x, weight, bias, eps, None)
    n = x.shape[-1]
    fused = (x.dtype in TRITON_DTYPES and 0 < n <= MAX_FUSED_N and not use_custom_op()
             and use_triton(x, x_bias, residual, weight, bias))
    if not fused:
        h = bias_dropout_residual(x, x_bias, residual, p, training, seed)
        return layer_norm(h, weight, bias, eps), h
    p_applied = float(p) if training else 0.0
    seed = seed_tensor(seed, x.device) if p_applied > 0 else None
    y, h = _EagerDropoutAddLayerNorm.apply(
        x.reshape(-1, n), x_bias, residual.reshape(-1, n), weight, bias, eps, p_applied, seed
    )
    return y.view(x.shape), h.view(x.shape)
