"""Causal self-attention from a packed projection on cuDNN's fused attention (through PyTorch's
``scaled_dot_product_attention`` with its cuDNN backend), where that measured faster than
dslab's Triton kernels.

:func:`dslab.kernels.attention_packed.attention_packed` hands a call here when :func:`eligible`
says so: a CUDA device of compute capability 9.x (Hopper), bf16 or fp16, causal, no key padding
mask, head dim 64 or 128, no seed passed in (the dropout mask then comes from torch's generator,
as in ``F.dropout``; with a seed the Triton kernels run, whose mask is a function of it), torch's
deterministic algorithms off, the ``auto`` kernel backend (``triton`` forces dslab's kernels, as
:mod:`dslab.kernels.dispatch` says) and PyTorch able to run cuDNN attention on these inputs.

Why: GPT-2 124M (causal, head dim 64, seq 1024, micro-batch 16, dropout 0.1) on an H200,
the whole training step with its CUDA graphs, dslab's Triton attention against this path in one
process: 33.03 against 32.31 ms/step (5 trials). Per layer, cuDNN's backward (~290 us with
dropout) is what wins: the Triton backward takes ~410 us, ~355 without dropout; the forwards are
~190 (cuDNN) and ~225 us (Triton) with dropout, ~90 us each without.

q, k and v are strided views of qkv (no copy in); the output's heads are merged with a view
where cuDNN lays it out as ``[batch, seq, heads, head_dim]``. The backward's dq, dk, dv are
gathered into qkv's gradient by autograd (one copy). ``bias``, the projection's bias already
inside qkv, gets the column sums of that gradient (:func:`dslab.kernels.column_sum.column_sum`),
with the key block's exactly 0 as on dslab's other paths (softmax ignores a shift of all of a
query's scores).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import backend

HEAD_DIMS = (64, 128)
_DTYPES = (torch.bfloat16, torch.float16)


def _sdpa_backend():
    from torch.nn.attention import SDPBackend

    return SDPBackend.CUDNN_ATTENTION


def _cudnn_can_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, causal: bool) -> bool:
    params_type = getattr(torch.backends.cuda, "SDPAParams", None)
    can_use = getattr(torch.backends.cuda, "can_use_cudnn_attention", None)
    if params_type is None or can_use is None or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    try:
        params = params_type(q, k, v, None, dropout_p, causal, False)
    except TypeError:  # an SDPAParams of another signature
        return False
    return bool(can_use(params, False))


def _split(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, seq, width = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, heads, width // (3 * heads)).unbind(2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def ineligible_reason(*, is_cuda: bool, dtype: torch.dtype, head_dim: int, causal: bool, has_padding_mask: bool,
                      has_seed: bool, kernel_backend: str, deterministic: bool,
                      capability: tuple[int, int] | None) -> str | None:
    """Why a call with these properties stays on dslab's Triton kernels, or None when it may come
    here (:func:`eligible` then asks PyTorch whether cuDNN can run the inputs)."""
    if not is_cuda:
        return "not a CUDA tensor"
    if kernel_backend != "auto":
        return f"kernel backend {kernel_backend!r} (only 'auto' picks cuDNN)"
    if capability is None or capability[0] != 9:
        return f"compute capability {capability} (measured faster on 9.x only)"
    if dtype not in _DTYPES:
        return f"dtype {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim}"
    if not causal:
        return "not causal"
    if has_padding_mask:
        return "a key padding mask"
    if has_seed:
        return "a dropout seed passed in"
    if deterministic:
        return "torch's deterministic algorithms are on"
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def eligible(qkv: torch.Tensor, heads: int, causal: bool, key_padding_mask: Optional[torch.Tensor],
             dropout_p: float, seed) -> bool:
    """Whether :func:`attention_packed` should run this call (module docstring), for inputs that
    :func:`dslab.kernels.attention_packed.attention_packed` has validated."""
    reason = ineligible_reason(
        is_cuda=qkv.is_cuda, dtype=qkv.dtype, head_dim=qkv.shape[-1] // (3 * heads), causal=bool(causal),
        has_padding_mask=key_padding_mask is not None, has_seed=seed is not None, kernel_backend=backend(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        capability=_capability(qkv.device.index) if qkv.is_cuda else None,
    )
    if reason is not None or qkv.numel() == 0:
        return False
    q, k, v = _split(qkv, heads)
    return _cudnn_can_run(q, k, v, dropout_p, causal)


class _BiasGrad(torch.autograd.Function):
    """Identity on qkv whose backward also returns the gradient of the bias inside it."""

    @staticmethod
    def forward(ctx, qkv, bias):
        ctx.bias_dtype = bias.dtype
        return qkv.view_as(qkv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        from dslab.kernels.column_sum import column_sum

        grad_bias = column_sum(grad.reshape(-1, grad.shape[-1]), ctx.bias_dtype)
        width = grad_bias.shape[0] // 3
        grad_bias[width:2 * width] = 0
        return grad, grad_bias


def attention_packed(qkv: torch.Tensor, heads: int, dropout_p: float, scale: float,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal self-attention over qkv ``[B, S, 3 * hidden]`` -> ``[B, S, hidden]`` on cuDNN, the
    contract of :func:`dslab.kernels.attention_packed.attention_packed`."""
    from torch.nn.attention import sdpa_kernel

    if bias is not None:
        qkv = _BiasGrad.apply(qkv, bias)
    batch, seq, width = qkv.shape
    q, k, v = _split(qkv, heads)
    with sdpa_kernel(_sdpa_backend()):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(batch, seq, width // 3)
