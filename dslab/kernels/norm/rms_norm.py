"""RMS normalization over the last dimension (Llama's ``RMSNorm``), optionally fused with the
residual add of a pre-norm transformer block.

    h    = x + residual                      (when ``residual`` is given: the new residual stream)
    rstd = 1 / sqrt(mean(h^2) + eps)
    y    = h * rstd * weight

``x`` is ``[..., N]`` in bf16, fp16 or fp32; ``weight`` is ``[N]`` (x's dtype or fp32) or None (no
scale). Statistics are computed in fp32 and ``y`` is rounded once, to x's dtype, at the end
(transformers' ``LlamaRMSNorm`` rounds the normalized value to x's dtype before the weight
multiplies it, so in bf16/fp16 the two differ by that rounding).

Backward, with g = dy * weight:
    dh = rstd * (g - h * rstd^2 * mean(g * h))     (+ the incoming gradient of h)
    dweight = sum_rows(dy * h * rstd)
and with a residual, x and residual both receive dh.

:func:`rms_norm_fork` also hands the input back as a second output whose gradient the backward
kernel adds (the pre-norm residual stream's two uses, without autograd's add kernel).

Layers: :func:`rms_norm_reference` (PyTorch) → the ``dslab::rms_norm`` / ``dslab::add_rms_norm``
custom ops with their autograd (``dslab::rms_norm_backward``) under ``torch.compile`` and dispatch
modes, and an ``autograd.Function`` making the same launches in eager mode (its host path is
shorter; see :mod:`dslab.kernels.norm.layer_norm`) → the Triton kernels in
:mod:`dslab.kernels.norm.rms_norm_triton`. :func:`rms_norm` picks between them with
:func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools

import torch

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Widest row the Triton path holds in registers: backward keeps h, dy, weight and the weight
# gradient's accumulator of a whole row there, and a wider row would spill. Equal to
# rms_norm_triton.MAX_FUSED_N, repeated so that choosing the path does not import Triton.
MAX_FUSED_N = 8192


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference: ``y``, or ``(y, h)`` with ``h = x + residual`` when given.

    Computes in fp32 (in x's dtype when that is wider, so a float64 call is exact to float64) and
    rounds ``y`` to x's dtype once.
    """
    h = x + residual if residual is not None else x
    compute = torch.promote_types(h.dtype, torch.float32)
    hf = h.to(compute)
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    y = y.to(x.dtype)
    return (y, h) if residual is not None else y


def _empty_rstd(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("dslab::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) for ``x`` [M, N]."""
    from dslab.kernels.norm import rms_norm_triton

    y, _, rstd = rms_norm_triton.forward(x, weight, None, eps)
    return y, rstd


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), _empty_rstd(x)


@torch.library.custom_op("dslab::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, rstd) for ``x``, ``residual`` [M, N] with ``h = x + residual``."""
    from dslab.kernels.norm import rms_norm_triton

    return rms_norm_triton.forward(x, weight, residual, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape), _empty_rstd(x)


@torch.library.custom_op("dslab::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    dy: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dh: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) for the normalized input ``h`` [M, N]; ``dh`` (the gradient reaching ``h``
    directly) is added to dx. Without a weight, dweight is an empty tensor."""
    from dslab.kernels.norm import rms_norm_triton

    dx, dw = rms_norm_triton.backward(dy, h, weight, rstd, dh)
    return dx, dw if dw is not None else h.new_empty(0)


@_rms_norm_backward_op.register_fake
def _(dy, h, weight, rstd, dh):
    dw = torch.empty_like(weight) if weight is not None else h.new_empty(0)
    return h.new_empty(h.shape), dw


def _setup_rms_norm(ctx, inputs, output):
    x, weight, _eps = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, rstd)


def _backward_rms_norm(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    if dy is None:
        return None, None, None
    dx, dw = _rms_norm_backward_op(dy, x, weight, rstd, None)
    return dx, dw if weight is not None else None, None


def _setup_add_rms_norm(ctx, inputs, output):
    _x, _residual, weight, _eps = inputs
    _y, h, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h, weight, rstd)


def _backward_add_rms_norm(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    if dy is None:
        return dh, dh, None, None
    dx, dw = _rms_norm_backward_op(dy, h, weight, rstd, dh)
    # h = x + residual, so both receive the same gradient.
    return dx, dx, dw if weight is not None else None, None


_rms_norm_op.register_autograd(_backward_rms_norm, setup_context=_setup_rms_norm)
_add_rms_norm_op.register_autograd(_backward_add_rms_norm, setup_context=_setup_add_rms_norm)


@functools.cache
def _triton_module():
    from dslab.kernels.norm import rms_norm_triton

    return rms_norm_triton


class _EagerRMSNorm(torch.autograd.Function):
    """The custom ops' launches for eager mode: returns ``y``, or ``(y, h)`` with a residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, h, rstd = _triton_module().forward(x, weight, residual, eps)
        ctx.set_materialize_grads(False)
        ctx.has_residual = residual is not None
        ctx.save_for_backward(h if residual is not None else x, weight, rstd)
        return (y, h) if residual is not None else y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dh=None):
        h, weight, rstd = ctx.saved_tensors
        if dy is None:
            # Only h reached the loss (or nothing did): y's branch contributes no gradient.
            return dh, dh if ctx.has_residual else None, None, None
        dx, dw = _triton_module().backward(dy, h, weight, rstd, dh)
        return dx, dx if ctx.has_residual else None, dw, None


def _check(x, weight, eps, residual) -> None:
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized one)")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    n = x.shape[-1]
    if weight is not None:
        if tuple(weight.shape) != (n,):
            raise ValueError(
                f"weight must have shape ({n},) to match x's last dimension, got {tuple(weight.shape)}"
            )
        if weight.dtype not in (x.dtype, torch.float32):
            raise ValueError(f"weight must have x's dtype {x.dtype} or torch.float32, got {weight.dtype}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def _triton_path(x, *tensors) -> bool:
    return x.dtype in TRITON_DTYPES and 0 < x.shape[-1] <= MAX_FUSED_N and use_triton(x, *tensors)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMS norm of ``x`` [..., N] over its last dimension.

    Returns ``y`` (x's shape and dtype), or ``(y, h)`` when ``residual`` (x's shape and dtype) is
    given, ``h = x + residual`` being normalized and returned in x's dtype. Gradients flow to x,
    residual and weight. The Triton path runs on CUDA tensors (or under the ``triton`` backend
    with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16 with N <= :data:`MAX_FUSED_N`; otherwise the
    reference runs.
    """
    _check(x, weight, eps, residual)
    if not _triton_path(x, weight, residual):
        return rms_norm_reference(x, weight, eps, residual)
    n = x.shape[-1]
    x2d = x.reshape(-1, n)
    r2d = residual.reshape(-1, n) if residual is not None else None
    if use_custom_op():
        if r2d is None:
            return _rms_norm_op(x2d, weight, eps)[0].view(x.shape)
        y, h, _ = _add_rms_norm_op(x2d, r2d, weight, eps)
        return y.view(x.shape), h.view(x.shape)
    if r2d is None:
        return _EagerRMSNorm.apply(x2d, None, weight, eps).view(x.shape)
    y, h = _EagerRMSNorm.apply(x2d, r2d, weight, eps)
    return y.view(x.shape), h.view(x.shape)


class _EagerRMSNormFork(torch.autograd.Function):
    """``(rms_norm(x), x)``; the backward kernel adds the second output's gradient to dx."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, _, rstd = _triton_module().forward(x, weight, None, eps)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, rstd)
        return y, x.view_as(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dx_other):
        x, weight, rstd = ctx.saved_tensors
        if dy is None:
            return dx_other, None, None
        dx, dw = _triton_module().backward(dy, x, weight, rstd, dx_other)
        return dx, dw, None


def rms_norm_fork(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x, weight, eps), x)`` for an input that is also used elsewhere (a pre-norm
    layer's residual stream feeds its RMS norm and its residual add): the backward kernel adds the
    second output's gradient to the input gradient, where autograd would add the two uses'
    gradients in a kernel of its own. Off the eager Triton path (the reference, or the custom ops
    under ``torch.compile`` and dispatch modes) the plain pair."""
    _check(x, weight, eps, None)
    if not _triton_path(x, weight) or use_custom_op():
        return rms_norm(x, weight, eps), x
    n = x.shape[-1]
    y, again = _EagerRMSNormFork.apply(x.reshape(-1, n), weight, eps)
    return y.view(x.shape), again.view(x.shape)
