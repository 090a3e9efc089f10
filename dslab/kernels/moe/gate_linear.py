"""The MoE gate's scores: an fp32 linear map with few outputs, read straight from half-precision
tokens.

    logits [T, E] = x.float() @ w.T           x [T, H] (fp32, fp16 or bf16), w [E, H] fp32
    dx     [T, H] = (dlogits @ w).to(x.dtype)
    dw     [E, H] = dlogits.T @ x.float()      (fp32)

DeepSpeed's ``TopKGate`` runs this as ``F.linear(x.float(), wg.weight)``, in fp32 so that routing
does not depend on the activations' precision. With E = 8 that is a poor fit for cuBLAS: on an
H100 at T = 16,384, H = 1,024 the upcast writes a 64 MB fp32 copy of x (about 30 us), SIMT sgemm
takes ~47 us forward and ~47 us for dx (written in fp32, then cast back to bf16 by the upcast's
backward, another ~30 us), and ~28 us for dw. Here each product is one pass over x (32 MB in
bf16): the forward and dx kernels hold a block of token rows and all E scores in registers, the
dw kernel sums row blocks into per-program fp32 partials that are added in a fixed order. The
arithmetic is fp32 with fp32 accumulation throughout (``tl.dot`` with ``input_precision="ieee"``);
only the order of the additions differs from cuBLAS's.

Layers: :func:`gate_linear_reference` (the upcast and ``F.linear``) → the ``dslab::gate_linear``
custom op (and ``dslab::gate_linear_backward``) under ``torch.compile`` and dispatch modes, an
``autograd.Function`` making the same launches in eager mode → the Triton kernels below. The
Triton path takes E <= 64 on CUDA tensors (or the ``triton`` backend under ``TRITON_INTERPRET=1``);
anything else runs the reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_EXPERTS = 64


def gate_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x.float(), weight.float())`` outside autocast: fp32 logits [T, E]."""
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), weight.float())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _logits_kernel(X, W, OUT, T, H, E, stride_x, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_E: tl.constexpr):
        """OUT[rows] = X[rows].float() @ W.T for one block of BLOCK_T token rows."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, BLOCK_E)
        row_mask = rows < T
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            col_mask = cols < H
            x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            w = tl.load(W + experts[None, :] * H + cols[:, None],
                        mask=(experts < E)[None, :] & col_mask[:, None], other=0.0)
            acc = tl.dot(x, w, acc, input_precision="ieee")
        tl.store(OUT + rows.to(tl.int64)[:, None] * E + experts[None, :], acc,
                 mask=row_mask[:, None] & (experts < E)[None, :])

    @triton.jit
    def _input_grad_kernel(DL, W, DX, T, H, E, stride_dx, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_E: tl.constexpr):
        """DX[rows] = (DL[rows] @ W) in DX's dtype for one block of BLOCK_T rows."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, BLOCK_E)
        row_mask = rows < T
        dl = tl.load(DL + rows.to(tl.int64)[:, None] * E + experts[None, :],
                     mask=row_mask[:, None] & (experts < E)[None, :], other=0.0)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            col_mask = cols < H
            w = tl.load(W + experts[:, None] * H + cols[None, :],
                        mask=(experts < E)[:, None] & col_mask[None, :], other=0.0)
            dx = tl.dot(dl, w, input_precision="ieee")
            tl.store(DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty),
                     mask=row_mask[:, None] & col_mask[None, :])

    @triton.jit
    def _weight_grad_kernel(DL, X, PARTIAL, T, H, E, stride_x, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_E: tl.constexpr):
        """PARTIAL[p, :, cols] = sum over this program's row blocks of DL[rows].T @ X[rows].float()."""
        pid = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        experts = tl.arange(0, BLOCK_E)
        col_mask = cols < H
        acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)
        for block in tl.range(pid, tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
            rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
            row_mask = rows < T
            dl = tl.load(DL + rows.to(tl.int64)[None, :] * E + experts[:, None],
                         mask=row_mask[None, :] & (experts < E)[:, None], other=0.0)
            x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(dl, x, acc, input_precision="ieee")
        tl.store(PARTIAL + (pid * E + experts[:, None]) * H + cols[None, :], acc,
                 mask=(experts < E)[:, None] & col_mask[None, :])

    return _logits_kernel, _input_grad_kernel, _weight_grad_kernel


def _blocks(num_experts: int) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_H): the expert axis padded to a dot's minimum of 16, and a contraction
    step keeping a [BLOCK_T, BLOCK_H] fp32 tile and the scores in registers."""
    import triton

    return max(16, triton.next_power_of_2(num_experts)), 64


BLOCK_T = 64
WEIGHT_GRAD_PROGRAMS = 64  # row-block programs per column block of dw; their partials are summed


def _triton_forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    import triton

    from dslab.kernels._grid import device_guard

    logits_kernel, _, _ = _kernels()
    tokens, hidden = x.shape
    experts = weight.shape[0]
    out = torch.empty((tokens, experts), dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out
    block_e, block_h = _blocks(experts)
    with device_guard(x):
        logits_kernel[(triton.cdiv(tokens, BLOCK_T),)](x, weight, out, tokens, hidden, experts, x.stride(0),
                                                       BLOCK_T=BLOCK_T, BLOCK_H=block_h, BLOCK_E=block_e, num_warps=4)
    return out


def _triton_backward(dlogits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool, need_w: bool):
    import triton

    from dslab.kernels._grid import device_guard

    _, input_grad_kernel, weight_grad_kernel = _kernels()
    tokens, hidden = x.shape
    experts = weight.shape[0]
    block_e, block_h = _blocks(experts)
    dlogits = dlogits.contiguous()
    dx = dw = None
    with device_guard(x):
        if need_x:
            dx = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
            if tokens:
                input_grad_kernel[(triton.cdiv(tokens, BLOCK_T),)](
                    dlogits, weight, dx, tokens, hidden, experts, dx.stride(0),
                    BLOCK_T=BLOCK_T, BLOCK_H=block_h, BLOCK_E=block_e, num_warps=4)
        if need_w:
            programs = max(1, min(WEIGHT_GRAD_PROGRAMS, triton.cdiv(tokens, BLOCK_T)))
            partial = torch.empty((programs, experts, hidden), dtype=torch.float32, device=x.device)
            if tokens:
                weight_grad_kernel[(programs, triton.cdiv(hidden, block_h))](
                    dlogits, x, partial, tokens, hidden, experts, x.stride(0),
                    BLOCK_T=BLOCK_T, BLOCK_H=block_h, BLOCK_E=block_e, num_warps=4)
                dw = partial.sum(0)
            else:
                dw = torch.zeros((experts, hidden), dtype=torch.float32, device=x.device)
    return dx, dw


@torch.library.custom_op("dslab::gate_linear", mutates_args=())
def _gate_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits [T, E] of x [T, H] and the fp32 gate weight [E, H]."""
    return _triton_forward(x, weight)


@_gate_linear_op.register_fake
def _(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dslab::gate_linear_backward", mutates_args=())
def _gate_linear_backward_op(dlogits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor]:
    """(dx [T, H] in x's dtype, dw [E, H] fp32)."""
    return _triton_backward(dlogits, x, weight, True, True)


@_gate_linear_backward_op.register_fake
def _(dlogits, x, weight):
    return x.new_empty(x.shape), weight.new_empty(weight.shape, dtype=torch.float32)


def _setup(ctx, inputs, output):
    x, weight = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx, dlogits):
    x, weight = ctx.saved_tensors
    dx, dw = _gate_linear_backward_op(dlogits, x, weight)
    return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None)


_gate_linear_op.register_autograd(_backward, setup_context=_setup)


class _EagerGateLinear(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _triton_forward(x, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dlogits):
        x, weight = ctx.saved_tensors
        return _triton_backward(dlogits, x, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1])


def gate_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``x.float() @ weight.T`` [T, E] for tokens ``x`` [T, H] (fp32/fp16/bf16) and the
    fp32 gate weight [E, H], outside autocast whatever the context. Gradients: dx in x's dtype,
    dw in fp32. Shapes, dtypes and devices are checked here (``ValueError`` naming the argument)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [experts, {x.shape[1]}] (x's hidden size), got {tuple(weight.shape)}")
    if weight.dtype != torch.float32:
        raise ValueError(f"weight must be fp32 (the gate scores in fp32), got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    if not (x.dtype in TRITON_DTYPES and 0 < weight.shape[0] <= MAX_EXPERTS and x.shape[1] > 0
            and use_triton(x, weight)):
        return gate_linear_reference(x, weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    if use_custom_op():
        return _gate_linear_op(x, weight)
    return _EagerGateLinear.apply(x, weight)
