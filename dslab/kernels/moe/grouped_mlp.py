"""Grouped MLP: each group of rows through its own two-layer MLP, the experts of a mixture of
experts, with the activation fused into the grouped GEMMs.

    pre[rows of g] = x[rows of g] @ w1[g].T + b1[g]       [M, F]
    act            = activation(pre)                       [M, F]
    y[rows of g]   = act[rows of g] @ w2[g].T + b2[g]      [M, H]

``x`` [M, H] holds the rows sorted by group, ``w1`` [G, F, H] and ``w2`` [G, H, F] are each group's
``nn.Linear`` weights ([out, in]), ``b1`` [G, F] and ``b2`` [G, H] their biases (each may be None),
``group_offsets`` [G + 1] (int32 or int64, on x's device) the groups' row boundaries, as for
:func:`dslab.kernels.moe.grouped_gemm.grouped_gemm`; a group may be empty. ``activation`` is
``"gelu"`` (erf), ``"gelu_tanh"``, ``"relu"`` or ``"silu"``. Gradients:

    d_pre  = (dy @ w2[g]) * activation'(pre)     per group's rows          [M, F]
    dw2[g] = dy[rows of g].T @ act[rows of g]     db2[g] = dy[rows].sum(0)
    dx     = d_pre @ w1[g]                        per group's rows          [M, H]
    dw1[g] = d_pre[rows of g].T @ x[rows of g]    db1[g] = d_pre[rows].sum(0)

Why fused: with a separate activation kernel between the two grouped GEMMs, a training step
writes the hidden [M, F] four times (pre, act, d_act, d_pre) and reads it seven times (pre and act
in the forward; d_act, pre, act for dw2 and d_pre twice in the backward). Here the first GEMM's
epilogue writes pre and act from its fp32 accumulator, and the second layer's input-gradient GEMM
multiplies its accumulator by activation'(pre) (loading the matching tile of pre) and writes d_pre,
so d_act is never materialised: three writes and five reads. The flops are those of the unfused
layers, ``4 M H F`` forward and ``8 M H F`` backward (the activation's are not counted); pre and
act are kept for the backward, as the unfused layers keep them.

Numerics: act is computed from pre rounded to x's dtype (what is saved), so the backward's
activation'(pre) is the derivative of exactly the function the forward applied; d_pre is rounded
once, from fp32, where the unfused layers round d_act first. As for the grouped GEMM, the weights
may be fp32 *master weights* for fp16/bf16 x: they are cast to x's dtype for the products and
dw1, db1, dw2, db2 come back in fp32 from the kernels' accumulators.

Layers: :func:`grouped_mlp_reference` (a per-group loop of ``F.linear`` and the torch activation;
it reads the offsets on the host) → the ``dslab::grouped_mlp`` custom op (which also returns pre
and act, marked non-differentiable, for its autograd to save) with its autograd
(``dslab::grouped_mlp_backward_hidden`` for d_pre, then the grouped GEMM's
``dslab::grouped_gemm_backward_weight`` and ``dslab::grouped_gemm_backward_input``) under
``torch.compile`` and dispatch modes, and an ``autograd.Function`` making the same launches in
eager mode → the Triton kernels of :mod:`dslab.kernels.moe.grouped_gemm_triton` with their activation
epilogues, which read the offsets on the device and never synchronise with the host.
:func:`grouped_mlp` picks between them with :func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton
from dslab.kernels.moe.grouped_gemm import (
    TRITON_DTYPES,
    _backward_input_op,
    _backward_weight_op,
    _check_offset_values,
    _compute_dtype,
    _triton_module,
    _validate,
)

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
REFERENCE_ACTIVATIONS = {
    "gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "relu": F.relu, "silu": F.silu,
}


def grouped_mlp_reference(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    group_offsets: torch.Tensor, activation: str = "gelu",
) -> torch.Tensor:
    """The PyTorch reference: ``F.linear``, the activation and ``F.linear`` on each group's rows,
    concatenated; fp32 master weights are cast to x's dtype first.

    Reads ``group_offsets`` on the host (a synchronisation on a GPU) and checks its values; three
    launches per group. Gradients come from autograd through the loop.
    """
    bounds = group_offsets.tolist()
    _check_offset_values(bounds, x.shape[0])
    w1, b1 = _compute_dtype(w1, b1, x.dtype)
    w2, b2 = _compute_dtype(w2, b2, x.dtype)
    act = REFERENCE_ACTIVATIONS[activation]
    outputs = []
    for g in range(w1.shape[0]):
        h = F.linear(x[bounds[g]:bounds[g + 1]], w1[g], b1[g] if b1 is not None else None)
        outputs.append(F.linear(act(h), w2[g], b2[g] if b2 is not None else None))
    return torch.cat(outputs) if outputs else x.new_empty((0, w2.shape[1]))


@torch.library.custom_op("dslab::grouped_mlp", mutates_args=())
def _grouped_mlp_op(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    group_offsets: torch.Tensor, activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [M, H], pre [M, F], act [M, F]) for x [M, H], w1 [G, F, H], w2 [G, H, F]; pre and act are
    the backward's saved hidden."""
    kernels = _triton_module()
    w1, b1 = _compute_dtype(w1, b1, x.dtype)
    w2, b2 = _compute_dtype(w2, b2, x.dtype)
    pre, act = kernels.forward_activation(x, w1, group_offsets, b1, activation)
    return kernels.forward(act, w2, group_offsets, b2), pre, act


@_grouped_mlp_op.register_fake
def _(x, w1, b1, w2, b2, group_offsets, activation):
    m, f = x.shape[0], w1.shape[1]
    return x.new_empty((m, w2.shape[1])), x.new_empty((m, f)), x.new_empty((m, f))


@torch.library.custom_op("dslab::grouped_mlp_backward_hidden", mutates_args=())
def _backward_hidden_op(
    dy: torch.Tensor, w2: torch.Tensor, group_offsets: torch.Tensor, pre: torch.Tensor, activation: str
) -> torch.Tensor:
    """d_pre [M, F] = (dy @ w2[g]) * activation'(pre) per group's rows, for dy [M, H],
    w2 [G, H, F] (in dy's dtype) and pre [M, F]."""
    return _triton_module().backward_input_activation(dy, w2, group_offsets, pre, activation)


@_backward_hidden_op.register_fake
def _(dy, w2, group_offsets, pre, activation):
    return dy.new_empty((dy.shape[0], w2.shape[2]))


def _setup(ctx, inputs, output):
    x, w1, b1, w2, b2, group_offsets, activation = inputs
    _, pre, act = output
    # pre and act are outputs only to be saved: no gradient flows into them, and none is
    # materialised as zeros for the backward.
    ctx.mark_non_differentiable(pre, act)
    ctx.set_materialize_grads(False)
    ctx.activation = activation
    ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
    ctx.save_for_backward(x, w1, w2, group_offsets, pre, act)


def _backward(ctx, dy, _pre_grad, _act_grad):
    x, w1, w2, group_offsets, pre, act = ctx.saved_tensors
    needs_x, needs_w1, needs_b1, needs_w2, needs_b2 = ctx.needs_input_grad[:5]
    fp32_out = w1.dtype != x.dtype
    dx = dw1 = db1 = dw2 = db2 = None
    if needs_w2 or (ctx.has_b2 and needs_b2):
        dw2, db2 = _backward_weight_op(dy, act, group_offsets, ctx.has_b2, fp32_out)
    if needs_x or needs_w1 or (ctx.has_b1 and needs_b1):
        d_pre = _backward_hidden_op(dy, w2.to(x.dtype), group_offsets, pre, ctx.activation)
        dx = _backward_input_op(d_pre, w1.to(x.dtype), group_offsets) if needs_x else None
        if needs_w1 or (ctx.has_b1 and needs_b1):
            dw1, db1 = _backward_weight_op(d_pre, x, group_offsets, ctx.has_b1, fp32_out)
    return (dx, dw1, db1 if ctx.has_b1 else None, dw2, db2 if ctx.has_b2 else None, None, None)


_grouped_mlp_op.register_autograd(_backward, setup_context=_setup)


class _EagerGroupedMlp(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, group_offsets, activation):
        kernels = _triton_module()
        ctx.activation = activation
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        ctx.weight_dtype = w1.dtype
        w1, b1 = _compute_dtype(w1, b1, x.dtype)
        w2, b2 = _compute_dtype(w2, b2, x.dtype)
        pre, act = kernels.forward_activation(x, w1, group_offsets, b1, activation)
        ctx.save_for_backward(x, w1, w2, group_offsets, pre, act)
        return kernels.forward(act, w2, group_offsets, b2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        kernels = _triton_module()
        x, w1, w2, group_offsets, pre, act = ctx.saved_tensors
        needs_x, needs_w1, needs_b1, needs_w2, needs_b2 = ctx.needs_input_grad[:5]
        dx = dw1 = db1 = dw2 = db2 = None
        if needs_w2 or (ctx.has_b2 and needs_b2):
            dw2, db2 = kernels.backward_weight(dy, act, group_offsets, ctx.has_b2, ctx.weight_dtype)
        if needs_x or needs_w1 or (ctx.has_b1 and needs_b1):
            d_pre = kernels.backward_input_activation(dy, w2, group_offsets, pre, ctx.activation)
            dx = kernels.backward_input(d_pre, w1, group_offsets) if needs_x else None
            if needs_w1 or (ctx.has_b1 and needs_b1):
                dw1, db1 = kernels.backward_weight(d_pre, x, group_offsets, ctx.has_b1, ctx.weight_dtype)
        return dx, dw1, db1, dw2, db2, None, None


def _validate_mlp(x, w1, b1, w2, b2, group_offsets, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _validate(x, w1, group_offsets, b1, w_name="w1", bias_name="b1")
    groups, f, h = w1.shape
    if w2.dim() != 3 or tuple(w2.shape) != (groups, h, f):
        raise ValueError(f"w2 must have shape ({groups}, {h}, {f}) ([G, H, F] for w1's [G, F, H]), "
                         f"got {tuple(w2.shape)}")
    if w2.dtype != w1.dtype:
        raise ValueError(f"w2 must have w1's dtype {w1.dtype}, got {w2.dtype}")
    if w2.device != x.device:
        raise ValueError(f"w2 must be on x's device {x.device}, got {w2.device}")
    if b2 is not None:
        if tuple(b2.shape) != (groups, h):
            raise ValueError(f"b2 must have shape ({groups}, {h}) (w2's [G, H]), got {tuple(b2.shape)}")
        if b2.dtype != w2.dtype:
            raise ValueError(f"b2 must have w2's dtype {w2.dtype}, got {b2.dtype}")
        if b2.device != x.device:
            raise ValueError(f"b2 must be on x's device {x.device}, got {b2.device}")


def grouped_mlp(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    group_offsets: torch.Tensor, activation: str = "gelu",
) -> torch.Tensor:
    """``y[rows of g] = activation(x[rows of g] @ w1[g].T + b1[g]) @ w2[g].T + b2[g]`` for x [M, H]
    (rows sorted by group), w1 [G, F, H], b1 [G, F] or None, w2 [G, H, F], b2 [G, H] or None,
    group_offsets [G + 1] (int32/int64 on x's device); y [M, H] in x's dtype. ``activation``:
    ``"gelu"``, ``"gelu_tanh"``, ``"relu"`` or ``"silu"``.

    Gradients flow to x, w1, b1, w2 and b2. The Triton path runs on CUDA tensors (or under the
    ``triton`` backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16 and never synchronises; it
    trusts the offsets' values. Otherwise, and for F = 0 or H = 0, the reference runs, which
    checks them. w1, b1, w2 and b2 share one dtype, x's or fp32 for fp16/bf16 x; shapes, dtypes
    and devices are checked here and raise ``ValueError`` naming the argument.
    """
    _validate_mlp(x, w1, b1, w2, b2, group_offsets, activation)
    if not (x.dtype in TRITON_DTYPES and w1.shape[1] > 0 and w1.shape[2] > 0
            and use_triton(x, w1, b1, w2, b2, group_offsets)):
        return grouped_mlp_reference(x, w1, b1, w2, b2, group_offsets, activation)
    if use_custom_op():
        return _grouped_mlp_op(x, w1, b1, w2, b2, group_offsets, activation)[0]
    return _EagerGroupedMlp.apply(x, w1, b1, w2, b2, group_offsets, activation)
