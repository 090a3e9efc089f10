"""dslab's transformer layers split over a tensor-parallel group (Megatron-LM's layout, Shoeybi et
al. 2019, §3), the LM head and loss over a split vocabulary, and GPT-2's state dicts converted
between the dense and the split form.

A layer of :func:`tensor_parallel_layer` is a :class:`~dslab.models.ops.TransformerLayer` whose
:class:`~dslab.models.ops.SelfAttention` and :class:`~dslab.models.ops.FeedForward` are given
parallel projections (:mod:`dslab.parallel.tensor_parallel`). Rank ``r`` of ``tp`` holds

- attention heads ``r * heads/tp .. (r + 1) * heads/tp - 1``: the packed ``qkv`` projection is
  column-parallel with ``partition_stride`` 3, ``[3 * hidden/tp, hidden]`` and its bias, the rows
  of its heads in the q block, then the k block, then the v block (so the attention op reads its
  ``heads/tp`` heads in the packed layout it always reads); ``out_proj`` is row-parallel,
  ``[hidden, hidden/tp]``, and its output arrives summed over the group;
- MLP columns ``r * I/tp ..``: ``fc_in`` column-parallel ``[I/tp, hidden]`` with ``fc_in_bias``
  ``[I/tp]`` (a shard: ``partition_dim`` 0), ``fc_out`` row-parallel ``[hidden, I/tp]``;
- the layer norms, ``out_bias`` and ``fc_out_bias`` whole (replicated).

The sublayers' forwards are the dense ones: bias-GELU runs on this rank's columns, attention on
its heads, and the bias, dropout and residual add after each row-parallel projection see the
summed output. Per layer that is two all-reduces of ``[batch, seq, hidden]`` forward and two
backward. The projections read their weights through :func:`~dslab.models.weight_cast.weight`,
as the dense ones do, so that a scope of casts or copies (:mod:`dslab.engine.weight_copies`) can
stand in for the shards.

With sequence parallelism the stream between the projections (layer norms, dropout, residual
adds, and so every replicated parameter's gradient) is split along the sequence: each rank holds
``[batch, seq/tp, hidden]``; the column-parallel projections all-gather it and the row-parallel
ones reduce-scatter their outputs (:mod:`dslab.parallel.tensor_parallel_regions`).
:func:`mark_sequence_parallel_replicas` marks the replicated parameters, whose gradients
:func:`dslab.parallel.tensor_parallel.allreduce_sequence_parallel_grads` then sums.

Dropout: ranks seeded alike draw the same masks for the replicated activations, as they must (the
residual stream stays equal across the group). Attention-probability dropout on each rank's own
heads then draws the same mask pattern on every rank (rank 0's head 0 and rank 1's head 0 share
it): each mask is still an unbiased Bernoulli draw, but the heads of one position are not
independent across ranks, as they are in the dense model. (Megatron-LM gives the tensor-parallel
regions a generator per rank, its CUDA RNG tracker; dslab has none.) With sequence parallelism
the same holds for the sequence shards. The tests train with dropout 0.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn as nn

from dslab import comm
from dslab.models.ops import FeedForward, OpSet, SelfAttention, TransformerLayer
from dslab.models.weight_cast import weight
from dslab.parallel.random import get_rng_tracker
from dslab.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, column_parallel_linear, is_tensor_parallel, mark_sequence_parallel,
    row_parallel_linear, set_tensor_model_parallel_attributes,
)
from dslab.parallel.tensor_parallel_regions import (
    divide, shard_tensor, tensor_parallel_rank, tensor_parallel_world_size, unshard_tensors,
)
from dslab.parallel.vocab_parallel import VocabParallelEmbedding, parallel_lm_logits, vocab_parallel_cross_entropy


class ColumnParallelProjection(ColumnParallelLinear):
    """A :class:`~dslab.parallel.tensor_parallel.ColumnParallelLinear` reading its weight and bias
    through :func:`~dslab.models.weight_cast.weight`; ``forward(x, bias_grad_elsewhere=False)`` as
    :class:`~dslab.models.ops.PackedProjection`'s (the attention op may compute the bias's
    gradient from the rows it writes)."""

    _read_through_weight = ("weight", "bias")

    def forward(self, input: torch.Tensor, bias_grad_elsewhere: bool = False) -> torch.Tensor:
        bias = weight(self.bias)
        if bias_grad_elsewhere and bias is not None:
            bias = bias.detach()
        return column_parallel_linear(input, weight(self.weight), bias, self.group, self.gather_output,
                                      self.sequence_parallel)


class RowParallelProjection(RowParallelLinear):
    """A :class:`~dslab.parallel.tensor_parallel.RowParallelLinear` reading its weight and bias
    through :func:`~dslab.models.weight_cast.weight`."""

    _read_through_weight = ("weight", "bias")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(input, weight(self.weight), weight(self.bias), self.group, self.input_is_parallel,
                                   self.sequence_parallel)


class ParallelTokenEmbedding(VocabParallelEmbedding):
    """A :class:`~dslab.parallel.vocab_parallel.VocabParallelEmbedding` called as
    :class:`~dslab.models.ops.Embedding` is, ``forward(ids, tie=None)``. The split lookup takes no
    tie: each rank's LM head reads its own rows of the matrix directly."""

    def forward(self, ids: torch.Tensor, tie=None) -> torch.Tensor:
        if tie is not None:
            raise ValueError("a vocabulary-parallel embedding takes no embedding tie")
        return super().forward(ids)


def check_group_size(size: int, group, size_key: str, group_key: str) -> None:
    """ValueError naming ``size_key`` unless ``group`` (None: the default group) has ``size`` ranks;
    with ``size`` 1 a group is optional, and must then have one rank. ``group_key``: the argument
    that passes the group, for the message."""
    if size == 1:
        if group is not None and comm.get_world_size(group) != 1:
            raise ValueError(f"{size_key}=1 but {group_key} has {comm.get_world_size(group)} ranks")
        return
    if not comm.is_initialized():
        raise ValueError(f"{size_key}={size} needs a process group of {size} ranks: start the script with "
                         "torchrun or dslab launch (no process group is initialised)")
    found = comm.get_world_size(group)
    if found != size:
        which = f"the default group ({group_key}=None)" if group is None else group_key
        raise ValueError(f"{size_key}={size} but {which} has {found} ranks")


def check_tensor_parallel_group(tp_size: int, group) -> None:
    """:func:`check_group_size` for ``tp_size`` and ``tp_group``."""
    check_group_size(tp_size, group, "tp_size", "tp_group")


def tensor_parallel_layer(hidden: int, heads: int, intermediate: int, hidden_dropout: float,
                          attention_dropout: float, eps: float, pre_ln: bool, causal: bool, gelu_approximate: str,
                          ops: OpSet, chain_layer_norms: bool = True, group=None,
                          sequence_parallel: bool = False) -> TransformerLayer:
    """A :class:`~dslab.models.ops.TransformerLayer` (same arguments) split over ``group``
    (module docstring). ValueError naming ``heads`` or ``intermediate`` when the group's size does
    not divide it. The projections are built, and draw their weights, in the dense layer's order
    (qkv, out_proj, fc_in, fc_out), so ranks seeded alike hold the slices of the dense layer built
    from the same seed."""
    size = tensor_parallel_world_size(group)
    local_heads = divide(heads, size, "heads")
    local_columns = divide(intermediate, size, "intermediate")
    split = dict(group=group, sequence_parallel=sequence_parallel)
    qkv = ColumnParallelProjection(hidden, 3 * hidden, bias=True, partition_stride=3, **split)
    out_proj = RowParallelProjection(hidden, hidden, bias=False, **split)
    attention = SelfAttention(hidden, local_heads, attention_dropout, hidden_dropout, causal, ops, qkv=qkv,
                              out_proj=out_proj)
    attention.rng_fork = get_rng_tracker().fork  # each rank's heads drop on its own stream
    fc_in = ColumnParallelProjection(hidden, intermediate, bias=False, **split)
    fc_out = RowParallelProjection(intermediate, hidden, bias=False, **split)
    mlp = FeedForward(hidden, local_columns, hidden_dropout, gelu_approximate, ops, fc_in=fc_in, fc_out=fc_out)
    set_tensor_model_parallel_attributes(mlp.fc_in_bias, True, 0)
    for replicated in (attention.out_bias, mlp.fc_out_bias):
        set_tensor_model_parallel_attributes(replicated, False)
    return TransformerLayer(hidden, local_heads, local_columns, hidden_dropout, attention_dropout, eps, pre_ln,
                            causal, gelu_approximate, ops, chain_layer_norms, attention=attention, mlp=mlp)


def mark_sequence_parallel_replicas(module: nn.Module) -> None:
    """Mark every parameter of ``module`` that is not a tensor-parallel shard as replicated and
    ``sequence_parallel``: in a sequence-parallel model each rank computes its gradient from its
    own sequence shard (layer norms, positions, the row-parallel biases)."""
    for param in module.parameters():
        if not is_tensor_parallel(param):
            set_tensor_model_parallel_attributes(param, False)
            mark_sequence_parallel(param)


def sequence_shard(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (a view; its gradient reaches only this rank's
    rows), e.g. the position embeddings of this rank's sequence shard."""
    size = tensor_parallel_world_size(group)
    return x.chunk(size, dim)[tensor_parallel_rank(group)]


def tensor_parallel_lm_loss(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                            group, sequence_parallel: bool, ignore_index: int) -> torch.Tensor:
    """The fp32 mean cross-entropy of a tied LM head over a split vocabulary: ``hidden
    [batch, seq, H]`` (with ``sequence_parallel``, this rank's ``[batch, seq/tp, H]``), ``head_weight
    [V/tp, H]`` this rank's rows, ``targets [batch, seq]``. Each rank computes the logits of its
    rows only; the mean is over the targets that are not ``ignore_index`` (``F.cross_entropy``'s)."""
    logits = parallel_lm_logits(hidden, head_weight, group, sequence_parallel)
    losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), group,
                                          ignore_index, vocab_size)
    return losses.sum() / (targets != ignore_index).sum()


def tensor_parallel_lm_logits(hidden: torch.Tensor, head_weight: torch.Tensor, vocab_size: int, group,
                              sequence_parallel: bool) -> torch.Tensor:
    """The whole logits ``[batch, seq, vocab_size]`` on every rank (all-gathered along the
    vocabulary; the padding columns dropped, as a strided view)."""
    logits = parallel_lm_logits(hidden, head_weight, group, sequence_parallel, gather_output=True)
    return logits[..., :vocab_size] if logits.shape[-1] != vocab_size else logits


# ---------------------------------------------------------------------------------------------
# GPT-2 state dicts, dense <-> split.
# ---------------------------------------------------------------------------------------------

# (key pattern, partition_dim, partition_stride) of every split tensor of GPT-2's state dict; the
# rest is replicated. A test holds it against the attributes of a tensor-parallel model's parameters.
GPT2_TENSOR_PARALLEL_LAYOUT = (
    (re.compile(r"wte\.weight"), 0, 1),
    (re.compile(r"layers\.\d+\.attention\.qkv\.(weight|bias)"), 0, 3),
    (re.compile(r"layers\.\d+\.attention\.out_proj\.weight"), 1, 1),
    (re.compile(r"layers\.\d+\.mlp\.fc_in\.weight"), 0, 1),
    (re.compile(r"layers\.\d+\.mlp\.fc_in_bias"), 0, 1),
    (re.compile(r"layers\.\d+\.mlp\.fc_out\.weight"), 1, 1),
)


def gpt2_partition(key: str) -> tuple[int, int] | None:
    """``(partition_dim, partition_stride)`` of GPT-2 state-dict entry ``key``, None when it is
    replicated."""
    for pattern, dim, stride in GPT2_TENSOR_PARALLEL_LAYOUT:
        if pattern.fullmatch(key):
            return dim, stride
    return None


def _checked(config, tp_size: int):
    """``config`` with ``tp_size`` (its checks: heads, MLP width and padded vocabulary divide)."""
    return dataclasses.replace(config, tp_size=tp_size, sequence_parallel=False)


def gpt2_tp_state_dict(dense_state_dict: dict[str, torch.Tensor], tp_rank: int, tp_size: int,
                       config) -> dict[str, torch.Tensor]:
    """Rank ``tp_rank``'s state dict of a GPT-2 split over ``tp_size`` ranks, sliced from a dense
    model's (``config``: its :class:`~dslab.models.gpt2.GPT2Config`; its ``tp_size`` is not read).
    Replicated entries are the dense tensors themselves; shards are copies."""
    _checked(config, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is not a rank of tp_size={tp_size}")
    out = {}
    for key, value in dense_state_dict.items():
        partition = gpt2_partition(key)
        out[key] = value if partition is None else shard_tensor(value, partition[0], tp_rank, tp_size, partition[1])
    return out


def gpt2_dense_state_dict(tp_state_dicts: list[dict[str, torch.Tensor]], config) -> dict[str, torch.Tensor]:
    """The dense GPT-2 state dict from every rank's (rank order): the inverse of
    :func:`gpt2_tp_state_dict`. Replicated entries are taken from rank 0's. (A live model gathers
    its own with :meth:`~dslab.models.gpt2.GPT2LMHeadModel.dense_state_dict`.)"""
    _checked(config, len(tp_state_dicts))
    out = {}
    for key, value in tp_state_dicts[0].items():
        partition = gpt2_partition(key)
        out[key] = value if partition is None else unshard_tensors([sd[key] for sd in tp_state_dicts], *partition)
    return out


# ---------------------------------------------------------------------------------------------
# BERT state dicts, dense -> split.
# ---------------------------------------------------------------------------------------------

BERT_TENSOR_PARALLEL_LAYOUT = (
    (re.compile(r"embeddings\.word_embeddings\.weight"), 0, 1),
    (re.compile(r"layers\.\d+\.attention\.qkv\.(weight|bias)"), 0, 3),
    (re.compile(r"layers\.\d+\.attention\.out_proj\.weight"), 1, 1),
    (re.compile(r"layers\.\d+\.mlp\.fc_in\.weight"), 0, 1),
    (re.compile(r"layers\.\d+\.mlp\.fc_in_bias"), 0, 1),
    (re.compile(r"layers\.\d+\.mlp\.fc_out\.weight"), 1, 1),
    (re.compile(r"mlm_bias"), 0, 1),
)


def bert_tp_state_dict(dense_state_dict: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """Rank ``tp_rank``'s state dict of a :class:`~dslab.models.bert.BertForPreTraining` split over
    ``tp_size`` ranks, sliced from a dense model's (the word embeddings and the MLM decoder's bias
    by vocabulary rows, the layers as GPT-2's)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is not a rank of tp_size={tp_size}")
    out = {}
    for key, value in dense_state_dict.items():
        partition = next(((dim, stride) for pattern, dim, stride in BERT_TENSOR_PARALLEL_LAYOUT
                          if pattern.fullmatch(key)), None)
        out[key] = value if partition is None else shard_tensor(value, partition[0], tp_rank, tp_size, partition[1])
    return out
