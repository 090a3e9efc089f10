"""The vocabulary split over a tensor-parallel group: the token embedding, the LM head's logits and
their softmax cross-entropy, none of which ever holds the whole vocabulary's columns on one rank
(Megatron-LM's ``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy``, Shoeybi et al.
2019, §3).

Rank ``r`` of ``tp`` owns vocabulary rows ``[r * V/tp, (r + 1) * V/tp)`` of the embedding matrix
``[V, H]`` (``V`` must divide by ``tp``: pad the vocabulary, see the models' ``vocab_pad_multiple``).
A tied LM head then gives each rank the logits of its own rows, ``[tokens, V/tp]``, and the loss
needs only per-token scalars across ranks: the max, the sum of exponentials and the target's
logit, three all-reduces of ``[tokens]`` fp32 each, against the ``[tokens, V]`` all-gather that
gathering the logits would cost.

Parameter attributes and groups as in :mod:`dslab.parallel.tensor_parallel`; sequence parallelism
as in :mod:`dslab.parallel.tensor_parallel_regions` (the sequence is dim 1 of ``[batch, seq, ...]``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab import comm
from dslab.parallel.tensor_parallel import _NO_INIT, column_parallel_linear, set_tensor_model_parallel_attributes
from dslab.parallel.tensor_parallel_regions import (
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region, shard_tensor, tensor_parallel_rank,
    tensor_parallel_world_size,
)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, group=None,
                             sequence_parallel: bool = False) -> torch.Tensor:
    """Token embeddings ``[*ids.shape, H]`` from this rank's rows ``weight [V/tp, H]``: ids outside
    this rank's range look up zeros, and the all-reduce over ``group`` fills in every row. With
    ``sequence_parallel`` (``ids [batch, seq]``) the sum is reduce-scattered instead: this rank's
    ``[batch, seq/tp, H]``."""
    size = tensor_parallel_world_size(group)
    if size == 1:
        return F.embedding(ids, weight)
    start = tensor_parallel_rank(group) * weight.shape[0]
    outside = (ids < start) | (ids >= start + weight.shape[0])
    out = F.embedding((ids - start).masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(out, group)
    return reduce_from_tensor_parallel_region(out, group, in_place=True)


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with its rows split over ``group``: ``weight
    [num_embeddings/tp, embedding_dim]`` holds rows ``vocab_start_index .. vocab_end_index - 1``.
    ``forward(ids)`` -> ``[*ids.shape, embedding_dim]`` whole on every rank, or with
    ``sequence_parallel`` this rank's ``[batch, seq/tp, embedding_dim]``.

    Initialisation: the whole matrix is drawn on every rank (``init_method``, default
    ``nn.init.normal_`` as ``nn.Embedding``) and each keeps its rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, sequence_parallel: bool = False,
                 init_method: Callable[[torch.Tensor], object] | None = None, dtype: torch.dtype | None = None,
                 device=None):
        super().__init__()
        size, rank = tensor_parallel_world_size(group), tensor_parallel_rank(group)
        if num_embeddings % size:
            raise ValueError(f"num_embeddings={num_embeddings} does not divide by the tensor-parallel size {size}: "
                             "pad the vocabulary to a multiple of it")
        if sequence_parallel and size == 1:
            raise ValueError("sequence_parallel needs a tensor-parallel group of more than one rank")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.tp_size, self.tp_rank = group, size, rank
        self.sequence_parallel = sequence_parallel
        per_rank = num_embeddings // size
        self.vocab_start_index, self.vocab_end_index = rank * per_rank, (rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        if init_method is not _NO_INIT:
            self.reset_parameters(init_method)

    def reset_parameters(self, init_method: Callable[[torch.Tensor], object] | None = None) -> None:
        """Draw the whole ``[num_embeddings, embedding_dim]`` matrix and keep this rank's rows."""
        if self.weight.device.type == "meta":
            return
        with torch.no_grad():
            full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype,
                               device=self.weight.device)
            (init_method or nn.init.normal_)(full)
            self.weight.copy_(shard_tensor(full, 0, self.tp_rank, self.tp_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.group, self.sequence_parallel)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group=None, sequence_parallel: bool = False) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding`` (copied). An embedding with ``padding_idx``,
        ``max_norm`` or sparse gradients is refused: the split lookup does not reproduce them."""
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding.from_dense takes a plain nn.Embedding "
                             "(no padding_idx, max_norm or sparse)")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, sequence_parallel, _NO_INIT,
                    embedding.weight.dtype, embedding.weight.device)
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(embedding.weight.detach(), 0, layer.tp_rank, layer.tp_size))
        return layer

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.vocab_start_index}.."
                f"{self.vocab_end_index - 1}, tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}")


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor, group=None, sequence_parallel: bool = False,
                       gather_output: bool = False) -> torch.Tensor:
    """An LM head's logits over this rank's vocabulary rows: ``hidden [..., H]`` (with
    ``sequence_parallel`` this rank's ``[batch, seq/tp, H]``, all-gathered first) times
    ``weight [V/tp, H]`` -> ``[..., V/tp]`` over the whole sequence (``gather_output``: all
    ``[..., V]``, which the loss does not need). The hidden states' gradient is summed over the
    group in the backward (a column-parallel linear without bias)."""
    return column_parallel_linear(hidden, weight, None, group, gather_output, sequence_parallel)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token softmax cross-entropy over logits split along the vocabulary (module docstring).

    Forward, in fp32: the row max (all-reduce MAX), the target's shifted logit (on the rank that
    owns it, all-reduce SUM), the sum of exponentials (all-reduce SUM); loss = log(sum) - target
    logit. The softmax of this rank's columns is kept, and the backward turns it in place into
    the logits' gradient ``(softmax - onehot) * grad``: one ``[tokens, V/tp]`` fp32 buffer in all,
    never the whole vocabulary. A second backward through the same graph fails (the saved softmax
    was overwritten, which autograd reports)."""

    @staticmethod
    def forward(ctx, logits, target, group, size, rank, ignore_index, vocab_size):
        local = logits.shape[-1]
        start = rank * local
        valid = local if vocab_size is None else max(0, min(local, vocab_size - start))
        logits32 = logits.float()
        if valid > 0:
            row_max = logits32[..., :valid].amax(-1)
        else:  # this rank's columns are all padding
            row_max = logits32.new_full(logits32.shape[:-1], float("-inf"))
        if size > 1:
            comm.all_reduce(row_max, op=comm.ReduceOp.MAX, group=group)
        shifted = logits32 - row_max.unsqueeze(-1)
        if valid < local:
            shifted[..., valid:] = float("-inf")  # padding columns: exp() = 0, so no probability
        ignored = target == ignore_index
        owned = (target >= start) & (target < start + local) & ~ignored
        local_target = (target - start).masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        if size > 1:
            comm.all_reduce(target_logit, group=group)
        exp = shifted.exp_()
        sum_exp = exp.sum(-1)
        if size > 1:
            comm.all_reduce(sum_exp, group=group)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, owned, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        softmax, local_target, owned, ignored = ctx.saved_tensors
        grad = softmax  # written in place (class docstring)
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=flat.device)
        flat.index_put_((rows, local_target.reshape(-1)), -owned.reshape(-1).to(flat.dtype), accumulate=True)
        grad.mul_(grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_parallel: torch.Tensor, target: torch.Tensor, group=None,
                                 ignore_index: int = -100, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token fp32 losses ``[*target.shape]`` of ``softmax(logits)`` against ``target``, the
    logits split along the last dimension over ``group``: ``logits_parallel [..., V/tp]`` holds
    columns ``rank * V/tp ..`` of this rank.

    ``vocab_size``: the real vocabulary when the columns are padded (``V/tp * tp`` > vocab_size):
    columns at or past it take no part in the softmax and get zero gradient. ``ignore_index``
    targets give a loss of 0 and no gradient. Targets must be in ``[0, vocab_size)`` or
    ``ignore_index``; others are not checked (that would cost a host synchronisation): one in the
    padding gives an infinite loss. The mean over non-ignored tokens is ``losses.sum() /
    (target != ignore_index).sum()``, ``F.cross_entropy``'s reduction."""
    if target.shape != logits_parallel.shape[:-1]:
        raise ValueError(f"target {tuple(target.shape)} must have the logits' shape without the vocabulary "
                         f"dimension, {tuple(logits_parallel.shape[:-1])}")
    size, rank = tensor_parallel_world_size(group), tensor_parallel_rank(group)
    padded = logits_parallel.shape[-1] * size
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {padded}] (the columns of all ranks' logits)")
    return _VocabParallelCrossEntropy.apply(logits_parallel, target, group, size, rank, ignore_index, vocab_size)
