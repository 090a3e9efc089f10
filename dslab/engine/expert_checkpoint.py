"""Expert parameters in checkpoints: saved per expert-parallel rank, beside the non-expert state.

With ep_size p the ranks hold p different sets of experts under the same parameter names, so no
one rank's state dict is the model's. Inside ``<save_dir>/<tag>/`` (:mod:`checkpointing`), for
every expert group name ``g`` (``"ep_size_{p}"``) and ep rank ``e`` in ``0 .. p-1``:

- ``expert_model_{g}_ep_rank{e:05d}.pt``: ``{"group_name": g, "ep_size": p, "ep_rank": e,
  "state": {state dict key: tensor}}``, the expert parameters that ep rank ``e`` holds;
- ``expert_optim_{g}_ep_rank{e:05d}.pt`` (ZeRO stage 0 only): the same header and ``"state":
  {optimizer param index: that parameter's optimizer state}``. With ZeRO stages 1 and 2 the
  experts' optimizer states are partitioned over their expert-data-parallel group and live in
  every rank's ``zero_shard_rank<r>.pt`` (:mod:`dslab.engine.zero.checkpoint`), as DeepSpeed's
  ``zero_pp_rank_*`` files hold them.

Each is written by the first rank of the expert-data-parallel group holding those experts (global
rank ``e``; the others hold the same values). ``model.pt`` and ``optimizer.pt`` hold the
non-expert state once, without the expert keys and states. ``engine.pt`` and the manifest's
metadata record the layout, ``{"world_size": W, "expert_groups": {g: p}}``.

A checkpoint is loaded only at the layout it was saved with (the same world size and ep_size per
group name; with experts or without): anything else raises :class:`CheckpointError` naming both
layouts. Loading reads this rank's expert files and merges them into the model's (and at stage 0
the optimizer's) state, which then load as one rank's whole state.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dslab import comm
from dslab.engine.checkpoint_io import CheckpointError, load_checkpoint_files
from dslab.engine.expert_parallel import describe_layout, expert_group_name
from dslab.moe.groups import get_expert_groups


def expert_model_file(group_name: str, ep_rank: int) -> str:
    return f"expert_model_{group_name}_ep_rank{ep_rank:05d}"


def expert_optim_file(group_name: str, ep_rank: int) -> str:
    return f"expert_optim_{group_name}_ep_rank{ep_rank:05d}"


def expert_keys(module: torch.nn.Module) -> dict[str, str]:
    """State dict key -> expert group name, for the module's expert parameters."""
    return {key: name for key, value in module.state_dict(keep_vars=True).items()
            if (name := expert_group_name(value)) is not None}


def without_experts(state: dict, keys: dict[str, str]) -> dict:
    """``state`` (a module state dict) less the expert keys: what ``model.pt`` holds."""
    return {k: v for k, v in state.items() if k not in keys}


def _optimizer_expert_indices(optimizer) -> dict[int, str]:
    """Optimizer param index (as in its state dict) -> expert group name, for expert params."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: name for i, p in enumerate(params) if (name := expert_group_name(p)) is not None}


def optimizer_without_experts(optimizer) -> dict:
    """The optimizer's state dict less the experts' states: what stage 0's ``optimizer.pt``
    holds."""
    state = optimizer.state_dict()
    experts = _optimizer_expert_indices(optimizer)
    return dict(state, state={i: s for i, s in state["state"].items() if i not in experts})


def _header(group_name: str) -> dict:
    groups = get_expert_groups(group_name)
    return {"group_name": group_name, "ep_size": groups.ep_size, "ep_rank": groups.ep_rank}


def own_files(module: torch.nn.Module, optimizer, stage: int) -> dict[str, dict]:
    """The expert files this rank writes: those of every expert group for which it is the first
    rank of its expert-data-parallel group (CPU tensors)."""
    keys = expert_keys(module)
    names = sorted(set(keys.values()))
    rank = comm.get_rank()
    writes = [g for g in names if rank // get_expert_groups(g).ep_size == 0]
    if not writes:
        return {}
    files = {}
    state = module.state_dict()
    optimizer_state = optimizer.state_dict() if stage == 0 and optimizer is not None else None
    indices = _optimizer_expert_indices(optimizer) if optimizer_state is not None else {}
    for name in writes:
        header = _header(name)
        files[expert_model_file(name, header["ep_rank"])] = dict(header, state={
            key: state[key].detach().cpu().clone() for key, g in keys.items() if g == name})
        if optimizer_state is not None:
            files[expert_optim_file(name, header["ep_rank"])] = dict(header, state={
                i: s for i, s in optimizer_state["state"].items() if indices.get(i) == name})
    return files


def check_layout(path: Path, saved: dict | None, current: dict | None) -> None:
    """Raise CheckpointError naming both layouts when ``saved`` (the checkpoint's) is not
    ``current`` (this engine's)."""
    if saved == current:
        return
    raise CheckpointError(
        f"{path} was saved with expert-parallel layout ({describe_layout(saved)}) and this "
        f"engine runs ({describe_layout(current)}): an expert-parallel checkpoint loads only at "
        "the world size and ep_size it was saved with")


def merge_expert_files(path: Path, module: torch.nn.Module, files: dict,
                       with_optimizer: bool) -> None:
    """Read this rank's expert files of the checkpoint at ``path`` and merge them into
    ``files["model"]`` and, with ``with_optimizer`` (a stage 0 checkpoint whose optimizer state
    is wanted), into ``files["optimizer"]["state"]``."""
    names = sorted(set(expert_keys(module).values()))
    wanted = {}
    for name in names:
        ep_rank = get_expert_groups(name).ep_rank
        wanted[expert_model_file(name, ep_rank)] = "model"
        if with_optimizer:
            wanted[expert_optim_file(name, ep_rank)] = "optimizer"
    _, loaded, _ = load_checkpoint_files(path.parent, path.name, names=list(wanted))
    missing = sorted(n for n in wanted if n not in loaded)
    if missing:
        raise CheckpointError(f"{path} is missing expert file(s) "
                              f"{', '.join(n + '.pt' for n in missing)}")
    model = dict(files["model"])
    optimizer = None
    if with_optimizer and "optimizer" in files:
        optimizer = dict(files["optimizer"], state=dict(files["optimizer"]["state"]))
    for file_name, kind in wanted.items():
        if kind == "model":
            model.update(loaded[file_name]["state"])
        elif optimizer is not None:
            optimizer["state"].update(loaded[file_name]["state"])
    files["model"] = model
    if optimizer is not None:
        files["optimizer"] = optimizer
