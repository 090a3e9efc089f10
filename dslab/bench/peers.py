"""The arms a user would pick beside dslab's ZeRO for sharded training: PyTorch's own data
parallelism and DeepSpeed itself, on the workload's model, in a run where ``torch.distributed``
is already initialized (torchrun or dslab's launcher; a world of one process is fine). Every
rank steps the same batch, as the ``dslab`` arm's ranks do.

- ``ddp``: the model on PyTorch's ops (``kernels="torch"``) in ``DistributedDataParallel``
  (``gradient_as_bucket_view=True``), the loop of the ``torch`` arm (:class:`dslab.bench.arms.PlainArm`):
  autocast to the precision's dtype, backward (a ``GradScaler`` for fp16), ``clip_grad_norm_``
  when the suite clips, ``torch.optim.AdamW`` (fused on CUDA, foreach elsewhere),
  ``zero_grad(set_to_none=True)``.
- ``fsdp2``: the model on PyTorch's ops with the cross-block LayerNorm fusion off
  (``chain_layer_norms=False``, so each block reads only its own parameters), ``fully_shard`` on
  each block of ``model.layers`` and then on the root (tied embeddings and heads live there).
  Mixed precision is FSDP2's own: ``MixedPrecisionPolicy(param_dtype=<bf16/fp16>,
  reduce_dtype=fp32)`` (the blocks compute in the half dtype from fp32 sharded parameters, the
  gradients are reduced in fp32; no autocast); fp32 has no policy. AdamW steps the sharded
  DTensor parameters: fused on CUDA (DTensor shards ``_fused_adamw_`` like any pointwise op, one
  kernel per parameter group over the local shards), foreach elsewhere; ``clip_grad_norm_``
  takes the DTensor gradients (the norm's partial sums are all-reduced). fp16 scales the loss
  with ``torch.amp.GradScaler``: DTensor all-reduces its inf check over the shards (a max), so
  every rank skips the same steps.
- ``fsdp2-compile``: ``fsdp2`` with each block compiled (``block.compile()``) before
  ``fully_shard``: regional compilation, as PyTorch's FSDP2 users (torchtitan) compile, so that
  FSDP2's all-gathers and reduce-scatters stay between the compiled blocks.
- ``deepspeed-zero1``/``-zero2``/``-zero3``: ``deepspeed.initialize`` on the model with dslab's
  kernels (``kernels="dslab"``, the cross-block fusion on: ZeRO-3 gathers a LayerNorm when its
  module runs, wherever that is), ZeRO stage 1, 2 or 3, DeepSpeed's own bf16/fp16 (it casts the
  model and keeps fp32 master weights), its ``AdamW`` (FusedAdam on CUDA) with the suite's
  settings and clipping. An MoE model's experts carry DeepSpeed's expert marks
  (``allreduce=False``), which make DeepSpeed look for the expert groups its own ``MoE`` class
  creates; with ``ep_size`` 1 every rank holds every expert, so the marks are removed and the
  experts are reduced with the dense parameters, which is what expert data parallelism over the
  whole world does. Without DeepSpeed the arm is skipped (:class:`~dslab.bench.common.ArmSkipped`).

Expert parallelism (``ep_size`` > 1) is the ``dslab`` arm's; the peers keep every expert on
each rank and are skipped for it. None of the peers parks (moves its state to the host between
trials): FSDP2's shards and DeepSpeed's flat partitions are views the arms cannot move.

Each arm has ``name``, ``step()`` (one optimizer step; returns the loss) and ``close()`` (drops
the model, the optimizer and the engine and frees the device's cached memory).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dslab import comm
from dslab.bench.arms import PRECISION_DTYPES, _optimizer_settings, plain_step
from dslab.bench.common import ArmSkipped, free_memory
from dslab.bench.workloads import Workload

PEER_ARMS = ("ddp", "fsdp2", "fsdp2-compile", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")
DEEPSPEED_STAGES = {"deepspeed-zero1": 1, "deepspeed-zero2": 2, "deepspeed-zero3": 3}
DEEPSPEED_INSTALL_HINT = ("pip install deepspeed; on a machine without network its sdist installs with "
                          "DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation <deepspeed sdist>")
DEEPSPEED_EXPERT_MARKS = ("allreduce", "group_name")


def _adamw(params, engine_cfg: dict, device: torch.device) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with the suite's settings: fused on CUDA, foreach elsewhere."""
    implementation = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, **_optimizer_settings(engine_cfg), **implementation)


class _TorchLoop:
    """The loop the ``ddp`` and ``fsdp2`` arms share (the ``torch`` arm's): forward (under autocast
    when ``autocast_dtype``), backward (through a ``GradScaler`` for fp16), clipping, AdamW."""

    name: str

    def __init__(self, workload: Workload, device: torch.device, precision: str, engine_cfg: dict,
                 model: nn.Module, forward: nn.Module, autocast_dtype: torch.dtype | None):
        self.device = device
        self.model = model
        self.forward = forward
        self.autocast_dtype = autocast_dtype
        self.optimizer = _adamw(model.parameters(), engine_cfg, device)
        self.clip = float(engine_cfg.get("gradient_clipping", 0.0))
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.loss_fn = workload.loss_fn()
        self.batch = workload.make_batch(device)

    def step(self) -> torch.Tensor:
        return plain_step(self.forward, self.loss_fn, self.batch, self.model, self.optimizer, self.autocast_dtype,
                          self.device, self.scaler, self.clip)

    def close(self) -> None:
        del self.model, self.forward, self.optimizer, self.scaler, self.batch
        free_memory(self.device)


class DDPArm(_TorchLoop):
    """``ddp``: the ``torch`` arm's loop around ``DistributedDataParallel`` (module docstring)."""

    name = "ddp"

    def __init__(self, workload: Workload, device: torch.device, precision: str, engine_cfg: dict):
        from torch.nn.parallel import DistributedDataParallel

        model = workload.build_model(kernels="torch", device=device).to(device).train()
        device_ids = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        super().__init__(workload, device, precision, engine_cfg, model, wrapped, PRECISION_DTYPES[precision])


def transformer_blocks(model: nn.Module, family: str) -> nn.ModuleList:
    """The blocks FSDP2 shards one by one: ``model.layers``; ArmSkipped for a model without them."""
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ArmSkipped(f"family {family!r}: its model has no 'layers' stack of blocks for fully_shard "
                         f"(the FSDP2 arms shard the blocks of bert, gpt2, gpt2_moe and moe_layer)")
    return blocks


class FSDP2Arm(_TorchLoop):
    """``fsdp2`` and ``fsdp2-compile``: per-block ``fully_shard`` (module docstring)."""

    def __init__(self, name: str, workload: Workload, device: torch.device, precision: str, engine_cfg: dict):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.name = name
        config = workload.model_config()
        overrides = {"chain_layer_norms": False} if hasattr(config, "chain_layer_norms") else None
        model = workload.build_model(kernels="torch", device=device, overrides=overrides).to(device).train()
        blocks = transformer_blocks(model, workload.family)
        dtype = PRECISION_DTYPES[precision]
        options = {"mesh": init_device_mesh(device.type, (comm.get_world_size(),))}
        if dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if name == "fsdp2-compile":
            # As the torch-compile arms (dslab.bench.arms.PlainArm): let a graph hold data-dependent
            # shapes (the torch set's MoE loop gathers each expert's tokens with where/nonzero).
            torch._dynamo.config.capture_dynamic_output_shape_ops = True
        for block in blocks:
            if name == "fsdp2-compile":
                block.compile()
            fully_shard(block, **options)
        fully_shard(model, **options)
        super().__init__(workload, device, precision, engine_cfg, model, model, autocast_dtype=None)


class DeepSpeedArm:
    """``deepspeed-zero1/2/3``: DeepSpeed's engine on the model with dslab's kernels (module
    docstring)."""

    def __init__(self, name: str, workload: Workload, device: torch.device, precision: str, engine_cfg: dict):
        try:
            import deepspeed
        except ImportError as err:
            raise ArmSkipped(f"deepspeed is not installed ({type(err).__name__}: {err}); "
                             f"{DEEPSPEED_INSTALL_HINT}") from None
        self.name = name
        self.device = device
        model = workload.build_model(kernels="dslab", device=device).to(device).train()
        if workload.is_moe:
            drop_expert_marks(model)
        config = deepspeed_config(workload, precision, engine_cfg, DEEPSPEED_STAGES[name])
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
        self.loss_fn = workload.loss_fn()
        self.batch = workload.make_batch(device)

    def step(self) -> torch.Tensor:
        loss = self.loss_fn(self.engine, self.batch)
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if callable(destroy):
            destroy()
        del self.engine, self.optimizer, self.batch
        free_memory(self.device)


def deepspeed_config(workload: Workload, precision: str, engine_cfg: dict, stage: int) -> dict:
    """DeepSpeed's config for ZeRO ``stage``: the case's micro-batch, no accumulation, the
    precision, DeepSpeed's ``AdamW`` with the suite's settings, its clipping, and no printing."""
    settings = _optimizer_settings(engine_cfg)
    if "betas" in settings:
        settings["betas"] = list(settings["betas"])
    config = {
        "train_micro_batch_size_per_gpu": workload.case.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": settings},
        "gradient_clipping": float(engine_cfg.get("gradient_clipping", 0.0)),
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision in ("bf16", "fp16"):
        config[precision] = {"enabled": True}
    return config


def drop_expert_marks(model: nn.Module) -> None:
    """Remove DeepSpeed's expert marks (``allreduce=False``, ``group_name``) from every parameter
    (see the module docstring: with ``ep_size`` 1 the experts are ordinary data-parallel
    parameters)."""
    for param in model.parameters():
        for mark in DEEPSPEED_EXPERT_MARKS:
            if hasattr(param, mark):
                delattr(param, mark)


def build_peer_arm(name: str, workload: Workload, device: torch.device, precision: str, engine_cfg: dict):
    """The peer arm ``name`` (one of :data:`PEER_ARMS`) for ``workload`` on ``device``.

    Raises ValueError for an unknown name or precision, and :class:`ArmSkipped` where the arm
    cannot run: ``torch.distributed`` not initialized, expert parallelism, a model without a stack
    of blocks (FSDP2), DeepSpeed not installed."""
    if name not in PEER_ARMS:
        raise ValueError(f"unknown peer arm {name!r}; choose one of {', '.join(PEER_ARMS)}")
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISION_DTYPES)}")
    if not comm.is_initialized():
        raise ArmSkipped(f"arm {name!r} needs an initialized torch.distributed process group "
                         f"(start the suite with torchrun or dslab's launcher)")
    if workload.is_moe and workload.model_config().ep_size > 1:
        raise ArmSkipped(f"ep_size={workload.model_config().ep_size}: expert parallelism is the dslab arm's; "
                         f"the peer arms keep every expert on each rank")
    if name == "ddp":
        return DDPArm(workload, device, precision, engine_cfg)
    if name in ("fsdp2", "fsdp2-compile"):
        return FSDP2Arm(name, workload, device, precision, engine_cfg)
    return DeepSpeedArm(name, workload, device, precision, engine_cfg)
