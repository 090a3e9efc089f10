"""A sigmoid gate with its two bias adds and a row mask fused: AlphaFold's gating.

    y = sigmoid(gate + gate_bias) * (x + x_bias) * row_mask[..., None]

``gate`` and ``x`` are ``[..., N]`` (the outputs of two bias-free projections), the biases ``[N]``
or None, ``row_mask`` ``x.shape[:-1]`` or None (broadcast over N, not differentiated). The
Evoformer gates every attention output (``sigmoid(linear_g(x)) * context``) and every triangle
update (``mask * sigmoid(linear_a_g(z)) * linear_a_p(z)``); in PyTorch that is a sigmoid, two or
three multiplies and, in the backward, as many passes again plus a column reduction per bias
(slow for narrow rows: the bias gradients of the Linears alone took 5 ms of a 42 ms Evoformer step
on an H100). Here it is one pass forward (read gate and x, write y) and one backward (read dy,
gate and x; write both gradients, reduce both bias gradients).

``channels_first=True`` writes y as ``[B, N, *S]`` for x ``[B, *S, N]``, contiguous: the triangle
multiplication's matmul layout (``[B, c, R, R]``), so that no permuted copy is made before it.

Dtypes: gate and x share one dtype; each bias is in it or fp32 (master weights under autocast:
the kernel adds them in fp32 and returns their gradients in their own dtype from fp32 sums).

Layers: :func:`sigmoid_gate_reference` (PyTorch) → the ``dslab::sigmoid_gate`` custom op with its
autograd (``dslab::sigmoid_gate_backward``) under ``torch.compile``, and an ``autograd.Function``
making the same launches in eager mode → the Triton kernels in
:mod:`dslab.kernels.evoformer.sigmoid_gate_triton`. :func:`sigmoid_gate` picks between them with
:func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools

import torch

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def sigmoid_gate_reference(gate, x, gate_bias=None, x_bias=None, row_mask=None, channels_first=False):
    """The PyTorch reference (biases cast to x's dtype, as a Linear's under autocast)."""
    if gate_bias is not None:
        gate = gate + gate_bias.to(gate.dtype)
    if x_bias is not None:
        x = x + x_bias.to(x.dtype)
    y = torch.sigmoid(gate) * x
    if row_mask is not None:
        y = y * row_mask.to(y.dtype).unsqueeze(-1)
    if channels_first:
        y = y.movedim(-1, 1).contiguous()
    return y


@torch.library.custom_op("dslab::sigmoid_gate", mutates_args=())
def _sigmoid_gate_op(gate: torch.Tensor, x: torch.Tensor, gate_bias: torch.Tensor | None,
                     x_bias: torch.Tensor | None, row_mask: torch.Tensor | None, batch: int,
                     channels_first: bool) -> torch.Tensor:
    """y for gate, x [M, N]: [M, N] or, channels first, [batch, N, M // batch]."""
    return _triton_module().forward(gate, x, gate_bias, x_bias, row_mask, batch, channels_first)


@_sigmoid_gate_op.register_fake
def _(gate, x, gate_bias, x_bias, row_mask, batch, channels_first):
    m, n = x.shape
    return x.new_empty((batch, n, m // batch) if channels_first else (m, n))


@torch.library.custom_op("dslab::sigmoid_gate_backward", mutates_args=())
def _sigmoid_gate_backward_op(
    dy: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, gate_bias: torch.Tensor | None,
    x_bias: torch.Tensor | None, row_mask: torch.Tensor | None, batch: int, channels_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgate, dx, dgate_bias, dx_bias); a bias gradient is an empty tensor without its bias."""
    dgate, dx, dgb, dxb = _triton_module().backward(dy, gate, x, gate_bias, x_bias, row_mask, batch,
                                                    channels_first)
    empty = x.new_empty(0)
    return dgate, dx, (empty if dgb is None else dgb), (empty if dxb is None else dxb)


@_sigmoid_gate_backward_op.register_fake
def _(dy, gate, x, gate_bias, x_bias, row_mask, batch, channels_first):
    def bias_grad(bias):
        return x.new_empty(0) if bias is None else torch.empty_like(bias)

    return torch.empty_like(gate), torch.empty_like(x), bias_grad(gate_bias), bias_grad(x_bias)


def _setup(ctx, inputs, output):
    gate, x, gate_bias, x_bias, row_mask, batch, channels_first = inputs
    ctx.batch, ctx.channels_first = batch, channels_first
    ctx.has_biases = (gate_bias is not None, x_bias is not None)
    ctx.save_for_backward(gate, x, gate_bias, x_bias, row_mask)


def _backward(ctx, dy):
    gate, x, gate_bias, x_bias, row_mask = ctx.saved_tensors
    dgate, dx, dgb, dxb = _sigmoid_gate_backward_op(dy, gate, x, gate_bias, x_bias, row_mask, ctx.batch,
                                                    ctx.channels_first)
    has_gb, has_xb = ctx.has_biases
    return dgate, dx, (dgb if has_gb else None), (dxb if has_xb else None), None, None, None


_sigmoid_gate_op.register_autograd(_backward, setup_context=_setup)


@functools.cache
def _triton_module():
    from dslab.kernels.evoformer import sigmoid_gate_triton

    return sigmoid_gate_triton


class _EagerSigmoidGate(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, gate, x, gate_bias, x_bias, row_mask, batch, channels_first):
        ctx.batch, ctx.channels_first = batch, channels_first
        ctx.save_for_backward(gate, x, gate_bias, x_bias, row_mask)
        return _triton_module().forward(gate, x, gate_bias, x_bias, row_mask, batch, channels_first)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        gate, x, gate_bias, x_bias, row_mask = ctx.saved_tensors
        dgate, dx, dgb, dxb = _triton_module().backward(dy, gate, x, gate_bias, x_bias, row_mask, ctx.batch,
                                                        ctx.channels_first)
        return dgate, dx, dgb, dxb, None, None, None


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``[M, n]`` rows with unit column stride: a view where one exists, else a copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.reshape(-1, n)


def _check(gate, x, gate_bias, x_bias, row_mask, channels_first) -> None:
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the channels)")
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if gate.dtype != x.dtype:
        raise ValueError(f"gate must have x's dtype {x.dtype}, got {gate.dtype}")
    n = x.shape[-1]
    for name, bias in (("gate_bias", gate_bias), ("x_bias", x_bias)):
        if bias is None:
            continue
        if tuple(bias.shape) != (n,):
            raise ValueError(f"{name} must have shape ({n},) to match x's last dimension, got {tuple(bias.shape)}")
        if bias.dtype not in (x.dtype, torch.float32):
            raise ValueError(f"{name} must be in x's dtype {x.dtype} or float32, got {bias.dtype}")
    if row_mask is not None and tuple(row_mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"row_mask must have shape {tuple(x.shape[:-1])} (x's without its last dimension), "
                         f"got {tuple(row_mask.shape)}")
    if channels_first and x.dim() < 2:
        raise ValueError("channels_first needs x of shape [B, ..., N] (at least two dimensions)")


def sigmoid_gate(gate: torch.Tensor, x: torch.Tensor, gate_bias: torch.Tensor | None = None,
                 x_bias: torch.Tensor | None = None, row_mask: torch.Tensor | None = None,
                 channels_first: bool = False) -> torch.Tensor:
    """``sigmoid(gate + gate_bias) * (x + x_bias) * row_mask[..., None]`` in x's dtype; shaped like
    x, or ``[B, N, *S]`` (contiguous) for x ``[B, *S, N]`` with ``channels_first``.

    Gradients flow to gate, x and both biases (not to the mask). The Triton path runs on CUDA
    tensors (or under the ``triton`` backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16;
    otherwise the reference runs.
    """
    _check(gate, x, gate_bias, x_bias, row_mask, channels_first)
    if not (x.dtype in TRITON_DTYPES and use_triton(gate, x, gate_bias, x_bias, row_mask)):
        return sigmoid_gate_reference(gate, x, gate_bias, x_bias, row_mask, channels_first)
    n = x.shape[-1]
    batch = x.shape[0] if channels_first else 1
    gate2d, x2d = _rows(gate, n), _rows(x, n)
    mask1d = None if row_mask is None else row_mask.reshape(-1)
    if mask1d is not None and mask1d.stride(0) != 1:
        mask1d = mask1d.contiguous()
    out_shape = (x.shape[0], n, *x.shape[1:-1]) if channels_first else x.shape
    if x.numel() == 0:
        return x.new_empty(out_shape)
    if use_custom_op():
        y = _sigmoid_gate_op(gate2d, x2d, gate_bias, x_bias, mask1d, batch, channels_first)
    else:
        y = _EagerSigmoidGate.apply(gate2d, x2d, gate_bias, x_bias, mask1d, batch, channels_first)
    return y.view(out_shape)


def sigmoid_gate_flops(numel: int, biases: int, masked: bool) -> tuple[int, int]:
    """(forward, backward) elementwise flops per call over ``numel`` elements: forward the bias
    adds, the sigmoid and the products; backward the recomputation, both gradients and the bias
    sums."""
    forward = numel * (biases + 2 + int(masked))
    backward = numel * (2 * biases + 6 + int(masked))
    return forward, backward
