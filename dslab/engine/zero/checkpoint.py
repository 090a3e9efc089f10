"""Sharded checkpoints for ZeRO: every rank writes its own shard into the checkpoint.

Inside ``<save_dir>/<tag>/`` (the layout of :mod:`dslab.engine.checkpointing`), a ZeRO run adds
one ``zero_shard_rank<r>.pt`` per rank (format in :mod:`.consolidate`) and leaves out
``optimizer.pt`` (the optimizer states are in the shards). ``model.pt`` holds the module's state
dict, without the sharded parameters at stage 3. ``engine.pt`` gains a ``zero`` entry::

    {"stage": s, "world_size": W, "units": [UnitLayout.to_dict(), ...],
     "state_dict_keys": [[key, parameter name or None], ...]}    # None: the value is in model.pt

The save is one atomic checkpoint written by several processes
(:mod:`dslab.engine.checkpoint_ranks`): every rank writes its shard into the directory rank 0
began, and rank 0 commits it. A failure on any rank fails the save on every rank.

Loading at the save's world size with the same units reads only this rank's shard and resumes
bit for bit. Otherwise (another world size, another stage or bucket size) every rank reads all
the shards, rebuilds whole per-parameter tensors and cuts its new shard from them: the memory of
one full copy of the model states on each rank, for the duration of the load.

Expert units (of MoE layers, partitioned over their expert-data-parallel group) are in the same
shard files: each rank's file holds its partition of every unit. Their layouts carry
``expert_group``. A checkpoint with experts loads only at its own world size and expert-parallel
layout (checked by :mod:`dslab.engine.expert_checkpoint`); with other units (another stage or
bucket size) only its weights load, from ``model.pt`` and the expert files.
"""

from __future__ import annotations

from pathlib import Path

from dslab.engine.checkpoint_io import CheckpointError, load_checkpoint_files
from dslab.engine.zero.consolidate import (
    SHARD_FORMAT_VERSION,
    full_optimizer_states,
    full_param_values,
    load_shards,
    shard_file_name,
    shard_for,
)


def state_dict_sources(runtime) -> list[list]:
    """``[key, parameter name or None]`` for every key of the module's state dict."""
    name_of = {id(p): name for u in runtime.units for name, p in zip(u.layout.names, u.params)}
    return [[key, name_of.get(id(value))]
            for key, value in runtime.module.state_dict(keep_vars=True).items()]


def model_state(runtime) -> dict:
    """What rank 0 stores in ``model.pt``: the module's state dict, less the sharded parameters
    at stage 3 (their data is not on one rank)."""
    state = runtime.module.state_dict()
    if runtime.stage < 3:
        return state
    sharded = {key for key, source in state_dict_sources(runtime) if source is not None}
    return {k: v for k, v in state.items() if k not in sharded}


def metadata(runtime) -> dict:
    return {"stage": runtime.stage, "world_size": runtime.world_size,
            "units": [u.layout.to_dict() for u in runtime.units],
            "state_dict_keys": state_dict_sources(runtime)}


def shard_state(runtime, optimizer) -> dict:
    """This rank's shard file (see :mod:`.consolidate`), CPU tensors."""
    index_of = {id(m): i for i, m in enumerate(runtime.masters)}
    order = [index_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "format_version": SHARD_FORMAT_VERSION,
        "rank": runtime.rank,
        "world_size": runtime.world_size,
        "stage": runtime.stage,
        "units": [u.layout.to_dict() for u in runtime.units],
        "params": runtime.shard_values(),
        "optimizer": runtime.optimizer_state_dict(optimizer),
        "optimizer_units": order,
    }


def load(runtime, optimizer, path: Path, files: dict, load_optimizer_states: bool,
         strict: bool) -> None:
    """Restore the module's unsharded state from ``files["model"]`` and the shards (and the
    optimizer's sharded states) from the shard files of the checkpoint at ``path``."""
    saved = files["engine"].get("zero")
    _load_unsharded(runtime, files["model"], saved, path, strict)
    layouts = [u.layout for u in runtime.units]
    where = str(path)
    if saved is None:
        if load_optimizer_states and optimizer is not None:
            raise CheckpointError(
                f"{path} was saved without ZeRO (stage 0) and this engine runs ZeRO stage "
                f"{runtime.stage}: its optimizer state is not sharded; pass "
                "load_optimizer_states=False to load only the weights")
        values = _model_values(runtime, files["model"], where)
        runtime.reload_shards(_shards_from(values, runtime, where))
        return
    same_layout = [u.to_dict() for u in layouts] == saved["units"]
    experts = any(lay.expert_group is not None for lay in layouts) or \
        any("expert_group" in unit for unit in saved["units"])
    if int(saved["world_size"]) == runtime.world_size and same_layout:
        name = shard_file_name(runtime.rank)
        _, loaded, _ = load_checkpoint_files(path.parent, path.name, names=[name])
        if name not in loaded:
            raise CheckpointError(f"{path} is missing its ZeRO shard file {name}.pt")
        shard = loaded[name]
        runtime.reload_shards(shard["params"])
        if load_optimizer_states and optimizer is not None:
            _load_optimizer(optimizer, shard["optimizer"], path / f"{name}.pt")
            runtime.optimizer_state_loaded(optimizer)
        return
    if experts:
        if load_optimizer_states and optimizer is not None:
            raise CheckpointError(
                f"{path} was saved with other ZeRO units (stage {saved['stage']}) than this "
                f"engine's (stage {runtime.stage}): expert-parallel optimizer states are restored "
                "only with the same stage and reduce_bucket_size; pass "
                "load_optimizer_states=False to load the weights")
        values = _model_values(runtime, files["model"], where)
        runtime.reload_shards(_shards_from(values, runtime, where))
        return
    shards = load_shards(path.parent, path.name, int(saved["world_size"]))
    values = full_param_values(shards)
    runtime.reload_shards(_shards_from(values, runtime, where))
    if load_optimizer_states and optimizer is not None:
        _load_optimizer(optimizer, _repartitioned_optimizer(runtime, optimizer, shards, where),
                        path)
        runtime.optimizer_state_loaded(optimizer)


def _shards_from(values: dict, runtime, where: str) -> list:
    """This rank's shard of every unit, cut from whole per-parameter tensors (each unit over its
    own partition: the data-parallel ranks, or an expert unit's expert-data-parallel ranks)."""
    return [shard_for(values, u.layout, u.world_size, u.rank, where) for u in runtime.units]


def _load_optimizer(optimizer, state: dict, where) -> None:
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{where} does not match the optimizer: {err}") from None


def _load_unsharded(runtime, state: dict, saved, path: Path, strict: bool) -> None:
    sharded_keys = {key for key, source in state_dict_sources(runtime) if source is not None}
    own = runtime.module.state_dict(keep_vars=True)
    if strict:
        missing = sorted(set(own) - set(state) - sharded_keys)
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise CheckpointError(f"{path / 'model.pt'} does not match the model: missing keys "
                                  f"{missing[:5]}, unexpected keys {unexpected[:5]}")
    unsharded = {k: v for k, v in state.items() if k in own and k not in sharded_keys}
    for key, value in unsharded.items():
        if tuple(own[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{path / 'model.pt'} does not match the model: '{key}' has shape "
                f"{tuple(value.shape)} in the checkpoint and {tuple(own[key].shape)} in the model")
    runtime.module.load_state_dict(unsharded, strict=False)


def _model_values(runtime, state: dict, where: str) -> dict:
    """Whole sharded parameters by name, from a full ``model.pt`` (a stage 0 checkpoint)."""
    values = {}
    for key, source in state_dict_sources(runtime):
        if source is not None and key in state:
            values.setdefault(source, state[key])
    for unit in runtime.units:
        for name, shape in zip(unit.layout.names, unit.layout.shapes):
            if name in values and tuple(values[name].shape) != shape:
                raise CheckpointError(f"{where}/model.pt does not match the model: '{name}' has "
                                      f"shape {tuple(values[name].shape)} in the checkpoint and "
                                      f"{shape} in the model")
    return values


def _repartitioned_optimizer(runtime, optimizer, shards: list[dict], where: str) -> dict:
    """The optimizer state dict for this rank's masters, cut from the whole states."""
    per_param, saved_groups = full_optimizer_states(shards)
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{where} has {len(saved_groups)} optimizer param groups and the "
                              f"optimizer {len(optimizer.param_groups)}")
    unit_of_master = {id(m): u for u, m in zip(runtime.units, runtime.masters)}
    state, groups, index = {}, [], 0
    for saved_group, group in zip(saved_groups, optimizer.param_groups):
        indices = []
        for master in group["params"]:
            unit = unit_of_master[id(master)]
            names = unit.layout.names
            present = [n in per_param for n in names]
            if any(present) and not all(present):
                raise CheckpointError(f"{where} holds optimizer state for only some of "
                                      f"{list(names)}")
            if all(present):
                first = per_param[names[0]]
                entry = dict(first["scalar"])
                for key in first["elementwise"]:
                    whole = {n: per_param[n]["elementwise"][key] for n in names}
                    entry[key] = shard_for(whole, unit.layout, unit.world_size, unit.rank,
                                           where).to(master.device)
                state[index] = entry
            indices.append(index)
            index += 1
        groups.append(dict(saved_group, params=indices))
    return {"state": state, "param_groups": groups}
