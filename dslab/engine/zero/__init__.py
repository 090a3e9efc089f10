"""ZeRO stages 1 to 3 (Rajbhandari et al., 2020, arXiv:1910.02054) over :mod:`dslab.comm`.

- Stage 1 shards the optimizer states: each rank steps the optimizer on its shard of every unit
  (see :mod:`.partition`), gradients are reduce-scattered on the accumulation boundary and the
  updated shards all-gathered back into the full parameters.
- Stage 2 also shards the gradients: every backward reduce-scatters them in buckets while it runs
  and keeps only this rank's shard (:mod:`.grads`).
- Stage 3 also shards the parameters: each module's parameters are all-gathered just before its
  forward and backward, prefetched, and released after use, or kept from forward to backward
  when the backward comes soon enough (``stage3_max_reuse_distance``; :mod:`.stage3`).

``offload_optimizer.device: cpu`` keeps the optimizer's masters, gradients and states in CPU
memory and steps there, pipelined with the copies to and from the GPU (:mod:`.offload`);
``device: nvme`` also swaps the optimizer states to files (:mod:`.nvme_offload`). Checkpoints
are sharded per rank
(:mod:`.checkpoint`); ``dslab zero-to-fp32`` consolidates them (:mod:`.consolidate`).

Expert parameters of MoE layers (:mod:`dslab.engine.expert_parallel`) are partitioned at stages
1 and 2 like the others, but over their expert-data-parallel group (the ranks that hold the same
experts): their units are reduce-scattered and all-gathered there, summed and divided by the
data-parallel world size. At stage 3 an expert's units are also gathered over that group, before
its module's forward and backward, like any other module's.

Every collective goes through :mod:`dslab.comm` (``reduce_scatter`` and ``all_gather``, sized as
nccl-tests count them), so the comms logger sees them all.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dslab.engine.zero.consolidate import consolidated_state_dict, zero_to_fp32
from dslab.engine.zero.runtime import ZeroRuntime, refuse_lamb

__all__ = ["ZeroRuntime", "build_zero", "consolidated_state_dict", "zero_to_fp32"]


def build_zero(module: nn.Module, config, optimizer, params: list, build_from_config, *,
               device: torch.device | None = None, broadcast: bool = False, group=None
               ) -> tuple[ZeroRuntime, torch.optim.Optimizer]:
    """The ZeRO runtime for ``module`` and the optimizer over its masters.

    ``device``, ``broadcast`` and ``group`` go to :class:`ZeroRuntime` (where the units live;
    whether each unit starts from the group's first rank's values; the data-parallel group the
    shards are cut over, None for the world).

    ``optimizer`` is what was passed to ``initialize()``: a torch optimizer built on the model's
    parameters (re-pointed at the masters), a callable (called with the masters' param groups),
    or None (``build_from_config(param_groups, fused_ok)`` builds the config's optimizer over
    ``params``).
    """
    zero = config.zero_optimization
    if isinstance(optimizer, torch.optim.Optimizer):
        refuse_lamb(optimizer, zero.stage)
        runtime = ZeroRuntime(module, zero, optimizer.param_groups, device=device,
                              broadcast=broadcast, aio=config.aio, group=group,
                              comm_dtype=config.communication_dtype,
                              scaling=config.gradient_scaling)
        return runtime, runtime.adopt(optimizer)
    if optimizer is not None and not callable(optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
    if optimizer is None and config.optimizer is None:
        raise ValueError(
            f"ZeRO stage {zero.stage} ('zero_optimization.stage') shards an optimizer's states: "
            "pass an optimizer to initialize() or add an 'optimizer' section to the config")
    runtime = ZeroRuntime(module, zero, params, device=device, broadcast=broadcast,
                          aio=config.aio, group=group, comm_dtype=config.communication_dtype,
                          scaling=config.gradient_scaling)
    if callable(optimizer):
        built = optimizer(runtime.optimizer_param_groups())
        if not isinstance(built, torch.optim.Optimizer):
            raise ValueError("the optimizer callable must return a torch.optim.Optimizer")
        refuse_lamb(built, zero.stage)
        return runtime, built
    return runtime, build_from_config(runtime.optimizer_param_groups(), runtime.fused_ok)
