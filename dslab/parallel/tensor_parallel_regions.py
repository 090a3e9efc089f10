"""The autograd regions of tensor parallelism (Megatron-LM's ``mappings.py``): functions that
are a collective one way and its adjoint the other, so that autograd moves gradients across the
tensor-parallel group exactly where the forward moved activations; plus the slicing of whole
tensors into the shards each rank holds.

- :func:`copy_to_tensor_parallel_region`: identity; backward all-reduce.
- :func:`reduce_from_tensor_parallel_region`: all-reduce; backward identity.
- :func:`scatter_to_tensor_parallel_region`: this rank's block of the last dim; backward all-gather.
- :func:`gather_from_tensor_parallel_region`: all-gather along the last dim; backward this rank's block.
- :func:`scatter_to_sequence_parallel_region`: this rank's block of the sequence; backward all-gather.
- :func:`gather_from_sequence_parallel_region`: all-gather along the sequence; backward
  reduce-scatter (or this rank's block, when every rank holds the whole gradient).
- :func:`reduce_scatter_to_sequence_parallel_region`: reduce-scatter along the sequence; backward
  all-gather.

Layout: activations are ``[batch, seq, hidden]`` throughout dslab, so the sequence dimension is
:data:`SEQUENCE_DIM` = 1 (Megatron-LM keeps ``[seq, batch, hidden]`` and works on dim 0). The flat
collectives of :mod:`dslab.comm` gather and scatter rank blocks along dim 0, so a gather along
another dimension costs one extra copy of the result (concatenating the ranks' blocks) and a
reduce-scatter one extra copy of the input (laying the blocks one after the other).

Groups: ``group=None`` means the default group (the world) when a process group is initialised.
Without a process group (a single process), or in a group of one rank, every region returns its
input: the tensor-parallel size is 1. Every collective goes through :mod:`dslab.comm`.
"""

from __future__ import annotations

import torch

from dslab import comm

SEQUENCE_DIM = 1


def tensor_parallel_world_size(group=None) -> int:
    """Ranks in the tensor-parallel ``group`` (1 without a process group)."""
    return comm.get_world_size(group)


def tensor_parallel_rank(group=None) -> int:
    """This process's rank within ``group`` (0 without a process group)."""
    return comm.get_rank(group)


def divide(numerator: int, size: int, what: str) -> int:
    """``numerator // size``; ValueError naming ``what`` unless ``size`` divides it."""
    if numerator % size:
        raise ValueError(f"{what}={numerator} does not divide by the tensor-parallel size {size}")
    return numerator // size


# ---------------------------------------------------------------------------------------------
# Slicing whole tensors into shards and back (local, no communication).
# ---------------------------------------------------------------------------------------------


def shard_tensor(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim`` (a contiguous copy): ``full`` is cut into
    ``stride`` equal blocks along ``dim``, each block into ``size`` equal pieces, and the shard is
    this rank's piece of every block, concatenated. ``stride`` 3 on a packed ``[3*H, H]`` q/k/v
    weight gives ``[q rows of rank r; k rows of rank r; v rows of rank r]``."""
    length = full.shape[dim]
    if length % (stride * size):
        raise ValueError(f"dimension {dim} of size {length} does not split into {stride} blocks "
                         f"of {size} tensor-parallel pieces")
    blocks = full.chunk(stride, dim)
    return torch.cat([block.chunk(size, dim)[rank] for block in blocks], dim).contiguous()


def unshard_tensors(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's shard (rank order): the inverse of :func:`shard_tensor`."""
    per_rank = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([torch.cat([blocks[j] for blocks in per_rank], dim) for j in range(stride)], dim)


# ---------------------------------------------------------------------------------------------
# Collectives along a dimension (the flat ones work on dim 0).
# ---------------------------------------------------------------------------------------------


def _start_all_gather(x: torch.Tensor, group, size: int):
    """Issue an async all-gather of ``x`` (rank blocks along dim 0 of the result); returns
    ``(buffer, work)`` for :func:`_finish_all_gather`."""
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    return out, comm.all_gather_into_tensor(out, x, group=group, async_op=True)


def _finish_all_gather(out: torch.Tensor, work, dim: int, size: int) -> torch.Tensor:
    if work is not None:
        work.wait()
    return out if dim == 0 else torch.cat(out.chunk(size, 0), dim)


def all_gather_along(x: torch.Tensor, dim: int, group=None, size: int | None = None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (no autograd). ``size``: the
    group's, when the caller knows it."""
    size = size or tensor_parallel_world_size(group)
    dim = dim % x.dim()
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    comm.all_gather_into_tensor(out, x, group=group)
    return out if dim == 0 else torch.cat(out.chunk(size, 0), dim)


def _stack_rank_blocks(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` cut into ``size`` blocks along ``dim`` and laid one after the other along dim 0 (the
    input layout of a flat reduce-scatter)."""
    divide(x.shape[dim], size, f"dimension {dim} of a {tuple(x.shape)} tensor")
    return x.contiguous() if dim == 0 else torch.cat(x.chunk(size, dim), 0)


def reduce_scatter_along(x: torch.Tensor, dim: int, group=None, size: int | None = None) -> torch.Tensor:
    """The sum over ranks of ``x``, of which this rank keeps its block along ``dim`` (no autograd)."""
    size = size or tensor_parallel_world_size(group)
    dim = dim % x.dim()
    stacked = _stack_rank_blocks(x, dim, size)
    shape = list(x.shape)
    shape[dim] //= size
    out = x.new_empty(shape)
    comm.reduce_scatter_tensor(out, stacked, group=group)
    return out


def split_along(x: torch.Tensor, dim: int, group=None, size: int | None = None) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (a contiguous copy; no autograd)."""
    size = size or tensor_parallel_world_size(group)
    divide(x.shape[dim], size, f"dimension {dim % x.dim()} of a {tuple(x.shape)} tensor")
    return x.chunk(size, dim)[tensor_parallel_rank(group)].contiguous()


def _fresh(grad: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with ``grad``'s values that nothing else reads (autograd may hand the
    same gradient tensor to several consumers, so it is never reduced in place)."""
    out = grad.contiguous()
    return out.clone() if out is grad else out


# ---------------------------------------------------------------------------------------------
# Autograd regions.
# ---------------------------------------------------------------------------------------------


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = _fresh(grad)
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, in_place):
        if in_place:
            ctx.mark_dirty(x)
        else:
            x = x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterAlong(torch.autograd.Function):
    """Forward: this rank's block along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x, dim, group, size):
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return split_along(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group, ctx.size), None, None, None


class _GatherAlong(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: reduce-scatter along ``dim`` when
    ``reduce_grad`` (the consumer's gradient is a partial sum per rank), else this rank's block."""

    @staticmethod
    def forward(ctx, x, dim, group, size, reduce_grad):
        ctx.dim, ctx.group, ctx.size, ctx.reduce_grad = dim, group, size, reduce_grad
        return all_gather_along(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return reduce_scatter_along(grad, ctx.dim, ctx.group, ctx.size), None, None, None, None
        return split_along(grad, ctx.dim, ctx.group, ctx.size), None, None, None, None


class _ReduceScatterAlong(torch.autograd.Function):
    """Forward: sum over ranks, keep this rank's block along ``dim``; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, dim, group, size):
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return reduce_scatter_along(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group, ctx.size), None, None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over ``group``: the entry of a
    replicated activation into rank-local work whose input gradients are partial sums."""
    if tensor_parallel_world_size(group) == 1:
        return x
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group=None, in_place: bool = False) -> torch.Tensor:
    """All-reduce forward (the sum of the ranks' partial results); identity backward.
    ``in_place``: reduce ``x``'s own storage instead of a copy, for a fresh tensor nothing else
    reads (a matmul's output)."""
    if tensor_parallel_world_size(group) == 1:
        return x
    return _ReduceFromTensorParallel.apply(x, group, in_place)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of the last dimension (which must divide by the group's size);
    backward all-gathers the gradient along it."""
    size = tensor_parallel_world_size(group)
    return x if size == 1 else _ScatterAlong.apply(x, -1, group, size)


def gather_from_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dimension; backward keeps this rank's
    block of the gradient."""
    size = tensor_parallel_world_size(group)
    return x if size == 1 else _GatherAlong.apply(x, -1, group, size, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """``x [batch, seq, ...]`` -> this rank's ``[batch, seq/tp, ...]``; backward all-gathers the
    gradient along the sequence."""
    size = tensor_parallel_world_size(group)
    return x if size == 1 else _ScatterAlong.apply(x, SEQUENCE_DIM, group, size)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """``[batch, seq/tp, ...]`` shards -> ``[batch, seq, ...]`` on every rank. Backward
    reduce-scatters the gradient along the sequence when ``tensor_parallel_output_grad`` (the
    consumer is rank-local work, so each rank's gradient is a partial sum), else keeps this
    rank's block (every rank holds the whole gradient)."""
    size = tensor_parallel_world_size(group)
    if size == 1:
        return x
    return _GatherAlong.apply(x, SEQUENCE_DIM, group, size, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Partial sums ``[batch, seq, ...]`` -> this rank's block ``[batch, seq/tp, ...]`` of their
    sum; backward all-gathers the gradient along the sequence."""
    size = tensor_parallel_world_size(group)
    return x if size == 1 else _ReduceScatterAlong.apply(x, SEQUENCE_DIM, group, size)
