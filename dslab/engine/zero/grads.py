"""Gradient reduce-scatter in units, overlapped with backward (ZeRO stages 1 to 3).

A post-accumulate-grad hook counts the parameters of a unit whose gradient is ready. Units are
issued strictly in ``issue_order`` (the same on every rank, so every rank issues the same
sequence of collectives): a unit whose gradients are all ready, and all units before it, are
copied into a flat buffer of ``padded`` elements (zeros for padding and for parameters that got
no gradient) and reduce-scattered asynchronously, averaging in the collective on nccl (divided
by the world size first on gloo); each rank receives its ``S``-element shard of the average.
With ``reduce_scatter: false`` (DeepSpeed's option) the buffer is all-reduced instead and each
rank keeps its slice: the same shards for twice the traffic. The parameters' ``.grad`` are freed
as soon as they are copied, so a full gradient lives only between its accumulation and its
unit's issue.

The shards are added into ``unit.grad_shard`` (the accumulation across micro-steps happens on
the shards: stage 2 and 3 reduce every backward) once the collective completes, or handed to
``deliver`` (optimizer offload: copied to CPU memory) instead. At most
``max_in_flight`` elements of flat gradient buffers wait on collectives at a time; beyond that the
oldest is completed first. Memory traffic per unit and reduction: read the grads once, write the
flat buffer once (plus a read and a write to divide on gloo), plus the collective's own.

Each unit reduces over its own group (``unit.group``): the data-parallel group, or for a unit of
expert parameters its expert-data-parallel group, summed there and divided by the data-parallel
world size (:mod:`dslab.engine.expert_parallel`).

Stage 1 reduces only on the accumulation boundary (gradients accumulate in full ``.grad`` until
then); stages 2 and 3 reduce every backward.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch
import torch.nn as nn

from dslab import comm
from dslab.engine.data_parallel import GradientScaling, pack_gradients
from dslab.engine.zero.partition import FlatUnit


class GradientReduceScatter:
    """Reduce-scatters the gradients of ``units`` into their ``grad_shard`` during backward."""

    def __init__(self, units: list[FlatUnit], reduce_every_backward: bool, max_in_flight: int,
                 on_issued: Callable[[FlatUnit], None] | None = None,
                 deliver: Callable[[FlatUnit, torch.Tensor], None] | None = None, group=None,
                 reduce_scatter: bool = True, comm_dtype: torch.dtype | None = None,
                 scaling: GradientScaling | None = None):
        self.units = units
        # DeepSpeed's prescale_gradients / gradient_predivide_factor (data_parallel.py)
        self.scaling = scaling or GradientScaling()
        # ``communication_data_type``: packed gradients are cast to it (after the division by
        # the group's size), reduced, and the shard cast back to the unit's dtype
        self.comm_dtype = comm_dtype
        self.reduce_scatter = reduce_scatter
        self.issue_order: list[FlatUnit] = list(units)
        self.reduce_every_backward = reduce_every_backward
        self.max_in_flight = max_in_flight
        self.on_issued = on_issued
        self.deliver = deliver
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.average_op = comm.averaging_op(group)
        self.active = False
        self._ready: dict[int, int] = {}
        self._next = 0
        self._in_flight: deque = deque()
        self._in_flight_numel = 0
        self._unit_of: dict[int, FlatUnit] = {}
        self._hooks = []
        for unit in units:
            for p in unit.params:
                self._unit_of[id(p)] = unit
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def set_issue_order(self, order: list[FlatUnit]) -> None:
        """Issue units in ``order`` (units missing from it go last, in index order; excluded
        units never)."""
        kept = {u.index for u in self.units}
        order = [u for u in order if u.index in kept]
        seen = {u.index for u in order}
        self.issue_order = order + [u for u in self.units if u.index not in seen]

    def exclude(self, units: list[FlatUnit]) -> None:
        """Stop reducing ``units``: their gradients are reduced elsewhere (stage 3's layer stack,
        :mod:`.stage3_stack`), which hands over their shards through :meth:`deliver_shard`."""
        gone = {u.index for u in units}
        self.units = [u for u in self.units if u.index not in gone]
        self.issue_order = [u for u in self.issue_order if u.index not in gone]

    def deliver_shard(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        """Take ``unit``'s reduced (averaged) gradient shard from elsewhere, as a completed
        reduction would: added into ``unit.grad_shard`` (a copy the first time: ``shard`` stays
        its owner's) or handed to ``deliver``."""
        if self.deliver is not None:
            self.deliver(unit, shard)
        elif unit.grad_shard is None:
            unit.grad_shard = shard.clone()
        else:
            unit.grad_shard.add_(shard)

    def begin(self, is_boundary: bool) -> None:
        """Before each backward: reduce in this backward (always for stages 2 and 3, only on the
        accumulation boundary for stage 1)."""
        self.active = self.reduce_every_backward or is_boundary
        self._ready = {u.index: 0 for u in self.units}
        self._next = 0

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.active:
            return
        index = self._unit_of[id(param)].index
        if index not in self._ready:  # an excluded unit: reduced elsewhere
            return
        self._ready[index] += 1
        self._issue_ready()

    def _issue_ready(self, force: bool = False) -> None:
        while self._next < len(self.issue_order):
            unit = self.issue_order[self._next]
            if not force and self._ready[unit.index] < len(unit.params):
                return
            self._issue(unit)
            self._next += 1

    def _averaging_op(self, unit: FlatUnit):
        """AVG in the collective when it divides by the right count (nccl, and the unit's group
        has ``grad_divisor`` ranks: not an expert unit of ep_size > 1); None: divide first."""
        if unit.group is self.group and unit.grad_divisor == self.world_size:
            return self.average_op
        return comm.averaging_op(unit.group) if unit.grad_divisor == unit.world_size else None

    def _issue(self, unit: FlatUnit) -> None:
        flat = torch.empty(unit.padded, dtype=unit.dtype, device=unit.device)
        pack_gradients(unit.params, flat, release=True)
        op, before, after = self.scaling.plan(unit.grad_divisor, self._averaging_op(unit))
        if before is not None:
            flat.div_(before)
        wire = flat
        if unit.world_size > 1 and self.comm_dtype is not None and self.comm_dtype != flat.dtype:
            wire = flat.to(self.comm_dtype)
        if unit.world_size == 1:  # a group of one: the packed gradients are the reduced shard
            shard, work = flat, None
        elif self.reduce_scatter:
            shard = torch.empty(unit.shard_numel, dtype=wire.dtype, device=unit.device)
            work = comm.reduce_scatter_tensor(shard, wire, op=op, group=unit.group, async_op=True,
                                              bucket=unit.index)
        else:  # ``reduce_scatter: false``: every rank receives the whole average, keeps its shard
            lo = unit.rank * unit.shard_numel
            shard = wire[lo: lo + unit.shard_numel]
            work = comm.all_reduce(wire, op=op, group=unit.group, async_op=True, bucket=unit.index)
        if self.on_issued is not None:
            self.on_issued(unit)
        self._in_flight.append((unit, flat, shard, work, after))
        self._in_flight_numel += unit.padded
        # Without overlap (max_in_flight < 0) every reduction completes at once; with it, the
        # newest stays in flight while backward goes on.
        keep = 0 if self.max_in_flight < 0 else 1
        while len(self._in_flight) > keep and self._in_flight_numel > self.max_in_flight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        unit, flat, shard, work, after = self._in_flight.popleft()
        self._in_flight_numel -= flat.numel()
        if work is not None:
            work.wait()
        if shard.dtype != unit.dtype:  # reduced in the communication dtype
            shard = shard.to(unit.dtype)
        if after is not None:
            shard.mul_(after)
        if self.deliver is not None:
            self.deliver(unit, shard)
        elif unit.grad_shard is None:
            # a shard cut from an all-reduced buffer is copied so that the buffer can be freed
            unit.grad_shard = shard if self.reduce_scatter else shard.clone()
        else:
            unit.grad_shard.add_(shard)

    def finish(self) -> None:
        """After backward: issue what is left (units that got no gradient contribute zeros) and
        complete every reduction."""
        if not self.active:
            return
        self._issue_ready(force=True)
        while self._in_flight:
            self._complete_oldest()
        self.active = False

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
