"""Layer norm over the channels of a channels-first tensor, written channels last.

    y[b, s, c] = (x[b, c, s] - mean_c x[b, :, s]) * rstd[b, s] * weight[c] + bias[c]
    rstd[b, s] = 1 / sqrt(var_c x[b, :, s] + eps)

``x`` is ``[B, C, *S]`` (channels first; at least one spatial dimension), ``y`` is ``[B, *S, C]``
(contiguous, x's dtype), ``weight`` and ``bias`` are ``[C]`` or None (no affine), in x's dtype or, for
bf16/fp16 x, fp32 (master weights under autocast; their gradients come back in their own dtype
from fp32 sums). Statistics are fp32 with the biased variance, as
:func:`torch.nn.functional.layer_norm` on ``x.movedim(1, -1)``, which is the reference.

Why: the Evoformer's triangle multiplication computes its product channels first,
``[B, c, R, R]`` (the layout its matmul multiplies in), then normalises it over ``c`` and feeds the
channels-last result to a Linear. A last-dimension layer norm needs unit-stride rows, so
``layer_norm(product.permute(0, 2, 3, 1))`` makes a permuted copy forward and another for the
gradient backward: about 1 ms of a 31 ms training step on an H100 (N_res 256, 4 blocks, outgoing and
incoming). Here the transpose happens inside the kernels' tiles.

Memory traffic (elements of ``B C P``, P the product of S): forward reads x and writes y (2, plus 8
bytes of fp32 statistics per position), against 4 for the permuted copy and a layer norm; backward
reads x and dy and writes dx (3, plus the statistics and the small parameter-gradient partials),
against 5 for a layer-norm backward and the copy of its gradient back to channels first. The
permuted copy kept for the backward (``B C P`` elements) is gone too.

Flops (estimates, as :mod:`dslab.profilers.flops_formulas` counts a layer norm): 5 per element
forward (4 without weight and bias), 10 per element backward (6 without).

Layers: :func:`layer_norm_channels_first_reference` (PyTorch) → the
``dslab::layer_norm_channels_first`` custom op with its autograd
(``dslab::layer_norm_channels_first_backward``) under ``torch.compile``, and an
``autograd.Function`` making the same launches in eager mode → the Triton kernels in
:mod:`dslab.kernels.norm.layer_norm_channels_triton`. :func:`layer_norm_channels_first` picks between
them with :func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)

# Widest channel column the kernels hold in registers (the backward keeps x, dy, weight and two
# gradient accumulators per element of a [C, BLOCK_P] tile); wider inputs are refused on every
# backend, so that a model behaves the same on CPU and GPU. Equal to
# layer_norm_channels_triton.MAX_CHANNELS, repeated so that checking does not import Triton.
MAX_CHANNELS = 256


def layer_norm_channels_first_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """The PyTorch reference: ``F.layer_norm`` over ``x.movedim(1, -1)``, contiguous ``[B, *S, C]``.
    CUDA's layer norm takes no parameters in another dtype than x (the CPU's does): there, 16-bit x
    with fp32 parameters is normalised in fp32, as autocast runs a layer norm, and cast back."""
    if x.is_cuda and any(p is not None and p.dtype != x.dtype for p in (weight, bias)):
        y = F.layer_norm(x.movedim(1, -1).float(), x.shape[1:2], None if weight is None else weight.float(),
                         None if bias is None else bias.float(), eps)
        return y.to(x.dtype).contiguous()
    return F.layer_norm(x.movedim(1, -1), x.shape[1:2], weight, bias, eps).contiguous()


def _empty_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, _, p = x.shape
    return x.new_empty((b, p), dtype=torch.float32), x.new_empty((b, p), dtype=torch.float32)


@functools.cache
def _triton_module():
    from dslab.kernels.norm import layer_norm_channels_triton

    return layer_norm_channels_triton


@torch.library.custom_op("dslab::layer_norm_channels_first", mutates_args=())
def _layer_norm_channels_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [B, P, C], mean [B, P], rstd [B, P]) for ``x`` [B, C, P]."""
    return _triton_module().forward(x, weight, bias, eps)


@_layer_norm_channels_op.register_fake
def _(x, weight, bias, eps):
    b, c, p = x.shape
    return (x.new_empty((b, p, c)), *_empty_stats(x))


@torch.library.custom_op("dslab::layer_norm_channels_first_backward", mutates_args=())
def _layer_norm_channels_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [B, C, P], dweight, dbias) for ``x`` [B, C, P] and ``dy`` [B, P, C]. A missing
    parameter's gradient is an empty tensor."""
    dx, dw, db = _triton_module().backward(dy, x, weight, bias, mean, rstd)
    return dx, _or_empty(dw, x), _or_empty(db, x)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


@_layer_norm_channels_backward_op.register_fake
def _(dy, x, weight, bias, mean, rstd):
    dw = torch.empty_like(weight) if weight is not None else x.new_empty(0)
    db = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    return x.new_empty(x.shape), dw, db


def _setup(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    if dy is None:
        return None, None, None, None
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_channels_backward_op(dy, x, weight, bias, mean, rstd)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), None


_layer_norm_channels_op.register_autograd(_backward, setup_context=_setup)


class _EagerLayerNormChannels(torch.autograd.Function):
    """The custom ops' launches for eager mode: returns ``y`` [B, P, C]."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _triton_module().forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = _triton_module().backward(dy, x, weight, bias, mean, rstd)
        return dx, dw, db, None


def _check(x, weight, bias, eps) -> None:
    if x.dim() < 3:
        raise ValueError(f"x must be [B, C, *S] with at least one spatial dimension (rank >= 3), "
                         f"got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    c = x.shape[1]
    if not 0 < c <= MAX_CHANNELS:
        raise ValueError(f"x's channel dimension (dim 1) must be between 1 and {MAX_CHANNELS}, got {c}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if tuple(param.shape) != (c,):
            raise ValueError(f"{name} must have shape ({c},) to match x's channels (dim 1), got {tuple(param.shape)}")
        if not (param.dtype == x.dtype or (param.dtype == torch.float32 and x.dtype in HALF_DTYPES)):
            raise ValueError(f"{name} must be in x's dtype {x.dtype} (or float32 for bf16/fp16 x), got {param.dtype}")
        if param.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {param.device}")
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise ValueError(f"bias must have weight's dtype {weight.dtype}, got {bias.dtype}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def layer_norm_channels_first(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """Layer norm of ``x`` ``[B, C, *S]`` over its channels (dim 1), returned channels last as a
    contiguous ``[B, *S, C]`` in x's dtype.

    Gradients flow to x, weight and bias. The Triton path runs on CUDA tensors (or under the
    ``triton`` backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16; otherwise the reference
    runs. C above :data:`MAX_CHANNELS` is a ValueError on every backend.
    """
    _check(x, weight, bias, eps)
    if not (x.dtype in TRITON_DTYPES and use_triton(x, weight, bias)):
        return layer_norm_channels_first_reference(x, weight, bias, eps)
    b, c = x.shape[:2]
    x3 = x.reshape(b, c, math.prod(x.shape[2:]))
    if use_custom_op():
        y = _layer_norm_channels_op(x3, weight, bias, eps)[0]
    else:
        y = _EagerLayerNormChannels.apply(x3, weight, bias, eps)
    return y.view(b, *x.shape[2:], c)
