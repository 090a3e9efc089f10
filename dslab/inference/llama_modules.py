"""dslab's inference modules for the Llama layout (transformers' Llama, Mistral and Qwen2): the
model a :class:`~dslab.inference.policies.LlamaSpec` describes, on dslab's kernels.

A layer (``x`` the residual stream ``[batch, seq, hidden]``, ``d`` the previous sublayer's output
still to be added to it; each ``RMS`` is :func:`dslab.kernels.norm.rms_norm.rms_norm`, which fuses
that residual add)::

    h, x = RMS1(d + x)
    qkv = h Wqkv^T [+ bqkv]                   one GEMM: H query heads, then Hkv key and Hkv value heads
    q, k = rope(q, k, positions)              apply_rope, tables rope_tables(positions, inv_freq)
    c = attention(q, k, v)                    grouped-query: query head h reads key/value head h // (H / Hkv)
    a = allreduce(c Wo^T [+ bo])
    h, x = RMS2(a + x)
    d = allreduce(swiglu(h Wgu^T [+ bgu]) Wd^T [+ bd])      Wgu: gate rows, then up rows -> next layer (x, d)

and after the last layer ``logits = RMS_f(d + x) E^T`` (``E`` the LM head, the word embeddings
when tied). There are no position embeddings: positions enter through the rotation of q and k
(:mod:`dslab.kernels.attention.rope`), and the keys are cached rotated. Position ids come from the
attention mask as in transformers' ``generate`` (``cumsum(mask) - 1``: a left-padded row starts at
0 at its first real token), and in a decode step from the cache position: ``write_pos -
valid_start``, the same device tensors the KV cache's writes and valid range use, so the step
stays a static, capturable graph.

Attention is the callable the caller passes (:mod:`dslab.inference.kv_cache`):
:class:`~dslab.inference.kv_cache.RotaryPrefillAttention` (dslab's flash attention, causal, with the
key-padding mask) or :class:`~dslab.inference.kv_cache.RotaryDecodeAttention` (decode attention over
the cache); both hand k and v to the kernels with their ``Hkv`` heads, and the cache holds ``Hkv``
heads (this rank's ``Hkv / tp`` under tensor parallelism, :mod:`dslab.inference.tensor_parallel`).

Weights as in :mod:`dslab.inference.modules`: parameters in the compute dtype, the four linear
weights of each layer int8 with fp32 scales under ``dtype=torch.int8``
(:class:`~dslab.inference.modules.InferenceLinear`); the row-parallel biases (``[+ bo]``,
``[+ bd]``, when the model has them) are added by tensor-parallel rank 0 only. The per-token step
runs fused, five launches a layer (:mod:`dslab.inference.fused_decode_llama`), unless its
``unfused_reason`` names a reason (by default: more than one row; ``fused_decode = False``), and
then op by op as written above.

Memory traffic of one decode step at batch B: every weight once, the valid part of the KV cache
(``2 * layers * B * Hkv * L * D`` elements for L valid positions: ``Hkv / H`` of multi-head
attention's), and ``O(B * hidden)`` activations per layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.inference.config import WeightQuantConfig
from dslab.inference.fused_decode_llama import fused_decode_step, unfused_reason
from dslab.inference.kv_cache import KVCache, RotaryDecodeAttention, RotaryPrefillAttention
from dslab.inference.modules import VOCAB_PAD, InferenceLinear, frozen_parameter, pad_rows, positions_and_padding
from dslab.inference.policies import LlamaLayerSpec, LlamaSpec
from dslab.inference.tensor_parallel import TensorParallel, columns, qkv_shard, row_parallel_bias, stacked_rows
from dslab.kernels.activation.swiglu import swiglu
from dslab.kernels.attention.rope import rope_tables
from dslab.kernels.norm.rms_norm import rms_norm


class InferenceRMSNorm(nn.Module):
    """An RMSNorm weight; ``forward(x, residual=None)`` as :func:`dslab.kernels.norm.rms_norm.rms_norm`
    (``(RMS(x + residual), x + residual)`` with a residual)."""

    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = frozen_parameter(weight, dtype, device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)


class InferenceLlamaLayer(nn.Module):
    """One Llama-layout layer, tensor-parallel slice included (see the module docstring)."""

    def __init__(self, spec: LlamaLayerSpec, model: LlamaSpec, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, quant: WeightQuantConfig | None):
        super().__init__()
        self.tp = tp
        self.heads, self.kv_heads = model.heads // tp.size, model.kv_heads // tp.size
        self.scale = model.head_dim ** -0.5
        q_rows, kv_rows = model.heads * model.head_dim, model.kv_heads * model.head_dim
        qkv_w, qkv_b = qkv_shard(spec.qkv_weight, spec.qkv_bias, tp, (q_rows, kv_rows, kv_rows))
        self.qkv = InferenceLinear(qkv_w, qkv_b, dtype, device, quant)
        self.out_proj = InferenceLinear(columns(spec.out_weight, tp), row_parallel_bias(spec.out_bias, tp),
                                        dtype, device, quant)
        halves = (model.intermediate, model.intermediate)
        self.gate_up = InferenceLinear(stacked_rows(spec.gate_up_weight, tp, halves),
                                       stacked_rows(spec.gate_up_bias, tp, halves), dtype, device, quant)
        self.down = InferenceLinear(columns(spec.down_weight, tp), row_parallel_bias(spec.down_bias, tp),
                                    dtype, device, quant)
        self.attention_norm = InferenceRMSNorm(spec.attention_norm, model.eps, dtype, device)
        self.mlp_norm = InferenceRMSNorm(spec.mlp_norm, model.eps, dtype, device)

    def forward(self, index: int, x: torch.Tensor, pending: torch.Tensor | None, attend):
        """``(x, pending)`` -> ``(x, pending)``: the residual stream and the MLP output not yet
        added to it."""
        h, x = (self.attention_norm(x), x) if pending is None else self.attention_norm(pending, x)
        context = attend(index, self.qkv(h), self.heads, self.kv_heads, self.scale)
        h, x = self.mlp_norm(self.tp.all_reduce(self.out_proj(context)), x)
        return x, self.tp.all_reduce(self.down(swiglu(self.gate_up(h))))


class InferenceLlama(nn.Module):
    """The injected Llama-layout model: embeddings, layers, final norm and LM head of a
    :class:`~dslab.inference.policies.LlamaSpec`.

    ``forward(input_ids, attention_mask=None)`` returns logits ``[batch, seq, vocab]``;
    :meth:`prefill` and :meth:`decode_step` are generation's two phases, with the contracts of
    :class:`~dslab.inference.modules.InferenceTransformer`'s.
    """

    def __init__(self, spec: LlamaSpec, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 quant: WeightQuantConfig | None = None):
        super().__init__()
        self.family, self.source, self.outputs, self.causal = spec.family, spec.source, spec.outputs, True
        self.vocab_size, self.max_positions = spec.vocab_size, spec.max_positions
        self.hidden, self.heads, self.kv_heads, self.head_dim = spec.hidden, spec.heads, spec.kv_heads, spec.head_dim
        self.tp = tp
        self.dtype, self.device = dtype, device
        self.token_type_embeddings = None  # the engine's check for token_type_ids
        tied = spec.lm_head.data_ptr() == spec.word_embeddings.data_ptr() \
            and spec.lm_head.shape == spec.word_embeddings.shape
        # Zero rows up to a multiple of 64 keep the head GEMM on cuBLAS's aligned kernels (as for
        # GPT-2 in dslab.inference.modules); the logits are cut back to the vocabulary.
        self.word_embeddings = frozen_parameter(pad_rows(spec.word_embeddings, VOCAB_PAD), dtype, device)
        self.layers = nn.ModuleList(InferenceLlamaLayer(layer, spec, tp, dtype, device, quant)
                                    for layer in spec.layers)
        self.final_norm = InferenceRMSNorm(spec.final_norm, spec.eps, dtype, device)
        self.lm_head = (self.word_embeddings if tied
                        else frozen_parameter(pad_rows(spec.lm_head, VOCAB_PAD), dtype, device))
        self.register_buffer("rope_inv_freq", spec.rope_inv_freq.to(device=device, dtype=torch.float32),
                             persistent=False)
        #: Whether :meth:`decode_step` may run the fused step (:mod:`dslab.inference.fused_decode_llama`),
        #: and up to how many rows (as :class:`~dslab.inference.modules.InferenceTransformer`'s).
        self.fused_decode = True
        self.fused_decode_rows = 1

    # --- pieces ----------------------------------------------------------------------------------

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(cos, sin)`` ``[*positions.shape, head_dim / 2]`` of integer ``positions``."""
        return rope_tables(positions, self.rope_inv_freq)

    def run_layers(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The layer stack and the final norm over ``x`` ``[batch, seq, hidden]``."""
        pending = None
        for index, layer in enumerate(self.layers):
            x, pending = layer(index, x, pending, attend)
        return self.final_norm(x) if pending is None else self.final_norm(pending, x)[0]

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., vocab]`` logits of the final hidden states."""
        return F.linear(hidden, self.lm_head)[..., :self.vocab_size]

    def _prompt_attention(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          cache: KVCache | None) -> RotaryPrefillAttention:
        positions, padding = positions_and_padding(input_ids, attention_mask, causal=True)
        # Without a mask every row has positions 0 .. seq - 1: one [seq, head_dim / 2] table.
        cos, sin = self.rope(positions if attention_mask is not None else positions[0])
        return RotaryPrefillAttention(padding, cos, sin, cache)

    # --- the phases ------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` (``token_type_ids`` must be None: the engine refuses it)."""
        attend = self._prompt_attention(input_ids, attention_mask, None)
        return self.lm_logits(self.run_layers(F.embedding(input_ids, self.word_embeddings), attend))

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
        """Run the prompts ``[batch, P]`` (left-padded), writing their rotated keys and values into
        ``cache`` rows ``0 .. batch - 1``, positions ``0 .. P - 1``; returns the logits of the
        last position ``[batch, vocab]``."""
        attend = self._prompt_attention(input_ids, attention_mask, cache)
        hidden = self.run_layers(F.embedding(input_ids, self.word_embeddings), attend)
        return self.lm_logits(hidden[:, -1])

    def decode_step(self, tokens: torch.Tensor, write_pos: torch.Tensor, valid_start: torch.Tensor,
                    cache: KVCache) -> torch.Tensor:
        """One token per row: ``tokens`` int64 ``[batch]`` at cache position ``write_pos``, its
        position id ``write_pos - valid_start`` -> logits ``[batch, vocab]``. Static shapes, no host
        synchronisation: the body of the decode CUDA graph. Fused
        (:mod:`dslab.inference.fused_decode_llama`) unless ``unfused_reason`` names a reason."""
        if unfused_reason(self, tokens.shape[0]) is None:
            return fused_decode_step(self, tokens, write_pos, valid_start, cache)
        cos, sin = self.rope((write_pos - valid_start)[:, None])  # [batch, 1, head_dim / 2]
        attend = RotaryDecodeAttention(cache, write_pos, valid_start, cos, sin)
        hidden = self.run_layers(F.embedding(tokens[:, None], self.word_embeddings), attend)
        return self.lm_logits(hidden[:, 0])
