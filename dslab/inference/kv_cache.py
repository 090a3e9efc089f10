"""The static KV cache and the ways a layer's attention uses it (a whole prompt, one new token).

:class:`KVCache` holds, per layer, ``keys`` and ``values`` ``[batch, heads, max_seq, head_dim]``
(``heads`` are this rank's under tensor parallelism), allocated once (zeros) and never resized:
``2 * layers * batch * heads * max_seq * head_dim`` elements. Row ``b`` of a generation keeps its
prompt (left padding included) at positions ``0 .. P - 1`` and its ``t``-th new token at ``P + t``;
the pad positions stay before ``valid_start[b]`` and are never attended to.

:class:`PrefillAttention` runs a whole prompt through dslab's training flash attention
(:func:`dslab.kernels.attention.attention_packed.attention_packed`: causal for GPT-2, the key-padding mask from
``attention_mask``) and, with a cache, writes the prompt's keys and values into positions
``0 .. P - 1``. :class:`DecodeAttention` writes the new token's key and value at ``write_pos[b]``
(a scatter with device-side indices) and attends with :func:`dslab.kernels.decode.decode_attention.decode_attention` over
``valid_start[b] <= j <= write_pos[b]``; nothing is read back to the host, so a CUDA graph can
capture it.

The Llama layout (grouped-query attention with rotary positions) has its own pair,
:class:`RotaryPrefillAttention` and :class:`RotaryDecodeAttention`: the packed projection is
``[batch, seq, (heads + 2 * kv_heads) * head_dim]`` (q heads, then k heads, then v heads); q and k
are rotated (:func:`dslab.kernels.attention.rope.apply_rope`, tables from the caller's positions)
before attention, the cache holds the rotated keys of ``kv_heads`` heads (``kv_heads / heads`` of
multi-head attention's cache), and :func:`dslab.kernels.attention.attention.attention` /
:func:`dslab.kernels.decode.decode_attention.decode_attention` take k and v with their
``kv_heads`` heads, each serving ``heads / kv_heads`` query heads.
"""

from __future__ import annotations

import torch

from dslab.kernels.attention.attention import attention
from dslab.kernels.attention.attention_packed import attention_packed
from dslab.kernels.attention.rope import apply_rope
from dslab.kernels.decode.decode_attention import decode_attention


class KVCache:
    """Per-layer key and value tensors ``[batch, heads, max_seq, head_dim]`` (see the module doc;
    ``heads`` are the key/value heads under grouped-query attention)."""

    def __init__(self, layers: int, batch: int, heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, heads, max_seq, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.batch, self.heads, self.max_seq, self.head_dim = batch, heads, max_seq, head_dim
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def describe(self) -> dict:
        return {"layers": len(self.keys), "batch": self.batch, "heads": self.heads, "max_seq": self.max_seq,
                "head_dim": self.head_dim, "dtype": str(self.dtype).removeprefix("torch."), "bytes": self.nbytes}


def split_qkv(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[batch, heads, seq, head_dim]`` views of a packed ``[batch, seq, 3 * heads * head_dim]``."""
    batch, seq, width = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4)
    return q, k, v


class PrefillAttention:
    """Self-attention over whole sequences (a prompt, or ``engine(input_ids)``)."""

    def __init__(self, causal: bool, key_padding_mask: torch.Tensor | None, cache: KVCache | None = None):
        self.causal = causal
        self.key_padding_mask = key_padding_mask
        self.cache = cache

    def __call__(self, layer: int, qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
        """``[batch, seq, heads * head_dim]`` context of ``qkv`` ``[batch, seq, 3 * heads * head_dim]``."""
        if self.cache is not None:
            _, k, v = split_qkv(qkv, heads)
            batch, seq = qkv.shape[0], qkv.shape[1]
            self.cache.keys[layer][:batch, :, :seq].copy_(k)
            self.cache.values[layer][:batch, :, :seq].copy_(v)
        return attention_packed(qkv, heads, causal=self.causal, key_padding_mask=self.key_padding_mask, scale=scale)


class DecodeAttention:
    """One new token per sequence against the cache (static buffers; CUDA-graph safe).

    ``write_pos`` int64 ``[batch]``: where row b's new key/value go (and the last position it sees);
    ``valid_start`` int32 ``[batch]``: its first real (non-pad) position."""

    def __init__(self, cache: KVCache, write_pos: torch.Tensor, valid_start: torch.Tensor):
        self.cache = cache
        self.write_pos = write_pos
        self.valid_start = valid_start
        self.valid_end = (write_pos + 1).to(torch.int32)

    def __call__(self, layer: int, qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
        q, k, v = split_qkv(qkv, heads)  # [batch, heads, 1, head_dim]
        batch, _, _, head_dim = q.shape
        index = self.write_pos.view(batch, 1, 1, 1).expand(batch, heads, 1, head_dim)
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keys.scatter_(2, index, k)
        values.scatter_(2, index, v)
        out = decode_attention(q[:, :, 0].contiguous(), keys, values, self.valid_start, self.valid_end, scale=scale)
        return out.reshape(batch, 1, heads * head_dim)


def split_grouped_qkv(qkv: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[batch, seq, heads, head_dim]``, k and v ``[batch, seq, kv_heads, head_dim]``: views of a
    packed ``[batch, seq, (heads + 2 * kv_heads) * head_dim]``."""
    batch, seq, width = qkv.shape
    packed = qkv.view(batch, seq, heads + 2 * kv_heads, width // (heads + 2 * kv_heads))
    return packed[:, :, :heads], packed[:, :, heads:heads + kv_heads], packed[:, :, heads + kv_heads:]


class RotaryPrefillAttention:
    """Causal grouped-query self-attention with rotary positions over whole sequences.

    ``cos``/``sin``: fp32 half tables ``[seq, head_dim / 2]`` or ``[batch, seq, head_dim / 2]``
    (:func:`dslab.kernels.attention.rope.rope_tables` of the position ids);
    ``key_padding_mask`` bool ``[batch, seq]`` (True at padding) or None."""

    def __init__(self, key_padding_mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 cache: KVCache | None = None):
        self.key_padding_mask = key_padding_mask
        self.cos, self.sin = cos, sin
        self.cache = cache

    def __call__(self, layer: int, qkv: torch.Tensor, heads: int, kv_heads: int, scale: float) -> torch.Tensor:
        """``[batch, seq, heads * head_dim]`` context of ``qkv`` ``[batch, seq, (heads + 2 *
        kv_heads) * head_dim]``."""
        batch, seq = qkv.shape[0], qkv.shape[1]
        q, k, v = split_grouped_qkv(qkv, heads, kv_heads)
        q, k = apply_rope(q, k, self.cos, self.sin)  # new [batch, seq, heads, head_dim] tensors
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [batch, kv_heads, seq, head_dim]
        if self.cache is not None:
            self.cache.keys[layer][:batch, :, :seq].copy_(k)
            self.cache.values[layer][:batch, :, :seq].copy_(v)
        out = attention(q.transpose(1, 2), k, v, causal=True, key_padding_mask=self.key_padding_mask, scale=scale)
        return out.transpose(1, 2).reshape(batch, seq, heads * q.shape[-1])


class RotaryDecodeAttention:
    """One new token per sequence against the grouped-query cache (static buffers; CUDA-graph
    safe): ``write_pos`` and ``valid_start`` as :class:`DecodeAttention`'s, ``cos``/``sin`` fp32
    ``[batch, 1, head_dim / 2]`` of each row's position id ``write_pos - valid_start``."""

    def __init__(self, cache: KVCache, write_pos: torch.Tensor, valid_start: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor):
        self.cache = cache
        self.write_pos = write_pos
        self.valid_start = valid_start
        self.valid_end = (write_pos + 1).to(torch.int32)
        self.cos, self.sin = cos, sin

    def __call__(self, layer: int, qkv: torch.Tensor, heads: int, kv_heads: int, scale: float) -> torch.Tensor:
        q, k, v = split_grouped_qkv(qkv, heads, kv_heads)  # [batch, 1, heads or kv_heads, head_dim]
        q, k = apply_rope(q, k, self.cos, self.sin)
        batch, _, _, head_dim = q.shape
        index = self.write_pos.view(batch, 1, 1, 1).expand(batch, kv_heads, 1, head_dim)
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keys.scatter_(2, index, k.transpose(1, 2))
        values.scatter_(2, index, v.transpose(1, 2))
        out = decode_attention(q[:, 0], keys, values, self.valid_start, self.valid_end, scale=scale)
        return out.reshape(batch, 1, heads * head_dim)
