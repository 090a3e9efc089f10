"""dslab's inference modules: the model a :class:`~dslab.inference.policies.ModelSpec` describes,
on dslab's kernels, with no code of the source model on the hot path. (The Llama layout, a
:class:`~dslab.inference.policies.LlamaSpec`, is :mod:`dslab.inference.llama_modules`, built from
the linear layers here.)

A layer (``x`` the residual stream ``[batch, seq, hidden]``; ``d`` the previous sublayer's output
that is still to be added to it; each ``LN`` is :func:`dslab.kernels.norm.layer_norm.layer_norm`, which fuses
that residual add)::

    pre-LN (GPT-2):   h, x = LN1(d + x)        qkv = h Wqkv^T + bqkv        c = attention(qkv)
                      a = allreduce(c Wo^T [+ bo])          h, x = LN2(a + x)
                      d = allreduce(bias_gelu(h W1^T, b1) W2^T [+ b2])    -> next layer (x, d)
    post-LN (BERT):   x = LN1(allreduce(attention(x Wqkv^T + bqkv) Wo^T [+ bo]) + x)
                      x = LN2(allreduce(bias_gelu(x W1^T, b1) W2^T [+ b2]) + x)

so every residual add rides in a LayerNorm kernel, the QKV projection is one GEMM, bias + GELU one
kernel, and the row-parallel biases (``[+ b]``) are added by tensor-parallel rank 0 only
(:mod:`dslab.inference.tensor_parallel`). The attention is a callable the caller passes
(:mod:`dslab.inference.kv_cache`): flash attention over whole sequences, or one new token against
the KV cache.

Weights are parameters (``requires_grad=False``) in the compute dtype, except the four linear
weights of each layer under int8 (:class:`InferenceLinear`): an int8 ``[out, in]`` matrix and
fp32 scales (:func:`dslab.kernels.quant.int8_linear.quantize_int8`, per output channel or per
group of inputs), multiplied with :func:`dslab.kernels.quant.int8_linear.int8_linear` (the Triton
weight-streaming GEMM for the few rows of decode, dequantise + cuBLAS for prefill). Embeddings, norms, biases and the heads stay in the
compute dtype. The LM head reuses the word-embedding parameter when the source model ties them.

Memory traffic of one decode step at batch B: every weight once (``2 * params`` bytes in bf16,
about half of that under int8 for GPT-2's layers), the valid part of the KV cache, and
``O(B * hidden)`` activations per layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.inference.config import WeightQuantConfig
from dslab.inference.fused_decode import fused_decode_step, unfused_reason
from dslab.inference.kv_cache import DecodeAttention, PrefillAttention
from dslab.inference.policies import LayerSpec, ModelSpec
from dslab.inference.tensor_parallel import TensorParallel, columns, qkv_shard, row_parallel_bias, rows
from dslab.kernels.activation.bias_gelu import bias_gelu
from dslab.kernels.norm.layer_norm import layer_norm
from dslab.kernels.quant.int8_linear import int8_linear, quantize_int8


def frozen_parameter(t: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> nn.Parameter | None:
    """``t`` as a contiguous parameter in ``dtype`` on ``device`` without gradient (None stays None)."""
    if t is None:
        return None
    return nn.Parameter(t.detach().to(device=device, dtype=dtype).contiguous(), requires_grad=False)


VOCAB_PAD = 64


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of ``multiple`` rows."""
    extra = -t.shape[0] % multiple
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def positions_and_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          causal: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Position ids ``[batch, seq]`` and the key-padding mask (bool, True at padding; None when
    there is no mask or nothing is padded: one host read decides). A causal model numbers each
    row's real tokens from 0 as transformers' ``generate`` does (``cumsum(mask) - 1``, pads at 0),
    so a left-padded row starts at position 0 at its first real token; otherwise ``0 .. seq - 1``."""
    seq = input_ids.shape[1]
    if attention_mask is None:
        return torch.arange(seq, device=input_ids.device).expand_as(input_ids), None
    padding = attention_mask == 0
    if causal:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
    else:
        positions = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
    return positions, (padding if bool(padding.any()) else None)


class InferenceLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` ``[out, in]`` in the compute dtype, or int8 with scales.

    ``bias`` is kept separately and added only when asked (``forward(x, add_bias=True)``), so
    that bias + GELU can fuse into one kernel after the GEMM."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device, quant: WeightQuantConfig | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = frozen_parameter(bias, dtype, device)
        if quant is None:
            self.weight = frozen_parameter(weight, dtype, device)
            self.group_size = None
        else:
            self.group_size = quant.group_size_for(self.in_features)
            # The source's weight may be a transposed view (transformers' Conv1D keeps [in, out]);
            # quantize_int8 returns row-major int8, the order the decode GEMM streams. A strided
            # qweight would be copied on every call, inside the CUDA graph: every token.
            qweight, scale = quantize_int8(weight.detach().to(device=device, dtype=torch.float32), self.group_size)
            assert qweight.is_contiguous() and scale.is_contiguous()
            self.weight = nn.Parameter(qweight, requires_grad=False)
            self.scale = nn.Parameter(scale, requires_grad=False)

    @property
    def int8(self) -> bool:
        return self.weight.dtype == torch.int8

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        bias = self.bias if add_bias else None
        if self.int8:
            return int8_linear(x, self.weight, self.scale, bias, self.group_size)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        kind = f"int8, group_size={self.group_size}" if self.int8 else str(self.weight.dtype)
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class InferenceNorm(nn.Module):
    """Affine LayerNorm parameters; ``forward(x, residual=None)`` as :func:`dslab.kernels.norm.layer_norm.layer_norm`
    (``(LN(x + residual), x + residual)`` with a residual)."""

    def __init__(self, pair: tuple[torch.Tensor, torch.Tensor], eps: float, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.weight = frozen_parameter(pair[0], dtype, device)
        self.bias = frozen_parameter(pair[1], dtype, device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return layer_norm(x, self.weight, self.bias, self.eps, residual)


class InferenceLayer(nn.Module):
    """One transformer layer, tensor-parallel slice included (see the module docstring)."""

    def __init__(self, spec: LayerSpec, model: ModelSpec, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, quant: WeightQuantConfig | None):
        super().__init__()
        self.tp = tp
        self.pre_ln = model.pre_ln
        self.heads = model.heads // tp.size
        self.scale = spec.attention_scale
        self.gelu = model.gelu
        qkv_w, qkv_b = qkv_shard(spec.qkv_weight, spec.qkv_bias, tp)
        self.qkv = InferenceLinear(qkv_w, qkv_b, dtype, device, quant)
        self.out_proj = InferenceLinear(columns(spec.out_weight, tp), row_parallel_bias(spec.out_bias, tp),
                                        dtype, device, quant)
        self.fc_in = InferenceLinear(rows(spec.fc_in_weight, tp), rows(spec.fc_in_bias, tp), dtype, device, quant)
        self.fc_out = InferenceLinear(columns(spec.fc_out_weight, tp), row_parallel_bias(spec.fc_out_bias, tp),
                                      dtype, device, quant)
        self.attention_norm = InferenceNorm(spec.attention_norm, model.eps, dtype, device)
        self.mlp_norm = InferenceNorm(spec.mlp_norm, model.eps, dtype, device)

    def _attention(self, index: int, x: torch.Tensor, attend) -> torch.Tensor:
        context = attend(index, self.qkv(x), self.heads, self.scale)
        return self.tp.all_reduce(self.out_proj(context))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = bias_gelu(self.fc_in(x, add_bias=False), self.fc_in.bias, self.gelu)
        return self.tp.all_reduce(self.fc_out(h))

    def forward(self, index: int, x: torch.Tensor, pending: torch.Tensor | None, attend):
        """``(x, pending)`` -> ``(x, pending)``: the residual stream and the sublayer output not
        yet added to it (pre-LN; post-LN layers return ``pending=None``)."""
        if not self.pre_ln:
            x = self.attention_norm(self._attention(index, x, attend), x)[0]
            return self.mlp_norm(self._mlp(x), x)[0], None
        h, x = (self.attention_norm(x), x) if pending is None else self.attention_norm(pending, x)
        h, x = self.mlp_norm(self._attention(index, h, attend), x)
        return x, self._mlp(h)


class InferenceTransformer(nn.Module):
    """The injected model: embeddings, layers and heads of a :class:`ModelSpec`.

    ``forward(input_ids, attention_mask=None, token_type_ids=None)`` returns what the source model
    returns (the table in :mod:`dslab.inference.policies`); GPT-2's positions come from the
    attention mask as in transformers' ``generate`` (a left-padded row starts at position 0 at
    its first real token), BERT's are ``0 .. seq - 1``. :meth:`prefill` and :meth:`decode_step`
    are generation's two phases.
    """

    def __init__(self, spec: ModelSpec, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 quant: WeightQuantConfig | None = None):
        super().__init__()
        self.family, self.source, self.outputs = spec.family, spec.source, spec.outputs
        self.causal, self.pre_ln, self.gelu = spec.causal, spec.pre_ln, spec.gelu
        self.vocab_size, self.max_positions = spec.vocab_size, spec.max_positions
        self.hidden, self.heads, self.head_dim = spec.hidden, spec.heads, spec.head_dim
        self.kv_heads = spec.heads  # the KV cache's heads (before tensor-parallel slicing)
        self.tp = tp
        self.dtype, self.device = dtype, device
        tied = spec.lm_head is not None and spec.lm_head.data_ptr() == spec.word_embeddings.data_ptr() \
            and spec.lm_head.shape == spec.word_embeddings.shape
        # The word embeddings (and an untied head) get zero rows up to a multiple of 64: a head
        # GEMM over GPT-2's 50257 rows takes cuBLAS's unaligned kernels (110 us of a 750 us
        # batch-32 step on an H200); the logits are cut back to the vocabulary.
        self.word_embeddings = frozen_parameter(pad_rows(spec.word_embeddings, VOCAB_PAD), dtype, device)
        self.position_embeddings = frozen_parameter(spec.position_embeddings, dtype, device)
        self.token_type_embeddings = frozen_parameter(spec.token_type_embeddings, dtype, device)
        self.embedding_norm = InferenceNorm(spec.embedding_norm, spec.eps, dtype, device) if spec.embedding_norm else None
        self.layers = nn.ModuleList(InferenceLayer(layer, spec, tp, dtype, device, quant) for layer in spec.layers)
        self.final_norm = InferenceNorm(spec.final_norm, spec.eps, dtype, device) if spec.final_norm else None
        if spec.lm_head is None:
            self.lm_head = None
        elif tied:
            self.lm_head = self.word_embeddings  # tied, as in the source model
        else:
            self.lm_head = frozen_parameter(pad_rows(spec.lm_head, VOCAB_PAD), dtype, device)
        self.mlm = None
        if spec.mlm:
            self.mlm = nn.Module()
            self.mlm.dense = InferenceLinear(spec.mlm["dense_weight"], spec.mlm["dense_bias"], dtype, device)
            self.mlm.norm = InferenceNorm((spec.mlm["norm_weight"], spec.mlm["norm_bias"]), spec.eps, dtype, device)
            self.mlm.decoder_bias = frozen_parameter(pad_rows(spec.mlm["decoder_bias"], VOCAB_PAD), dtype, device)
        self.pooler = InferenceLinear(*spec.pooler, dtype, device) if spec.pooler else None
        self.nsp = InferenceLinear(*spec.nsp, dtype, device) if spec.nsp else None
        #: Whether :meth:`decode_step` may run the fused step (:mod:`dslab.inference.fused_decode`),
        #: and up to how many rows (8: see that module); off, every step runs op by op (the A/B of
        #: benchmarks/decode_profile.py).
        self.fused_decode = True
        self.fused_decode_rows = 8

    # --- pieces ----------------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., hidden]`` embeddings of ``input_ids`` at ``positions`` (same shape)."""
        x = F.embedding(input_ids, self.word_embeddings) + F.embedding(positions, self.position_embeddings)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                x = x + self.token_type_embeddings[0]
            else:
                x = x + F.embedding(token_type_ids, self.token_type_embeddings)
        return self.embedding_norm(x) if self.embedding_norm is not None else x

    def run_layers(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The layer stack and the final norm (GPT-2) over ``x`` ``[..., hidden]``."""
        pending = None
        for index, layer in enumerate(self.layers):
            x, pending = layer(index, x, pending, attend)
        if self.final_norm is not None:
            x = self.final_norm(x) if pending is None else self.final_norm(pending, x)[0]
        return x

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., vocab]``: GPT-2's head, or BERT's MLM head (transform, LN, decoder + bias)."""
        if self.mlm is not None:
            h = bias_gelu(self.mlm.dense(hidden, add_bias=False), self.mlm.dense.bias, self.gelu)
            return F.linear(self.mlm.norm(h), self.lm_head, self.mlm.decoder_bias)[..., :self.vocab_size]
        return F.linear(hidden, self.lm_head)[..., :self.vocab_size]

    # --- the phases ------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None):
        positions, padding = self.positions_and_padding(input_ids, attention_mask)
        hidden = self.run_layers(self.embed(input_ids, positions, token_type_ids),
                                 PrefillAttention(self.causal, padding))
        if self.outputs == "logits":
            return self.lm_logits(hidden)
        pooled = torch.tanh(self.pooler(hidden[:, 0])) if self.pooler is not None else None
        if self.outputs == "hidden_pooled":
            return hidden, pooled
        return self.lm_logits(hidden), self.nsp(pooled)

    def positions_and_padding(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """Position ids ``[batch, seq]`` and the key-padding mask (:func:`positions_and_padding`)."""
        return positions_and_padding(input_ids, attention_mask, self.causal)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """Run the prompts ``[batch, P]`` (left-padded) through the model, writing their keys and
        values into ``cache`` rows ``0 .. batch - 1``, positions ``0 .. P - 1``; returns the
        logits of the last position ``[batch, vocab]``."""
        positions, padding = self.positions_and_padding(input_ids, attention_mask)
        hidden = self.run_layers(self.embed(input_ids, positions), PrefillAttention(self.causal, padding, cache))
        return self.lm_logits(hidden[:, -1])

    def decode_step(self, tokens: torch.Tensor, write_pos: torch.Tensor, valid_start: torch.Tensor,
                    cache) -> torch.Tensor:
        """One token per row: ``tokens`` int64 ``[batch]`` at cache position ``write_pos`` (its
        position id ``write_pos - valid_start``) -> logits ``[batch, vocab]``. Static shapes, no
        host synchronisation: the body of the decode CUDA graph. Fused
        (:mod:`dslab.inference.fused_decode`) unless ``unfused_reason`` names a reason."""
        if unfused_reason(self, tokens.shape[0]) is None:
            return fused_decode_step(self, tokens, write_pos, valid_start, cache)
        positions = write_pos - valid_start
        x = self.embed(tokens[:, None], positions[:, None])
        hidden = self.run_layers(x, DecodeAttention(cache, write_pos, valid_start))
        return self.lm_logits(hidden[:, 0])
