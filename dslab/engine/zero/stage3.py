"""ZeRO stage 3: parameters gathered per module just before use and released after.

Each module that owns a released (non-resident) unit (the module that registers its parameters,
or the ancestor gathered whole under ``stage3_module_granularity_threshold``) gets:

- a forward pre-hook that all-gathers its units (waiting for a prefetch already in flight) and
  then prefetches the units that the recorded forward order says come next, up to
  ``prefetch_numel`` elements, while fewer than ``max_live_numel`` gathered elements are live;
- a forward hook that releases its units again (not after an activation checkpoint's recompute,
  which runs inside backward right before the module's own backward), unless backward will
  reuse them within
  ``stage3_max_reuse_distance`` gathered elements (the last modules of the forward are the first
  of the backward), and registers a hook on each output tensor that needs a gradient: when
  backward reaches the module's output, the units are gathered again if they were released
  (with a prefetch of the next ones in reverse forward order);
- after backward, :class:`~dslab.engine.zero.grads.GradientReduceScatter` releases a unit as soon
  as its gradients are copied out for the reduce-scatter.

With one rank a unit's shard is the whole unit: a gather points the parameters at the shard
itself (no copy, no memory), except for a unit whose shard lives off the GPU
(:mod:`.param_offload`), which is fetched into a buffer of its own.

A unit read outside its owner's forward, inside another hooked module's forward (an attention
module reading its ``qkv`` projection's bias after calling the projection), is adopted by that
module on the recorded forward: from the next step on it is gathered and released with the
adopter's own units, and its owner's forward leaves it gathered while the adopter runs.

A parameter read outside its own module's forward while the root module runs forward (a tied LM
head reading ``self.wte.weight``) is gathered on access through the module's parameter registry
and held until its gradients are reduced (or, without autograd, until the forward ends).

The forward order is recorded in the first forward; all ranks see the same module order, so all
ranks issue the same sequence of all-gathers. Parameters must not be read outside the forward
(their data is empty between uses): :meth:`ParameterGatherer.gathered_state_dict` is the way to
read the full weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from dslab import comm
from dslab.engine.zero.partition import FlatUnit


class _GatheringParameters(dict):
    """A module's ``_parameters`` that reports every ``module.name`` read to ``on_access``."""

    def __init__(self, items, on_access):
        super().__init__(items)
        self.on_access = on_access

    def __getitem__(self, name):
        value = super().__getitem__(name)
        self.on_access(value)
        return value


class _FetchThenGather:
    """A gather of an offloaded unit over several ranks: the shard's fetch to the device (in
    flight), then the all-gather when it is waited on."""

    def __init__(self, unit: FlatUnit, staged: torch.Tensor, fetch):
        self.unit = unit
        self.staged = staged
        self.fetch = fetch

    def wait(self) -> None:
        if self.fetch is not None:
            self.fetch.wait()
            self.fetch = None
        if self.staged is not None:
            comm.all_gather_into_tensor(self.unit.full, self.staged, group=self.unit.group)
            self.staged = None


class ParameterGatherer:
    """Gathers and releases stage 3 units around their modules' forward and backward. Units whose
    index is in ``external`` are gathered by someone else (a layer stack,
    :mod:`.stage3_stack`): no hooks for them, but :meth:`gathered_state_dict` and
    :meth:`release_all` still cover them. With ``home`` (parameter offload,
    :mod:`.param_offload`) a unit's shard is fetched from there to the device before its
    all-gather (with one rank, straight into the unit's full buffer)."""

    def __init__(self, root: nn.Module, units: list[tuple[FlatUnit, nn.Module]],
                 prefetch_numel: int, max_live_numel: int, group=None, max_reuse_numel: int = 0,
                 external: set[int] = frozenset(), home=None):
        self.root = root
        self.group = group
        self.home = home
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self.units = [u for u, _ in units if not u.resident]
        self._units_of: dict[int, list[FlatUnit]] = {}
        self._unit_of_param: dict[int, FlatUnit] = {}
        owners: dict[int, nn.Module] = {}
        self._owner_of: dict[int, int] = {}  # unit index -> id of the module that owns it
        for unit, owner in units:
            if unit.resident or unit.index in external:
                continue
            self._units_of.setdefault(id(owner), []).append(unit)
            owners[id(owner)] = owner
            self._owner_of[unit.index] = id(owner)
            for p in unit.params:
                self._unit_of_param[id(p)] = unit
        self.order: list[FlatUnit] = []
        self._position: dict[int, int] = {}  # unit index -> place in the forward order
        self._recorded: set[int] = set()
        self._reuse_distance: dict[int, int] = {}  # unit index -> elements gathered until reuse
        self._order_done = False
        self._root_depth = 0
        self._running: list[nn.Module] = []  # hooked modules inside their forward, innermost last
        self.adopted: dict[int, int] = {}  # unit index -> id of the module that adopted it
        self.live_numel = 0
        self.gathers = 0  # units gathered so far (prefetches included)
        self._hooks = [
            root.register_forward_pre_hook(self._root_pre_forward, prepend=True),
            root.register_forward_hook(self._root_post_forward),
        ]
        for owner in owners.values():
            self._hooks.append(owner.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(owner.register_forward_hook(self._post_forward))
        # every module that registers a released parameter (the owner, or a descendant of an
        # owner gathered whole) reports reads of it
        self._holders = [m for m in root.modules()
                         if any(p is not None and id(p) in self._unit_of_param
                                for p in m._parameters.values())]
        for holder in self._holders:
            holder._parameters = _GatheringParameters(holder._parameters, self._on_access)

    # -- gather and release -------------------------------------------------------------------

    def gather(self, unit: FlatUnit) -> None:
        """Make ``unit``'s parameters full (waiting for its prefetch if one is in flight)."""
        if unit.pending is not None:
            unit.pending.wait()
            unit.pending = None
            unit.bind()
        elif unit.full is None:
            self._start_gather(unit, async_op=False)

    def _start_gather(self, unit: FlatUnit, async_op: bool) -> None:
        self.gathers += 1
        offloaded = self.home is not None and self.home.holds(unit)
        if unit.world_size == 1 and not offloaded:
            # one rank: the shard is the whole unit; the parameters view it, nothing is copied
            unit.full = unit.shard
            unit.bind()
            return
        unit.full = torch.empty(unit.padded, dtype=unit.dtype, device=unit.device)
        self.live_numel += unit.padded
        if offloaded:
            work = self._fetch(unit, async_op)
        else:
            # over the unit's partition group: the data-parallel group, or an expert unit's
            # expert-data-parallel group
            work = comm.all_gather_into_tensor(unit.full, unit.shard, group=unit.group,
                                               async_op=async_op)
        if async_op and work is not None:
            unit.pending = work
        else:
            unit.bind()

    def _fetch(self, unit: FlatUnit, async_op: bool):
        """Start an offloaded unit's gather: its shard's fetch from the home (and, over several
        ranks, the all-gather after it); the work to wait on, or None when it is done."""
        if unit.world_size == 1:
            return self.home.fetch(unit, unit.full, async_op)
        staged = torch.empty(unit.shard_numel, dtype=unit.dtype, device=unit.device)
        work = _FetchThenGather(unit, staged, self.home.fetch(unit, staged, async_op))
        if not async_op:
            work.wait()
            return None
        return work

    def release(self, unit: FlatUnit) -> None:
        if unit.resident or unit.full is None:
            return
        if unit.pending is not None:
            unit.pending.wait()
        if unit.full is not unit.shard:
            self.live_numel -= unit.padded
        unit.release()

    def release_all(self) -> None:
        """Release every gathered unit (after the optimizer step: their full copies are stale)."""
        for unit in self.units:
            self.release(unit)

    def _prefetch_after(self, unit: FlatUnit, reverse: bool) -> None:
        """Start gathering the units that follow ``unit`` in the forward order (or precede it,
        in backward) within the next ``prefetch_numel`` elements of that order; units already
        gathered count toward the window, so a pass over kept units stays short."""
        if not self._order_done or self.prefetch_numel <= 0:
            return
        index = self._position.get(unit.index)
        if index is None:
            return
        step = -1 if reverse else 1
        budget = self.prefetch_numel
        index += step
        while 0 <= index < len(self.order) and budget > 0:
            candidate = self.order[index]
            index += step
            budget -= candidate.padded
            if candidate.full is not None:
                continue
            if self.live_numel + candidate.padded > self.max_live_numel:
                break
            if self.home is not None and self.home.holds(candidate) and not self.home.updated(candidate):
                break  # a background optimizer step has yet to update it: its gather waits for that
            self._start_gather(candidate, async_op=True)

    # -- hooks --------------------------------------------------------------------------------

    def _root_pre_forward(self, module, args):
        if self._root_depth == 0:
            self._running = []
        self._root_depth += 1

    def _root_post_forward(self, module, args, output):
        self._root_depth -= 1
        if self._root_depth == 0:
            if not self._order_done and self.order:
                self._order_done = True
                self._measure_reuse_distances()
            if not torch.is_grad_enabled():
                for unit in self.units:
                    if unit.held:
                        self.release(unit)

    def _pre_forward(self, module, args):
        self._running.append(module)
        units = self._units_of[id(module)]
        for unit in units:
            if not self._order_done and unit.index not in self._recorded:
                self._recorded.add(unit.index)
                self._position[unit.index] = len(self.order)
                self.order.append(unit)
            self.gather(unit)
        if torch._C._current_graph_task_id() != -1:
            # a recompute inside backward: what comes next is the backward of earlier modules
            self._prefetch_after(units[0], reverse=True)
        else:
            self._prefetch_after(units[-1], reverse=False)

    def _post_forward(self, module, args, output):
        if self._running and self._running[-1] is module:
            self._running.pop()
        units = self._units_of[id(module)]
        # a forward inside backward is an activation checkpoint's recompute: the module's own
        # backward comes next, so its units stay gathered until their gradients are reduced
        recompute = torch._C._current_graph_task_id() != -1
        running = {id(m) for m in self._running}
        for unit in units:
            # a unit adopted by a module still in its forward stays for that module
            adopter_running = self.adopted.get(unit.index, id(module)) in running
            if not unit.held and not recompute and not adopter_running \
                    and not self._reused_soon(unit):
                self.release(unit)
        if torch.is_grad_enabled():
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    leaf.register_hook(lambda grad, units=units: self._pre_backward(units))
        return None

    def _pre_backward(self, units: list[FlatUnit]):
        for unit in units:
            self.gather(unit)
        self._prefetch_after(units[0], reverse=True)
        return None

    def _on_access(self, value) -> None:
        if self._root_depth == 0 or not isinstance(value, nn.Parameter):
            return
        unit = self._unit_of_param.get(id(value))
        if unit is None:
            return
        if not self._order_done:
            self._adopt(unit)
        if not unit.gathered:
            self.gather(unit)
            unit.held = True

    def _adopt(self, unit: FlatUnit) -> None:
        """On the recorded forward: a unit read while its owner is not in its forward (an
        attention module reading its projection's bias after calling the projection, a model
        reading a tied embedding for its head) joins the innermost hooked module in its forward,
        which gathers and releases it from the next step on like its own (the owner's forward
        then leaves it gathered for the adopter); until then, and when no hooked module is
        running, the unit is held from the read until its gradients are reduced."""
        if unit.index in self.adopted or not self._running:
            return
        owner = self._owner_of.get(unit.index)
        if owner is None or any(id(m) == owner for m in self._running):
            return
        adopter = self._running[-1]
        self._units_of[id(adopter)].append(unit)
        self.adopted[unit.index] = id(adopter)
        if unit.index not in self._recorded:
            self._recorded.add(unit.index)
            self._position[unit.index] = len(self.order)
            self.order.append(unit)

    def _measure_reuse_distances(self) -> None:
        """Each unit's reuse distance: the elements gathered between its forward and its
        backward, the units after it in the forward order, once in forward and once again as
        backward comes back to it (the last unit's is 0)."""
        after = 0
        for unit in reversed(self.order):
            self._reuse_distance[unit.index] = 2 * after
            after += unit.padded

    def _reused_soon(self, unit: FlatUnit) -> bool:
        """Keep ``unit`` gathered after its forward (``stage3_max_reuse_distance``): a backward
        will follow (autograd is on), the forward order is known and its backward comes within
        ``max_reuse_numel`` gathered elements, while the gathered elements stay within
        ``max_live_numel``."""
        if self.max_reuse_numel <= 0 or not torch.is_grad_enabled():
            return False
        distance = self._reuse_distance.get(unit.index)
        return (distance is not None and distance <= self.max_reuse_numel
                and self.live_numel <= self.max_live_numel)

    def backward_issue_order(self) -> list[FlatUnit]:
        """The order gradients become ready in, roughly: the reverse of the forward order."""
        return self.order[::-1]

    # -- whole-model access -------------------------------------------------------------------

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """The root module's full state dict (copies); a collective: call it on every rank."""
        held = [u for u in self.units if u.full is None]
        for unit in held:
            self.gather(unit)
        try:
            state = {k: v.detach().clone() for k, v in self.root.state_dict().items()}
        finally:
            for unit in held:
                self.release(unit)
        return state

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for holder in self._holders:
            holder._parameters = dict(holder._parameters)
        self._holders = []
