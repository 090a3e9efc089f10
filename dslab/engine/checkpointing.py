"""What the engine puts in a checkpoint and how it resumes from one.

Layout of ``<save_dir>/<tag>/`` (written by :mod:`checkpoint_io`: aside, then renamed):

- ``model.pt``: the module's state dict.
- ``optimizer.pt``, ``scheduler.pt``: their state dicts (when present).
- ``engine.pt``: counters, the loss scaler, the world size, and every rank's RNG state.
- ``client_state.pt``: the caller's ``client_state``.
- ``manifest.json``: sizes and checksums of the above, and the config.

With data parallelism (ZeRO stage 0) every rank holds the same states, so rank 0 writes and the
others wait at a barrier; the RNG states of all ranks are gathered so each resumes its own stream.
With ZeRO stages 1 to 3 every rank also writes its shard (``zero_shard_rank<r>.pt``, holding the
optimizer state partition and the parameter shards) into the same checkpoint, and there is no
``optimizer.pt``: see :mod:`dslab.engine.zero.checkpoint`. A model with expert parameters (MoE)
saves them per expert-parallel rank in files of their own, written by the ranks that hold them,
and records its expert-parallel layout: see :mod:`dslab.engine.expert_checkpoint`.

Engines with tensor or pipeline parallelism save per (tensor, pipeline) coordinate instead, with
their layout in the manifest (:mod:`dslab.engine.model_parallel_checkpoint`); :func:`load` refuses
such a checkpoint by name, as it holds no whole model.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import torch

from dslab import comm
from dslab.engine import expert_checkpoint, model_parallel_checkpoint
from dslab.engine.checkpoint_io import CheckpointError, load_checkpoint_files, save_checkpoint_files
from dslab.engine.checkpoint_ranks import save_from_ranks
from dslab.engine.expert_parallel import describe_layout
from dslab.engine.rng import capture_rng_state, restore_rng_state
from dslab.engine.zero import checkpoint as zero_checkpoint
from dslab.engine.zero.consolidate import shard_file_name
from dslab.io.handle import AsyncIOHandle

_ENGINE_FILES = ("model", "optimizer", "scheduler", "engine", "client_state")

log = logging.getLogger(__name__)


def save(engine, save_dir, tag, client_state: dict, save_latest: bool) -> Path:
    """Write the checkpoint (module docstring); with the config's ``aio`` section every file
    goes through an async I/O handle built from it (:mod:`dslab.engine.checkpoint_io`)."""
    if tag is None:
        tag = f"global_step{engine.global_steps}"
    tag = str(tag)
    handle = AsyncIOHandle.from_config(engine.config.aio) if engine.config.aio is not None else None
    try:
        return _save(engine, save_dir, tag, client_state, save_latest, handle)
    finally:
        if handle is not None:
            handle.close()


def _save(engine, save_dir, tag: str, client_state: dict, save_latest: bool, handle) -> Path:
    rng_states = comm.all_gather_object(capture_rng_state())
    metadata = {"config": engine.config.to_dict(), "world_size": engine.world_size}
    if engine.expert_layout is not None:
        metadata["expert_layout"] = engine.expert_layout

    def rank0_files() -> dict:
        return _rank0_files(engine, client_state, rng_states)

    if engine.zero is not None or engine.expert_layout is not None:
        own = {}
        if engine.zero is not None:
            own[shard_file_name(engine.rank)] = zero_checkpoint.shard_state(engine.zero,
                                                                            engine.optimizer)
        if engine.expert_layout is not None:
            own.update(expert_checkpoint.own_files(engine.module, engine.optimizer,
                                                   engine.config.zero_optimization.stage))
        path = save_from_ranks(engine.rank, save_dir, tag, own, rank0_files, metadata,
                               save_latest, handle)
        log.info("saved checkpoint %s", path)
        return path
    path = Path(save_dir) / tag
    if engine.rank == 0:
        path = save_checkpoint_files(save_dir, tag, rank0_files(), metadata,
                                     save_latest=save_latest, handle=handle)
        log.info("saved checkpoint %s", path)
    comm.barrier()
    return path


def _rank0_files(engine, client_state: dict, rng_states: list) -> dict:
    zero = engine.zero
    experts = engine.expert_layout is not None
    model = engine.module.state_dict() if zero is None else zero_checkpoint.model_state(zero)
    if experts:
        model = expert_checkpoint.without_experts(model, expert_checkpoint.expert_keys(engine.module))
    files = {"model": model, "client_state": client_state}
    if engine.optimizer is not None and zero is None:
        files["optimizer"] = (expert_checkpoint.optimizer_without_experts(engine.optimizer)
                              if experts else engine.optimizer.state_dict())
    if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "state_dict"):
        files["scheduler"] = engine.lr_scheduler.state_dict()
    files["engine"] = {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "world_size": engine.world_size,
        "zero_stage": engine.config.zero_optimization.stage,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "rng": rng_states,
        "expert_layout": engine.expert_layout,
    }
    if zero is not None:
        files["engine"]["zero"] = zero_checkpoint.metadata(zero)
    return files


def _load_module(engine, state: dict, path: Path, strict: bool) -> None:
    model_file = path / "model.pt"
    own = engine.module.state_dict()
    if strict:
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise CheckpointError(
                f"{model_file} does not match the model: missing keys {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                f"{'...' if len(unexpected) > 5 else ''}"
            )
    for key, value in state.items():
        if key in own and tuple(own[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{model_file} does not match the model: '{key}' has shape {tuple(value.shape)} "
                f"in the checkpoint and {tuple(own[key].shape)} in the model"
            )
    engine.module.load_state_dict(state, strict=strict)


def _refuse_sharded(path: Path, zero: dict | None, wants_optimizer: bool) -> None:
    """A stage 0 engine reads a ZeRO checkpoint's model.pt only when it is whole (stages 1, 2)
    and the optimizer states are not asked for."""
    if zero is None:
        return
    saved = f"{path} was saved with ZeRO stage {zero['stage']} by {zero['world_size']} ranks"
    if zero["stage"] == 3:
        raise CheckpointError(
            f"{saved}: its parameters are sharded and this engine runs stage 0; load it with a "
            "ZeRO engine, or consolidate the weights with 'dslab zero-to-fp32'")
    if wants_optimizer:
        raise CheckpointError(
            f"{saved}: its optimizer states are sharded and this engine runs stage 0; load it "
            "with a ZeRO engine, or pass load_optimizer_states=False")


def load(engine, load_dir, tag, load_optimizer_states: bool, load_lr_scheduler_states: bool,
         load_module_strict: bool):
    load_dir = Path(load_dir)
    if tag is None and not (load_dir / "latest").is_file():
        log.warning("no 'latest' file in %s: nothing to resume from", load_dir)
        return None, None
    path, files, metadata = load_checkpoint_files(load_dir, tag, names=_ENGINE_FILES)
    model_parallel_checkpoint.refuse_in_data_parallel_load(path, metadata, engine.world_size)
    state = files["engine"]
    expert_checkpoint.check_layout(path, state.get("expert_layout"), engine.expert_layout)
    if engine.expert_layout is not None:
        stage0_optimizer = (engine.zero is None and state.get("zero") is None
                            and load_optimizer_states and engine.optimizer is not None)
        expert_checkpoint.merge_expert_files(path, engine.module, files, stage0_optimizer)
    if engine.zero is not None:
        zero_checkpoint.load(engine.zero, engine.optimizer, path, files, load_optimizer_states,
                             load_module_strict)
    else:
        _refuse_sharded(path, state.get("zero"), load_optimizer_states and engine.optimizer is not None)
        _load_module(engine, files["model"], path, load_module_strict)
        if load_optimizer_states and engine.optimizer is not None:
            if "optimizer" not in files:
                raise CheckpointError(f"{path} holds no optimizer state (optimizer.pt is missing)")
            try:
                engine.optimizer.load_state_dict(files["optimizer"])
            except (ValueError, KeyError) as err:
                raise CheckpointError(f"{path / 'optimizer.pt'} does not match the optimizer: {err}") from None
    if load_lr_scheduler_states and engine.lr_scheduler is not None and "scheduler" in files:
        engine.lr_scheduler.load_state_dict(files["scheduler"])
    engine.global_steps = int(state["global_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.micro_steps = int(state["micro_steps"])
    engine.skipped_steps = int(state["skipped_steps"])
    if engine.loss_scaler is not None and state.get("loss_scaler") is not None:
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
    rng = state.get("rng") or []
    if int(state["world_size"]) == engine.world_size and engine.rank < len(rng):
        restore_rng_state(rng[engine.rank])
    else:
        log.warning(
            "checkpoint %s was saved by %s ranks and is loaded by %d: RNG states not restored",
            path, state["world_size"], engine.world_size,
        )
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return path, files.get("client_state", {})


def save_16bit(engine, save_dir, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """``engine.save_16bit_model``: the module's full state dict in the training precision
    (floating-point tensors cast to bf16 or fp16 when that is on; as they are otherwise) in one
    ``torch.save`` file, written by rank 0 (temp file, fsync, rename). With ZeRO stage 3 the
    weights are gathered from every rank (a collective) only when
    ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` is true; otherwise nothing is
    written and False is returned, as in DeepSpeed."""
    if not save_filename or os.sep in save_filename or save_filename in (".", ".."):
        raise ValueError(f"save_filename must be a file name, got {save_filename!r}")
    layout = engine.expert_layout
    if layout is not None and any(p > 1 for p in layout["expert_groups"].values()):
        raise ValueError(
            "save_16bit_model writes one file from rank 0, and this model's experts are spread "
            f"over expert-parallel ranks ({describe_layout(layout)}); save_checkpoint saves "
            "every ep rank's experts")
    zero = engine.config.zero_optimization
    if zero.stage == 3 and not zero.gather_16bit_weights_on_model_save:
        log.warning("save_16bit_model wrote nothing: ZeRO stage 3 shards the weights and "
                    "'zero_optimization.stage3_gather_16bit_weights_on_model_save' is false")
        return False
    state = engine.module_state_dict()
    if exclude_frozen_parameters:
        frozen = {name for name, p in engine.module.named_parameters() if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    dtype = (torch.bfloat16 if engine.config.bf16.enabled
             else torch.float16 if engine.config.fp16.enabled else None)
    error = None
    if engine.rank == 0:
        try:
            _write_state(state, dtype, Path(save_dir), save_filename)
        except Exception as err:  # every rank must hear of it, or the others would wait
            error = f"rank 0: {err}"
    errors = [e for e in comm.all_gather_object(error) if e]
    if errors:
        raise CheckpointError(f"save_16bit_model to {Path(save_dir) / save_filename} failed: "
                              + "; ".join(errors))
    return True


def _write_state(state: dict, dtype, directory: Path, name: str) -> None:
    cast: dict[tuple, torch.Tensor] = {}  # tied tensors stay one tensor
    out = {}
    for key, value in state.items():
        ident = (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
        if ident not in cast:
            moved = value.detach().cpu()
            cast[ident] = moved.to(dtype) if dtype is not None and moved.is_floating_point() else moved
        out[key] = cast[ident]
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}.tmp-{secrets.token_hex(8)}"
    try:
        torch.save(out, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("saved the 16-bit model %s", directory / name)
