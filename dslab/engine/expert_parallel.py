"""Expert parallelism in the engine (DeepSpeed-MoE's rules): which parameters are experts, over
which group each gradient is reduced, the optimizer's param groups, clipping, and the layout a
checkpoint records.

An MoE layer (:mod:`dslab.moe`) marks every expert parameter with ``param.allreduce = False`` and
``param.group_name = "ep_size_{p}"``. With ``ep_size`` p on W ranks each rank holds 1/p of the
experts, and the gradient a rank computes for its experts is already the sum over its
expert-parallel group's tokens (the all_to_all routed every member's tokens through it). So:

- a non-expert gradient is averaged over the data-parallel group (all W ranks);
- an expert gradient is summed over its expert-data-parallel group (the W/p ranks that hold the
  same experts: ``{r : r mod p == ep_rank}``, :mod:`dslab.moe.groups`) and divided by W.

Then ep_size p gives the gradients of ep_size 1. The global gradient norm counts every expert
shard once: the squared norm of a rank's expert gradients is summed over its expert-parallel
group (different ep ranks hold different experts), the non-expert part is the same everywhere and
is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn

from dslab import comm
from dslab.moe.groups import get_expert_groups


def is_expert_param(param: torch.Tensor) -> bool:
    """DeepSpeed's ``is_moe_param``: the MoE layer sets ``allreduce = False`` on experts."""
    return getattr(param, "allreduce", True) is False


def expert_group_name(param: torch.Tensor) -> str | None:
    """The expert group name (``"ep_size_{p}"``) of an expert parameter; None for the others."""
    if not is_expert_param(param):
        return None
    name = getattr(param, "group_name", None)
    if not isinstance(name, str):
        raise ValueError(f"a parameter of shape {tuple(param.shape)} is marked as an expert "
                         "(allreduce=False) but has no group_name naming its expert groups "
                         "(DeepSpeed's convention: 'ep_size_{p}')")
    return name


@dataclass(frozen=True)
class ReductionGroup:
    """Where one parameter's gradient is reduced.

    ``group`` (None: the default group) has ``size`` ranks, this rank is ``rank`` in it; the
    gradient is summed over it and divided by ``divisor`` (the data-parallel world size).
    ``source_rank`` is the global rank every member starts from (its weights are broadcast from
    there). Expert parameters also carry their expert-parallel group, over which the squared
    gradient norms are summed.
    """

    name: str | None
    group: object
    size: int
    rank: int
    divisor: int
    source_rank: int = 0
    ep_size: int = 1
    expert_parallel_group: object = None

    @property
    def is_expert(self) -> bool:
        return self.name is not None

    def averaging_op(self):
        """``ReduceOp.AVG`` when the collective itself can divide (nccl, and the group has
        ``divisor`` ranks); None when the sender divides before a SUM."""
        if self.size != self.divisor:
            return None
        return comm.averaging_op(self.group)


def reduction_group(param: torch.Tensor, data_parallel_group=None) -> ReductionGroup:
    """The :class:`ReductionGroup` of ``param``: the data-parallel group, or for an expert its
    expert-data-parallel group (whose first member, global rank ``ep_rank``, is the source)."""
    world = comm.get_world_size(data_parallel_group)
    name = expert_group_name(param)
    if name is None:
        return ReductionGroup(None, data_parallel_group, world, comm.get_rank(data_parallel_group),
                              world)
    if world != comm.get_world_size():
        raise ValueError("expert parameters need the data-parallel group to be the whole world: "
                         "their expert-data-parallel groups are cut from it")
    groups = get_expert_groups(name)
    return ReductionGroup(name, groups.expert_data_parallel, groups.expert_data_parallel_size,
                          comm.get_rank() // groups.ep_size, world, source_rank=groups.ep_rank,
                          ep_size=groups.ep_size, expert_parallel_group=groups.expert_parallel)


# -- optimizer param groups -----------------------------------------------------------------------


def _as_groups(params: Iterable) -> list[dict]:
    """``params`` (tensors, or param-group dicts) as param-group dicts with list ``params``."""
    params = list(params)
    if not params or not isinstance(params[0], dict):
        return [{"params": params}]
    return [dict(g, params=[g["params"]] if torch.is_tensor(g["params"]) else list(g["params"]))
            for g in params]


def parameters_of(params: Iterable) -> list[torch.Tensor]:
    """The tensors of ``params``: tensors, or param-group dicts holding them."""
    return [p for group in _as_groups(params) for p in group["params"]]


def split_param_groups(params: Iterable) -> list:
    """DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``, as the engine applies
    it: every param group's expert parameters move into a group of their own per expert group
    name, with the group's options plus ``name`` (the expert group name) and ``moe: True``.

    ``params`` are tensors (e.g. ``model.parameters()``) or param-group dicts; without expert
    parameters they come back as they are (as a list). Groups already split (``moe: True``
    holding only the experts of one name) are kept; a group left empty by the split is dropped.
    Raises ValueError for a ``moe`` group that holds anything else.
    """
    params = list(params)
    groups = _as_groups(params)
    if not any(is_expert_param(p) for g in groups for p in g["params"]) and \
            not any(g.get("moe") for g in groups):
        return params
    out = []
    for index, group in enumerate(groups):
        names = {expert_group_name(p) for p in group["params"]}
        if group.get("moe"):
            if len(names) > 1 or None in names:
                held = ("non-expert parameters" if None in names
                        else f"the experts of {sorted(names)}")
                raise ValueError(f"optimizer param group {index} is marked 'moe': True and holds "
                                 f"{held}; a moe group holds the experts of one expert group name")
            out.append(dict(group, name=names.pop()) if names else group)
            continue
        options = {k: v for k, v in group.items() if k != "params"}
        dense = [p for p in group["params"] if not is_expert_param(p)]
        if dense or names <= {None}:
            out.append(dict(options, params=dense))
        for name in sorted(n for n in names if n is not None):
            experts = [p for p in group["params"] if expert_group_name(p) == name]
            out.append(dict(options, params=experts, name=name, moe=True))
    return out


# -- the layout a checkpoint records --------------------------------------------------------------


def expert_layout(params: Iterable[torch.Tensor]) -> dict | None:
    """``{"world_size": W, "expert_groups": {group name: ep_size}}`` for a model with expert
    parameters; None without."""
    names = {expert_group_name(p) for p in params} - {None}
    if not names:
        return None
    return {"world_size": comm.get_world_size(),
            "expert_groups": {name: get_expert_groups(name).ep_size for name in sorted(names)}}


def describe_layout(layout: dict | None) -> str:
    if layout is None:
        return "no expert parameters"
    groups = ", ".join(f"{name}: ep_size {size}" for name, size in layout["expert_groups"].items())
    return f"world size {layout['world_size']} with expert groups {{{groups}}}"


# -- the step -------------------------------------------------------------------------------------


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads)
    return torch.stack([n.float().to(device) for n in norms]).square().sum()


def global_grad_norm(params: list[nn.Parameter], data_parallel_group=None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient when every rank holds whole averaged gradients
    (stage 0): the non-expert part from this rank, each expert group's part summed over its
    expert-parallel group (a collective per expert group name). A 0-dim float32 tensor."""
    device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
    by_name: dict[str | None, list[torch.Tensor]] = {}
    reduction: dict[str, ReductionGroup] = {}
    for p in params:
        name = expert_group_name(p)
        if name is not None and name not in reduction:
            reduction[name] = reduction_group(p, data_parallel_group)
        if p.grad is not None:
            by_name.setdefault(name, []).append(p.grad)
    total = _squared_norm(by_name.get(None, []), device)
    for name in sorted(reduction):
        part = _squared_norm(by_name.get(name, []), device)
        if reduction[name].ep_size > 1:
            comm.all_reduce(part, group=reduction[name].expert_parallel_group)
        total = total + part
    return total.sqrt()


def clip_gradients(params: list[nn.Parameter], max_norm: float, data_parallel_group=None
                   ) -> torch.Tensor:
    """Scale the gradients by ``min(1, max_norm / (norm + 1e-6))`` as
    ``torch.nn.utils.clip_grad_norm_`` does, with the norm of :func:`global_grad_norm`.
    Returns the norm."""
    norm = global_grad_norm(params, data_parallel_group)
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_key.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, dtype), grads in by_key.items():
        torch._foreach_mul_(grads, coefficient.to(device=device, dtype=dtype))
    return norm
