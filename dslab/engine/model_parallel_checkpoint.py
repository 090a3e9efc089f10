"""Checkpoints of model-parallel engines: one file per (tensor, pipeline) coordinate, the layout
recorded, and a load at any other layout refused by name.

Under tensor or pipeline parallelism no rank holds the model: rank ``(pp, tp)`` holds stage
``pp``'s layers (a :class:`~dslab.parallel.pipe.PipelineModule`) split into tensor-parallel shard
``tp``. So, unlike :mod:`dslab.engine.checkpointing`, there is no ``model.pt``. Inside
``<save_dir>/<tag>/`` (one atomic checkpoint written by every rank,
:mod:`dslab.engine.checkpoint_ranks`):

- ``mp_rank_{tp:02d}_pp_{pp:02d}_model_states.pt``: that coordinate's module state dict (its
  stage's layers under their global index, its tensor-parallel shards), written by its
  data-parallel rank 0 (the other replicas hold the same values). A pipeline stage that holds a
  copy of a tied module it does not own (``param.ds_pipe_replicated``) leaves that copy's
  parameters out: on load the owner's weights are broadcast to it, as after every step.
- ``mp_rank_{tp:02d}_pp_{pp:02d}_optim_states.pt`` (ZeRO stage 0): that coordinate's optimizer
  state dict, written by its data-parallel rank 0.
- ``zero_dp_rank_{dp:02d}_mp_rank_{tp:02d}_pp_{pp:02d}_optim_states.pt`` (ZeRO stages 1 and 2):
  every rank's shard of its coordinate's optimizer states and parameters, partitioned over its
  data-parallel group; the format of :mod:`dslab.engine.zero.consolidate`.
- ``engine.pt`` (counters, the loss scaler, the layout, every rank's RNG state in global rank
  order), ``scheduler.pt``, ``client_state.pt``: written once, by rank 0.
- ``manifest.json``: every file's size and sha256, the config, and ``model_parallel_layout``.

The layout (:func:`layout_of`)::

    {"world_size": W, "tensor_parallel": tp, "pipeline_parallel": pp, "data_parallel": dp,
     "zero_stage": s, "pipeline": {"num_layers": n, "parts": [stage boundaries]} or None}

A checkpoint loads only at the sizes, world size and pipeline partition it was saved with: the
files are cut by those, and nothing here re-cuts them. The ZeRO stage must match too when the
optimizer states are loaded (they are sharded by it); the weights, whole per coordinate in the
model-states files, load at any ZeRO stage. Anything else raises
:class:`ModelParallelLayoutError` (a ValueError) naming both layouts and the path, before any file
but the manifest is read. A data-parallel checkpoint loaded by a model-parallel engine, and the
reverse (:func:`refuse_in_data_parallel_load`), are refused the same way.

Every rank reads the manifest, ``engine.pt`` and its own files, checks keys and shapes, and only
then do the ranks agree (an all-gather of the outcomes) before the collectives of the load (ZeRO
rebuilding its flat buffers, the tied weights' broadcast): a file missing or mismatched on one
rank fails the load on every rank instead of leaving the others waiting.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dslab import comm
from dslab.engine.checkpoint_io import CheckpointError, load_checkpoint_files
from dslab.engine.checkpoint_ranks import agree, save_from_ranks
from dslab.engine.rng import capture_rng_state, restore_rng_state
from dslab.engine.zero import checkpoint as zero_checkpoint
from dslab.io.handle import AsyncIOHandle
from dslab.parallel.pipe.module import PipelineModule

LAYOUT_KEY = "model_parallel_layout"

log = logging.getLogger(__name__)


class ModelParallelLayoutError(CheckpointError, ValueError):
    """A checkpoint loaded at another parallel layout than the one it was saved with."""


def model_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_pp_{pp_rank:02d}_model_states"


def optimizer_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_pp_{pp_rank:02d}_optim_states"


def zero_shard_file_name(dp_rank: int, tp_rank: int, pp_rank: int) -> str:
    return f"zero_dp_rank_{dp_rank:02d}_mp_rank_{tp_rank:02d}_pp_{pp_rank:02d}_optim_states"


def applies(engine) -> bool:
    """Whether ``engine``'s checkpoints are model-parallel ones: other ranks hold other parts of
    its model, or it runs a pipeline (whose partition the checkpoint records, even with one
    stage)."""
    return engine.parallel.model_parallel or isinstance(engine.module, PipelineModule)


def _pipe_rank(engine) -> int:
    if engine.parallel.pp_world_size == 1:
        return 0
    for name in ("get_pipe_parallel_rank", "get_pipeline_model_parallel_rank"):
        method = getattr(engine.mpu, name, None)
        if callable(method):
            return int(method())
    return comm.get_rank(engine.parallel.pp_group)


def coordinate(engine) -> tuple[int, int, int]:
    """``(tp_rank, pp_rank, dp_rank)`` of this rank."""
    return engine.parallel.tp_rank, _pipe_rank(engine), engine.parallel.dp_rank


def layout_of(engine) -> dict:
    """The layout this engine runs (module docstring); JSON-serialisable."""
    parallel = engine.parallel
    module = engine.module
    pipeline = None
    if isinstance(module, PipelineModule):
        pipeline = {"num_layers": len(module.layer_specs), "parts": [int(p) for p in module.parts]}
    return {"world_size": engine.world_size, "tensor_parallel": parallel.tp_world_size,
            "pipeline_parallel": parallel.pp_world_size, "data_parallel": parallel.dp_world_size,
            "zero_stage": engine.config.zero_optimization.stage, "pipeline": pipeline}


def describe_layout(layout: dict) -> str:
    """``layout`` as one line, e.g. ``tp 2 x pp 2 x dp 1 (world 4), ZeRO stage 0, pipeline of 7
    layers cut at [0, 4, 7]``."""
    text = (f"tp {layout['tensor_parallel']} x pp {layout['pipeline_parallel']} x "
            f"dp {layout['data_parallel']} (world {layout['world_size']}), "
            f"ZeRO stage {layout['zero_stage']}")
    pipeline = layout.get("pipeline")
    if pipeline is not None:
        text += f", pipeline of {pipeline['num_layers']} layers cut at {pipeline['parts']}"
    return text


def _data_parallel_layout(metadata: dict) -> str:
    world = metadata.get("world_size", "?")
    stage = (metadata.get("config") or {}).get("zero_optimization", {}).get("stage", 0)
    return f"no model parallelism: data parallel over {world} ranks, ZeRO stage {stage}"


def check_layout(path: Path, saved: dict | None, current: dict, optimizer_states: bool,
                 metadata: dict) -> None:
    """Raise :class:`ModelParallelLayoutError` naming ``path`` and both layouts when the
    checkpoint's layout (``saved``; None for a data-parallel checkpoint) is not ``current``; the
    ZeRO stage counts only when ``optimizer_states`` are to be loaded."""
    if saved is None:
        raise ModelParallelLayoutError(
            f"{path} was saved with {_data_parallel_layout(metadata)}, and this engine runs "
            f"{describe_layout(current)}: a data-parallel checkpoint holds whole models, not the "
            "per-coordinate files a model-parallel engine loads")
    shape_keys = ("world_size", "tensor_parallel", "pipeline_parallel", "data_parallel", "pipeline")
    if any(saved.get(k) != current[k] for k in shape_keys):
        raise ModelParallelLayoutError(
            f"{path} was saved at layout ({describe_layout(saved)}) and this engine runs "
            f"({describe_layout(current)}): a model-parallel checkpoint loads only at the tensor-, "
            "pipeline- and data-parallel sizes and the pipeline partition it was saved with")
    if optimizer_states and saved.get("zero_stage") != current["zero_stage"]:
        raise ModelParallelLayoutError(
            f"{path} was saved at layout ({describe_layout(saved)}) and this engine runs "
            f"({describe_layout(current)}): its optimizer states are sharded by ZeRO stage "
            f"{saved.get('zero_stage')}; load it at that stage, or pass "
            "load_optimizer_states=False to load the weights")


def refuse_in_data_parallel_load(path: Path, metadata: dict, world_size: int) -> None:
    """What :mod:`dslab.engine.checkpointing` calls before reading a checkpoint into an engine
    without model parallelism: a model-parallel checkpoint has no whole model to give it."""
    saved = metadata.get(LAYOUT_KEY)
    if saved is None:
        return
    raise ModelParallelLayoutError(
        f"{path} was saved at layout ({describe_layout(saved)}) and this engine runs no model "
        f"parallelism (data parallel over {world_size} ranks): its model is split into "
        "per-coordinate files that only an engine of the same layout loads")


def _refuse_experts(engine, call: str) -> None:
    if engine.expert_layout is not None:
        raise ValueError(f"{call}() of a model with expert parameters under model parallelism "
                         f"(tp {engine.parallel.tp_world_size}, pp {engine.parallel.pp_world_size}) "
                         "is not supported: expert checkpoints are laid out per expert-parallel "
                         "rank of a data-parallel world")


def _replicated_keys(module: torch.nn.Module) -> set[str]:
    """State-dict keys of the tied copies this stage holds but does not own."""
    return {key for key, value in module.state_dict(keep_vars=True).items()
            if getattr(value, "ds_pipe_replicated", False)}


# -- save ---------------------------------------------------------------------------------------

def save(engine, save_dir, tag, client_state: dict, save_latest: bool) -> Path:
    """Write the checkpoint of the module docstring from every rank (a collective: call it on
    all ranks); returns its path. With the config's ``aio`` section every file goes through an
    async I/O handle built from it."""
    _refuse_experts(engine, "save_checkpoint")
    if tag is None:
        tag = f"global_step{engine.global_steps}"
    tag = str(tag)
    handle = AsyncIOHandle.from_config(engine.config.aio) if engine.config.aio is not None else None
    try:
        rng_states = comm.all_gather_object(capture_rng_state())
        layout = layout_of(engine)
        metadata = {"config": engine.config.to_dict(), "world_size": engine.world_size,
                    LAYOUT_KEY: layout}
        path = save_from_ranks(engine.rank, save_dir, tag, _own_files(engine),
                               lambda: _rank0_files(engine, client_state, rng_states, layout),
                               metadata, save_latest, handle)
    finally:
        if handle is not None:
            handle.close()
    log.info("saved model-parallel checkpoint %s (%s)", path, describe_layout(layout))
    return path


def _own_files(engine) -> dict:
    """This rank's files: its coordinate's module (and stage 0 optimizer) state on data-parallel
    rank 0, its ZeRO shard on every rank."""
    tp_rank, pp_rank, dp_rank = coordinate(engine)
    files = {}
    if dp_rank == 0:
        skip = _replicated_keys(engine.module)
        files[model_file_name(tp_rank, pp_rank)] = {
            k: v for k, v in engine.module.state_dict().items() if k not in skip}
        if engine.zero is None and engine.optimizer is not None:
            files[optimizer_file_name(tp_rank, pp_rank)] = engine.optimizer.state_dict()
    if engine.zero is not None:
        files[zero_shard_file_name(dp_rank, tp_rank, pp_rank)] = zero_checkpoint.shard_state(
            engine.zero, engine.optimizer)
    return files


def _rank0_files(engine, client_state: dict, rng_states: list, layout: dict) -> dict:
    files = {"client_state": client_state}
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
        LAYOUT_KEY: layout,
    }
    return files


# -- load ---------------------------------------------------------------------------------------

def load(engine, load_dir, tag, load_optimizer_states: bool, load_lr_scheduler_states: bool,
         load_module_strict: bool):
    """Resume from the checkpoint (a collective: call it on all ranks). Returns ``(path,
    client_state)``, or ``(None, None)`` when ``tag`` is None and ``load_dir`` has no
    ``latest``."""
    _refuse_experts(engine, "load_checkpoint")
    load_dir = Path(load_dir)
    if tag is None and not (load_dir / "latest").is_file():
        log.warning("no 'latest' file in %s: nothing to resume from", load_dir)
        return None, None
    path, _, metadata = load_checkpoint_files(load_dir, tag, names=())
    optimizer_states = load_optimizer_states and engine.optimizer is not None
    check_layout(path, metadata.get(LAYOUT_KEY), layout_of(engine), optimizer_states, metadata)

    tp_rank, pp_rank, dp_rank = coordinate(engine)
    model_name = model_file_name(tp_rank, pp_rank)
    if engine.zero is not None:
        optimizer_name = zero_shard_file_name(dp_rank, tp_rank, pp_rank)
    else:
        optimizer_name = optimizer_file_name(tp_rank, pp_rank)
    wanted = ["engine", "scheduler", "client_state", model_name]
    if optimizer_states:
        wanted.append(optimizer_name)
    files, error = {}, None
    try:
        _, files, _ = load_checkpoint_files(path.parent, path.name, names=wanted)
        for name in ("engine", model_name) + ((optimizer_name,) if optimizer_states else ()):
            if name not in files:
                raise CheckpointError(f"{path} is missing {name}.pt")
        _load_module(engine, files[model_name], path / f"{model_name}.pt", load_module_strict)
        if optimizer_states:
            _load_optimizer(engine, files[optimizer_name], path / f"{optimizer_name}.pt")
    except Exception as err:  # every rank must hear of it before the collectives below
        error = f"rank {engine.rank}: {err}"
    agree(None, error, f"loading checkpoint {path}")

    if engine.zero is not None:
        if optimizer_states:
            engine.zero.reload_shards(files[optimizer_name]["params"])
            engine.zero.optimizer_state_loaded(engine.optimizer)
        else:  # the units' shards are views of the module's loaded weights (stages 1 and 2)
            engine.zero.reload_shards([unit.shard.detach().clone() for unit in engine.zero.units])
    if isinstance(engine.module, PipelineModule):
        engine.module.broadcast_tied_weights()
    state = files["engine"]
    if load_lr_scheduler_states and engine.lr_scheduler is not None and "scheduler" in files:
        engine.lr_scheduler.load_state_dict(files["scheduler"])
    engine.global_steps = int(state["global_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.micro_steps = int(state["micro_steps"])
    engine.skipped_steps = int(state["skipped_steps"])
    if engine.loss_scaler is not None and state.get("loss_scaler") is not None:
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
    restore_rng_state(state["rng"][engine.rank])
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return path, files.get("client_state", {})


def _load_module(engine, state: dict, model_file: Path, strict: bool) -> None:
    """Check ``state`` against this rank's module (keys when ``strict``, shapes always) and copy
    it in. The tied copies this stage does not own are expected absent: they take the owner's
    weights afterwards."""
    module = engine.module
    skip = _replicated_keys(module)
    own = {k: v for k, v in module.state_dict().items() if k not in skip}
    if strict:
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise CheckpointError(f"{model_file} does not match the model: missing keys "
                                  f"{missing[:5]}, unexpected keys {unexpected[:5]}")
    for key, value in state.items():
        if key in own and tuple(own[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{model_file} does not match the model: '{key}' has shape {tuple(value.shape)} "
                f"in the checkpoint and {tuple(own[key].shape)} in the model")
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def _load_optimizer(engine, state: dict, where: Path) -> None:
    """Stage 0: the coordinate's optimizer state dict. ZeRO: this rank's shard, whose units must
    be the engine's (the same stage and ``reduce_bucket_size``)."""
    if engine.zero is not None:
        units = [u.layout.to_dict() for u in engine.zero.units]
        if state.get("units") != units:
            raise CheckpointError(
                f"{where} was saved with other ZeRO units than this engine's (another "
                "reduce_bucket_size or parameter grouping): its optimizer states do not fit; pass "
                "load_optimizer_states=False to load the weights")
        state = state["optimizer"]
    try:
        engine.optimizer.load_state_dict(state)
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{where} does not match the optimizer: {err}") from None
