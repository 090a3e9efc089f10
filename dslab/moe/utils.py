"""Parameter helpers for MoE models (DeepSpeed's ``deepspeed.moe.utils`` names).

Expert parameters are the ones an :class:`dslab.moe.layer.MoE` marked with ``allreduce = False``
and ``group_name = "ep_size_{p}"``; the engine reduces them over that expert-data-parallel group.
Optimizers that shard or reduce state per group want them in param groups of their own, one per
``group_name``, marked ``'moe': True``.
"""

from __future__ import annotations

from torch import nn

from dslab.moe.layer import MoE

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default: parameters (elements) per expert group


def is_moe_param(param) -> bool:
    """True for a parameter an MoE layer marked as an expert's (``allreduce`` is False)."""
    return getattr(param, "allreduce", True) is False


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """``(whether model holds an MoE layer, the number of experts of the last one found)``."""
    found, num_experts = False, 0
    for module in model.modules():
        if isinstance(module, MoE):
            found, num_experts = True, module.num_experts
    return found, num_experts


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """``(shared, expert)`` parameter lists."""
    params = list(params)
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=DEFAULT_MAX_GROUP_SIZE):
    """Split each param group into its non-expert parameters and one group per expert ``group_name``.

    ``param_groups``: a dict, a list or a tuple of dicts with a ``'params'`` entry (the other keys,
    e.g. ``lr`` and ``weight_decay``, are copied to the expert groups). Each expert group gets
    ``'moe': True`` and ``'name': group_name``; with ``max_group_size`` (elements, or None) an
    expert group is cut into several of at most that many elements (a single larger parameter
    gets a group of its own). Returns a tuple of groups: the shared ones first, in order, then the
    expert ones. The input dicts are not modified.
    """
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups must be a dict, a list or a tuple of dicts, got {type(param_groups).__name__}")
    if max_group_size is not None and (isinstance(max_group_size, bool) or not isinstance(max_group_size, int)
                                       or max_group_size < 1):
        raise ValueError(f"max_group_size must be a positive int or None, got {max_group_size!r}")
    shared_groups, expert_groups = [], []
    for group in param_groups:
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError("each entry of param_groups must be a dict with a 'params' entry")
        params = group["params"]
        params = [params] if not isinstance(params, (list, tuple)) and hasattr(params, "data") else list(params)
        by_name: dict[str, list] = {}
        shared = []
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
            else:
                shared.append(p)
        shared_groups.append({**group, "params": shared})
        options = {key: value for key, value in group.items() if key not in ("params", "name")}
        for name, expert_params in by_name.items():
            for chunk in _chunks(expert_params, max_group_size):
                expert_groups.append({**options, "name": name, "moe": True, "params": chunk})
    return tuple(shared_groups + expert_groups)


def _chunks(params: list, max_group_size: int | None) -> list[list]:
    if max_group_size is None:
        return [params]
    chunks, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > max_group_size:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        chunks.append(current)
    return chunks
