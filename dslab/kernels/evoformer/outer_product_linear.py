"""The outer product mean's output projection, read straight from the outer product's layout.

    out[b, i, j, e] = (sum_{c, d} x[b, i, c, j, d] * W[e, c*C + d] + bias[e]) * row_scale[b, i, j]

x is ``[B, R, C, R, C]``: the contiguous ``[B, R*C, R*C]`` matmul that sums AlphaFold's outer
products over the sequences (``a^T b``, rows ``(i, c)``, columns ``(j, d)``), viewed in five dims;
W is ``[E, C*C]`` (``linear_out.weight``), bias ``[E]`` or None, row_scale ``[B, R, R]`` or None
(a factor of 1); out is ``[B, R, R, E]``, contiguous, in x's dtype. In PyTorch the Linear needs
``(c, d)`` innermost, so the product is first copied to ``[B, i, j, c*d]`` (``view``,
``transpose(-2, -3)``, ``reshape``), and the backward copies the input gradient back to the
matmul's layout: at N_res 256, C 32 each copy moves 2 x 128 MiB in bf16, about 1.5 ms of a 31 ms
Evoformer training step (4 blocks) on an H100. Here the GEMMs address x through per-row pointers
instead (:mod:`dslab.kernels.evoformer.outer_product_linear_triton`), so neither copy is made:

- forward reads x once (``M K`` elements, ``M = B R^2``, ``K = C^2``) and W per row block, writes
  ``M E``;
- the input gradient reads dout (``M E``) and W, and writes dx (``M K``) in x's layout, the
  contiguous gradient the matmul's backward takes;
- the weight gradient reads x and dout once more and sums fp32 partials over row splits, in a
  fixed order (deterministic); the bias gradient (column sums of dout) comes out of the same pass.

Row scale: the outer product mean divides each pair's sum over sequences by ``count[b, i, j] + eps``,
the number of sequences where both residues are unmasked, so that the update is a mean. That is one
factor per GEMM row, passed as ``row_scale = 1 / (count + eps)`` and applied where the rows are
already in registers: to the fp32 accumulator in the forward's epilogue, before the one rounding to
x's dtype, and backward to the rows of the output gradient (the input gradient's accumulator, dout's
tiles in the weight gradient, the bias sums). As a separate divide, the mean writes an fp32
``[B, R, R, E]`` quotient, casts it back to x's dtype and makes one more pass backward, each over
16-32 MiB at N_res 256, c_z 128. The scale is a constant: no gradient flows to it, and one that
requires grad is refused while grad is enabled rather than silently left without a gradient.

Flops: ``2 M K E`` forward (the bias add not counted, as for ``addmm``), ``4 M K E`` backward (dx
and dW).

Dtypes: x in fp32, fp16 or bf16; W and bias each in x's dtype or fp32 (master weights), row_scale
in x's dtype or fp32. Under autocast, x is first cast to the autocast dtype (as ``F.linear`` casts
its input); the weight is cast to x's dtype for the products, as autocast does, and the bias added
and the row scale applied in fp32. Gradients come back in each input's own dtype, accumulated in
fp32.

Layers: :func:`outer_product_linear_reference` (PyTorch: the permuted copy and ``F.linear``) → the
``dslab::outer_product_linear`` custom op with its autograd (``dslab::outer_product_linear_backward``)
under ``torch.compile`` and dispatch modes, and an ``autograd.Function`` making the same launches in
eager mode → the Triton kernels. :func:`outer_product_linear` picks between them with
:func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def outer_product_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                   row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch path: ``x`` ``[B, R, C, R, C]`` copied to ``[B, R, R, C*C]``, then ``F.linear``
    with the weight and bias cast to x's dtype (as a Linear's under autocast); a ``row_scale``
    ``[B, R, R]`` multiplies that output in fp32 (its own dtype if wider) and the product is cast
    back: the outer product mean's divide as a separate elementwise op, rounding twice in 16-bit
    dtypes."""
    batch, res, c = x.shape[:3]
    permuted = x.transpose(2, 3).reshape(batch, res, res, c * c)
    out = F.linear(permuted, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    if row_scale is None:
        return out
    wide = torch.promote_types(out.dtype, torch.float32)
    return (out.to(wide) * row_scale.to(wide).unsqueeze(-1)).to(out.dtype)


@torch.library.custom_op("dslab::outer_product_linear", mutates_args=())
def _outer_product_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out ``[B, R, R, E]`` for contiguous x ``[B, R, C, R, C]``, weight ``[E, C*C]`` and
    contiguous row_scale ``[B, R, R]`` or None (a constant: its gradient is None)."""
    return _triton_module().forward(x, weight, bias, row_scale)


@_outer_product_linear_op.register_fake
def _(x, weight, bias, row_scale=None):
    batch, res = x.shape[:2]
    return x.new_empty((batch, res, res, weight.shape[0]))


@torch.library.custom_op("dslab::outer_product_linear_backward", mutates_args=())
def _outer_product_linear_backward_op(
    dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) from ``dout * row_scale[..., None]``; dbias is an empty tensor without
    a bias."""
    dx, dweight, dbias = _triton_module().backward(dout, x, weight, bias, row_scale)
    return dx, dweight, (x.new_empty(0) if dbias is None else dbias)


@_outer_product_linear_backward_op.register_fake
def _(dout, x, weight, bias, row_scale=None):
    dbias = x.new_empty(0) if bias is None else torch.empty_like(bias)
    return torch.empty_like(x), weight.new_empty(weight.shape), dbias


def _setup(ctx, inputs, output):
    x, weight, bias, row_scale = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias, row_scale)


def _backward(ctx, dout):
    x, weight, bias, row_scale = ctx.saved_tensors
    dx, dweight, dbias = _outer_product_linear_backward_op(dout, x, weight, bias, row_scale)
    return dx, dweight, (dbias if ctx.has_bias else None), None


_outer_product_linear_op.register_autograd(_backward, setup_context=_setup)


@functools.cache
def _triton_module():
    from dslab.kernels.evoformer import outer_product_linear_triton

    return outer_product_linear_triton


class _EagerOuterProductLinear(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, x, weight, bias, row_scale):
        ctx.save_for_backward(x, weight, bias, row_scale)
        return _triton_module().forward(x, weight, bias, row_scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        x, weight, bias, row_scale = ctx.saved_tensors
        return *_triton_module().backward(dout, x, weight, bias, row_scale), None


def _check(x, weight, bias, row_scale) -> None:
    if x.dim() != 5 or x.shape[1] != x.shape[3] or x.shape[2] != x.shape[4]:
        raise ValueError(f"x must be [B, R, C, R, C] (the outer product [B, R*C, R*C] viewed in five dims), "
                         f"got shape {tuple(x.shape)}")
    c = x.shape[2]
    if weight.dim() != 2 or weight.shape[1] != c * c:
        raise ValueError(f"weight must be [E, C*C] = [E, {c * c}] for x's C = {c}, got shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},) (weight's E), got {tuple(bias.shape)}")
    rows = (x.shape[0], x.shape[1], x.shape[1])
    if row_scale is not None and tuple(row_scale.shape) != rows:
        raise ValueError(f"row_scale must be [B, R, R] = {list(rows)} for x's B and R, "
                         f"got shape {tuple(row_scale.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("row_scale", row_scale)):
        if t is None:
            continue
        if t.dtype not in (x.dtype, torch.float32):
            raise ValueError(f"{name} must be in x's dtype {x.dtype} or float32, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if row_scale is not None and row_scale.requires_grad and torch.is_grad_enabled():
        raise ValueError("row_scale is a constant and gets no gradient, but it requires grad: "
                         "pass row_scale.detach() (or compute it under torch.no_grad())")


def _autocast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_scale: torch.Tensor | None):
    """Under autocast, x (and a weight, bias or row scale in neither fp32 nor the autocast dtype)
    in the autocast dtype, as ``F.linear`` would take them; otherwise unchanged."""
    device = x.device.type
    if not (torch.is_autocast_enabled(device) and x.dtype in TRITON_DTYPES):
        return x, weight, bias, row_scale
    dtype = torch.get_autocast_dtype(device)

    def cast(t):
        return t if t is None or t.dtype in (dtype, torch.float32) else t.to(dtype)

    return x.to(dtype), cast(weight), cast(bias), cast(row_scale)


def outer_product_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over ``x`` ``[B, R, C, R, C]`` read as ``[B, R, R, C*C]`` (``(c, d)`` innermost)
    with ``weight`` ``[E, C*C]`` and ``bias`` ``[E]`` or None, each output row ``(b, i, j)`` times
    ``row_scale[b, i, j]`` when ``row_scale`` ``[B, R, R]`` is given: ``[B, R, R, E]`` in x's dtype
    (the autocast dtype under autocast). The scale is applied in fp32 before the output's one
    rounding; for the outer product mean it is ``1 / (count + eps)``.

    Gradients flow to x (in x's layout), weight and bias, each in its own dtype, from the scaled
    output gradient ``dout * row_scale[..., None]``. ``row_scale`` (fp32 or x's dtype, on x's
    device) is a constant: none flows to it, and a ``row_scale`` that requires grad raises
    ``ValueError`` while grad is enabled. The Triton path runs on CUDA tensors (or under the
    ``triton`` backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16 x; otherwise the reference
    runs.
    """
    x, weight, bias, row_scale = _autocast(x, weight, bias, row_scale)
    _check(x, weight, bias, row_scale)
    if not (x.dtype in TRITON_DTYPES and x.numel() > 0 and weight.numel() > 0
            and use_triton(x, weight, bias, row_scale)):
        return outer_product_linear_reference(x, weight, bias, row_scale)
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    row_scale = None if row_scale is None else row_scale.contiguous()
    if use_custom_op():
        return _outer_product_linear_op(x, weight, bias, row_scale)
    return _EagerOuterProductLinear.apply(x, weight, bias, row_scale)


def outer_product_linear_flops(batch: int, res: int, c_hidden: int, out_features: int) -> tuple[int, int]:
    """(forward, backward) matmul flops: ``2 M K E`` with ``M = B R^2``, ``K = C^2`` forward (the
    bias add not counted), twice that backward (dx and dW; the bias gradient's sums not counted)."""
    forward = 2 * batch * res * res * c_hidden * c_hidden * out_features
    return forward, 2 * forward
