"""The ZeRO runtime the engine calls: units, optimizer over shards, the step.

The optimizer never sees the model's parameters. For each unit it sees one *master*: a 1-D
``nn.Parameter`` of the unit's shard (``S`` elements). Without offload the master shares storage
with the shard, so the optimizer updates the shard in place; with ``offload_optimizer.device:
cpu`` the masters, their gradients and the optimizer states live in CPU memory
(:mod:`.offload`): gradient shards are copied out during backward and the CPU step is pipelined
with copying the new shards back; with ``device: nvme`` the optimizer states live in files and
are swapped around each sub-group's step (:mod:`.nvme_offload`). The update is elementwise per
master, which is exact for Adam/AdamW/SGD-style optimizers; LAMB's per-parameter trust ratio is
not, so LAMB is refused.

One optimizer step (on the accumulation boundary, after backward left each rank's averaged
gradient shard in ``unit.grad_shard``, or in CPU memory with offload):

1. fp16: unscale the shards and check them for inf/NaN; the verdict is all-reduced (MAX) so every
   rank skips or steps together.
2. Clipping: the global norm is ``sqrt(all_reduce(sum of squared shard norms))`` (padding is
   zero and adds nothing); the shards are scaled by ``min(1, clip / (norm + 1e-6))`` as
   ``torch.nn.utils.clip_grad_norm_`` does. Expert units are partitioned over their
   expert-data-parallel group, and the groups of different ep ranks hold different experts, so
   the same sum over all ranks counts every expert element exactly once.
3. The optimizer steps on the masters (offload: chunk by chunk on the CPU).
4. Publish: resident units all-gather their shards into the full buffers that the parameters
   view, in collectives of at most ``allgather_bucket_size`` elements; stage 3 releases every
   gathered unit (its full copy is stale).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from dslab import comm
from dslab.engine.expert_parallel import reduction_group
from dslab.engine.lamb import Lamb
from dslab.engine.optimizers import fused_kernels_supported
from dslab.engine.zero.grads import GradientReduceScatter
from dslab.engine.zero.nvme_offload import NvmeOptimizerOffload
from dslab.engine.zero.offload import CpuOptimizerOffload
from dslab.engine.zero.param_gather import DeferredGathers, defers_on
from dslab.engine.zero.param_offload import ParamHome, build_param_home
from dslab.engine.zero.partition import FlatUnit, bucket_resident_units, plan_buckets, plan_module_units
from dslab.engine.zero.stage3 import ParameterGatherer
from dslab.engine.zero.stage3_stack import Stage3LayerStack, stack_units
from dslab.engine.zero_config import ZeroConfig
from dslab.io.config import AioConfig
from dslab.models.graphs import LayerStackGraphs


def refuse_lamb(optimizer, stage: int) -> None:
    if isinstance(optimizer, Lamb):
        raise ValueError(
            f"optimizer Lamb cannot run with ZeRO stage {stage} ('zero_optimization.stage'): its "
            "trust ratio needs each parameter's whole norm, and ZeRO splits parameters across "
            "ranks; use stage 0 or an Adam/AdamW/SGD optimizer")


def _graphed_stack_units(module: nn.Module, units: list[FlatUnit], owners: list[nn.Module]
                         ) -> list[list[FlatUnit]] | None:
    """The sharded units of each layer of ``module``'s layer stack when the stack runs through
    CUDA graphs (the engine's ``cuda_graphs`` on a :class:`~dslab.models.graphs.CudaGraphLayers`
    model whose stack yields nothing beside its output), else None: stage 3 then gathers the
    stack's layers itself (:mod:`.stage3_stack`)."""
    graphs = getattr(module, "_layer_graphs", None)
    if not isinstance(graphs, LayerStackGraphs) or graphs.side is not None:
        return None
    if getattr(getattr(module, "config", None), "checkpoint_layers", 0):
        return None  # checkpointed segments run eagerly, through the per-module hooks
    by_layer = stack_units(module.layers, units, owners)
    return by_layer if any(by_layer) else None


def _stepped_on_device(units: list[FlatUnit], offload) -> set[int]:
    """Indices of the units that ``offload_optimizer.ratio`` keeps on the device: with offload
    on and ratio ``r`` < 1, the units in index order are offloaded until ``r`` of all shard
    elements are, the rest stay (none with ``r`` = 1 or without offload)."""
    if offload.device == "none" or offload.ratio >= 1.0 or not units:
        return set()
    total = sum(u.shard_numel for u in units)
    offloaded, stay = 0, set()
    for unit in units:
        if offloaded >= offload.ratio * total:
            stay.add(unit.index)
        else:
            offloaded += unit.shard_numel
    return stay


def _scale(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    for (device, dtype), group in by_key.items():
        torch._foreach_mul_(group, factor.to(device=device, dtype=dtype))


def _as_groups(params) -> list[dict]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(group) for group in params]
    return [{"params": params}]


class _UnitAccess:
    """What ``dslab.zero.GatheredParameters`` calls for a parameter of a ZeRO unit: ``gather()``
    makes the unit whole (stage 3 holds it gathered), ``release(modifier_rank)`` keeps this
    rank's shard of ``modifier_rank``'s values (broadcast over the unit's group) in the unit,
    its master and its home, then releases a stage 3 unit again."""

    def __init__(self, runtime: "ZeroRuntime", unit: FlatUnit):
        self.runtime = runtime
        self.unit = unit

    def gather(self) -> bool:
        unit, gatherer = self.unit, self.runtime.gatherer
        if not unit.resident and gatherer is not None:
            gatherer.gather(unit)
            unit.held = True
        return True

    def release(self, modifier_rank: int | None) -> None:
        runtime, unit = self.runtime, self.unit
        if modifier_rank is not None:
            with torch.no_grad():
                if unit.world_size > 1:
                    comm.broadcast(unit.full, src=comm.get_global_rank(unit.group, modifier_rank),
                                   group=unit.group)
                lo = unit.rank * unit.shard_numel
                shard = unit.full[lo: lo + unit.shard_numel]
                runtime.set_shard(unit, shard)
        if not unit.resident and runtime.gatherer is not None:
            runtime.gatherer.release(unit)


class ZeroRuntime:
    """ZeRO stages 1 to 3 for one module; built by the engine when ``zero_optimization.stage`` > 0.

    ``param_groups`` are the optimizer's groups over the model's parameters (dicts with
    ``params`` and per-group options); only parameters that require a gradient are sharded.
    The units are placed on ``device`` (default: where the parameters are); with
    ``broadcast=True`` each unit's flat buffer is broadcast from rank 0 as it is built (the
    engine's start from rank 0's weights, one unit at a time). ``aio`` (the config's ``aio``
    section, or None for its defaults) parameterises the handle of NVMe optimizer offload.
    """

    def __init__(self, module: nn.Module, config: ZeroConfig, param_groups, group=None,
                 device: torch.device | None = None, broadcast: bool = False, aio=None,
                 comm_dtype: torch.dtype | None = None, scaling=None):
        self.module = module
        self.config = config
        self.stage = config.stage
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        # groups beyond the data-parallel one over which the squared gradient norm is summed:
        # the model-parallel ranks holding other parts of the model (the engine sets them)
        self.norm_groups: list = []
        self.group_options = []
        named_groups = self._named_groups(_as_groups(param_groups))
        if self.stage == 3:
            planned = plan_module_units(module, named_groups,
                                        config.stage3_param_persistence_threshold,
                                        config.stage3_module_granularity_threshold)
            planned = bucket_resident_units(planned, module, config.reduce_bucket_size)
            owners = [owner for _, _, owner in planned]
            planned = [(layout, params) for layout, params, _ in planned]
        else:
            planned = plan_buckets(named_groups, config.reduce_bucket_size)
        self.units = []
        for i, (layout, params) in enumerate(planned):
            reduction = reduction_group(params[0], group)
            sync = None
            if broadcast and self.world_size > 1:
                # from rank 0, or for an expert's unit from the first rank of its
                # expert-data-parallel group (the other ep ranks hold other experts)
                def sync(full: torch.Tensor, reduction=reduction) -> None:
                    if reduction.is_expert:
                        comm.broadcast(full, src=reduction.source_rank, group=reduction.group)
                    else:
                        comm.broadcast(full, src=comm.get_global_rank(group, 0), group=group)
            self.units.append(FlatUnit(i, layout, params, reduction.size, reduction.rank, device,
                                       sync, group=reduction.group,
                                       grad_divisor=reduction.divisor))
        if self.stage == 3:  # DeepSpeed's names for the whole size of a parameter stage 3 empties
            for unit in self.units:
                for p, shape in zip(unit.params, unit.layout.shapes):
                    p.ds_shape = tuple(shape)
                    p.ds_numel = math.prod(shape)
        aio = aio if aio is not None else AioConfig()
        self.gatherer = None
        # parameter offload (stage 3): the released shards' home off the GPU (param_offload.py)
        self.param_home: ParamHome | None = None
        by_layer = None
        # partial optimizer offload (offload_optimizer.ratio < 1): units stepped on the device
        on_device = _stepped_on_device(self.units, config.offload_optimizer)
        if self.stage == 3:
            self.param_home = build_param_home(
                config.offload_param, [u for u in self.units if u.index not in on_device],
                self.units[0].device if self.units else torch.device("cpu"), aio, comm.get_rank())
            # the graphed layer stack gathers from device-resident shards; offloaded shards go
            # through the per-module hooks, which fetch them from their home first
            if self.param_home is None:
                by_layer = _graphed_stack_units(module, self.units, owners)
            external = {u.index for units in by_layer for u in units} if by_layer else set()
            self.gatherer = ParameterGatherer(
                module, list(zip(self.units, owners)), config.stage3_prefetch_bucket_size,
                config.stage3_max_live_parameters, group,
                max_reuse_numel=config.stage3_max_reuse_distance, external=external,
                home=self.param_home)
        self.offload: CpuOptimizerOffload | None = None
        offload = config.offload_optimizer
        if offload.device == "cpu":
            self.offload = CpuOptimizerOffload(
                self.units, pin_memory=offload.pin_memory, chunk_numel=config.sub_group_size,
                home=self.param_home, on_device=on_device, accumulate_on=offload.accumulate_on,
                staging_buffers=offload.staging_buffers, staging_dtype=offload.staging_dtype)
        elif offload.device == "nvme":
            self.offload = NvmeOptimizerOffload(
                self.units, pin_memory=offload.pin_memory, chunk_numel=config.sub_group_size,
                nvme_path=offload.nvme_path, aio=aio,
                buffer_count=offload.buffer_count, rank=comm.get_rank(),
                pipeline_read=offload.pipeline_read, pipeline_write=offload.pipeline_write,
                home=self.param_home, on_device=on_device, accumulate_on=offload.accumulate_on,
                staging_buffers=offload.staging_buffers, staging_dtype=offload.staging_dtype)
        if self.offload is not None:
            self.masters: list[nn.Parameter] = self.offload.masters
        else:
            self.masters = [nn.Parameter(unit.shard) for unit in self.units]
        max_in_flight = 2 * config.reduce_bucket_size if config.overlap_comm else -1
        self.reducer = GradientReduceScatter(
            self.units, reduce_every_backward=self.stage >= 2, max_in_flight=max_in_flight,
            on_issued=self.gatherer.release if self.gatherer is not None else None,
            deliver=self.offload.receive if self.offload is not None else None, group=group,
            reduce_scatter=config.reduce_scatter, comm_dtype=comm_dtype, scaling=scaling)
        self.comm_device = self.units[0].device if self.units else (device or torch.device("cpu"))
        # stage 3 over a model's CUDA-graphed layer stack: the stack gathers and reduces its own
        # layers inside its graphs (stage3_stack.py)
        self.stack: Stage3LayerStack | None = None
        if by_layer:
            self.stack = Stage3LayerStack(module.layers, by_layer, self.reducer, group=group)
            module._layer_graphs = self.stack
        # overlap_param_gather: the post-step gathers are waited where the next forward reads them
        self.deferred: DeferredGathers | None = None
        if config.overlap_param_gather and self.world_size > 1 and defers_on(self.comm_device):
            self.deferred = DeferredGathers(module, self.units)
        # dslab.zero.GatheredParameters reaches the units through each parameter's access
        for unit in self.units:
            access = _UnitAccess(self, unit)
            for p in unit.params:
                p.ds_access = access

    def _named_groups(self, groups: list[dict]) -> list[list[tuple[str, nn.Parameter]]]:
        name_of = {id(p): name for name, p in self.module.named_parameters()}
        seen: set[int] = set()
        named_groups = []
        for index, group in enumerate(groups):
            named = []
            for p in group["params"]:
                if id(p) not in name_of:
                    raise ValueError(
                        f"optimizer param group {index} holds a parameter of shape "
                        f"{tuple(p.shape)} that is not in the model; ZeRO shards the model's "
                        "own parameters only")
                if id(p) in seen:
                    raise ValueError(f"parameter '{name_of[id(p)]}' is in more than one "
                                     "optimizer param group")
                seen.add(id(p))
                if p.requires_grad:
                    named.append((name_of[id(p)], p))
            named_groups.append(named)
            self.group_options.append({k: v for k, v in group.items() if k != "params"})
        return named_groups

    # -- the optimizer ------------------------------------------------------------------------

    def optimizer_param_groups(self) -> list[dict]:
        """Param groups over the masters, with each original group's options."""
        groups = [dict(options, params=[]) for options in self.group_options]
        for unit, master in zip(self.units, self.masters):
            groups[unit.layout.group]["params"].append(master)
        kept = [g for g in groups if g["params"]]
        # a rank holding no trainable parameter (a pipeline stage of tied copies only) still
        # gets an optimizer, with one empty group
        return kept or [dict(groups[0] if groups else {}, params=[])]

    def adopt(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point an optimizer built on the model's parameters at the masters instead."""
        refuse_lamb(optimizer, self.stage)
        if any(optimizer.state.values()):
            raise ValueError(f"the optimizer passed to initialize() ({type(optimizer).__name__}) holds state "
                             "already: it has stepped, or it builds its state when constructed (as "
                             "torch.optim.Adagrad does); ZeRO builds the states of its shards itself and "
                             "needs an optimizer whose state starts empty")
        for group, unit_group in zip(optimizer.param_groups, range(len(self.group_options))):
            group["params"] = [m for u, m in zip(self.units, self.masters)
                               if u.layout.group == unit_group]
        optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]]
        return optimizer

    @property
    def fused_ok(self) -> bool:
        """True when torch's fused optimizer kernels can step the masters: all on CUDA, or all in
        CPU memory (offload; torch's fused Adam, AdamW and SGD have CPU kernels)."""
        return fused_kernels_supported(self.masters)

    # -- backward and step --------------------------------------------------------------------

    def begin(self, is_boundary: bool) -> None:
        """Before each backward (the engine calls it as it calls stage 0's all-reducer)."""
        if self.gatherer is not None and self.gatherer.order:
            resident = [u for u in self.units if u.resident]
            self.reducer.set_issue_order(self.gatherer.backward_issue_order() + resident)
        if self.offload is not None:
            self.offload.begin(last_backward=is_boundary)
        self.reducer.begin(is_boundary)

    def finish(self) -> None:
        """After each backward: complete the reductions into the gradient shards."""
        self.reducer.finish()

    def step(self, optimizer: torch.optim.Optimizer, loss_scaler, clip: float) -> bool:
        """Unscale/check, clip, step the masters and publish the new shards; False when an fp16
        overflow skipped the update. Gradients are cleared either way."""
        if self.offload is not None:
            applied = self._step_offloaded(optimizer, loss_scaler, clip)
            self.zero_grad()
            return applied
        for unit in self.units:
            if unit.grad_shard is None:
                unit.grad_shard = torch.zeros(unit.shard_numel, dtype=unit.dtype, device=unit.device)
        grads = [unit.grad_shard for unit in self.units]
        overflow = False
        if loss_scaler is not None and grads:
            found = loss_scaler.unscale_and_find_inf(grads)
            comm.all_reduce(found, op=comm.ReduceOp.MAX, group=self.group)
            for group in self.norm_groups:
                comm.all_reduce(found, op=comm.ReduceOp.MAX, group=group)
            overflow = bool(found.item() > 0)
            loss_scaler.update_scale(overflow)
        if not overflow:
            # with model parallelism every rank joins the norm's sums, even one with no gradient
            if clip > 0 and (grads or self.norm_groups):
                coefficient = self.clip_coefficient(grads, clip)
                if grads:
                    _scale(grads, coefficient)
            for unit, master in zip(self.units, self.masters):
                master.grad = unit.grad_shard
            optimizer.step()
            self._publish()
        self.zero_grad()
        return not overflow

    def _step_offloaded(self, optimizer: torch.optim.Optimizer, loss_scaler, clip: float) -> bool:
        """The step with the optimizer in CPU memory (:mod:`.offload`): the global norm of the
        (still loss-scaled) gradients comes from the squared norms taken on the GPU; a
        non-finite one is an fp16 overflow; unscaling and clipping are one factor applied chunk
        by chunk on the CPU."""
        self.offload.gradients()
        factor = None
        if loss_scaler is not None or clip > 0:
            total = self.offload.squared_norm(self.comm_device)
            self._sum_squares(total)
            squared = float(total.item())
            scale = loss_scaler.loss_scale if loss_scaler is not None else 1.0
            if loss_scaler is not None:
                overflow = not math.isfinite(squared)
                loss_scaler.update_scale(overflow)
                if overflow:
                    return False
            factor = 1.0 / scale
            if clip > 0:
                factor *= min(1.0, clip / (math.sqrt(squared) / scale + 1e-6))
        if self.config.offload_optimizer.overlap_step and self.param_home is not None:
            order = [u.index for u in self.gatherer.order] if self.gatherer is not None else None
            self._wait(self.offload.step_in_background(optimizer, factor, self._publish_unit, order))
        else:
            self._wait(self.offload.step_in_chunks(optimizer, factor, self._publish_unit))
        return True

    def stepping(self) -> bool:
        """Whether the offloaded optimizer step still runs in the background
        (``offload_optimizer.overlap_step``): the optimizer's masters are its until
        :meth:`settle`."""
        return self.offload is not None and self.offload.stepping()

    def set_norm_filter(self, counts) -> None:
        """Count in the gradient norm only the parameters for which ``counts(param)`` is True
        (under tensor parallelism, a replicated parameter counts on one tensor-parallel rank):
        each unit holding one that does not count gets a mask over its shard that zeroes the
        elements of those parameters before their squares are summed."""
        self._norm_masks = {}
        for unit in self.units:
            if all(counts(p) for p in unit.params):
                continue
            if self.offload is not None:
                raise ValueError("'zero_optimization.offload_optimizer' with tensor parallelism is not "
                                 "supported (its gradient norm is taken on the CPU, over whole shards)")
            mask = torch.ones(unit.shard_numel, dtype=torch.float32, device=unit.device)
            lo = unit.rank * unit.shard_numel
            for param, offset, size in zip(unit.params, unit.layout.offsets, unit.layout.sizes):
                if counts(param):
                    continue
                a, b = max(offset, lo), min(offset + size, lo + unit.shard_numel)
                if a < b:
                    mask[a - lo: b - lo] = 0.0
            self._norm_masks[unit.index] = mask

    def global_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of the whole model's gradient from every rank's shards (a collective; a
        0-dim tensor on the collective's device). ``grads``: the units' gradient shards, in unit
        order (masked where :meth:`set_norm_filter` says)."""
        masks = getattr(self, "_norm_masks", None)
        if masks:
            grads = [g * masks[u.index] if u.index in masks else g for u, g in zip(self.units, grads)]
        if not grads:
            total = torch.zeros((), dtype=torch.float32, device=self.comm_device)
        else:
            total = torch.stack([n.float().to(self.comm_device)
                                 for n in torch._foreach_norm(grads)]).square().sum()
        self._sum_squares(total)
        return total.sqrt()

    def _sum_squares(self, total: torch.Tensor) -> None:
        """Sum a squared norm over the data-parallel group and then each of ``norm_groups``."""
        comm.all_reduce(total, group=self.group)
        for group in self.norm_groups:
            comm.all_reduce(total, group=group)

    def clip_coefficient(self, grads: list[torch.Tensor], clip: float) -> torch.Tensor:
        """``min(1, clip / (norm + 1e-6))`` for the global gradient norm (a collective)."""
        return (clip / (self.global_grad_norm(grads) + 1e-6)).clamp(max=1.0)

    def _publish_unit(self, unit: FlatUnit, master: torch.Tensor | None = None):
        """Start making ``unit``'s new shard visible: copy it from its offloaded master, and
        all-gather it into the full buffer of a resident unit. Returns the collective's handle
        (or None)."""
        with torch.no_grad():
            # an offloaded unit's master is its home copy (param_offload.py): nothing to copy, but
            # what the home fetches in its place follows it
            if self.param_home is not None and self.param_home.holds(unit):
                if master is not None:
                    self.param_home.refresh(unit)
            elif master is not None and master.data_ptr() != unit.shard.data_ptr():
                unit.shard.copy_(master, non_blocking=True)
        if not unit.resident:
            return None
        if unit.world_size == 1:  # a group of one: the shard is the whole unit
            if unit.full.data_ptr() != unit.shard.data_ptr():
                with torch.no_grad():
                    unit.full.copy_(unit.shard)
            return None
        per_rank = max(1, self.config.allgather_bucket_size // unit.world_size)
        if unit.shard_numel <= per_rank:
            return comm.all_gather_into_tensor(unit.full, unit.shard, group=unit.group,
                                               async_op=True)
        self._gather_in_pieces(unit, per_rank)
        return None

    def _gather_in_pieces(self, unit: FlatUnit, per_rank: int) -> None:
        """All-gather a unit larger than ``allgather_bucket_size`` in collectives of at most that
        many elements: piece ``j`` gathers elements ``[j * per_rank, (j + 1) * per_rank)`` of
        every rank's shard through one staging buffer, then lands in each rank's slice of
        ``full``. Each piece completes before the next starts, so the extra memory is one piece."""
        slices = unit.full.view(unit.world_size, unit.shard_numel)
        for lo in range(0, unit.shard_numel, per_rank):
            hi = min(lo + per_rank, unit.shard_numel)
            staged = torch.empty(unit.world_size * (hi - lo), dtype=unit.dtype, device=unit.device)
            comm.all_gather_into_tensor(staged, unit.shard[lo:hi].contiguous(), group=unit.group)
            slices[:, lo:hi].copy_(staged.view(unit.world_size, hi - lo))

    def _publish(self) -> None:
        masters = self.masters if self.offload is not None else [None] * len(self.units)
        if self.deferred is not None:  # stages 1-2, no offload: waited at their first reader
            self.deferred.settle()
            for unit in self.deferred.issue_order(self.units):
                self.deferred.add(unit, self._publish_unit(unit))
            return
        self._wait([self._publish_unit(u, m) for u, m in zip(self.units, masters)])

    def before_forward(self) -> None:
        """The engine's forward begins (``overlap_param_gather``: the deferred gathers of the units
        read before the layer stack are waited now)."""
        if self.deferred is not None:
            self.deferred.before_forward()

    def settle(self) -> None:
        """Complete any deferred parameter gathers (``overlap_param_gather``) and a background
        optimizer step (``offload_optimizer.overlap_step``): the parameters are whole and the
        masters and optimizer states up to date after it. Checkpoints and state dicts call it; so
        may a caller that reads the parameters or the optimizer between a step and the next
        forward."""
        if self.deferred is not None:
            self.deferred.settle()
        if self.offload is not None:
            self.offload.settle()

    def _wait(self, handles: list) -> None:
        for handle in handles:
            if handle is not None:
                handle.wait()
        if self.stack is not None:
            self.stack.refresh_shards()
        if self.gatherer is not None:
            self.gatherer.release_all()

    def zero_grad(self) -> None:
        # a background step (offload_optimizer.overlap_step) sets and clears its masters' grads
        # itself: clearing them here could take a chunk's away between the two
        masters = not self.stepping()
        for unit, master in zip(self.units, self.masters):
            unit.grad_shard = None
            if masters:
                master.grad = None
        if self.offload is not None:
            self.offload.zero_grad()

    def reload_shards(self, shards: list[torch.Tensor]) -> None:
        """Set every unit's shard (and master) from ``shards`` and rebuild the resident units'
        full buffers (a collective)."""
        with torch.no_grad():
            for unit, master, shard in zip(self.units, self.masters, shards):
                if self.param_home is not None and self.param_home.holds(unit):
                    self.param_home.write(unit, shard)  # the master shares the home copy
                    continue
                unit.shard.copy_(shard)
                if self.offload is not None:
                    master.copy_(shard)
        self._publish()

    def set_shard(self, unit: FlatUnit, values: torch.Tensor) -> None:
        """Set one unit's shard (and its master, and the layer stack's copy) to ``values``."""
        master = self.masters[unit.index]
        with torch.no_grad():
            if self.param_home is not None and self.param_home.holds(unit):
                self.param_home.write(unit, values)
            else:
                if unit.shard.data_ptr() != values.data_ptr():
                    unit.shard.copy_(values)
                if self.offload is not None:
                    master.copy_(values)
        if self.stack is not None:
            self.stack.refresh_shards()

    def shard_values(self) -> list[torch.Tensor]:
        """Every unit's shard as this rank holds it, CPU copies (checkpoints)."""
        values = []
        for unit, master in zip(self.units, self.masters):
            if self.param_home is not None and self.param_home.holds(unit):
                values.append(self.param_home.read(unit))
            else:
                values.append(master.detach().cpu().clone())
        return values

    # -- whole model --------------------------------------------------------------------------

    def module_state_dict(self) -> dict:
        """The module's full state dict; with stage 3 a collective (copies gathered from every
        rank), otherwise the module's own."""
        if self.gatherer is not None:
            return self.gatherer.gathered_state_dict()
        self.settle()
        return self.module.state_dict()

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state dict with every state in memory (NVMe offload reads its
        swapped states back for it)."""
        if self.offload is not None:
            return self.offload.optimizer_state_dict(optimizer)
        return optimizer.state_dict()

    def optimizer_state_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict``: NVMe offload swaps the loaded states out."""
        if self.offload is not None:
            self.offload.states_loaded(optimizer)

    def remove(self) -> None:
        if self.deferred is not None:
            self.deferred.remove()
        self.reducer.remove()
        if self.gatherer is not None:
            self.gatherer.remove()
        if self.offload is not None:
            self.offload.close()
        if self.param_home is not None:
            self.param_home.close()
