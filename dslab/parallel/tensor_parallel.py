"""Megatron-LM's tensor parallelism for training: the column- and row-parallel linear layers and
the bookkeeping a training loop needs for their parameters (Shoeybi et al. 2019, "Megatron-LM",
§3; sequence parallelism: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4.2.2). The autograd regions these layers are built on are in
:mod:`dslab.parallel.tensor_parallel_regions`, the vocabulary-parallel embedding and
cross-entropy in :mod:`dslab.parallel.vocab_parallel`.

A group of ``tp`` ranks splits each weight matrix ``W [out, in]`` of an MLP or attention block:

- column-parallel (:class:`ColumnParallelLinear`): rank ``r`` holds rows ``W[r*out/tp:(r+1)*out/tp]``
  and computes its columns of ``y = x W^T`` from the whole input; the input's gradient is a
  partial sum over the ranks, all-reduced in the backward (overlapped with the weight-gradient
  matmul);
- row-parallel (:class:`RowParallelLinear`): rank ``r`` holds columns ``W[:, r*in/tp:...]`` and
  its slice of the input (a column-parallel layer's output), so its product is a partial sum,
  all-reduced in the forward; the bias is added once, after the sum.

A column-parallel layer followed by a row-parallel one (an MLP; attention's qkv projection and
output projection, with each rank owning whole heads) costs one all-reduce of
``[batch, seq, hidden]`` in the forward and one in the backward.

Sequence parallelism (``sequence_parallel=True``) keeps the activations between those pairs (layer
norms, dropout, residual adds) split along the sequence, so each rank stores ``1/tp`` of them: the
column-parallel layer all-gathers its input along the sequence (its backward reduce-scatters the
input's gradient, and gathers the input again for the weight gradient rather than keeping it)
and the row-parallel layer reduce-scatters its output along the sequence instead of all-reducing
it (its backward all-gathers the gradient). The bytes moved are an all-reduce's. The sequence is
dim 1 of ``[batch, seq, hidden]`` (:data:`~dslab.parallel.tensor_parallel_regions.SEQUENCE_DIM`).

Groups: ``group=None`` means the default group (the world) when a process group is initialised.
Without a process group (a single process) the tensor-parallel size is 1 and every layer is its
dense counterpart.

Every collective goes through :mod:`dslab.comm`, where the comms logger sees it.

Parameter attributes (Megatron's names), set on every parameter of these layers; a parameter
without them is replicated:

- ``tensor_model_parallel`` (bool): True for a shard, False for a parameter every rank holds
  whole (a row-parallel bias);
- ``partition_dim`` (int): the dimension a shard is cut along (-1 when replicated);
- ``partition_stride`` (int): how many blocks the whole tensor is made of along that dimension,
  each cut into ``tp`` pieces separately (3 for a packed q/k/v projection: rank ``r`` holds its
  heads' rows of q, then of k, then of v; :func:`shard_tensor`);
- ``sequence_parallel`` (bool, only where True): a replicated parameter used on sequence shards,
  whose gradient on each rank is a partial sum over its shard: :func:`allreduce_sequence_parallel_grads`
  sums them over the tensor-parallel group after the backward.

What a training loop (or the engine) must do with them: step every rank's local parameters with
an ordinary optimizer; without sequence parallelism the replicated parameters' gradients are
already equal across the tensor-parallel group (every rank computed them from the same
activations), with it call :func:`allreduce_sequence_parallel_grads` first; data-parallel
reduction runs over the data-parallel group only (never over ranks of one tensor-parallel group,
which hold different shards); a gradient norm sums the shards' squares over the tensor-parallel
group and counts replicated parameters once (:func:`tensor_parallel_grad_norm_sq`).

Initialisation: each layer draws its whole weight on every rank from torch's generator and keeps
its shard, so that ranks seeded alike start from the slices of one dense layer: a tp=2 layer
starts equal to the tp=1 layer built after the same ``torch.manual_seed`` (the whole weight is
held for a moment on every rank). The default draws as ``nn.Linear`` does (Kaiming-uniform weight,
bias uniform in ``±1/sqrt(in_features)``); with ``init_method`` the weight is drawn by it and the
bias is zero (Megatron's choice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab import comm
from dslab.parallel.tensor_parallel_regions import (
    SEQUENCE_DIM, _finish_all_gather, _stack_rank_blocks, _start_all_gather, all_gather_along, divide,
    gather_from_tensor_parallel_region, reduce_scatter_along, scatter_to_tensor_parallel_region, shard_tensor,
    tensor_parallel_rank, tensor_parallel_world_size, unshard_tensors,
)

# from_dense builds its layer with this in place of an init_method: the weights are copied in.
_NO_INIT = object()


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int = -1,
                                         stride: int = 1) -> None:
    """Mark ``param`` as a shard cut along ``dim`` (``is_parallel``) or as replicated (module
    docstring)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim if is_parallel else -1
    param.partition_stride = stride if is_parallel else 1


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for a shard of a tensor-parallel layer's weight."""
    return bool(getattr(param, "tensor_model_parallel", False))


def mark_sequence_parallel(param: torch.Tensor) -> None:
    """Mark a replicated ``param`` whose gradient is a partial sum over a sequence shard."""
    param.sequence_parallel = True


# ---------------------------------------------------------------------------------------------
# The two matmuls, each one autograd function with its collective inside.
# ---------------------------------------------------------------------------------------------


def _linear_grads(ctx, grad: torch.Tensor, total_input: torch.Tensor, weight_: torch.Tensor):
    """The weight's and bias's gradients of ``y = x W^T + b`` (None where not needed)."""
    flat = grad.reshape(-1, grad.shape[-1])
    grad_weight = grad_bias = None
    if ctx.needs_input_grad[1]:
        grad_weight = flat.t().matmul(total_input.reshape(-1, total_input.shape[-1])).to(weight_.dtype)
    if getattr(ctx, "bias_dtype", None) is not None and ctx.needs_input_grad[2]:
        grad_bias = flat.sum(0).to(ctx.bias_dtype)
    return grad_weight, grad_bias


class _ColumnParallelMatmul(torch.autograd.Function):
    """``y = x W^T + b`` with ``W`` this rank's rows. Forward: with sequence parallelism the
    input shard is all-gathered along the sequence first. Backward: the input's gradient (a
    partial sum) is all-reduced, or reduce-scattered along the sequence, while the weight's
    gradient is computed; with sequence parallelism the input is gathered again for it (only the
    shard is kept between forward and backward)."""

    @staticmethod
    def forward(ctx, input, weight_, bias, group, size, sequence_parallel):
        total = all_gather_along(input, SEQUENCE_DIM, group, size) if sequence_parallel else input
        out = F.linear(total, weight_, bias)  # under autocast: in the autocast dtype
        ctx.save_for_backward(input.to(out.dtype), weight_)
        ctx.group, ctx.size, ctx.sequence_parallel = group, size, sequence_parallel
        ctx.input_dtype = input.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        input, weight_ = ctx.saved_tensors
        group, size, sequence_parallel = ctx.group, ctx.size, ctx.sequence_parallel
        grad = grad.contiguous()
        pending_gather = None
        if sequence_parallel and ctx.needs_input_grad[1]:
            pending_gather = _start_all_gather(input.movedim(SEQUENCE_DIM, 0), group, size)
        grad_input = work = None
        if ctx.needs_input_grad[0]:
            grad_input = grad.matmul(weight_.to(grad.dtype))
            if sequence_parallel:
                stacked = _stack_rank_blocks(grad_input, SEQUENCE_DIM, size)
                shape = list(grad_input.shape)
                shape[SEQUENCE_DIM] //= size
                grad_input = grad_input.new_empty(shape)
                work = comm.reduce_scatter_tensor(grad_input, stacked, group=group, async_op=True)
            else:
                work = comm.all_reduce(grad_input, group=group, async_op=True)
        total = input
        if pending_gather is not None:
            total = _finish_all_gather(*pending_gather, 0, size).movedim(0, SEQUENCE_DIM)
        grad_weight, grad_bias = _linear_grads(ctx, grad, total, weight_)
        if work is not None:
            work.wait()
        if grad_input is not None:
            grad_input = grad_input.to(ctx.input_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None


class _RowParallelMatmul(torch.autograd.Function):
    """``y = sum over ranks of x_r W_r^T`` with ``W_r`` this rank's columns: the partial product
    is all-reduced in place (with sequence parallelism, reduce-scattered along the sequence); the
    backward is a plain linear's, after all-gathering the gradient along the sequence with
    sequence parallelism."""

    @staticmethod
    def forward(ctx, input, weight_, group, size, sequence_parallel):
        partial = F.linear(input, weight_)
        if sequence_parallel:
            out = reduce_scatter_along(partial, SEQUENCE_DIM, group, size)
        else:
            comm.all_reduce(partial, group=group)
            out = partial
        ctx.save_for_backward(input.to(partial.dtype), weight_)
        ctx.group, ctx.size, ctx.sequence_parallel = group, size, sequence_parallel
        ctx.input_dtype = input.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        input, weight_ = ctx.saved_tensors
        if ctx.sequence_parallel:
            grad = all_gather_along(grad, SEQUENCE_DIM, ctx.group, ctx.size)
        grad = grad.contiguous()
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grad.matmul(weight_.to(grad.dtype)).to(ctx.input_dtype)
        grad_weight, _ = _linear_grads(ctx, grad, input, weight_)
        return grad_input, grad_weight, None, None, None


def column_parallel_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           group=None, gather_output: bool = False,
                           sequence_parallel: bool = False) -> torch.Tensor:
    """``x W^T + b`` with ``weight [out/tp, in]`` and ``bias [out/tp]`` this rank's rows.

    ``input``: ``[..., in]`` whole on every rank, or with ``sequence_parallel`` this rank's
    sequence shard ``[batch, seq/tp, in]``. Returns this rank's columns ``[..., out/tp]`` (over
    the whole sequence), or all of them ``[..., out]`` with ``gather_output``."""
    size = tensor_parallel_world_size(group)
    if size == 1:
        return F.linear(input, weight, bias)
    out = _ColumnParallelMatmul.apply(input, weight, bias, group, size, sequence_parallel)
    return gather_from_tensor_parallel_region(out, group) if gather_output else out


def row_parallel_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        group=None, input_is_parallel: bool = True,
                        sequence_parallel: bool = False) -> torch.Tensor:
    """``x W^T + b`` with ``weight [out, in/tp]`` this rank's columns and ``bias [out]`` whole.

    ``input``: this rank's ``[..., in/tp]`` (a column-parallel output), or the whole ``[..., in]``
    when not ``input_is_parallel`` (this rank's block is taken). Returns the whole ``[..., out]``
    on every rank, or with ``sequence_parallel`` this rank's sequence shard
    ``[batch, seq/tp, out]``; the bias is added after the sum, once."""
    size = tensor_parallel_world_size(group)
    if size == 1:
        return F.linear(input, weight, bias)
    if not input_is_parallel:
        if sequence_parallel:
            raise ValueError("a row-parallel layer with sequence_parallel takes its input already split "
                             "(input_is_parallel=True)")
        input = scatter_to_tensor_parallel_region(input, group)
    out = _RowParallelMatmul.apply(input, weight, group, size, sequence_parallel)
    return out if bias is None else out + bias.to(out.dtype)


# ---------------------------------------------------------------------------------------------
# Layers.
# ---------------------------------------------------------------------------------------------


def _draw_linear(out_features: int, in_features: int, bias: bool, init_method, like: torch.Tensor):
    """The whole ``[out, in]`` weight and ``[out]`` bias (or None) drawn as the module docstring
    says, on ``like``'s device and dtype."""
    weight_ = torch.empty(out_features, in_features, dtype=like.dtype, device=like.device)
    full_bias = torch.empty(out_features, dtype=like.dtype, device=like.device) if bias else None
    if init_method is None:  # nn.Linear.reset_parameters, draw for draw
        nn.init.kaiming_uniform_(weight_, a=math.sqrt(5))
        if full_bias is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(full_bias, -bound, bound)
    else:
        init_method(weight_)
        if full_bias is not None:
            full_bias.zero_()
    return weight_, full_bias


class _ParallelLinear(nn.Module):
    """What the column- and row-parallel layers share: the group, the shard layout of the
    weight, drawing the whole weight and keeping the shard."""

    partition_dim: int

    def __init__(self, in_features: int, out_features: int, bias: bool, group, sequence_parallel: bool,
                 partition_stride: int, bias_is_parallel: bool, dtype, device):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group = group
        self.tp_size, self.tp_rank = tensor_parallel_world_size(group), tensor_parallel_rank(group)
        self.sequence_parallel = sequence_parallel
        self.partition_stride = partition_stride
        if sequence_parallel and self.tp_size == 1:
            raise ValueError("sequence_parallel needs a tensor-parallel group of more than one rank")
        split = out_features if self.partition_dim == 0 else in_features
        name = "out_features" if self.partition_dim == 0 else "in_features"
        if partition_stride == 1:
            divide(split, self.tp_size, name)
        elif split % (self.tp_size * partition_stride):
            raise ValueError(f"{name}={split} does not split into {partition_stride} blocks of "
                             f"{self.tp_size} tensor-parallel pieces (partition_stride={partition_stride})")
        shape = [out_features, in_features]
        shape[self.partition_dim] //= self.tp_size
        factory = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        set_tensor_model_parallel_attributes(self.weight, True, self.partition_dim, partition_stride)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // self.tp_size if bias_is_parallel else out_features,
                                                 **factory))
            set_tensor_model_parallel_attributes(self.bias, bias_is_parallel, 0, partition_stride)
            if sequence_parallel and not bias_is_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)
        self._bias_is_parallel = bias_is_parallel

    def reset_parameters(self, init_method: Callable[[torch.Tensor], object] | None = None) -> None:
        """Draw the whole ``[out, in]`` weight (and bias) with ``init_method`` (None: as
        ``nn.Linear``; see the module docstring) and keep this rank's shard."""
        if self.weight.device.type == "meta":
            return
        with torch.no_grad():
            full_weight, full_bias = _draw_linear(self.out_features, self.in_features, self.bias is not None,
                                                  init_method, self.weight)
            self._load_whole(full_weight, full_bias)

    def _load_whole(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None) -> None:
        with torch.no_grad():
            self.weight.copy_(shard_tensor(full_weight, self.partition_dim, self.tp_rank, self.tp_size,
                                           self.partition_stride))
            if self.bias is not None:
                if self._bias_is_parallel:
                    full_bias = shard_tensor(full_bias, 0, self.tp_rank, self.tp_size, self.partition_stride)
                self.bias.copy_(full_bias)

    @classmethod
    def _from_dense(cls, linear: nn.Linear, **kwargs):
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, init_method=_NO_INIT,
                    dtype=linear.weight.dtype, device=linear.weight.device, **kwargs)
        layer._load_whole(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp_size={self.tp_size}, tp_rank={self.tp_rank}, sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the output features split over the group: ``weight
    [out_features/tp, in_features]`` and ``bias [out_features/tp]`` are this rank's rows
    (``partition_dim`` 0). See :func:`column_parallel_linear` for the shapes in and out.

    ``partition_stride``: the output features are ``stride`` blocks each split separately
    (:func:`shard_tensor`), 3 for a packed q/k/v projection. ``init_method`` fills the whole
    weight in place (module docstring)."""

    partition_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None, sequence_parallel: bool = False, init_method=None, partition_stride: int = 1,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__(in_features, out_features, bias, group, sequence_parallel, partition_stride,
                         bias_is_parallel=True, dtype=dtype, device=device)
        self.gather_output = gather_output
        if init_method is not _NO_INIT:
            self.reset_parameters(init_method)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(input, self.weight, self.bias, self.group, self.gather_output,
                                      self.sequence_parallel)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, gather_output: bool = False, sequence_parallel: bool = False,
                   partition_stride: int = 1) -> ColumnParallelLinear:
        """This rank's rows of ``linear`` (its weight and bias are copied, ``linear`` is left alone)."""
        return cls._from_dense(linear, gather_output=gather_output, group=group,
                               sequence_parallel=sequence_parallel, partition_stride=partition_stride)


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the input features split over the group: ``weight
    [out_features, in_features/tp]`` is this rank's columns (``partition_dim`` 1), ``bias
    [out_features]`` is whole on every rank and added after the sum. See
    :func:`row_parallel_linear` for the shapes in and out."""

    partition_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None, sequence_parallel: bool = False, init_method=None, partition_stride: int = 1,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__(in_features, out_features, bias, group, sequence_parallel, partition_stride,
                         bias_is_parallel=False, dtype=dtype, device=device)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("a row-parallel layer with sequence_parallel takes its input already split "
                             "(input_is_parallel=True)")
        self.input_is_parallel = input_is_parallel
        if init_method is not _NO_INIT:
            self.reset_parameters(init_method)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(input, self.weight, self.bias, self.group, self.input_is_parallel,
                                   self.sequence_parallel)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True,
                   sequence_parallel: bool = False, partition_stride: int = 1) -> RowParallelLinear:
        """This rank's columns of ``linear`` and its whole bias (copied; ``linear`` is left alone)."""
        return cls._from_dense(linear, input_is_parallel=input_is_parallel, group=group,
                               sequence_parallel=sequence_parallel, partition_stride=partition_stride)


# ---------------------------------------------------------------------------------------------
# Gradients and state.
# ---------------------------------------------------------------------------------------------


def allreduce_sequence_parallel_grads(module: nn.Module, group=None) -> None:
    """Sum the gradients of ``module``'s parameters marked ``sequence_parallel`` over ``group``
    (one flat all-reduce per dtype and device), after the backward and before the optimizer step
    (and before any data-parallel reduction, which then sees whole gradients)."""
    if tensor_parallel_world_size(group) == 1:
        return
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def tensor_parallel_grad_norm_sq(params: Iterable[torch.Tensor], group=None) -> torch.Tensor:
    """The squared L2 norm (fp32, 0-dim) of the whole model's gradient from this rank's
    ``params``: the shards' squares summed over ``group`` (one all-reduce), the replicated
    parameters' counted once. Every rank of the group gets the same value."""
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float32, device=device)
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        square = p.grad.detach().float().pow(2).sum()
        if is_tensor_parallel(p):
            sharded += square
        else:
            replicated += square
    if tensor_parallel_world_size(group) > 1:
        comm.all_reduce(sharded, group=group)
    return sharded + replicated


def gather_tensor_parallel(shard: torch.Tensor, group=None, dim: int = 0, stride: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's ``shard`` (a collective over ``group``)."""
    size = tensor_parallel_world_size(group)
    if size == 1:
        return shard.detach().clone()
    gathered = all_gather_along(shard.detach(), 0, group, size)
    return unshard_tensors(list(gathered.chunk(size, 0)), dim, stride)


def gather_tensor_parallel_state_dict(module: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every tensor-parallel shard replaced by the whole tensor
    (gathered by its ``partition_dim`` and ``partition_stride``): the dense model's state dict, on
    every rank. A collective: every rank of ``group`` calls it."""
    state = module.state_dict()
    for name, param in module.named_parameters():
        if is_tensor_parallel(param) and name in state:
            state[name] = gather_tensor_parallel(param, group, param.partition_dim, param.partition_stride)
    return state
