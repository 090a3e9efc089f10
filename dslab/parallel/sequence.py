"""Sequence-parallel attention, DeepSpeed-Ulysses style (``deepspeed.sequence.layer``).

Each of the ``p`` ranks of a sequence-parallel group holds a contiguous chunk of the sequence
(rank r: positions ``[r * s/p, (r + 1) * s/p)``) of q, k and v, with every head. Attention needs
the whole sequence, but each head is independent of the others, so one all-to-all per tensor
trades the split: afterwards each rank holds the whole sequence of ``h/p`` heads (rank r: heads
``[r * h/p, (r + 1) * h/p)``), runs the ordinary attention on them, and one more all-to-all
trades the output back to the rank's sequence chunk with every head::

    q, k, v [s/p, b, h, d]  --all-to-all-->  [s, b, h/p, d]  --local_attention-->  [s, b, h/p, d]
    out     [s/p, b, h, d]  <--all-to-all--  [s, b, h/p, d]

The all-to-all that scatters dim ``a`` and gathers dim ``c`` is a permutation of the ranks'
elements; its adjoint (and inverse) scatters ``c`` and gathers ``a``, which is its backward, so
the gradients of q, k and v reach the rank that holds them. Each exchange is one
:func:`dslab.comm.all_to_all_single` (the comms logger sees it as ``all_to_all``). q, k and v
travel together: the block each rank sends to rank r is its q, k and v blocks for r packed along
the heads (grouped-query k and v with their own head counts), so the forward issues two
all-to-alls (q, k, v packed; the output) and the backward two, each packed one three times the
size of one tensor's: a third of the latency-bound launches of one exchange per tensor.

Layouts (``scatter_idx`` is the heads' dim, ``gather_idx`` the sequence's):

- ``scatter_idx=2, gather_idx=0``: sequence first, ``[s/p, b, h, d]`` (DeepSpeed's default,
  Megatron's layout); ``local_attention`` gets ``[s, b, h/p, d]``.
- ``scatter_idx=2, gather_idx=1``: batch first, ``[b, s/p, h, d]``; ``local_attention`` gets
  ``[b, s, h/p, d]``.

Other index pairs are refused (ValueError naming ``scatter_idx`` or ``gather_idx``).

Heads: ``h`` must divide by ``p``. Grouped-query k and v (``h_kv`` heads, a divisor of ``h``)
are split the same way when ``h_kv`` divides by ``p``; when it is smaller than ``p`` and divides
it, each kv head is repeated ``p / h_kv`` times in place first (transformers' ``repeat_kv``
order), so that rank r receives the one kv head its query heads attend with, and the repeats'
gradients sum back into it. Any other kv head count is refused by name.

A group of one rank (or no process group at all) makes the wrapper the identity around
``local_attention``: no collectives.

Around the attention (the rest of a training step):

- :func:`initialize_sequence_parallel` builds (once per size) the grid of ``world = dp x sp``
  ranks, DeepSpeed's and Megatron-DeepSpeed's layout: the ``sp`` ranks of one sequence-parallel
  group are neighbours (ranks ``[i sp, (i + 1) sp)``, on one host when ``sp`` fits in it, for
  the all-to-alls), a data-parallel group holds the ranks of one sequence-parallel rank (strided
  by ``sp``), and the sequence-data-parallel group (every rank holding the same replica of the
  weights, here the world) is where gradients are reduced and ZeRO shards. A model is built with
  its ``.group``; the engine (``sequence_parallel_size``) finds the same groups.
- :func:`split_sequence`: this rank's contiguous chunk of every tensor of a batch (data side).
- :func:`sequence_mean_loss`: the whole sequence's mean loss from each rank's mean over its chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from dslab import comm
from dslab.parallel.topology import ProcessTopology
from dslab.parallel.tensor_parallel_regions import reduce_from_tensor_parallel_region

# (scatter_idx, gather_idx) -> the layout's name
LAYOUTS = {(2, 0): "[s/p, b, h, d] (sequence first)", (2, 1): "[b, s/p, h, d] (batch first)"}


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, size: int) -> torch.Tensor:
    """Cut ``x`` into ``size`` blocks along ``scatter_dim``, send block r to rank r, and
    concatenate the blocks received along ``gather_dim`` in rank order (no autograd)."""
    shape = list(x.shape)
    split = shape[:scatter_dim] + [size, shape[scatter_dim] // size] + shape[scatter_dim + 1:]
    # [size, ...]: the rank blocks one after the other along dim 0, as the flat collective wants
    send = x.reshape(split).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(send)
    comm.all_to_all_single(received, send, group=group)
    # received's dims after 0 are x's dims (scatter_dim shrunk); rank blocks go in front of gather_dim
    out_shape = list(received.shape[1:])
    out_shape[gather_dim] *= size
    return received.movedim(0, gather_dim).reshape(out_shape)


def _all_to_all_packed(tensors, scatter_dim: int, gather_dim: int, group, size: int) -> list[torch.Tensor]:
    """:func:`_all_to_all` of several tensors in one collective. They differ only in the heads'
    dim (2; it is ``scatter_dim`` or ``gather_dim``): each rank's block of every tensor goes in one
    send block, packed along the heads within the block, and is unpacked on arrival."""
    sends = []
    for x in tensors:
        shape = list(x.shape)
        split = shape[:scatter_dim] + [size, shape[scatter_dim] // size] + shape[scatter_dim + 1:]
        sends.append(x.reshape(split).movedim(scatter_dim, 0))
    # in the [size, ...] layout every tensor's dims follow the rank blocks' in order: heads at 1 + 2
    widths = [t.shape[3] for t in sends]
    send = torch.cat(sends, dim=3)
    received = torch.empty_like(send)
    comm.all_to_all_single(received, send, group=group)
    outs = []
    for part in received.split(widths, dim=3):
        out_shape = list(part.shape[1:])
        out_shape[gather_dim] *= size
        outs.append(part.movedim(0, gather_dim).reshape(out_shape))
    return outs


class _PackedAllToAll(torch.autograd.Function):
    """q, k and v (``[.., .., heads_i, d]``) through one all-to-all scattering the heads' dim and
    gathering ``gather_dim``; backward: their gradients through the inverse one."""

    @staticmethod
    def forward(ctx, scatter_dim, gather_dim, group, size, *tensors):
        ctx.scatter_dim, ctx.gather_dim, ctx.group, ctx.size = scatter_dim, gather_dim, group, size
        return tuple(_all_to_all_packed(tensors, scatter_dim, gather_dim, group, size))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None,
                *_all_to_all_packed(grads, ctx.gather_dim, ctx.scatter_dim, ctx.group, ctx.size))


class _SeqAllToAll(torch.autograd.Function):
    """Forward: the all-to-all scattering ``scatter_dim`` and gathering ``gather_dim``;
    backward: the inverse one (gathering ``scatter_dim``, scattering ``gather_dim``)."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, size):
        ctx.scatter_dim, ctx.gather_dim, ctx.group, ctx.size = scatter_dim, gather_dim, group, size
        return _all_to_all(x, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group, ctx.size), None, None, None, None


def seq_all_to_all(x: torch.Tensor, scatter_idx: int, gather_idx: int, group=None) -> torch.Tensor:
    """Differentiable all-to-all over ``group``: ``x``'s dim ``scatter_idx`` is cut into the
    group's size blocks, rank r receiving block r, and dim ``gather_idx`` becomes the ranks' pieces
    concatenated in rank order. The identity in a group of one rank."""
    size = comm.get_world_size(group)
    if size == 1:
        return x
    for name, idx in (("scatter_idx", scatter_idx), ("gather_idx", gather_idx)):
        if not 0 <= idx < x.dim():
            raise ValueError(f"{name}={idx} is not a dim of a {x.dim()}-d tensor")
    if scatter_idx == gather_idx:
        raise ValueError(f"scatter_idx and gather_idx are both {scatter_idx}")
    if x.shape[scatter_idx] % size:
        raise ValueError(f"dim {scatter_idx} (scatter_idx) of size {x.shape[scatter_idx]} does not divide "
                         f"by the sequence-parallel group size {size}")
    return _SeqAllToAll.apply(x, scatter_idx, gather_idx, group, size)


class DistributedAttention(nn.Module):
    """``local_attention`` over the whole sequence for inputs split along the sequence over
    ``sequence_process_group`` (DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``).

    ``forward(query, key, value, *args, **kwargs)`` takes this rank's sequence chunk of q, k, v
    in the layout that ``scatter_idx``/``gather_idx`` name (see the module docstring: ``(2, 0)``
    ``[s/p, b, h, d]``, ``(2, 1)`` ``[b, s/p, h, d]``), calls ``local_attention(q, k, v, *args,
    **kwargs)`` on the whole sequence of this rank's ``h/p`` heads, and returns this rank's
    sequence chunk of the output with every head. ``sequence_process_group`` None means the
    default group (the world) when a process group is initialised.
    """

    def __init__(self, local_attention, sequence_process_group=None, scatter_idx: int = 2, gather_idx: int = 0):
        super().__init__()
        if not callable(local_attention):
            raise ValueError(f"local_attention must be callable, got {type(local_attention).__name__}")
        if scatter_idx != 2:
            raise ValueError(f"scatter_idx={scatter_idx} is not supported: the heads' dim must be 2 "
                             f"(layouts: {', '.join(f'{k}: {v}' for k, v in LAYOUTS.items())})")
        if (scatter_idx, gather_idx) not in LAYOUTS:
            raise ValueError(f"gather_idx={gather_idx} is not supported: the sequence's dim must be 0 "
                             f"{LAYOUTS[(2, 0)]} or 1 {LAYOUTS[(2, 1)]}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx

    def _kv_repeats(self, heads: int, kv_heads: int, size: int, name: str) -> int:
        """How many times each of ``name``'s heads is repeated before the exchange (1: none)."""
        if kv_heads == heads or kv_heads % size == 0:
            if heads % kv_heads:
                raise ValueError(f"{name} has {kv_heads} heads, which do not divide the query's {heads}")
            return 1
        if heads % kv_heads == 0 and size % kv_heads == 0:
            return size // kv_heads
        raise ValueError(f"{name} has {kv_heads} heads: neither a multiple nor a divisor of the "
                         f"sequence-parallel group size {size} (query heads: {heads})")

    def _check(self, query, key, value, size: int) -> tuple[int, int]:
        """Validate the inputs' shapes; the repeats of key's and value's heads."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a 4-d tensor {LAYOUTS[(self.scatter_idx, self.gather_idx)]}, "
                                 f"got {shape}")
        batch_dim = 1 - self.gather_idx
        for name, t in (("key", key), ("value", value)):
            for dim, what in ((self.gather_idx, "sequence length"), (batch_dim, "batch size")):
                if t.shape[dim] != query.shape[dim]:
                    raise ValueError(f"{name}'s {what} {t.shape[dim]} (dim {dim}) differs from query's "
                                     f"{query.shape[dim]}")
        if key.shape[2] != value.shape[2]:
            raise ValueError(f"key has {key.shape[2]} heads and value {value.shape[2]}: they must match")
        heads = query.shape[2]
        if heads % size:
            raise ValueError(f"query has {heads} heads, which do not divide by the sequence-parallel "
                             f"group size {size}")
        return (self._kv_repeats(heads, key.shape[2], size, "key"),
                self._kv_repeats(heads, value.shape[2], size, "value"))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        size = comm.get_world_size(self.spg)
        key_repeats, value_repeats = self._check(query, key, value, size)
        if size == 1:
            return self.local_attn(query, key, value, *args, **kwargs)
        if key_repeats > 1:
            key = key.repeat_interleave(key_repeats, dim=2)
        if value_repeats > 1:
            value = value.repeat_interleave(value_repeats, dim=2)
        s, g = self.scatter_idx, self.gather_idx
        if query.dtype == key.dtype == value.dtype:
            q, k, v = _PackedAllToAll.apply(s, g, self.spg, size, query, key, value)
        else:
            q, k, v = (_SeqAllToAll.apply(t, s, g, self.spg, size) for t in (query, key, value))
        out = self.local_attn(q, k, v, *args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"local_attention must return one tensor, got {type(out).__name__}")
        return _SeqAllToAll.apply(out, g, s, self.spg, size)


# ---------------------------------------------------------------------------------------------
# Groups, the batch's split and the loss over the split.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceParallelGroups:
    """The groups of one ``sequence_parallel_size`` as seen from this rank.

    ``group``: the ``size`` ranks this rank's sequence is split over (``rank`` is its place
    there); ``data_parallel_group``: the ``data_parallel_size`` ranks with this rank's sequence
    chunk of other batches (``data_parallel_rank`` its place there); ``seq_data_parallel_group``:
    every rank holding the same replica of the weights (None: the world), over which gradients
    are reduced. With ``size`` 1 every group is None (the world, or no process group)."""

    size: int
    rank: int
    group: object
    data_parallel_size: int
    data_parallel_rank: int
    data_parallel_group: object
    seq_data_parallel_group: object = None

    def ranks(self) -> list[int]:
        """The global ranks of :attr:`group`, in group order."""
        if self.size == 1:
            return [comm.get_rank()]
        return [comm.get_global_rank(self.group, r) for r in range(self.size)]


_groups: dict[int, SequenceParallelGroups] = {}


def initialize_sequence_parallel(sequence_parallel_size: int) -> SequenceParallelGroups:
    """The sequence- and data-parallel groups of ``world = dp x sequence_parallel_size`` ranks
    (module docstring), created on the first call for a size (every rank must make that call, in
    the same order as its other group creations) and returned as they are on the next ones.
    ValueError naming ``sequence_parallel_size`` when it is not a positive int dividing the
    world, or is > 1 without a process group."""
    size = sequence_parallel_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"sequence_parallel_size must be a positive int, got {size!r}")
    if size in _groups:
        return _groups[size]
    world, rank = comm.get_world_size(), comm.get_rank()
    if size == 1:
        groups = SequenceParallelGroups(1, 0, None, world, rank, None)
    else:
        if not comm.is_initialized():
            raise ValueError(f"sequence_parallel_size={size} needs a process group of a multiple of {size} "
                             "ranks: start the script with torchrun or dslab launch (no process group is "
                             "initialised)")
        if world % size:
            raise ValueError(f"sequence_parallel_size={size} does not divide the world size {world}: the "
                             f"world is data-parallel x sequence-parallel ranks")
        grid = ProcessTopology(["data", "sequence"], [world // size, size])
        mine = {}
        for axis in ("sequence", "data"):  # every rank creates every group, in one order
            for ranks in grid.get_axis_comm_lists(axis):
                made = comm.new_group(ranks)
                if rank in ranks:
                    mine[axis] = made
        coord = grid.get_coord(rank)
        groups = SequenceParallelGroups(size, coord.sequence, mine["sequence"], world // size, coord.data,
                                        mine["data"])
    _groups[size] = groups
    return groups


def _split(tensor: torch.Tensor, sp_rank: int, sp_size: int, dim: int, where: str) -> torch.Tensor:
    if tensor.dim() <= dim:
        raise ValueError(f"{where} has shape {tuple(tensor.shape)}: no dim {dim} to split the sequence along")
    length = tensor.shape[dim]
    if length % sp_size:
        raise ValueError(f"{where} has sequence length {length} (dim {dim}), which does not divide by the "
                         f"sequence-parallel size {sp_size}")
    chunk = length // sp_size
    return tensor.narrow(dim, sp_rank * chunk, chunk)


def split_sequence(batch, sp_rank: int, sp_size: int, dim: int = 1):
    """Rank ``sp_rank``'s contiguous chunk (positions ``[r s/p, (r + 1) s/p)``) along ``dim`` of
    every tensor in ``batch`` (a tensor, or dicts, lists and tuples of them, nested; other values
    pass through). Chunks are views. A model that takes chunks needs its labels shifted for the
    next-token loss *before* the split, or the last position of each chunk loses its target
    (dslab's GPT-2 and Llama take the whole batch and split it themselves). ValueError naming the
    batch entry whose length does not divide by ``sp_size``."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive int, got {sp_size!r}")
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} is not a rank of a sequence-parallel group of {sp_size}")

    def walk(item, where: str):
        if isinstance(item, torch.Tensor):
            return _split(item, sp_rank, sp_size, dim, where)
        if isinstance(item, dict):
            return type(item)((k, walk(v, f"{where}[{k!r}]")) for k, v in item.items())
        if isinstance(item, (list, tuple)):
            parts = [walk(v, f"{where}[{i}]") for i, v in enumerate(item)]
            return type(item)(*parts) if hasattr(item, "_fields") else type(item)(parts)
        return item

    return walk(batch, "batch")


def sequence_mean_loss(chunk_loss: torch.Tensor, chunk_targets: torch.Tensor, group=None,
                       ignore_index: int = -100) -> torch.Tensor:
    """The mean loss over the whole sequence of every rank of ``group``, from this rank's mean
    ``chunk_loss`` over the targets of its chunk that are not ``ignore_index``: each rank's sum
    (mean x count), all-reduced, over the all-reduced count. Every rank returns the same value;
    the backward is the identity through the sum, so a rank's gradients are its chunk's share
    and their sum over the group is the unsplit loss's gradient. A chunk without targets makes
    its mean (and so the result) NaN."""
    count = (chunk_targets != ignore_index).sum().to(chunk_loss.dtype)
    total = reduce_from_tensor_parallel_region(chunk_loss * count, group)
    all_counts = count.clone()  # count itself is saved for the product's backward
    comm.all_reduce(all_counts, group=group)
    return total / all_counts
