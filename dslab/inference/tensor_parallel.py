"""Tensor-parallel slicing of a transformer layer (Megatron-LM's scheme, Shoeybi et al. 2019, §3).

With ``tp_size`` ranks, rank ``r`` keeps

- heads ``r * H / tp .. (r + 1) * H / tp - 1``: the matching rows of each of the q, k and v blocks
  of the fused QKV weight and bias (column-parallel), and the matching input columns of the
  attention output projection (row-parallel);
- MLP columns ``r * I / tp ..``: rows of the first MLP weight and bias (column-parallel) and the
  matching input columns of the second (row-parallel).

Grouped-query attention (the Llama layout: ``H`` query heads share ``Hkv`` key/value heads, query
head ``h`` reading key/value head ``h // (H / Hkv)``) slices the q block by query heads and the k
and v blocks by key/value heads, ``r * Hkv / tp ..``: with ``Hkv`` divisible by ``tp``, a rank's
``H / tp`` query heads are exactly those that read its ``Hkv / tp`` key/value heads, so attention
needs nothing from another rank, and each rank's KV cache holds its ``Hkv / tp`` heads. The fused
gate/up weight ``[2 I, hidden]`` keeps the rank's rows of the gate block, then of the up block
(:func:`stacked_rows`), so that SwiGLU pairs the same columns on every rank.

Each row-parallel product is a partial sum; an ``all_reduce`` over the tensor-parallel group (through
:mod:`dslab.comm`, where the comms logger sees it) completes it, two per layer per forward. The
row-parallel biases are added by rank 0 only, so the sum holds them once. Embeddings, norms and
the heads stay whole on every rank (each rank computes the full logits).

Groups are blocks of consecutive ranks (``[0, tp)``, ``[tp, 2 tp)``, ...); every rank creates
every group, as ``torch.distributed.new_group`` requires. With ``tp_size`` equal to the world the
group is the world.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dslab import comm


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group."""

    size: int = 1
    rank: int = 0
    group: object = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` in place over the group (nothing when ``size`` is 1); returns ``t``."""
        if self.size > 1:
            comm.all_reduce(t, group=self.group)
        return t


def tensor_parallel_group(tp_size: int) -> TensorParallel:
    """This rank's tensor-parallel group of ``tp_size`` ranks; ValueError naming
    ``tensor_parallel.tp_size`` when the world cannot hold it."""
    if tp_size == 1:
        return TensorParallel()
    if not comm.is_initialized():
        raise ValueError(f"tensor_parallel.tp_size={tp_size} needs a process group of {tp_size} or a multiple "
                         f"of it: start the script with torchrun / dslab launch (no process group is initialised)")
    world, rank = comm.get_world_size(), comm.get_rank()
    if world % tp_size:
        raise ValueError(f"tensor_parallel.tp_size={tp_size} does not divide the world size {world}")
    if world == tp_size:
        return TensorParallel(tp_size, rank, None)
    mine = None
    for start in range(0, world, tp_size):
        group = comm.new_group(list(range(start, start + tp_size)))
        if start <= rank < start + tp_size:
            mine = group
    return TensorParallel(tp_size, rank % tp_size, mine)


def check_divisible(heads: int, intermediate: int, tp_size: int, kv_heads: int | None = None) -> None:
    """ValueError naming ``tensor_parallel.tp_size`` when it does not split the heads, the
    key/value heads (grouped-query attention; None: one per head) and the MLP columns."""
    if heads % tp_size:
        raise ValueError(f"tensor_parallel.tp_size={tp_size} does not divide the model's {heads} attention heads")
    if kv_heads is not None and kv_heads % tp_size:
        raise ValueError(f"tensor_parallel.tp_size={tp_size} does not divide the model's {kv_heads} key/value heads "
                         f"(grouped-query attention: each rank keeps whole key/value heads and the query heads "
                         f"that read them)")
    if intermediate % tp_size:
        raise ValueError(f"tensor_parallel.tp_size={tp_size} does not divide the model's MLP width {intermediate}")


def stacked_rows(t: torch.Tensor | None, tp: TensorParallel, sizes: tuple[int, ...]) -> torch.Tensor | None:
    """This rank's rows of each block of ``t``'s first dimension (blocks of ``sizes`` rows, in
    order), concatenated: a fused column-parallel weight or bias (None stays None)."""
    if t is None or tp.size == 1:
        return t
    return torch.cat([rows(block, tp) for block in t.split(list(sizes), dim=0)])


def qkv_shard(weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel,
              sizes: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's rows of a fused QKV weight and its bias: its heads' rows of the q block, then
    of the k block, then of the v block. ``sizes`` are the blocks' rows (default three equal
    blocks, ``[3 * hidden, hidden]``; grouped-query attention: ``(H * D, Hkv * D, Hkv * D)``)."""
    sizes = sizes or (weight.shape[0] // 3,) * 3
    return stacked_rows(weight, tp, sizes), stacked_rows(bias, tp, sizes)


def rows(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's contiguous block of ``t``'s first dimension (column-parallel weights, biases)."""
    if tp.size == 1:
        return t
    n = t.shape[0] // tp.size
    return t[tp.rank * n:(tp.rank + 1) * n]


def columns(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's contiguous block of ``t``'s last dimension (row-parallel weights)."""
    if tp.size == 1:
        return t
    n = t.shape[-1] // tp.size
    return t[..., tp.rank * n:(tp.rank + 1) * n]


def row_parallel_bias(bias: torch.Tensor | None, tp: TensorParallel) -> torch.Tensor | None:
    """The bias a row-parallel layer adds on this rank: all of it on rank 0, none elsewhere."""
    return bias if tp.rank == 0 else None
