"""The ops a Llama-family model adds to :mod:`dslab.models.ops`' set, by kernel set, and its rotary tables.

Two sets with one signature each (:class:`LlamaOps`):

- ``"dslab"``: :mod:`dslab.kernels`' fused ops, each dispatching on its own (Triton on CUDA, its
  PyTorch reference elsewhere): :func:`dslab.kernels.norm.rms_norm.rms_norm` (the residual add
  fused), :func:`dslab.kernels.activation.swiglu.swiglu`,
  :func:`dslab.kernels.attention.rope.apply_rope` (q and k in one launch) and
  :func:`dslab.kernels.attention.attention.attention` with fewer key/value heads than query heads.
- ``"torch"``: what a PyTorch user writes with PyTorch's own ops: ``F.rms_norm``,
  ``F.silu(gate) * up``, the rotation with elementwise ops (transformers' ``rotate_half`` form, the
  tables cast to the activation's dtype as transformers does) and
  ``F.scaled_dot_product_attention(..., enable_gqa=True)``.

The ops:

- ``rms_norm(x, weight, eps, residual=None)`` -> ``y``, or ``(y, h)`` with ``h = x + residual``
  normalized. The dslab set casts the residual to x's dtype (so under autocast the residual stream
  is in the autocast dtype after the first add, as in :mod:`dslab.models.ops`); the torch set lets
  PyTorch promote the add (an fp32 stream under autocast, as transformers' model has).
- ``rms_norm_fork(x, weight, eps)`` -> ``(rms_norm(x), x)``: the input also feeds a residual add;
  the dslab set's backward kernel adds the second output's gradient.
- ``swiglu(x [..., 2I])`` -> ``silu(x[..., :I]) * x[..., I:]``: a fused gate and up projection,
  gate columns first.
- ``rope(q [b, s, Hq, D], k [b, s, Hkv, D], cos, sin)`` -> the rotated ``(q, k)``, contiguous
  ``[b, s, H, D]``; ``cos``/``sin`` fp32 ``[s, D/2]`` from :class:`RotaryTables`.
- ``attention(q [b, Hq, s, D], k [b, Hkv, s, D], v, causal, key_padding_mask)`` -> ``[b, Hq, s, D]``:
  query head ``h`` reads key/value head ``h // (Hq / Hkv)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

LLAMA_KERNEL_SETS = ("dslab", "torch")


@dataclass(frozen=True)
class LlamaOps:
    """The Llama-specific ops of one kernel set (signatures in the module docstring)."""

    name: str
    rms_norm: Callable
    rms_norm_fork: Callable
    swiglu: Callable
    rope: Callable
    attention: Callable

    def __reduce__(self):
        return llama_op_set, (self.name,)


# ---------------------------------------------------------------------------------------------
# The torch set.
# ---------------------------------------------------------------------------------------------


def _torch_rms_norm(x, weight, eps, residual=None):
    h = x if residual is None else x + residual
    y = F.rms_norm(h, h.shape[-1:], weight.to(h.dtype) if weight is not None else None, eps)
    return y if residual is None else (y, h)


def _torch_rms_norm_fork(x, weight, eps):
    return _torch_rms_norm(x, weight, eps), x


def _torch_swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _torch_rope(q, k, cos, sin):
    # [s, D/2] -> [s, 1, D/2]: broadcast over the heads (and the batch)
    cos = cos.unsqueeze(-2).to(q.dtype)
    sin = sin.unsqueeze(-2).to(q.dtype)
    return _rotate(q, cos, sin), (None if k is None else _rotate(k, cos, sin))


def _torch_attention(q, k, v, causal=True, key_padding_mask=None):
    gqa = q.shape[1] != k.shape[1]
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    allowed = ~key_padding_mask[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)


TORCH_LLAMA_OPS = LlamaOps(
    name="torch", rms_norm=_torch_rms_norm, rms_norm_fork=_torch_rms_norm_fork, swiglu=_torch_swiglu,
    rope=_torch_rope, attention=_torch_attention,
)


# ---------------------------------------------------------------------------------------------
# The dslab set.
# ---------------------------------------------------------------------------------------------


@functools.cache
def _dslab_llama_ops() -> LlamaOps:
    from dslab.kernels.activation.swiglu import swiglu
    from dslab.kernels.attention.attention import attention
    from dslab.kernels.attention.rope import apply_rope
    from dslab.kernels.norm.rms_norm import rms_norm, rms_norm_fork

    def dslab_rms_norm(x, weight, eps, residual=None):
        if residual is not None:
            residual = residual.to(x.dtype)
        return rms_norm(x, weight, eps, residual)

    def dslab_attention(q, k, v, causal=True, key_padding_mask=None):
        return attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask)

    return LlamaOps(
        name="dslab", rms_norm=dslab_rms_norm, rms_norm_fork=rms_norm_fork, swiglu=swiglu, rope=apply_rope,
        attention=dslab_attention,
    )


def llama_op_set(kernels: str) -> LlamaOps:
    """The Llama ops of ``kernels`` ("dslab" or "torch")."""
    if kernels == "torch":
        return TORCH_LLAMA_OPS
    if kernels == "dslab":
        return _dslab_llama_ops()
    raise ValueError(f"kernels={kernels!r} is not a kernel set; choose one of {', '.join(LLAMA_KERNEL_SETS)}")


class RotaryTables:
    """A model's rotary frequencies and its ``(cos, sin)`` tables for positions ``0..seq``.

    The frequencies are :func:`dslab.kernels.attention.rope.rope_inv_freq` of the head dim,
    ``rope_theta`` and transformers' ``rope_scaling`` (default, linear, Llama 3). The tables are
    fp32 ``[seq, head_dim / 2]``, made once per (seq, device) and kept: every layer of a step reads
    the same two tensors, and a captured CUDA graph reads them at a fixed address.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        from dslab.kernels.attention.rope import rope_inv_freq

        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self._tables: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, seq: int, device: torch.device, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(cos, sin)`` ``[seq, head_dim / 2]`` of positions ``start .. start + seq`` (a
        sequence-parallel rank's chunk starts past 0). Under ``torch.compile`` they are computed
        in the traced code each call and never kept: a kept output of a compiled region would be
        memory that ``mode="reduce-overhead"``'s CUDA graphs overwrite on their next replay."""
        from dslab.kernels.attention.rope import rope_tables

        if torch.compiler.is_compiling():
            return rope_tables(torch.arange(start, start + seq, device=device), self.inv_freq.to(device))
        key = (start, seq, str(device))
        found = self._tables.get(key)
        if found is None:
            positions = torch.arange(start, start + seq, device=device)
            found = rope_tables(positions, self.inv_freq.to(device))
            self._tables[key] = found
        return found

    def clear(self) -> None:
        """Forget every table (they are made again on the next call)."""
        self._tables.clear()
