"""The arms a user would pick beside dslab's model-parallel layouts: PyTorch's own tensor and
pipeline parallelism and DeepSpeed's pipeline engine, on the same GPT-2 and the same global batch
(:mod:`dslab.bench.model_parallel` says what a step is), in a run where ``torch.distributed`` is
initialized (the suite's launches).

- ``torch-tpK`` and ``torch-tpKdpM``: :class:`~dslab.bench.torch_gpt2.TorchGPT2` (dslab's GPT-2
  on ``nn`` modules, one ``nn.Linear`` per projection) on a ``DeviceMesh`` of ``(dp, tp)``, split
  over ``tp`` with ``parallelize_module``: q, k, v and the MLP's first projection
  ``ColwiseParallel``, the attention's output and the MLP's second projection ``RowwiseParallel``
  (Megatron-LM's layout: two all-reduces a block forward, two backward), the token embedding
  ``RowwiseParallel`` (split over the vocabulary) and the LM head ``ColwiseParallel`` with its
  logits left split over the vocabulary for ``loss_parallel()`` (no rank holds whole logits); the
  head is tied to the embedding again after the split (both are ``Shard(0)`` of the same matrix).
  With ``dp`` > 1, FSDP2 over the mesh's ``dp`` dimension (PyTorch's 2-D recipe, torchtitan's):
  ``fully_shard`` on each block and the root, ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, ``reshard_after_forward=False``, and within a step's micro-batches no
  gradient reduce-scatter and no resharding until the last one (``set_requires_gradient_sync``,
  ``set_reshard_after_backward``): one all-gather and one reduce-scatter of each block per step,
  as ZeRO-1's one reduction and one gather. With ``dp`` 1, autocast to bf16 over fp32 parameters.
- ``torch-ppK``: the same model cut into K stages (:func:`~dslab.bench.torch_gpt2.build_torch_gpt2`:
  the blocks as dslab's ``type:GPT2Block`` partition balances them, the embeddings on the first
  stage, the final norm and the head on the last), each a ``torch.distributed.pipelining``
  ``PipelineStage`` run by ``Schedule1F1B`` over the step's micro-batches (autocast to bf16 in
  each stage's forward; the case's activation checkpointing as ``torch.utils.checkpoint`` around
  runs of blocks). The last stage's head starts as the first stage's embedding matrix, and the
  two gradients are summed over the first and last stage before each step, as dslab's and
  DeepSpeed's pipelines sum a tied layer's; the batch's loss is broadcast from the last stage, as
  theirs is.
- ``deepspeed-ppK`` and ``deepspeed-ppKdpM``: DeepSpeed's ``PipelineModule`` over dslab's GPT-2
  pipeline layers (:func:`dslab.models.gpt2_pipe.gpt2_pipeline_layers`, dslab's kernels, the same
  ``type:GPT2Block`` partition, tied embedding and head, the same loss) in DeepSpeed's pipeline
  engine (``engine.train_batch``), its bf16 (the model cast to bf16, fp32 master weights and
  gradient accumulation: its ``BF16_Optimizer``, which it runs under ZeRO stage 1, so stage 1 even
  where ``dp`` is 1 and it shards nothing), ``AdamW`` with the suite's settings and clipping, the
  case's ``activation_checkpoint_interval`` over the blocks (``checkpointable_layers``). The tie
  between the embedding and the head is the token matrix's (the head's copy of the positions is
  unused). Without DeepSpeed the arm is skipped (:class:`~dslab.bench.common.ArmSkipped`).

The torch arms run fp32 or bf16 (fp16 would need one loss scale shared by the pipeline's stages;
the suite refuses it for every arm), ``torch.optim.AdamW`` with the suite's settings (fused on
CUDA, foreach elsewhere), and clip the whole model's gradient norm at the suite's
``gradient_clipping``: each group of gradients that live on one mesh (DTensors) or on this rank
(tensors) gives its norm, the squares are added (over the pipeline's stages too, the tied head
counted once) and every gradient is scaled by the one factor.

Each arm has ``step()`` (one optimizer step over the global batch; returns the loss) and
``close()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dslab.bench.arms import PRECISION_DTYPES, _optimizer_settings
from dslab.bench.common import ArmSkipped, free_memory
from dslab.bench.peers import DEEPSPEED_INSTALL_HINT, deepspeed_config
from dslab.bench.torch_gpt2 import build_torch_gpt2, next_token_loss
from dslab.bench.workloads import Workload


def _adamw(params, engine_cfg: dict, device: torch.device) -> torch.optim.AdamW:
    implementation = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, **_optimizer_settings(engine_cfg), **implementation)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pipe_group=None,
                   not_counted: tuple[nn.Parameter, ...] = ()) -> torch.Tensor:
    """Scale the gradients of ``params`` so that the whole model's gradient norm is at most
    ``max_norm``; returns that norm. Gradients are grouped by where they live (the mesh of a
    DTensor, or this rank), each group's norm computed by ``torch.nn.utils.get_total_norm`` (a
    DTensor's over its mesh), the squares added, then added over ``pipe_group`` (the other
    stages); ``not_counted`` (a stage's copy of a tied matrix another stage counts) is scaled but
    left out of the norm. As ``clip_grad_norm_``, the factor is ``max_norm / (norm + 1e-6)``,
    at most 1."""
    from torch.distributed.tensor import DTensor

    skip = {id(p) for p in not_counted}
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None and id(p) not in skip:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    squared = torch.zeros((), dtype=torch.float32, device=next((p.device for p in params), torch.device("cpu")))
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = squared + norm.float().to(squared.device) ** 2
    if pipe_group is not None:
        dist.all_reduce(squared, group=pipe_group)
    total = squared.sqrt()
    # every gradient scaled by one factor, a DTensor through its local shard (meshes may differ)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in local:
        by_device.setdefault(grad.device, []).append(grad)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coefficient.to(device))
    return total


class TorchTensorParallelArm:
    """``torch-tpK`` / ``torch-tpKdpM`` (module docstring)."""

    def __init__(self, run, workload: Workload, device: torch.device, precision: str, engine_cfg: dict):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.run, self.device = run, device
        self.dtype = PRECISION_DTYPES[precision]
        mesh = init_device_mesh(device.type, (run.dp, run.tp), mesh_dim_names=("dp", "tp"))
        config = workload.model_config({"tp_size": run.tp})
        model = build_torch_gpt2(config, device, workload.seed)
        tp_mesh = mesh["tp"]
        parallelize_module(model, tp_mesh, {
            "wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })
        block_plan = {"attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
                      "attention.v": ColwiseParallel(), "attention.out": RowwiseParallel(),
                      "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, block_plan)
        model.lm_head.weight = model.wte.weight  # each style distributed its own copy of the tied matrix
        self.fsdp = run.dp > 1
        if self.fsdp:
            options = {"mesh": mesh["dp"], "reshard_after_forward": False}
            if self.dtype is not None:
                options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
            for block in model.layers.values():
                fully_shard(block, **options)
            fully_shard(model, **options)
        self.model = model
        # without FSDP2 the norms and positions stay tensors beside the DTensors; a foreach or fused
        # AdamW steps one group of either kind at a time
        split = [p for p in model.parameters() if isinstance(p, DTensor)]
        whole = [p for p in model.parameters() if not isinstance(p, DTensor)]
        self.optimizer = _adamw([{"params": group} for group in (split, whole) if group], engine_cfg, device)
        self.clip = float(engine_cfg.get("gradient_clipping", 0.0))
        batch = workload.make_batch(device)
        self.ids, self.labels = batch["input_ids"], batch["labels"]

    def step(self) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        micro = self.run.micro_batches
        autocast = self.dtype is not None and not self.fsdp  # FSDP2 casts the parameters itself
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for i in range(micro):
            last = i == micro - 1
            if self.fsdp:
                self.model.set_requires_gradient_sync(last)
                self.model.set_reshard_after_backward(last)
            with loss_parallel():
                with torch.autocast(self.device.type, dtype=self.dtype, enabled=autocast):
                    logits = self.model(self.ids)
                loss = next_token_loss(logits, self.labels) / micro
                loss.backward()
            total += loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        if self.clip > 0:
            clip_grad_norm(list(self.model.parameters()), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def close(self) -> None:
        del self.model, self.optimizer, self.ids, self.labels
        free_memory(self.device)


class _Autocast(nn.Module):
    """A stage's forward under autocast to ``dtype`` (the pipeline's stages call modules)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype | None):
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.module(x)


class TorchPipelineArm:
    """``torch-ppK`` (module docstring)."""

    def __init__(self, run, workload: Workload, device: torch.device, precision: str, engine_cfg: dict):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.run, self.device = run, device
        stages, stage = run.pp, dist.get_rank()
        self.stage, self.stages = stage, stages
        config = workload.model_config()
        self.model = build_torch_gpt2(config, device, workload.seed, stage=stage, stages=stages,
                                      checkpoint_interval=run.checkpoint_interval)
        self.pipe_group = dist.new_group(list(range(stages))) if stages > 1 else None
        # the embedding matrix on the first stage and the head on the last are one tied matrix
        self.tie_group = dist.new_group([0, stages - 1]) if stages > 1 else None
        if stages > 1 and stage == 0:
            self.tied = self.model.wte.weight
        elif stages > 1 and stage == stages - 1:
            self.tied = self.model.lm_head.weight
        else:
            self.tied = None
        pipeline_stage = PipelineStage(_Autocast(self.model, PRECISION_DTYPES[precision]), stage, stages, device,
                                       group=self.pipe_group)
        self.schedule = Schedule1F1B(pipeline_stage, n_microbatches=run.micro_batches, loss_fn=next_token_loss)
        self.optimizer = _adamw(self.model.parameters(), engine_cfg, device)
        self.clip = float(engine_cfg.get("gradient_clipping", 0.0))
        batch = workload.make_batch(device)
        repeat = (run.micro_batches, 1)
        self.ids, self.labels = batch["input_ids"].repeat(*repeat), batch["labels"].repeat(*repeat)

    def step(self) -> torch.Tensor:
        first, last = self.stage == 0, self.stage == self.stages - 1
        losses: list[torch.Tensor] = []
        if first and last:
            self.schedule.step(self.ids, target=self.labels, losses=losses)
        elif first:
            self.schedule.step(self.ids)
        elif last:
            self.schedule.step(target=self.labels, losses=losses)
        else:
            self.schedule.step()
        if self.tied is not None:
            dist.all_reduce(self.tied.grad, group=self.tie_group)
        if self.clip > 0:
            not_counted = (self.tied,) if self.tied is not None and last else ()
            clip_grad_norm(list(self.model.parameters()), self.clip, self.pipe_group, not_counted)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = (torch.stack([x.detach().float() for x in losses]).mean() if last
                else torch.zeros((), dtype=torch.float32, device=self.device))
        if self.stages > 1:
            dist.broadcast(loss, src=self.stages - 1, group=self.pipe_group)
        return loss

    def close(self) -> None:
        del self.schedule, self.model, self.optimizer, self.tied, self.ids, self.labels
        free_memory(self.device)


class DeepSpeedPipelineArm:
    """``deepspeed-ppK`` / ``deepspeed-ppKdpM`` (module docstring)."""

    def __init__(self, run, workload: Workload, device: torch.device, precision: str, engine_cfg: dict):
        try:
            import deepspeed
            from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
            from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
        except ImportError as err:
            raise ArmSkipped(f"deepspeed is not installed ({type(err).__name__}: {err}); "
                             f"{DEEPSPEED_INSTALL_HINT}") from None
        from dslab.models.gpt2_pipe import gpt2_pipeline_layers, gpt2_pipeline_loss
        from dslab.parallel.pipe import LayerSpec as DslabLayerSpec, TiedLayerSpec as DslabTiedLayerSpec

        self.device = device
        deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the process group the run is in
        config = workload.model_config({"chain_layer_norms": False})
        layers = []
        for spec in gpt2_pipeline_layers(config, "dslab"):
            if isinstance(spec, DslabTiedLayerSpec):
                # the token matrix alone: the head's copy of the positions gets no gradient, and
                # DeepSpeed's bf16 optimizer sums a tied weight's gradient only where it has one
                layers.append(TiedLayerSpec(spec.key, spec.typename, *spec.module_args, forward_fn=spec.forward_fn,
                                            tied_weight_attr=["wte.weight"], **spec.module_kwargs))
            elif isinstance(spec, DslabLayerSpec):
                layers.append(LayerSpec(spec.typename, *spec.module_args, **spec.module_kwargs))
            else:
                layers.append(spec)
        torch.manual_seed(workload.seed)
        with torch.device(device):
            module = PipelineModule(layers=layers, loss_fn=gpt2_pipeline_loss(config, "dslab"),
                                    topology=PipeDataParallelTopology(num_pp=run.pp, num_dp=run.dp),
                                    partition_method="type:GPT2Block", seed_layers=True, base_seed=workload.seed,
                                    seed_fn=_seed_torch, activation_checkpoint_interval=run.checkpoint_interval,
                                    checkpointable_layers=["GPT2Block"])
        # ZeRO stage 1 even over one data-parallel rank (where it shards nothing): DeepSpeed's bf16
        # optimizer accumulates the micro-batches' gradients in fp32, as dslab's engine does, only
        # under stage 1 (at stage 0 it accumulates them in bf16)
        ds_config = deepspeed_config(workload, precision, engine_cfg, 1)
        ds_config["gradient_accumulation_steps"] = run.micro_batches
        ds_config["data_types"] = {"grad_accum_dtype": "fp32"}
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=ds_config)
        batch = workload.make_batch(device)
        self.micro_batches = [(batch["input_ids"], batch["labels"])] * run.micro_batches

    def step(self) -> torch.Tensor:
        return self.engine.train_batch(data_iter=iter(self.micro_batches))

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if callable(destroy):
            destroy()
        del self.engine, self.micro_batches
        free_memory(self.device)


def _seed_torch(seed) -> None:
    """A layer's seed for DeepSpeed's ``seed_layers``: torch's generator, as dslab's pipeline
    seeds it (DeepSpeed's own seeds Python's ``random`` too, which refuses the NumPy integers its
    ``type:`` partition hands it on Python 3.11 and later)."""
    torch.manual_seed(int(seed))


def build_layout_peer(run, workload: Workload, device: torch.device, precision: str, engine_cfg: dict):
    """The peer arm of ``run`` (a :class:`~dslab.bench.model_parallel.LayoutRun` whose
    implementation is ``torch`` or ``deepspeed``) for ``workload`` on ``device``; ArmSkipped
    where it cannot run (no process group, DeepSpeed not installed)."""
    if not dist.is_initialized():
        raise ArmSkipped(f"arm {run.arm!r} needs an initialized torch.distributed process group "
                         f"(start the suite with dslab bench or torchrun)")
    if run.impl == "deepspeed":
        return DeepSpeedPipelineArm(run, workload, device, precision, engine_cfg)
    if run.layout.pipeline:
        return TorchPipelineArm(run, workload, device, precision, engine_cfg)
    return TorchTensorParallelArm(run, workload, device, precision, engine_cfg)
