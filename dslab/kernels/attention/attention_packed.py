"""Attention straight from a packed projection: the op of :mod:`dslab.kernels.attention.attention` without
the layout copies around it.

``attention_packed(qkv, heads, causal, key_padding_mask, dropout_p, scale)`` is the same attention
straight from a packed projection: qkv ``[batch, seq, 3 * hidden]`` (q, k, v blocks of ``hidden``
columns, ``heads`` heads of ``hidden / heads`` columns in order within each) -> ``[batch, seq,
hidden]`` (heads concatenated). Its Triton path reads q, k, v as strided views of qkv, writes the
output in ``[batch, seq, heads, head_dim]`` order, reads the incoming ``[batch, seq, hidden]``
gradient in place and writes dq, dk, dv into one ``[batch, seq, 3 * hidden]`` gradient: no
transposes, copies or zero-fills around the kernels (whose memory traffic is ``attention``'s).

``bias`` (optional, ``[3 * hidden]``) is the bias the projection has already added into qkv
(``qkv = x W^T + bias``, in the matmul's epilogue): it does not change the output, and its
gradient, the column sums of qkv's gradient, comes out of the backward kernels (each program adds
up the rows it writes, :func:`dslab.kernels.attention.attention_triton_bwd.bias_partials`) instead of a
separate reduction that reads the whole ``[batch * seq, 3 * hidden]`` gradient again (BERT-large
seq 128 on an H100: 31 us per layer). The key block's gradient is exactly 0: softmax ignores the
shift ``q_i . b_k`` that the key bias adds to all of query ``i``'s scores (the column sums of dK
are that 0 up to the rounding of dS), on every path.

On Hopper, causal calls without a key padding mask or a seed go to cuDNN's fused attention
(:mod:`dslab.kernels.attention.attention_cudnn`, which says when and why) with the same contract.

Reference, dispatch, dropout seeds, validation and the eager/custom-op split are
:mod:`dslab.kernels.attention.attention`'s; the custom ops here are ``dslab::attention_packed_forward`` /
``dslab::attention_packed_backward``.
"""

import math
from typing import Optional

import torch

from dslab.kernels._grid import column_sums
from dslab.kernels.attention import attention_cudnn, attention_triton, attention_triton_bwd
from dslab.kernels.attention.attention import (
    _DTYPES,
    HEAD_DIMS,
    TRITON_DTYPES,
    _describe,
    _function_apply,
    _keep_buffer,
    _seed_tensor,
    _validate_options,
    attention_reference,
    draw_dropout_seed,
)
from dslab.kernels.dispatch import use_custom_op, use_triton


def _split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[batch, heads, seq, head_dim]`` as strided views of qkv ``[batch, seq, 3 * hidden]``."""
    batch, seq, width = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, heads, width // (3 * heads)).unbind(2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _as_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[batch, seq, hidden]`` viewed as ``[batch, heads, seq, head_dim]`` (no copy for any strides)."""
    batch, seq, hidden = t.shape
    return t.view(batch, seq, heads, hidden // heads).transpose(1, 2)


def attention_packed_reference(
    qkv: torch.Tensor,
    heads: int,
    causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    dropout_mask: Optional[torch.Tensor] = None,
    seed: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attention_reference` on the heads of qkv ``[batch, seq, 3 * hidden]``, returned as
    ``[batch, seq, hidden]``; ``dropout_mask`` and ``seed`` as there."""
    batch, seq, width = qkv.shape
    q, k, v = _split_heads(qkv, heads)
    out = attention_reference(q, k, v, causal, key_padding_mask, dropout_p, scale, dropout_mask, seed)
    return out.transpose(1, 2).reshape(batch, seq, width // 3)


def _packed_forward(qkv, key_padding_mask, seed, heads, causal, dropout_p, scale):
    batch, seq, width = qkv.shape
    out = qkv.new_empty((batch, seq, width // 3))
    q, k, v = _split_heads(qkv, heads)
    keep = _keep_buffer(q, seq, dropout_p)
    _, lse = attention_triton.attention_forward(
        q, k, v, key_padding_mask, seed, causal, dropout_p, scale, out=_as_heads(out, heads), keep=keep
    )
    return out, lse, keep


def _packed_backward(grad_out, qkv, out, lse, key_padding_mask, seed, heads, causal, dropout_p, scale, keep=None,
                     bias=None):
    """(the gradient of qkv, that of ``bias`` in its dtype or None without one)."""
    grad_qkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    q, k, v = _split_heads(qkv, heads)
    grads = attention_triton_bwd.attention_backward(
        _as_heads(grad_out, heads), q, k, v, _as_heads(out, heads), lse, key_padding_mask, seed,
        causal, dropout_p, scale, grads=_split_heads(grad_qkv, heads), keep=keep, bias_sums=bias is not None,
    )
    if bias is None:
        return grad_qkv, None
    (grad_bias,) = column_sums(grads[3].unsqueeze(0), (bias.dtype,))
    return grad_qkv, grad_bias


@torch.library.custom_op("dslab::attention_packed_forward", mutates_args=())
def _attention_packed_forward_op(
    qkv: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
    heads: int,
    causal: bool,
    dropout_p: float,
    scale: float,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton forward on qkv ``[batch, seq, 3 * hidden]``: (out ``[batch, seq, hidden]``, base-2
    logsumexp ``[batch, heads, seq]`` fp32, the dropout bits for the backward as
    :func:`dslab.kernels.attention.attention._attention_forward_op` returns them). ``bias`` is not read here:
    it is the input whose gradient the backward returns (see the module docstring)."""
    return _packed_forward(qkv, key_padding_mask, seed, heads, causal, dropout_p, scale)


@_attention_packed_forward_op.register_fake
def _attention_packed_forward_fake(qkv, key_padding_mask, seed, heads, causal, dropout_p, scale, bias=None):
    batch, seq, width = qkv.shape
    keep = (qkv.new_empty((batch * heads, seq, -(-seq // 8)), dtype=torch.uint8) if dropout_p > 0.0
            else qkv.new_empty((0,), dtype=torch.uint8))
    return qkv.new_empty((batch, seq, width // 3)), qkv.new_empty((batch, heads, seq), dtype=torch.float32), keep


@torch.library.custom_op("dslab::attention_packed_backward", mutates_args=())
def _attention_packed_backward_op(
    grad_out: torch.Tensor,
    qkv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
    heads: int,
    causal: bool,
    dropout_p: float,
    scale: float,
    keep: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backward: (the gradient of qkv, ``[batch, seq, 3 * hidden]``; that of ``bias`` in its
    dtype, or an empty tensor without one). The dropout mask comes from the forward's bits
    ``keep``, else it is drawn again from ``seed``."""
    grad_qkv, grad_bias = _packed_backward(grad_out, qkv, out, lse, key_padding_mask, seed, heads, causal,
                                           dropout_p, scale, keep, bias)
    return grad_qkv, grad_bias if grad_bias is not None else qkv.new_empty(0)


@_attention_packed_backward_op.register_fake
def _attention_packed_backward_fake(grad_out, qkv, out, lse, key_padding_mask, seed, heads, causal, dropout_p, scale,
                                    keep=None, bias=None):
    grad_bias = torch.empty_like(bias) if bias is not None else qkv.new_empty(0)
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device), grad_bias


def _packed_setup_context(ctx, inputs, output):
    qkv, key_padding_mask, seed, heads, causal, dropout_p, scale, *rest = inputs
    bias = rest[0] if rest else None
    out, lse, keep = output
    ctx.save_for_backward(qkv, out, lse, key_padding_mask, seed, keep, bias)
    ctx.params = (heads, causal, dropout_p, scale)
    ctx.mark_non_differentiable(lse, keep)


def _packed_backward_autograd(ctx, grad_out, grad_lse, grad_keep):
    qkv, out, lse, key_padding_mask, seed, keep, bias = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grad_qkv, grad_bias = _attention_packed_backward_op(grad_out, qkv, out, lse, key_padding_mask, seed,
                                                        *ctx.params, keep, bias)
    return grad_qkv, None, None, None, None, None, None, (grad_bias if bias is not None else None)


_attention_packed_forward_op.register_autograd(_packed_backward_autograd, setup_context=_packed_setup_context)


class _EagerAttentionPacked(torch.autograd.Function):
    """The packed custom ops' launches for eager mode (see :class:`_EagerAttention`)."""

    @staticmethod
    def forward(ctx, qkv, key_padding_mask, seed, heads, causal, dropout_p, scale, bias):
        out, lse, keep = _packed_forward(qkv, key_padding_mask, seed, heads, causal, dropout_p, scale)
        ctx.save_for_backward(qkv, out, lse, key_padding_mask, seed, keep, bias)
        ctx.params = (heads, causal, dropout_p, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():
            return _eager_packed_backward_once_differentiable(ctx, grad_out)
        return _eager_packed_backward(ctx, grad_out)


def _eager_packed_backward(ctx, grad_out):
    qkv, out, lse, key_padding_mask, seed, keep, bias = ctx.saved_tensors
    grad_qkv, grad_bias = _packed_backward(grad_out, qkv, out, lse, key_padding_mask, seed, *ctx.params, keep, bias)
    return grad_qkv, None, None, None, None, None, None, grad_bias


_eager_packed_backward_once_differentiable = torch.autograd.function.once_differentiable(_eager_packed_backward)
_eager_attention_packed = _function_apply(_EagerAttentionPacked)


def _validate_packed(qkv, heads, key_padding_mask, dropout_p, scale) -> None:
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3:
        raise ValueError(f"qkv must be a 3-d tensor [batch, seq, 3 * hidden], got {_describe(qkv)}")
    if qkv.dtype not in _DTYPES:
        raise ValueError(f"qkv has dtype {qkv.dtype}; expected one of {', '.join(map(str, _DTYPES))}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    width = qkv.shape[-1]
    if width % (3 * heads):
        raise ValueError(f"qkv's last dimension {width} is not 3 * heads * head_dim for heads={heads}")
    if width // (3 * heads) not in HEAD_DIMS:
        raise ValueError(
            f"qkv has head_dim {width // (3 * heads)} ({width} / (3 * heads={heads})); supported head dims "
            f"are {HEAD_DIMS}"
        )
    _validate_options(key_padding_mask, qkv.shape[0], qkv.shape[1], qkv.device, "qkv", dropout_p, scale)


def _validate_bias(bias, qkv) -> None:
    if not isinstance(bias, torch.Tensor) or bias.shape != (qkv.shape[-1],):
        raise ValueError(f"bias must be a tensor [3 * hidden] = [{qkv.shape[-1]}] like qkv's last dimension, "
                         f"got {_describe(bias)}")
    if not bias.is_floating_point():
        raise ValueError(f"bias has dtype {bias.dtype}; expected a floating point dtype")
    if bias.device != qkv.device:
        raise ValueError(f"bias is on {bias.device} but qkv is on {qkv.device}")


def attention_packed(
    qkv: torch.Tensor,
    heads: int,
    causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    seed: int | torch.Tensor | None = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Self-attention over qkv ``[B, S, 3 * hidden]`` (q, k, v column blocks, ``heads`` heads in
    order in each) -> ``[B, S, hidden]``; masks, dropout, ``seed`` and backends as :func:`attention`.
    ``bias``: the ``[3 * hidden]`` bias already inside qkv, which receives its gradient from here
    (module docstring); the output does not depend on it. Raises ValueError naming the bad argument."""
    _validate_packed(qkv, heads, key_padding_mask, dropout_p, scale)
    if bias is not None:
        _validate_bias(bias, qkv)
    head_dim = qkv.shape[-1] // (3 * heads)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if attention_cudnn.eligible(qkv, heads, causal, key_padding_mask, dropout_p, seed):
        return attention_cudnn.attention_packed(qkv, heads, float(dropout_p), float(scale), bias)
    if seed is not None:
        seed = _seed_tensor(seed, qkv.device)
    if qkv.numel() > 0 and qkv.dtype in TRITON_DTYPES and use_triton(qkv, key_padding_mask):
        if dropout_p > 0.0:
            seed = draw_dropout_seed(qkv.device) if seed is None else seed
        else:
            seed = None
        args = (qkv, key_padding_mask, seed, heads, bool(causal), float(dropout_p), float(scale), bias)
        if use_custom_op():
            return _attention_packed_forward_op(*args)[0]
        return _eager_attention_packed(*args)
    if bias is not None:  # adds zeros: routes qkv's gradient, summed over rows, to the bias (0 to k's)
        q_bias, k_bias, v_bias = bias.chunk(3)
        routed = torch.cat([q_bias, k_bias * 0, v_bias])
        qkv = qkv + (routed - routed.detach()).to(qkv.dtype)
    return attention_packed_reference(qkv, heads, causal, key_padding_mask, dropout_p, scale, seed=seed)
