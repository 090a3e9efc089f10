"""Data-parallel gradient averaging, bucketed and overlapped with backward.

Parameters are grouped into buckets of at most ``bucket_size`` elements, in reverse registration
order (roughly the order backward produces their gradients), one open bucket per (dtype, device,
reduction group): a model whose layers interleave bf16 weight copies and fp32 norms still gets
full buckets of each. A post-accumulate-grad hook marks a parameter ready; when a bucket is
complete its gradients are copied into one flat buffer (one concatenation kernel) and averaged by
an asynchronous all-reduce through :mod:`dslab.comm` while backward goes on (AVG in the
collective on nccl; on gloo the buffer is divided by the world size first).
Expert parameters (:mod:`expert_parallel`) are summed over their expert-data-parallel group
instead and divided by the data-parallel world size; a bucket holds the parameters of one
reduction group only.
Buckets are issued strictly in index order so every rank issues the same sequence of collectives.
:meth:`finish` issues any bucket still open (a parameter that got no gradient contributes zeros),
waits for the reductions and makes each ``param.grad`` a view of its slot in the bucket's buffer
(no copy back). A later backward that accumulates into such a view (``zero_grad(set_to_none=False)``)
leaves its gradient in place, and packing skips it.

Reduction happens only on the gradient-accumulation boundary; on other micro-steps gradients
accumulate locally, as with DDP's ``no_sync``.

The tensors given need not be the module's parameters: with bf16 weight copies
(:mod:`dslab.engine.weight_copies`) the engine passes each copied parameter's bf16 copy, whose
gradient the optimizer reads, so those gradients are averaged in bf16 (half the bytes of fp32;
DeepSpeed's bf16 mode reduces its bf16 gradients in bf16 as well).

``comm_dtype`` (DeepSpeed's ``communication_data_type``) reduces every bucket in that dtype
instead: a bucket of another dtype is cast after its division by the world size, reduced, and
cast back into its buffer (``"fp32"`` averages bf16 gradients without their rounding on the way;
``"bf16"`` halves an fp32 model's bytes).

``scaling`` (:class:`GradientScaling`, DeepSpeed's ``prescale_gradients`` and
``gradient_predivide_factor``) says where the division by the group's size happens. By default
the collective averages (AVG on nccl; on gloo the sum of buffers divided first). With
``prescale_gradients`` every bucket is divided by the group's size and then summed, as DeepSpeed's
prescale does; with a ``gradient_predivide_factor`` f it is divided by f, summed, and multiplied
by f / size after the collective, as DeepSpeed's default path does (f the size: the prescale).
The same average either way, rounded at different points: fp16 gradients of a large group can
overflow in a sum that was not divided first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from dslab import comm
from dslab.engine.expert_parallel import ReductionGroup, reduction_group


@dataclass(frozen=True)
class GradientScaling:
    """DeepSpeed's ``prescale_gradients`` and ``gradient_predivide_factor`` (module docstring)."""

    prescale: bool = False
    predivide: float = 1.0

    def plan(self, divisor: int, average_op) -> tuple[object, float | None, float | None]:
        """``(op, divide_before, multiply_after)`` for a reduction over ``divisor`` ranks whose
        collective can average with ``average_op`` (None: it cannot); None: no such scaling."""
        if self.prescale:
            return comm.ReduceOp.SUM, (divisor if divisor > 1 else None), None
        if self.predivide != 1.0:
            after = self.predivide / divisor
            return comm.ReduceOp.SUM, self.predivide, (None if after == 1.0 else after)
        if average_op is not None:
            return average_op, None, None
        return comm.ReduceOp.SUM, (divisor if divisor > 1 else None), None


def pack_gradients(params: list[nn.Parameter], flat: torch.Tensor, release: bool = False) -> None:
    """The parameters' gradients end to end at the start of ``flat`` (zeros for a parameter with
    no gradient and after the last one): one concatenation when every gradient is there and none
    lies in ``flat``; a gradient that already is its own slot of ``flat`` is left as it is.
    ``release`` drops each ``.grad`` once copied."""
    grads = [p.grad for p in params]
    numel = sum(p.numel() for p in params)
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    if all(g is not None and not lo <= g.data_ptr() < hi for g in grads):
        torch.cat([g.reshape(-1) for g in grads], out=flat[:numel])
    else:
        offset = 0
        for p, g in zip(params, grads):
            view = flat[offset: offset + p.numel()]
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g.reshape(-1))
            offset += p.numel()
    if flat.numel() > numel:
        flat[numel:].zero_()
    if release:
        for p in params:
            p.grad = None


class _Bucket:
    def __init__(self, params: list[nn.Parameter], reduction: ReductionGroup):
        self.params = params
        self.reduction = reduction
        self.average_op = reduction.averaging_op()
        self.numel = sum(p.numel() for p in params)
        self.ready = 0
        self.buffer: torch.Tensor | None = None
        self.wire: torch.Tensor | None = None  # the buffer in the communication dtype, when cast
        self.multiply_after: float | None = None
        self.work = None
        self.issued = False

    def reset(self) -> None:
        self.ready = 0
        self.work = None
        self.wire = None
        self.issued = False


class GradientAllReducer:
    """Averages gradients across the data-parallel group during backward."""

    def __init__(self, params: list[nn.Parameter], bucket_size: int, group=None,
                 comm_dtype: torch.dtype | None = None, scaling: GradientScaling | None = None):
        self.group = group
        self.comm_dtype = comm_dtype
        self.scaling = scaling or GradientScaling()
        self.world_size = comm.get_world_size(group)
        self.average_op = comm.averaging_op(group)
        self.active = False
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._next = 0
        self._hooks = []
        trainable = [p for p in params if p.requires_grad]
        # one open bucket per (dtype, device, reduction group), closed when the next tensor of its
        # key would overflow it; the rest close at the end in the order they were opened
        open_buckets: dict[tuple, tuple[list[nn.Parameter], ReductionGroup]] = {}
        open_numel: dict[tuple, int] = {}
        for p in reversed(trainable):
            reduction = reduction_group(p, group)
            key = (p.dtype, p.device, reduction.name)
            if key in open_buckets and open_numel[key] + p.numel() > bucket_size:
                self.buckets.append(_Bucket(*open_buckets.pop(key)))
            if key not in open_buckets:
                open_buckets[key], open_numel[key] = ([], reduction), 0
            open_buckets[key][0].append(p)
            open_numel[key] += p.numel()
        self.buckets.extend(_Bucket(*current) for current in open_buckets.values())
        for index, bucket in enumerate(self.buckets):
            for p in bucket.params:
                self._bucket_of[id(p)] = index
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def begin(self, reduce_this_backward: bool) -> None:
        """Called before each backward: reduce only when this is the accumulation boundary."""
        self.active = reduce_this_backward and self.world_size > 1
        self._next = 0
        for bucket in self.buckets:
            bucket.reset()

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.active:
            return
        bucket = self.buckets[self._bucket_of[id(param)]]
        bucket.ready += 1
        self._issue_ready_buckets()

    def _issue_ready_buckets(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not force and bucket.ready < len(bucket.params):
                return
            self._issue(bucket, self._next)
            self._next += 1

    def _issue(self, bucket: _Bucket, index: int) -> None:
        first = bucket.params[0]
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel, dtype=first.dtype, device=first.device)
        pack_gradients(bucket.params, bucket.buffer)
        reduction = bucket.reduction
        op, before, bucket.multiply_after = self.scaling.plan(reduction.divisor, bucket.average_op)
        if before is not None:
            bucket.buffer.div_(before)
        wire = bucket.buffer
        if self.comm_dtype is not None and self.comm_dtype != wire.dtype:
            wire = bucket.wire = wire.to(self.comm_dtype)
        bucket.work = comm.all_reduce(wire, op=op, group=reduction.group, async_op=True, bucket=index)
        bucket.issued = True

    def finish(self) -> None:
        """After backward: issue what is left, wait, and write the averages into ``param.grad``."""
        if not self.active:
            return
        self._issue_ready_buckets(force=True)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if bucket.wire is not None:
                bucket.buffer.copy_(bucket.wire)
                bucket.wire = None
            if bucket.multiply_after is not None:
                bucket.buffer.mul_(bucket.multiply_after)
                bucket.multiply_after = None
            offset = 0
            for p in bucket.params:
                averaged = bucket.buffer[offset: offset + p.numel()].view_as(p)
                if p.grad is None or p.grad.data_ptr() != averaged.data_ptr():
                    p.grad = averaged
                offset += p.numel()
        self.active = False

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
