"""dslab's transformer layer with DeepSpeed-Ulysses sequence-parallel attention (Jacobs et al.
2023, arXiv:2309.14509), for GPT-2 and BERT's :class:`~dslab.models.ops.TransformerLayer`.

Each rank of the sequence-parallel group holds ``[batch, seq/p, hidden]`` of the stream and every
parameter whole. Everything but attention acts on positions one by one, so it runs on the chunk
unchanged: the layer norms, the projections, bias-GELU, dropout and the residual adds. Attention
needs the whole sequence: :class:`SequenceParallelSelfAttention` projects the chunk to q, k, v
(``[batch, seq/p, heads, head_dim]``, batch first) and hands them to
:class:`dslab.parallel.sequence.DistributedAttention`, which all-to-alls them to the whole
sequence of ``heads/p`` heads, runs the op set's ``attention`` there, and trades the output back
(two all-to-alls forward, q, k and v packed in one of ``[batch, seq/p, 3 hidden]`` and the
output's, and two backward, per layer).

The parameters and their names are :class:`~dslab.models.ops.SelfAttention`'s, so the state dict
of the unsplit model loads as it is. The gradient a rank computes is its chunk's share; the sum
over the group is the unsplit model's (the engine's reduction over the data x sequence ranks
does it, :mod:`dslab.engine.sequence_parallel`).
"""

from __future__ import annotations

import torch

from dslab.models.ops import LayerNorm, OpSet, SelfAttention, TransformerLayer
from dslab.models.weight_cast import weight
from dslab.parallel.sequence import DistributedAttention


class SequenceParallelSelfAttention(SelfAttention):
    """:class:`~dslab.models.ops.SelfAttention` on this rank's sequence chunk, attending over the
    whole sequence of ``sp_group`` (module docstring). ``forward(x, residual, key_padding_mask=None,
    norm=None)`` as the dense one's, on ``[batch, seq/p, hidden]``; a key padding mask is refused
    (it would have to be split and exchanged with the keys)."""

    def __init__(self, hidden: int, heads: int, attention_dropout: float, hidden_dropout: float, causal: bool,
                 ops: OpSet, sp_group=None):
        super().__init__(hidden, heads, attention_dropout, hidden_dropout, causal, ops)
        # batch-first chunks [b, s/p, h, d] in, the whole sequence of h/p heads to the op
        self.sequence_attention = DistributedAttention(self._local_attention, sp_group, scatter_idx=2, gather_idx=1)

    def _local_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The op set's attention of ``[b, s, h, d]`` q, k, v -> ``[b, s, h, d]``."""
        dropout_p = self.attention_dropout if self.training else 0.0
        context = self.ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=self.causal,
                                     dropout_p=dropout_p)
        return context.transpose(1, 2)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                norm: LayerNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if key_padding_mask is not None:
            raise ValueError("key_padding_mask is not supported with sequence_parallel_size > 1")
        batch, chunk, hidden = x.shape
        # the packed projection's rows: q, k, v, each head by head
        q, k, v = self.qkv(x).view(batch, chunk, 3, self.heads, hidden // self.heads).unbind(2)
        context = self.sequence_attention(q, k, v).reshape(batch, chunk, hidden)
        out, bias = self.out_proj(context), weight(self.out_bias)
        if norm is None:
            return self.ops.bias_dropout_residual(out, bias, residual, self.hidden_dropout, self.training)
        return norm.after_residual_add(out, bias, residual, self.hidden_dropout, self.training)


def sequence_parallel_layer(hidden: int, heads: int, intermediate: int, hidden_dropout: float,
                            attention_dropout: float, eps: float, pre_ln: bool, causal: bool, gelu_approximate: str,
                            ops: OpSet, chain_layer_norms: bool = True, sp_group=None) -> TransformerLayer:
    """A :class:`~dslab.models.ops.TransformerLayer` (same arguments) whose attention is
    :class:`SequenceParallelSelfAttention` over ``sp_group``."""
    attention = SequenceParallelSelfAttention(hidden, heads, attention_dropout, hidden_dropout, causal, ops,
                                              sp_group)
    return TransformerLayer(hidden, heads, intermediate, hidden_dropout, attention_dropout, eps, pre_ln, causal,
                            gelu_approximate, ops, chain_layer_norms, attention=attention)
