"""Evoformer attention (DeepSpeed4Science's ``DS4Sci_EvoformerAttention``): attention over residues
within each MSA sequence (or each residue row of the pair stack), with a per-key mask bias and a
per-head pair bias.

    out[..., s, i, h, :] = softmax_j(q[s, i, h] . k[s, j, h] * D**-0.5 + mask[s, j] + pair[h, i, j]) @ v[s, j, h]

- q, k, v, out: ``[*, N_seq, N_res, H, D]`` (any leading batch dims, typically one), one dtype
  (fp32, fp16 or bf16), D in 16, 32, 64, 128.
- ``biases``: a list of at most two tensors in q's dtype and on q's device (an entry may be None):
  ``biases[0]``, the mask bias, broadcastable to ``[*, N_seq, 1, 1, N_res]`` (OpenFold passes
  ``1e9 * (mask - 1)``); ``biases[1]``, the pair bias, broadcastable to ``[*, 1, H, N_res, N_res]``.
- The softmax scale ``D**-0.5`` is applied inside, as DeepSpeed's kernel does.
- Gradients flow to q, k, v and both biases, as in DeepSpeed (which computes the mask bias's
  gradient too when it requires one). The pair bias's gradient is dS summed over sequences (and
  over the batch and heads where the bias broadcasts), the mask bias's dS summed over heads and
  query residues. Neither is ever materialised per sequence on the Triton path.

Flops (FlashAttention's count): ``4 * B * N_seq * N_res**2 * H * D`` forward (``q k^T`` and
``p v``), 2.5x that backward (five matmuls).

Layers: :func:`evoformer_attention_reference` (the naive PyTorch computation; materialises the
``[*, N_seq, H, N_res, N_res]`` scores) → the ``dslab::evoformer_attention`` custom op (returning
the output and the row log-sum-exp) with its autograd through ``dslab::evoformer_attention_backward``
under ``torch.compile`` and dispatch modes, and an ``autograd.Function`` making the same launches in
eager mode → the Triton kernels of :mod:`dslab.kernels.evoformer.evoformer_attention_triton` (forward) and
:mod:`dslab.kernels.evoformer.evoformer_attention_triton_bwd` (backward; its docstring explains how the
pair-bias gradient is reduced over sequences and what that costs). :func:`evoformer_attention`
picks between them with :func:`dslab.kernels.dispatch.use_triton`.
:func:`DS4Sci_EvoformerAttention` is the same function under DeepSpeed's name and argument names
(re-exported by :mod:`dslab.ops.deepspeed4science`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Optional

import torch

from dslab.kernels.dispatch import use_custom_op, use_triton
from dslab.kernels.evoformer.evoformer_layout import output_like

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BIAS_NAMES = ("biases[0] (the mask bias)", "biases[1] (the pair bias)")


def evoformer_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, biases: Sequence[torch.Tensor | None] = ()
) -> torch.Tensor:
    """The naive computation in the inputs' dtype: ``[*, N_seq, H, N_res, N_res]`` scores, the biases
    added by broadcasting, a softmax over keys, a matmul with v. Gradients come from autograd."""
    scale = q.shape[-1] ** -0.5
    q_heads, k_heads, v_heads = (t.transpose(-2, -3) for t in (q, k, v))  # [*, N_seq, H, N_res, D]
    scores = torch.matmul(q_heads, k_heads.transpose(-1, -2)) * scale
    for bias in biases:
        if bias is not None:
            scores = scores + bias
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v_heads).transpose(-2, -3)


@functools.cache
def _triton():
    from dslab.kernels.evoformer import evoformer_attention_triton

    return evoformer_attention_triton


@functools.cache
def _triton_bwd():
    from dslab.kernels.evoformer import evoformer_attention_triton_bwd

    return evoformer_attention_triton_bwd


def _lse_shape(q: torch.Tensor) -> tuple[int, int, int, int]:
    """``[B, N_seq, H, N_res]`` of the forward's row statistics (B the product of the batch dims)."""
    n_seq, n_res, heads, _ = q.shape[-4:]
    return math.prod(q.shape[:-4]), n_seq, heads, n_res


@torch.library.custom_op("dslab::evoformer_attention", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    mask_bias: Optional[torch.Tensor], pair_bias: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out like q, fp32 base-2 log-sum-exp ``[B, N_seq, H, N_res]``)."""
    return _triton().forward(q, k, v, mask_bias, pair_bias)


@_forward_op.register_fake
def _(q, k, v, mask_bias, pair_bias):
    return output_like(q), q.new_empty(_lse_shape(q), dtype=torch.float32)


@torch.library.custom_op("dslab::evoformer_attention_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, mask_bias: Optional[torch.Tensor], pair_bias: Optional[torch.Tensor],
    mask_grad: bool, pair_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dmask, dpair); dmask and dpair are empty tensors unless requested."""
    dq, dk, dv, dmask, dpair = _triton_bwd().backward(
        grad_out, q, k, v, out, lse, mask_bias, pair_bias, mask_grad, pair_grad
    )
    return dq, dk, dv, _or_empty(dmask, q), _or_empty(dpair, q)


def _or_empty(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if grad is None else grad


@_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, mask_bias, pair_bias, mask_grad, pair_grad):
    dmask = mask_bias.new_empty(mask_bias.shape) if mask_grad else q.new_empty(0)
    dpair = pair_bias.new_empty(pair_bias.shape) if pair_grad else q.new_empty(0)
    return output_like(q), output_like(k), output_like(v), dmask, dpair


def _bias_grads_needed(ctx, mask_bias, pair_bias) -> tuple[bool, bool]:
    needs = ctx.needs_input_grad
    return mask_bias is not None and needs[3], pair_bias is not None and needs[4]


def _setup_context(ctx, inputs, output):
    q, k, v, mask_bias, pair_bias = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, mask_bias, pair_bias)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, mask_bias, pair_bias = ctx.saved_tensors
    mask_grad, pair_grad = _bias_grads_needed(ctx, mask_bias, pair_bias)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dmask, dpair = _backward_op(grad_out, q, k, v, out, lse, mask_bias, pair_bias, mask_grad, pair_grad)
    return dq, dk, dv, (dmask if mask_grad else None), (dpair if pair_grad else None)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerEvoformerAttention(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, q, k, v, mask_bias, pair_bias):
        out, lse = _triton().forward(q, k, v, mask_bias, pair_bias)
        ctx.save_for_backward(q, k, v, out, lse, mask_bias, pair_bias)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, mask_bias, pair_bias = ctx.saved_tensors
        mask_grad, pair_grad = _bias_grads_needed(ctx, mask_bias, pair_bias)
        return _triton_bwd().backward(grad_out, q, k, v, out, lse, mask_bias, pair_bias, mask_grad, pair_grad)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _validate_bias(index: int, bias, q: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
    name = _BIAS_NAMES[index]
    if not isinstance(bias, torch.Tensor):
        raise ValueError(f"{name} must be a tensor or None, got {_describe(bias)}")
    wanted = f"a shape broadcastable to {layout} = {expected}"
    if bias.dim() > len(expected):
        raise ValueError(f"{name} has shape {tuple(bias.shape)}; expected {wanted}")
    try:
        broadcast = torch.broadcast_shapes(bias.shape, expected)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(expected):
        raise ValueError(f"{name} has shape {tuple(bias.shape)}; expected {wanted}")
    if bias.dtype != q.dtype:
        raise ValueError(f"{name} has dtype {bias.dtype}; expected q's dtype {q.dtype}")
    if bias.device != q.device:
        raise ValueError(f"{name} is on {bias.device}; expected q's device {q.device}")


def _validate(q, k, v, biases) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Check the arguments (ValueError naming the bad one and the expected shape); returns
    (mask_bias, pair_bias), each possibly None."""
    if not isinstance(q, torch.Tensor) or q.dim() < 4:
        raise ValueError(f"q must be a tensor [*, N_seq, N_res, H, D] with at least 4 dims, got {_describe(q)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; expected one of {', '.join(map(str, DTYPES))}")
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"q has head dim D = {head_dim} (shape {tuple(q.shape)}); supported head dims are {HEAD_DIMS}"
        )
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape:
            raise ValueError(
                f"{name} must have q's shape [*, N_seq, N_res, H, D] = {tuple(q.shape)}, got {_describe(t)}"
            )
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}; expected q's dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}; expected q's device {q.device}")
    if biases is None:
        biases = ()
    if not isinstance(biases, (list, tuple)) or len(biases) > 2:
        raise ValueError(
            f"biases must be a list of at most 2 tensors ([mask bias, pair bias]), got {_describe(biases)}"
            + (f" of length {len(biases)}" if isinstance(biases, (list, tuple)) else "")
        )
    *batch, n_seq, n_res, heads, _ = q.shape
    layouts = (
        ((*batch, n_seq, 1, 1, n_res), "[*, N_seq, 1, 1, N_res]"),
        ((*batch, 1, heads, n_res, n_res), "[*, 1, H, N_res, N_res]"),
    )
    padded = [*biases, None, None][:2]
    for index, bias in enumerate(padded):
        if bias is not None:
            _validate_bias(index, bias, q, *layouts[index])
    return padded[0], padded[1]


def evoformer_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, biases: Sequence[torch.Tensor | None] = ()
) -> torch.Tensor:
    """Evoformer attention of q, k, v ``[*, N_seq, N_res, H, D]`` with ``biases`` ``[mask_bias,
    pair_bias]`` (either may be missing or None; see the module docstring) → ``[*, N_seq, N_res, H,
    D]`` in q's dtype, in q's memory layout on the Triton path when q is dense with unit stride
    along D (see :func:`output_like`), else contiguous. ``biases`` is not modified.

    The Triton path runs on CUDA tensors (or under the ``triton`` backend with
    ``TRITON_INTERPRET=1``); otherwise, and for empty inputs, the reference runs. Gradients reach
    q, k, v and both biases (the mask bias only when it requires one, as in DeepSpeed). Shapes,
    dtypes, devices and head dims are checked here and raise ``ValueError`` naming the argument
    and the expected shape.
    """
    mask_bias, pair_bias = _validate(q, k, v, biases)
    if q.numel() == 0 or not use_triton(q, k, v, mask_bias, pair_bias):
        return evoformer_attention_reference(q, k, v, (mask_bias, pair_bias))
    if use_custom_op():
        return _forward_op(q, k, v, mask_bias, pair_bias)[0]
    return _EagerEvoformerAttention.apply(q, k, v, mask_bias, pair_bias)


def DS4Sci_EvoformerAttention(  # noqa: N802 - DeepSpeed's name
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, biases: Sequence[torch.Tensor | None]  # noqa: N803
) -> torch.Tensor:
    """DeepSpeed's ``deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention(Q, K, V, biases)``:
    :func:`evoformer_attention` with DeepSpeed's argument names. Q, K, V ``[*, N_seq, N_res, H,
    D]``; ``biases`` ``[mask_bias [*, N_seq, 1, 1, N_res], pair_bias [*, 1, H, N_res, N_res]]``, at
    most two, None allowed (unlike DeepSpeed, the list is not padded in place)."""
    return evoformer_attention(Q, K, V, biases)
