"""Bias add, dropout and residual add fused: the end of a transformer sublayer.

    out = residual + dropout(x + bias, p)      x, residual [..., N]; bias [N] or None

Dropout zeroes each element with probability p and scales the rest by 1 / (1 - p); it applies only
when ``training`` and p > 0. The mask is a function of a ``seed`` (and of the element's position):
the same seed and shape give the same mask, so backward regenerates it instead of storing it.

The seed is a 1-element int64 tensor on x's device (:func:`draw_seed` draws one with
``torch.randint`` from torch's generator for that device, so ``torch.manual_seed`` reproduces a
run); an int is accepted too and turned into such a tensor with a fill on the device. The Triton
kernels load the seed from device memory, so no host synchronisation happens and a CUDA graph that
captured the op draws a new mask on every replay (the captured ``randint`` writes a new value).

Each backend has its own generator — the Triton kernel uses Philox per element (see
:mod:`dslab.kernels.dropout.bias_dropout_residual_triton`), the reference a ``torch.Generator`` seeded with
the seed's value, which it reads on the host (free on CPU; one synchronisation on a GPU, where the
reference runs only when forced) — so the two give different masks for one seed;
:func:`bias_dropout_residual_reference` also takes an explicit ``keep_mask`` so that one backend's
mask can be replayed through the reference.

Layers: :func:`bias_dropout_residual_reference` (PyTorch) → the ``dslab::bias_dropout_residual``
custom op with its autograd (``dslab::bias_dropout_residual_backward``) under ``torch.compile``,
and an ``autograd.Function`` making the same launches in eager mode with less host time than the
custom ops' Python dispatch (see :mod:`dslab.kernels.norm.layer_norm`) → the Triton
kernels. :func:`bias_dropout_residual` picks between them with
:func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SEED = 2**63 - 1
SEED_HIGH = 2**62


def draw_seed(device: torch.device | str) -> torch.Tensor:
    """A dropout seed: int64 ``[1]`` on ``device``, uniform in ``[0, 2**62)``, from torch's
    generator for that device (``torch.randint``; no host synchronisation, safe to capture in a
    CUDA graph, where each replay draws a new value)."""
    return torch.randint(0, SEED_HIGH, (1,), dtype=torch.int64, device=device)


def seed_tensor(seed: int | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``seed`` as the int64 ``[1]`` tensor on ``device`` that the kernels read: a tensor is viewed
    as ``[1]`` (no copy), an int is written by a fill on the device (no host-to-device copy)."""
    if isinstance(seed, torch.Tensor):
        return seed.view(1)
    return torch.full((1,), seed, dtype=torch.int64, device=device)


def dropout_keep_mask_reference(
    shape: torch.Size | tuple[int, ...], p: float, seed: int | torch.Tensor, device: torch.device | str
) -> torch.Tensor:
    """The reference's keep mask (bool, ``shape``): ``rand >= p`` from a generator seeded with
    ``seed``'s value (read on the host)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return torch.rand(shape, generator=generator, device=device) >= p


def bias_dropout_residual_reference(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
    seed: int | torch.Tensor | None = None,
    keep_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch reference. When dropout applies, the mask is ``keep_mask`` (bool, x's shape)
    if given, else :func:`dropout_keep_mask_reference` of ``seed`` (an int or a 1-element tensor)."""
    h = x + bias if bias is not None else x
    if training and p > 0:
        if keep_mask is None:
            keep_mask = dropout_keep_mask_reference(x.shape, p, seed, x.device)
        scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
        h = h * keep_mask * scale
    return residual + h


@torch.library.custom_op("dslab::bias_dropout_residual", mutates_args=())
def _bias_dropout_residual_op(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    seed: Optional[torch.Tensor],
) -> torch.Tensor:
    """residual + dropout(x + bias, p) for ``x``, ``residual`` [M, N]; no dropout when p == 0.
    ``seed``: int64 ``[1]`` on x's device (None when p == 0)."""
    from dslab.kernels.dropout import bias_dropout_residual_triton

    return bias_dropout_residual_triton.forward(x, bias, residual, p, seed)


@_bias_dropout_residual_op.register_fake
def _(x, bias, residual, p, seed):
    return x.new_empty(x.shape)


@torch.library.custom_op("dslab::bias_dropout_residual_backward", mutates_args=())
def _bias_dropout_residual_backward_op(
    dout: torch.Tensor, bias: Optional[torch.Tensor], p: float, seed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias) for ``dout`` [M, N] and p > 0; dbias is an empty tensor without a bias (whose
    only use here is its presence and dtype)."""
    from dslab.kernels.dropout import bias_dropout_residual_triton

    dx, dbias = bias_dropout_residual_triton.backward(dout, bias, p, seed)
    return dx, dbias if dbias is not None else dout.new_empty(0)


@_bias_dropout_residual_backward_op.register_fake
def _(dout, bias, p, seed):
    return dout.new_empty(dout.shape), torch.empty_like(bias) if bias is not None else dout.new_empty(0)


def _setup(ctx, inputs, output):
    _x, bias, _residual, p, seed = inputs
    ctx.p = p
    ctx.save_for_backward(bias, seed)


def _backward(ctx, dout):
    bias, seed = ctx.saved_tensors
    if ctx.p == 0:
        dx = dout
        dbias = dout.sum(dim=0) if bias is not None else None
    else:
        dx, dbias = _bias_dropout_residual_backward_op(dout, bias, ctx.p, seed)
    return dx, (dbias if bias is not None else None), dout, None, None


_bias_dropout_residual_op.register_autograd(_backward, setup_context=_setup)


@functools.cache
def _triton_module():
    from dslab.kernels.dropout import bias_dropout_residual_triton

    return bias_dropout_residual_triton


class _EagerBiasDropoutResidual(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, x, bias, residual, p, seed):
        ctx.p = p
        ctx.save_for_backward(bias, seed)
        return _triton_module().forward(x, bias, residual, p, seed)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        bias, seed = ctx.saved_tensors
        if ctx.p == 0:
            return dout, (dout.sum(dim=0) if bias is not None else None), dout, None, None
        dx, dbias = _triton_module().backward(dout, bias, ctx.p, seed)
        return dx, dbias, dout, None, None


def _check(x, bias, residual, p, training, seed) -> None:
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the bias's)")
    n = x.shape[-1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got {tuple(residual.shape)} {residual.dtype}"
        )
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype):
        raise ValueError(
            f"bias must have shape ({n},) and x's dtype {x.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if training and p > 0:
        if isinstance(seed, torch.Tensor):
            if seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != x.device:
                raise ValueError(
                    f"seed must be a 1-element int64 tensor on x's device {x.device}, got a {seed.dtype} "
                    f"tensor of shape {tuple(seed.shape)} on {seed.device}"
                )
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(
                f"seed must be an int or a 1-element int64 tensor when dropout applies (training and p > 0), "
                f"got {seed!r}"
            )
        elif not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed}")


def bias_dropout_residual(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
    seed: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + dropout(x + bias, p)`` for ``x``, ``residual`` [..., N] (one dtype) and
    ``bias`` [N] or None; dropout only when ``training`` and ``p > 0``, with its mask a function
    of ``seed`` (required then): a 1-element int64 tensor on x's device (:func:`draw_seed`), or an
    int in ``[0, 2**63)``; an int and a tensor holding it give the same mask. Gradients flow to x,
    bias and residual.

    The Triton path runs on CUDA tensors (or under the ``triton`` backend with
    ``TRITON_INTERPRET=1``) for fp32/fp16/bf16; otherwise the reference runs.
    """
    _check(x, bias, residual, p, training, seed)
    if not (x.dtype in TRITON_DTYPES and use_triton(x, bias, residual)):
        return bias_dropout_residual_reference(x, bias, residual, p, training, seed)
    n = x.shape[-1]
    p_applied = float(p) if training else 0.0
    seed = seed_tensor(seed, x.device) if p_applied > 0 else None
    args = (x.reshape(-1, n), bias, residual.reshape(-1, n), p_applied, seed)
    if use_custom_op():
        return _bias_dropout_residual_op(*args).view(x.shape)
    return _EagerBiasDropoutResidual.apply(*args).view(x.shape)
