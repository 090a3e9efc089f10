"""How ZeRO lays parameters out: flat units, each split into equal shards across the ranks.

A *unit* is a list of parameters of one optimizer param group, one dtype and one device, laid end
to end in a flat buffer of ``numel`` elements and padded with zeros to ``padded = ceil(numel /
W) * W`` elements for a world of ``W`` ranks. Rank ``r`` owns elements ``[r * S, (r + 1) * S)``
of every unit, ``S = padded / W`` (FSDP's layout): a reduce-scatter of a unit's flat gradient
leaves each rank exactly its shard, and an all-gather of the shards rebuilds the unit, so every
collective works on whole units with no per-rank bookkeeping.

Expert parameters (:mod:`dslab.engine.expert_parallel`) form units of their own, one expert group
name each, partitioned over their expert-data-parallel group instead: there ``W`` is that group's
size and ``r`` this rank's place in it.

Which parameters form a unit does not depend on ``W`` (buckets of at most ``reduce_bucket_size``
elements for stages 1 and 2, one module's own parameters for stage 3), so a checkpoint's units
can be re-split for another world size from its :class:`UnitLayout` records alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from dslab.engine.expert_parallel import expert_group_name
from dslab.parallel.partitioned import forget_partition, full_numel, full_shape, gather_, is_partitioned


@dataclass(frozen=True)
class UnitLayout:
    """What a unit holds, independent of the world size (stored in sharded checkpoints).

    ``names`` are the parameters' names in ``module.named_parameters()``, in flat-buffer order;
    ``group`` is the optimizer param group; ``resident`` units keep their full flat buffer on
    every rank (stages 1 and 2, and stage 3 units under the persistence threshold).
    ``expert_group`` names the expert group (``"ep_size_{p}"``) of a unit of expert parameters,
    which is partitioned over that group's expert-data-parallel ranks.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group: int
    resident: bool
    expert_group: str | None = None

    @property
    def sizes(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    @property
    def offsets(self) -> list[int]:
        offsets, total = [], 0
        for size in self.sizes:
            offsets.append(total)
            total += size
        return offsets

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def padded(self, world_size: int) -> int:
        return math.ceil(self.numel / world_size) * world_size

    def shard_numel(self, world_size: int) -> int:
        return self.padded(world_size) // world_size

    def to_dict(self) -> dict:
        out = {"names": list(self.names), "shapes": [list(s) for s in self.shapes],
               "group": self.group, "resident": self.resident}
        if self.expert_group is not None:
            out["expert_group"] = self.expert_group
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "UnitLayout":
        return cls(tuple(data["names"]), tuple(tuple(int(d) for d in s) for s in data["shapes"]),
                   int(data["group"]), bool(data["resident"]), data.get("expert_group"))


def flatten(tensors: list[torch.Tensor], padded: int) -> torch.Tensor:
    """The tensors end to end in one 1-D buffer of ``padded`` elements (zeros after them)."""
    first = tensors[0]
    flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
    offset = 0
    for t in tensors:
        flat[offset: offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    return flat


def plan_buckets(named_groups: list[list[tuple[str, nn.Parameter]]], bucket_size: int
                 ) -> list[tuple[UnitLayout, list[nn.Parameter]]]:
    """Stage 1 and 2 units: each group's parameters in reverse order (roughly the order backward
    produces their gradients), cut into buckets of at most ``bucket_size`` elements (a larger
    parameter gets a bucket of its own) and at every change of dtype, device or expert group."""
    units = []
    for group_index, named in enumerate(named_groups):
        current: list[tuple[str, nn.Parameter]] = []
        current_numel, current_key = 0, None
        for name, p in reversed(named):
            key = (p.dtype, p.device, expert_group_name(p))
            if current and (current_numel + full_numel(p) > bucket_size or key != current_key):
                units.append(_unit(current, group_index, resident=True))
                current, current_numel = [], 0
            current.append((name, p))
            current_numel += full_numel(p)
            current_key = key
        if current:
            units.append(_unit(current, group_index, resident=True))
    return units


def plan_module_units(module: nn.Module, named_groups: list[list[tuple[str, nn.Parameter]]],
                      persistence_threshold: int, granularity_threshold: int = 0
                      ) -> list[tuple[UnitLayout, list[nn.Parameter], nn.Module]]:
    """Stage 3 units: the parameters each module registers itself (not its children's), split by
    param group, dtype and device, in ``module.modules()`` order. A unit of at most
    ``persistence_threshold`` elements stays resident (gathered once, never released). Returns
    ``(layout, params, owning module)`` triples.

    A module whose granularity, its subtree's parameter elements over ``1 +`` its number of
    descendant modules, is below ``granularity_threshold`` (DeepSpeed's
    ``stage3_module_granularity_threshold``; 0 turns it off) is gathered whole: its own and all
    its descendants' parameters form its units, so a transformer block of small modules costs
    one gather instead of one per module. Containers without a forward of their own
    (``nn.ModuleList``, ``nn.ModuleDict``) are never gathered whole: no hook would run for them.
    """
    group_of = {id(p): g for g, named in enumerate(named_groups) for _, p in named}
    name_of = {id(p): name for named in named_groups for name, p in named}
    whole = _gathered_whole(module, granularity_threshold)
    assigned: set[int] = set()
    units = []
    for owner in _modules_outside(module, whole):
        params = owner.parameters() if id(owner) in whole else owner._parameters.values()
        by_key: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
        for p in params:
            if p is None or id(p) not in group_of or id(p) in assigned:
                continue
            assigned.add(id(p))
            key = (group_of[id(p)], p.dtype, p.device)
            by_key.setdefault(key, []).append((name_of[id(p)], p))
        for (group_index, _, _), named in by_key.items():
            numel = sum(full_numel(p) for _, p in named)
            layout, params = _unit(named, group_index, resident=numel <= persistence_threshold)
            units.append((layout, params, owner))
    return units


def bucket_resident_units(planned: list[tuple[UnitLayout, list[nn.Parameter], nn.Module]], root: nn.Module,
                          bucket_size: int) -> list[tuple[UnitLayout, list[nn.Parameter], nn.Module]]:
    """Stage 3's resident units (under the persistence threshold: norms, biases, small
    embeddings) regrouped into buckets of at most ``bucket_size`` elements, as stages 1 and 2
    bucket theirs, each owned by ``root``. A resident unit is never gathered or released, so
    nothing ties it to its module; one per module cost a reduce-scatter and a gather a step each
    (about a hundred of each for GPT-2 355M, host-bound). The released units come first, as
    planned; the buckets keep the parameters' order and split at a change of param group, dtype,
    device or expert group."""
    released = [item for item in planned if not item[0].resident]
    buckets: list[tuple[UnitLayout, list[nn.Parameter], nn.Module]] = []
    current: list[tuple[str, nn.Parameter]] = []
    current_numel, current_key = 0, None
    for layout, params, _ in (item for item in planned if item[0].resident):
        for name, p in zip(layout.names, params):
            key = (layout.group, p.dtype, p.device, expert_group_name(p))
            if current and (current_numel + full_numel(p) > bucket_size or key != current_key):
                buckets.append((*_unit(current, current_key[0], resident=True), root))
                current, current_numel = [], 0
            current.append((name, p))
            current_numel += full_numel(p)
            current_key = key
    if current:
        buckets.append((*_unit(current, current_key[0], resident=True), root))
    return released + buckets


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _gathered_whole(root: nn.Module, threshold: int) -> set[int]:
    """Ids of the modules whose granularity is below ``threshold`` (see
    :func:`plan_module_units`)."""
    if threshold <= 0:
        return set()
    whole = set()
    for m in root.modules():
        elements = sum(full_numel(p) for p in m.parameters())
        descendants = sum(1 for _ in m.modules()) - 1
        if elements and _has_forward(m) and elements / (1 + descendants) < threshold:
            whole.add(id(m))
    return whole


def _modules_outside(root: nn.Module, whole: set[int]) -> list[nn.Module]:
    """``root.modules()`` in order, without the descendants of a module in ``whole``."""
    order, seen, stack = [], set(), [root]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        order.append(m)
        if id(m) not in whole:
            stack.extend(reversed(list(m.children())))
    return order


def _unit(named: list[tuple[str, nn.Parameter]], group: int, resident: bool
          ) -> tuple[UnitLayout, list[nn.Parameter]]:
    layout = UnitLayout(tuple(n for n, _ in named), tuple(tuple(full_shape(p)) for _, p in named),
                        group, resident, expert_group_name(named[0][1]))
    return layout, [p for _, p in named]


class FlatUnit:
    """One unit on one rank: its shard, and its full flat buffer while gathered.

    The model's parameters are views into ``full`` while the unit is gathered; a released unit
    (stage 3) points them at empty tensors and frees ``full``. ``shard`` (``S`` elements) is this
    rank's slice: a view into ``full`` for a resident unit, its own buffer otherwise.
    ``grad_shard`` (``S`` elements) accumulates this rank's reduced gradient until the step.

    The unit lives on ``device`` (default: its parameters'). Parameters built elsewhere (a stage 3
    model constructed on the CPU) are flattened where they are and moved one unit at a time, so
    the whole model is never on ``device`` at once; ``sync(full)``, when given, runs on the moved
    flat buffer before the shard is cut (the engine broadcasts it from rank 0 there).

    ``world_size`` and ``rank`` are the partition's: the unit's collectives run over ``group``
    (None: the default group), and its gradients are summed there and divided by
    ``grad_divisor`` (default ``world_size``; the data-parallel world size for experts).
    """

    def __init__(self, index: int, layout: UnitLayout, params: list[nn.Parameter],
                 world_size: int, rank: int, device: torch.device | None = None,
                 sync: Callable[[torch.Tensor], None] | None = None, group=None,
                 grad_divisor: int | None = None):
        self.index = index
        self.layout = layout
        self.params = params
        self.world_size = world_size
        self.rank = rank
        self.group = group
        self.grad_divisor = world_size if grad_divisor is None else grad_divisor
        self.numel = layout.numel
        self.padded = layout.padded(world_size)
        self.shard_numel = self.padded // world_size
        self.resident = layout.resident
        self.dtype = params[0].dtype
        self.device = params[0].device if device is None else torch.device(device)
        self.grad_shard: torch.Tensor | None = None
        self.pending = None
        self.held = False
        # parameters built partitioned (dslab.zero.Init) are gathered whole here, one unit at a
        # time, and leave their own layout for the unit's
        built_partitioned = [p for p in params if is_partitioned(p)]
        for p in built_partitioned:
            gather_(p)
            forget_partition(p)
        with torch.no_grad():
            full = flatten([p.detach() for p in params], self.padded).to(self.device)
            if sync is not None and len(built_partitioned) < len(params):
                sync(full)
        self.full: torch.Tensor | None = full
        lo = rank * self.shard_numel
        shard = self.full[lo: lo + self.shard_numel]
        self.shard = shard if self.resident else shard.clone()
        self.bind()
        if not self.resident:
            self.release()

    @property
    def gathered(self) -> bool:
        return self.full is not None and self.pending is None

    def bind(self) -> None:
        """Point every parameter at its slice of ``full``."""
        for p, shape, offset, size in zip(self.params, self.layout.shapes, self.layout.offsets,
                                          self.layout.sizes):
            p.data = self.full[offset: offset + size].view(shape)

    def release(self) -> None:
        """Free the full buffer (stage 3); the parameters become empty until the next gather."""
        if self.resident:
            return
        self.full = None
        self.pending = None
        self.held = False
        for p in self.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def param_slices(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``flat`` (this unit's full flat buffer, at least ``numel`` long) cut into its
        parameters by name, each in its shape (views)."""
        return {name: flat[offset: offset + size].view(shape)
                for name, shape, offset, size in zip(self.layout.names, self.layout.shapes,
                                                     self.layout.offsets, self.layout.sizes)}
