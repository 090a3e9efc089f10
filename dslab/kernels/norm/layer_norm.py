"""Layer normalization over the last dimension, optionally fused with the residual add of a
pre-LN transformer block.

    h = x + residual                         (when ``residual`` is given: the new residual stream)
    y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias

``x`` is ``[..., N]`` in bf16, fp16 or fp32; ``weight`` and ``bias`` are ``[N]`` or None (no
affine). Statistics are computed in fp32 (biased variance, as :func:`torch.nn.functional.layer_norm`).

:func:`layer_norm_fork` also hands the input back as a second output whose gradient the backward
kernel adds (the pre-LN residual stream's two uses, without autograd's add kernel).

Layers: :func:`layer_norm_reference` (PyTorch) → the ``dslab::layer_norm`` / ``dslab::add_layer_norm``
custom ops with their autograd (``dslab::layer_norm_backward``) under ``torch.compile``, and an
``autograd.Function`` making the same launches in eager mode → the Triton kernels in
:mod:`dslab.kernels.norm.layer_norm_triton`. :func:`layer_norm` picks between them with
:func:`dslab.kernels.dispatch.use_triton`.

Why two wrappers: the whole fwd+bwd of a 65536 x 1024 bf16 layer norm is ~0.24 ms of device
work, less than its host time, so the host path is kept short. On the H100 host of 2026-11
(torch 2.11, triton 3.6) one 4096 x 1024 fwd+bwd took 173 us of host time for the launches alone,
728 us through this ``autograd.Function`` and 852 us through the custom ops (their Python
dispatch runs twice forward and once more for the backward op); most of the rest is the autograd
engine running the Python backward on its device thread (393 us with
``torch.autograd.set_multithreading_enabled(False)``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Widest row the Triton path holds in registers: backward keeps h, dy, weight and the two gradient
# accumulators of a whole row there, 5 * 8192 * 4 bytes, and a wider row would spill. Equal to
# layer_norm_triton.MAX_FUSED_N, repeated so that choosing the path does not import Triton.
MAX_FUSED_N = 8192


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference: ``y``, or ``(y, h)`` with ``h = x + residual`` when given."""
    if residual is None:
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    h = x + residual
    return F.layer_norm(h, h.shape[-1:], weight, bias, eps), h


def _empty_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    return x.new_empty(m, dtype=torch.float32), x.new_empty(m, dtype=torch.float32)


@torch.library.custom_op("dslab::layer_norm", mutates_args=())
def _layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) for ``x`` [M, N]."""
    from dslab.kernels.norm import layer_norm_triton

    y, _, mean, rstd = layer_norm_triton.forward(x, weight, bias, None, eps)
    return y, mean, rstd


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    return (x.new_empty(x.shape), *_empty_stats(x))


@torch.library.custom_op("dslab::add_layer_norm", mutates_args=())
def _add_layer_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, mean, rstd) for ``x``, ``residual`` [M, N] with ``h = x + residual``."""
    from dslab.kernels.norm import layer_norm_triton

    return layer_norm_triton.forward(x, weight, bias, residual, eps)


@_add_layer_norm_op.register_fake
def _(x, residual, weight, bias, eps):
    return (x.new_empty(x.shape), x.new_empty(x.shape), *_empty_stats(x))


@torch.library.custom_op("dslab::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(
    dy: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dh: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) for the normalized input ``h`` [M, N]; ``dh`` (the gradient reaching
    ``h`` directly) is added to dx. A missing parameter's gradient is an empty tensor."""
    from dslab.kernels.norm import layer_norm_triton

    dx, dw, db = layer_norm_triton.backward(dy, h, weight, bias, mean, rstd, dh)
    return dx, _or_empty(dw, h), _or_empty(db, h)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


@_layer_norm_backward_op.register_fake
def _(dy, h, weight, bias, mean, rstd, dh):
    dw = torch.empty_like(weight) if weight is not None else h.new_empty(0)
    db = torch.empty_like(bias) if bias is not None else h.new_empty(0)
    return h.new_empty(h.shape), dw, db


def _param_grads(weight, bias, dw, db):
    return (dw if weight is not None else None), (db if bias is not None else None)


def _setup_layer_norm(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _backward_layer_norm(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward_op(dy, x, weight, bias, mean, rstd, None)
    return dx, *_param_grads(weight, bias, dw, db), None


def _setup_add_layer_norm(ctx, inputs, output):
    _x, _residual, weight, bias, _eps = inputs
    _y, h, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h, weight, bias, mean, rstd)


def _backward_add_layer_norm(ctx, dy, dh, _dmean, _drstd):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:
        return dh, dh, None, None, None
    dx, dw, db = _layer_norm_backward_op(dy, h, weight, bias, mean, rstd, dh)
    # h = x + residual, so both receive the same gradient.
    return dx, dx, *_param_grads(weight, bias, dw, db), None


_layer_norm_op.register_autograd(_backward_layer_norm, setup_context=_setup_layer_norm)
_add_layer_norm_op.register_autograd(_backward_add_layer_norm, setup_context=_setup_add_layer_norm)


@functools.cache
def _triton_module():
    from dslab.kernels.norm import layer_norm_triton

    return layer_norm_triton


class _EagerLayerNorm(torch.autograd.Function):
    """The custom ops' launches for eager mode: returns ``y``, or ``(y, h)`` with a residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps):
        y, h, mean, rstd = _triton_module().forward(x, weight, bias, residual, eps)
        ctx.set_materialize_grads(False)
        ctx.has_residual = residual is not None
        ctx.save_for_backward(h if residual is not None else x, weight, bias, mean, rstd)
        return (y, h) if residual is not None else y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dh=None):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        if dy is None:
            # Only h reached the loss (or nothing did): y's branch contributes no gradient.
            return dh, dh if ctx.has_residual else None, None, None, None
        dx, dw, db = _triton_module().backward(dy, h, weight, bias, mean, rstd, dh)
        return dx, dx if ctx.has_residual else None, dw, db, None


def _check(x, weight, bias, eps, residual) -> None:
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized one)")
    n = x.shape[-1]
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and tuple(param.shape) != (n,):
            raise ValueError(
                f"{name} must have shape ({n},) to match x's last dimension, got {tuple(param.shape)}"
            )
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Layer norm of ``x`` [..., N] over its last dimension.

    Returns ``y`` (x's shape and dtype), or ``(y, h)`` when ``residual`` (x's shape and dtype) is
    given, ``h = x + residual`` being normalized and returned in x's dtype. Gradients flow to x,
    residual, weight and bias. The Triton path runs on CUDA tensors (or under the ``triton``
    backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16 with N <= 8192; otherwise the
    reference runs.
    """
    _check(x, weight, bias, eps, residual)
    n = x.shape[-1]
    if not (
        x.dtype in TRITON_DTYPES and 0 < n <= MAX_FUSED_N and use_triton(x, weight, bias, residual)
    ):
        return layer_norm_reference(x, weight, bias, eps, residual)
    x2d = x.reshape(-1, n)
    r2d = residual.reshape(-1, n) if residual is not None else None
    if use_custom_op():
        if r2d is None:
            return _layer_norm_op(x2d, weight, bias, eps)[0].view(x.shape)
        y, h, _, _ = _add_layer_norm_op(x2d, r2d, weight, bias, eps)
        return y.view(x.shape), h.view(x.shape)
    if r2d is None:
        return _EagerLayerNorm.apply(x2d, None, weight, bias, eps).view(x.shape)
    y, h = _EagerLayerNorm.apply(x2d, r2d, weight, bias, eps)
    return y.view(x.shape), h.view(x.shape)


class _EagerLayerNormFork(torch.autograd.Function):
    """``(layer_norm(x), x)``; the backward kernel adds the second output's gradient to dx."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, _, mean, rstd = _triton_module().forward(x, weight, bias, None, eps)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y, x.view_as(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dx_other):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        if dy is None:
            return dx_other, None, None, None
        dx, dw, db = _triton_module().backward(dy, x, weight, bias, mean, rstd, dx_other)
        return dx, dw, db, None


def layer_norm_fork(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x, weight, bias, eps), x)`` for an input that is also used elsewhere (a
    pre-LN layer's residual stream feeds its layer norm and its residual add): the backward kernel
    adds the second output's gradient to the input gradient, where autograd would add the two
    uses' gradients in a kernel of its own. Off the eager Triton path (the reference, or the custom
    ops under ``torch.compile``) the plain pair."""
    _check(x, weight, bias, eps, None)
    n = x.shape[-1]
    if not (x.dtype in TRITON_DTYPES and 0 < n <= MAX_FUSED_N and use_triton(x, weight, bias)) or use_custom_op():
        return layer_norm(x, weight, bias, eps), x
    y, again = _EagerLayerNormFork.apply(x.reshape(-1, n), weight, bias, eps)
    return y.view(x.shape), again.view(x.shape)
