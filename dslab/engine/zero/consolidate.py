"""Rebuild whole tensors from ZeRO shard files, and ``dslab zero-to-fp32``.

Everything here reads CPU tensors from checkpoint files: no GPU, no process group.

A shard file (one per rank, ``zero_shard_rank<r>.pt``) holds::

    {"format_version": 1, "rank": r, "world_size": W, "stage": s,
     "units": [UnitLayout.to_dict(), ...],          # the same list on every rank
     "params": [1-D tensor of S_u elements per unit],
     "optimizer": torch optimizer state_dict over this rank's masters,
     "optimizer_units": [unit index of each optimizer param index]}

Unit ``u``'s flat buffer is the concatenation of the ranks' ``params[u]`` in rank order; its first
``numel`` elements are its parameters end to end (see :mod:`partition`). Optimizer states with one
value per element (Adam's ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``) are 1-D tensors
of ``S_u`` elements and are rebuilt the same way; other states (``step``) are the same on every
rank and are taken from rank 0.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import torch

from dslab.engine.checkpoint_io import CheckpointError, load_checkpoint_files
from dslab.engine.zero.partition import UnitLayout, flatten

SHARD_FORMAT_VERSION = 1


def shard_file_name(rank: int) -> str:
    return f"zero_shard_rank{rank:05d}"


def _layouts(shards: list[dict]) -> list[UnitLayout]:
    return [UnitLayout.from_dict(d) for d in shards[0]["units"]]


def check_shards(shards: list[dict], where: str) -> None:
    """Raise CheckpointError naming ``where`` when the shard files do not form one checkpoint."""
    world = len(shards)
    for rank, shard in enumerate(shards):
        if shard.get("format_version") != SHARD_FORMAT_VERSION:
            raise CheckpointError(f"{where}: {shard_file_name(rank)}.pt has format version "
                                  f"{shard.get('format_version')!r}; this dslab reads "
                                  f"{SHARD_FORMAT_VERSION}")
        if shard["rank"] != rank or shard["world_size"] != world or \
                shard["units"] != shards[0]["units"]:
            raise CheckpointError(f"{where}: {shard_file_name(rank)}.pt does not belong to a "
                                  f"{world}-rank checkpoint with rank 0's units")


def full_param_values(shards: list[dict]) -> dict[str, torch.Tensor]:
    """Every sharded parameter, whole, by name (CPU tensors in the checkpoint's dtype)."""
    values = {}
    for index, layout in enumerate(_layouts(shards)):
        flat = torch.cat([shard["params"][index] for shard in shards])
        values.update(_split(flat, layout))
    return values


def _split(flat: torch.Tensor, layout: UnitLayout) -> dict[str, torch.Tensor]:
    return {name: flat[offset: offset + size].view(shape).clone()
            for name, shape, offset, size in zip(layout.names, layout.shapes, layout.offsets,
                                                 layout.sizes)}


def full_optimizer_states(shards: list[dict]) -> tuple[dict[str, dict], list[dict]]:
    """Per-parameter optimizer states, whole: ``({name: {"elementwise": {key: tensor shaped
    like the parameter}, "scalar": {key: value}}}, param_groups)``.

    ``param_groups`` are rank 0's (their ``params`` lists refer to the saved indices)."""
    layouts = _layouts(shards)
    world = len(shards)
    per_param: dict[str, dict] = {}
    states = [shard["optimizer"]["state"] for shard in shards]
    for index, unit_index in enumerate(shards[0]["optimizer_units"]):
        if index not in states[0]:
            continue
        layout = layouts[unit_index]
        shard_numel = layout.shard_numel(world)
        for key, value in states[0][index].items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == shard_numel:
                flat = torch.cat([states[r][index][key] for r in range(world)])
                for name, tensor in _split(flat.cpu(), layout).items():
                    _entry(per_param, name)["elementwise"][key] = tensor
            else:
                for name in layout.names:
                    _entry(per_param, name)["scalar"][key] = value
    return per_param, shards[0]["optimizer"]["param_groups"]


def _entry(per_param: dict, name: str) -> dict:
    return per_param.setdefault(name, {"elementwise": {}, "scalar": {}})


def shard_for(values: dict[str, torch.Tensor], layout: UnitLayout, world_size: int, rank: int,
              where: str) -> torch.Tensor:
    """This rank's shard of a unit, cut from whole per-parameter tensors."""
    missing = [n for n in layout.names if n not in values]
    if missing:
        raise CheckpointError(f"{where} holds no value for parameter(s) {missing[:5]}")
    flat = flatten([values[n] for n in layout.names], layout.padded(world_size))
    size = layout.shard_numel(world_size)
    return flat[rank * size: (rank + 1) * size].clone()


def load_shards(load_dir, tag: str, world_size: int) -> list[dict]:
    names = [shard_file_name(r) for r in range(world_size)]
    path, files, _ = load_checkpoint_files(load_dir, tag, names=names)
    missing = [n for n in names if n not in files]
    if missing:
        raise CheckpointError(f"{path} is missing ZeRO shard file(s) {', '.join(missing)}")
    shards = [files[n] for n in names]
    check_shards(shards, str(path))
    return shards


def _resolve_tag(checkpoint_dir: Path, tag: str | None) -> tuple[Path, str]:
    if tag is None and (checkpoint_dir / "manifest.json").is_file():
        return checkpoint_dir.parent, checkpoint_dir.name
    return checkpoint_dir, tag


def consolidated_state_dict(checkpoint_dir, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The model's full state dict from a checkpoint (any ZeRO stage), floating tensors in fp32.

    ``checkpoint_dir`` is a save directory (``tag`` or its ``latest`` picks the checkpoint) or
    one checkpoint's own directory. Equals ``engine.module_state_dict()`` at the save.
    """
    load_dir, tag = _resolve_tag(Path(checkpoint_dir), tag)
    path, files, _ = load_checkpoint_files(load_dir, tag, names=["model", "engine"])
    for name in ("model", "engine"):
        if name not in files:
            raise CheckpointError(f"{path} is not an engine checkpoint: {name}.pt is missing")
    layout = files["engine"].get("expert_layout")
    if layout is not None:
        raise CheckpointError(
            f"{path} holds expert parameters ({', '.join(layout['expert_groups'])}): the ep "
            "ranks' experts share parameter names, so they have no one consolidated state dict; "
            "model.pt holds the other weights and expert_model_*.pt each ep rank's experts")
    zero = files["engine"].get("zero")
    if zero is None:
        state = dict(files["model"])
    else:
        values = full_param_values(load_shards(load_dir, path.name, int(zero["world_size"])))
        state = {key: values[source] if source is not None else files["model"][key]
                 for key, source in zero["state_dict_keys"]}
    return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in state.items()}


def zero_to_fp32(checkpoint_dir, out, tag: str | None = None) -> Path:
    """Write :func:`consolidated_state_dict` to ``out`` (torch.save, atomically: a temporary file
    beside it, then a rename). Returns ``out``."""
    state = consolidated_state_dict(checkpoint_dir, tag)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(8)}"
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
