"""Llama written for PyTorch's context parallelism: the model the ``torch-cp`` arm of a long-context
suite trains (:mod:`dslab.bench.long_context_peers`), and the model whose step the suite counts
flops on (:mod:`dslab.bench.long_context`).

It is :class:`dslab.models.llama.LlamaForCausalLM`'s function on PyTorch's own ops (the ``torch``
op set of :mod:`dslab.models.llama_ops`: ``F.rms_norm``, SwiGLU, rotary positions,
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=...)``), with the same parameter names
and shapes, so it loads a dslab Llama's state dict and starts from the same weights. What differs
is what context parallelism needs (torchtitan's Llama is written the same way):

- the rotary tables are inputs, ``cos`` and ``sin`` ``[seq, head_dim / 2]`` of the sequence's
  positions, not computed inside from the local length: ``context_parallel`` shards them along the
  sequence with the token ids (its load balancer hands each rank two chunks, one from each end of
  the sequence, so a rank's positions are not contiguous and only sharded tables say which they
  are);
- the targets are an input too, already shifted on the whole sequence (``targets[t] =
  labels[t + 1]``, the last position ignored) and sharded with the ids, and the model returns the
  *sum* of its tokens' losses: the caller divides by the whole sequence's target count, so the
  ranks' results add up to the whole sequence's mean;
- each block reads only its own parameters (no norm chained across blocks), so ``fully_shard``
  can wrap the blocks one by one, and ``config.checkpoint_layers`` > 0 runs the stack in segments
  of that many blocks under ``torch.utils.checkpoint`` (non-reentrant), as dslab's model does.

Shapes: ``input_ids``, ``targets`` ``[batch, seq]`` int64 -> the fp32 sum of the next-token losses
over the targets that are not ignored (a 0-d tensor). The loss is ``F.cross_entropy`` over the
first ``vocab_size`` columns of the logits (the padding columns sliced away, as the ``torch`` op
set's loss does).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dslab.models.llama import LlamaConfig
from dslab.models.llama_ops import TORCH_LLAMA_OPS, RotaryTables

IGNORE_INDEX = -100


class TorchLlamaAttention(nn.Module):
    """``o_proj attention(rope(q), rope(k), v)`` with q, k, v from one ``qkv`` projection (rows q,
    then k, then v, as dslab's layout)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden, config.qkv_rows, bias=False)
        self.o_proj = nn.Linear(config.heads * config.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        q, k = TORCH_LLAMA_OPS.rope(q, k, cos, sin)
        # [b, h, s, d] for SDPA: dim 2 is the sequence, the dim context_parallel's ring shards
        context = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(context.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class TorchLlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_up = nn.Linear(config.hidden, 2 * config.intermediate, bias=False)
        self.down = nn.Linear(config.intermediate, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(TORCH_LLAMA_OPS.swiglu(self.gate_up(x)))


class TorchRMSNorm(nn.Module):
    """``F.rms_norm`` with a weight (ones until a state dict is loaded)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TORCH_LLAMA_OPS.rms_norm(x, self.weight, self.eps)


class TorchLlamaBlock(nn.Module):
    """``x + attention(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = TorchRMSNorm(config.hidden, config.rms_norm_eps)
        self.attention = TorchLlamaAttention(config)
        self.mlp_norm = TorchRMSNorm(config.hidden, config.rms_norm_eps)
        self.mlp = TorchLlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TorchLlama(nn.Module):
    """The Llama language model (module docstring): ``forward(input_ids, targets, cos, sin)`` ->
    the sum of the next-token losses. Parameters are created uninitialised; load a dslab Llama's
    state dict (:func:`build_torch_llama`)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.embed = nn.Embedding(config.padded_vocab_size, config.hidden)
        self.layers = nn.ModuleList(TorchLlamaBlock(config) for _ in range(config.layers))
        self.final_norm = TorchRMSNorm(config.hidden, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden, config.padded_vocab_size,
                                                                          bias=False)

    def _segment(self, start: int, stop: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[start:stop]:
            x = layer(x, cos, sin)
        return x

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        every = self.config.checkpoint_layers
        if every > 0 and torch.is_grad_enabled():
            for start in range(0, len(self.layers), every):
                x = checkpoint(self._segment, start, start + every, x, cos, sin, use_reentrant=False)
        else:
            x = self._segment(0, len(self.layers), x, cos, sin)
        x = self.final_norm(x)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, head)[..., :self.config.vocab_size]
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` moved one position left on the whole sequence, the last position ignored (what
    dslab's Llama scores each position against)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def rotary_tables(config: LlamaConfig, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` ``[seq, head_dim / 2]`` of positions ``0 .. seq``: dslab's tables
    (:class:`dslab.models.llama_ops.RotaryTables`), copies the caller may shard in place."""
    cos, sin = RotaryTables(config.head_dim, config.rope_theta, config.rope_scaling).tables(seq, device)
    return cos.clone(), sin.clone()


def build_torch_llama(config: LlamaConfig, state_dict: dict[str, torch.Tensor]) -> TorchLlama:
    """A :class:`TorchLlama` holding ``state_dict``'s tensors (a dslab Llama's, same keys), built on
    the meta device and given the tensors themselves (no copy): it lives where they do."""
    with torch.device("meta"):
        model = TorchLlama(config)
    model.load_state_dict(state_dict, assign=True)
    return model
