"""The training engine: DeepSpeed's ``engine(batch)`` / ``engine.backward(loss)`` /
``engine.step()`` loop around any ``nn.Module``.

What one optimizer step does, with ``gradient_accumulation_steps = G``:

1. ``G`` micro-steps of forward (under autocast when bf16/fp16 is on, reading bf16 copies of the
   weights where :mod:`weight_copies` applies) and ``backward``. The loss is
   divided by ``G`` (and multiplied by the fp16 loss scale) before ``backward``, so accumulated
   gradients are the mean over the whole batch.
2. On the last micro-step (the accumulation boundary) the data-parallel all-reduce runs in buckets
   during backward (:mod:`data_parallel`). With ZeRO (``zero_optimization.stage`` 1 to 3) the
   :mod:`zero` runtime reduce-scatters instead, and shards optimizer states, gradients and
   parameters by stage.
3. ``step()`` on the boundary: fp16 unscale and overflow check (an overflow skips the update and
   lowers the scale), clipping by global norm, the optimizer and scheduler steps, zeroing the
   gradients. Off the boundary ``step()`` only counts the micro-step.

The step is cheap on the host: the module's parameter list is kept between steps
(:class:`parameters.ModuleParameters`, rebuilt when the module tree changes), clipping runs
torch's foreach kernels over all gradients at once, and the engine reads no value back from the
device on its default path (bf16 or fp32, no monitor), so the host issues the next step while the
device still runs this one. An fp16 step reads the overflow verdict (one synchronisation), and
the monitor reads the loss once per optimizer step.

Expert parameters of MoE layers (``param.allreduce = False``) follow DeepSpeed-MoE's rules
(:mod:`expert_parallel`): their gradients are reduced over their expert-data-parallel group, the
optimizer gets them in param groups of their own, the global norm and the overflow check count
every rank's experts, and checkpoints save them per expert-parallel rank.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn as nn

from dslab import comm
from dslab.engine import checkpointing, expert_parallel, model_parallel_checkpoint, parameters, weight_copies
from dslab.engine.checkpoint_tags import check_tag
from dslab.engine.config import DslabConfig
from dslab.engine.data_parallel import GradientAllReducer
from dslab.engine.model_parallel import ModelParallelLayout
from dslab.engine.monitor import Monitor
from dslab.engine.optimizers import build_optimizer, fused_kernels_supported
from dslab.engine.precision import LossScaler, autocast_context, autocast_dtype, check_grad_accum_dtype
from dslab.engine.profiling import ProfilerHooks, build_profilers
from dslab.engine.schedulers import build_scheduler
from dslab.engine.sequence_parallel import SequenceParallelLayout
from dslab.engine.zero import build_zero, param_gather
from dslab.parallel.partitioned import forget_partition, gather_, is_partitioned
from dslab.parallel.tensor_parallel import allreduce_sequence_parallel_grads
from dslab.kernels import dispatch

log = logging.getLogger(__name__)


def _move_to_device(model: nn.Module, device: torch.device, keep_trainable: bool) -> nn.Module:
    """``model.to(device)``, or with ``keep_trainable`` everything but the parameters that
    require a gradient (ZeRO stage 3 moves those itself, shard by shard)."""
    if not keep_trainable:
        return model.to(device)
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
            for name, p in module._parameters.items():
                if p is None or p.requires_grad:
                    continue
                moved = p.data.to(device)
                if torch._has_compatible_shallow_copy_type(p, moved):
                    p.data = moved
                else:  # e.g. to the meta device: a new Parameter, as nn.Module.to makes
                    module._parameters[name] = nn.Parameter(moved, requires_grad=False)
    return model


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")



def _check_partitioned(model: nn.Module, stage: int) -> None:
    """A model built under ``dslab.zero.Init`` trains at stage 3 only (its parameters are
    partitioned; stages 0-2 keep whole parameters on every rank)."""
    if stage == 3:
        return
    for name, p in model.named_parameters():
        if is_partitioned(p):
            raise ValueError(
                f"parameter '{name}' was built partitioned (dslab.zero.Init) and config key "
                f"'zero_optimization.stage' = {stage}: a model built under zero.Init trains at "
                "stage 3; build it without zero.Init for stages 0-2")

class DslabEngine(nn.Module):
    """Wraps ``model`` for training; built by :func:`dslab.initialize`."""

    # set by dslab.initialize in an autotuning experiment (dslab.engine.autotuning.experiment)
    autotuning_experiment = None

    def __init__(
        self,
        model: nn.Module,
        config: DslabConfig,
        optimizer=None,
        model_parameters=None,
        lr_scheduler=None,
        mpu=None,
    ):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config
        self.world_size = comm.get_world_size()
        self.rank = comm.get_rank()
        # model parallelism (mpu: a Megatron-style object, or dslab's PipelineParallelGrid):
        # data parallelism runs over its data-parallel group, the gradient norm sums over the
        # model-parallel groups (model_parallel.py)
        self.mpu = mpu
        self.parallel = ModelParallelLayout(mpu, config)
        # sequence parallelism (sequence_parallel_size): the data axis of a data x sequence grid;
        # gradients are reduced, and ZeRO shards, over the seq_dp ranks that hold one replica
        # (sequence_parallel.py; without it they are the data-parallel group)
        self.sequence_layout = SequenceParallelLayout(config, self.parallel, model)
        self.sequence_parallel_group = self.sequence_layout.group
        self.dp_group = self.sequence_layout.dp_group
        self.dp_world_size = self.sequence_layout.dp_world_size
        self.dp_rank = self.sequence_layout.dp_rank
        self.seq_dp_group = self.sequence_layout.seq_dp_group
        self.seq_dp_world_size = self.sequence_layout.seq_dp_world_size
        config.resolve_batch_size(self.dp_world_size)
        dispatch.set_backend(None if config.kernels == "auto" else config.kernels)

        self.device = _default_device()
        # ZeRO stage 3 shards the trainable parameters from wherever the model was built, one
        # unit at a time (zero/partition.py), so the whole model never has to fit on the device;
        # everything else moves now.
        shard_in_place = config.zero_optimization.stage == 3
        _check_partitioned(model, config.zero_optimization.stage)
        self.module = _move_to_device(model, self.device, keep_trainable=shard_in_place)
        # Kept out of nn.Module's registry: it is self.module or its compiled wrapper, and must
        # not show up a second time in the engine's modules or state dict.
        config.cuda_graphs.apply(self.module, data_parallel_world=self.seq_dp_world_size,
                                 zero_stage=config.zero_optimization.stage,
                                 model_parallel=self.parallel.model_parallel)
        if "activation_checkpointing" in config.model_fields_set:
            config.activation_checkpointing.apply()  # the process's checkpoint settings, as DeepSpeed's
            config.activation_checkpointing.apply_to_model(self.module)
        param_gather.check_config(config, model_parallel=self.parallel.model_parallel)
        object.__setattr__(self, "_run_module", config.compile.wrap(self.module))
        if self.seq_dp_world_size > 1:
            self._broadcast_parameters(trainable=not shard_in_place)

        self.autocast_dtype = autocast_dtype(config.fp16, config.bf16)
        check_grad_accum_dtype(config.data_types, self.module.parameters())
        self.loss_scaler = LossScaler(config.fp16) if config.fp16.enabled else None

        params = list(model_parameters) if model_parameters is not None else list(self.module.parameters())
        # DeepSpeed-MoE: expert parameters in param groups of their own ('moe': True, 'name')
        params = expert_parallel.split_param_groups(params)
        self.expert_layout = expert_parallel.expert_layout(self.module.parameters())
        # The module's parameters for the per-step work, kept while the module tree is unchanged.
        self._param_cache = parameters.ModuleParameters(self.module)
        # ZeRO (stage > 0) owns the gradient reduction and the optimizer's view of the parameters.
        self.zero = None
        # bf16 copies of the weights, kept by the optimizer (weight_copies.py); None for autocast alone.
        self.weight_copies = weight_copies.build(
            config, self.module, device=self.device,
            optimizer_passed=optimizer is not None, experts=self.expert_layout is not None, log=log,
            model_parallel=self.parallel.model_parallel)
        self.optimizer = self._configure_optimizer(optimizer, params)
        if self.weight_copies is not None:
            self.weight_copies.register(self.optimizer)
        if shard_in_place:
            self._place_unsharded_parameters()
        self.lr_scheduler = self._configure_scheduler(lr_scheduler)

        self.grad_reducer = self.zero
        if self.seq_dp_world_size > 1 and self.zero is None:
            reduced = self._data_parallel_parameters()
            if self.weight_copies is not None:  # the copies hold the gradients the optimizer reads
                reduced = self.weight_copies.grad_holders(reduced)
            self.grad_reducer = GradientAllReducer(
                reduced, config.zero_optimization.reduce_bucket_size, group=self.seq_dp_group,
                comm_dtype=config.communication_dtype, scaling=config.gradient_scaling)
        if self.zero is not None:
            self.zero.norm_groups = self.parallel.norm_groups
            if self.parallel.tp_world_size > 1:
                self.zero.set_norm_filter(self.parallel.counts_in_norm)
        # sequence parallelism: replicated parameters whose gradients are partial sums over the
        # tensor-parallel ranks' sequence shards, summed before each step
        self._sequence_parallel = self.parallel.tp_world_size > 1 and any(
            getattr(p, "sequence_parallel", False) for p in self.module.parameters())
        if self._sequence_parallel and config.zero_optimization.stage > 0:
            raise ValueError(f"config key 'zero_optimization.stage' is {config.zero_optimization.stage} with a "
                             "sequence-parallel model: its replicated gradients are summed over the "
                             "tensor-parallel group before the step, which ZeRO's shards do not take; use stage 0")

        self.profilers = ProfilerHooks(build_profilers(config, self.device))
        self.profilers.call("attach", self.module, self.optimizer)
        memory_tracer = self.profilers.find("memory")
        if memory_tracer is not None:
            memory_tracer.set_zero_stage(config.zero_optimization.stage, self.seq_dp_world_size, self.zero)
        self.monitor = Monitor(config.csv_monitor, config.tensorboard, rank=self.rank)
        self._pending_losses: list[torch.Tensor] = []

        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._boundary_override: bool | None = None

    # -- set-up -------------------------------------------------------------------------------

    def _broadcast_parameters(self, trainable: bool = True) -> None:
        """Start every rank from rank 0's weights and buffers (``trainable=False``: not the
        parameters that require a gradient; stage 3 broadcasts those unit by unit). An expert
        parameter starts from the first rank of its expert-data-parallel group: the ranks of
        other ep ranks hold other experts."""
        params = [p for p in self.module.parameters() if trainable or not p.requires_grad]
        source = comm.get_global_rank(self.seq_dp_group, 0)
        with torch.no_grad():
            for p in params:
                if expert_parallel.is_expert_param(p):
                    reduction = expert_parallel.reduction_group(p)
                    comm.broadcast(p.data, src=reduction.source_rank, group=reduction.group)
                else:
                    comm.broadcast(p.data, src=source, group=self.seq_dp_group)
            for tensor in self.module.buffers():
                comm.broadcast(tensor.data, src=source, group=self.seq_dp_group)

    def _data_parallel_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients stage 0 averages over the data-parallel group."""
        return list(self.module.parameters())

    def _place_unsharded_parameters(self) -> None:
        """After stage 3 sharded the optimizer's parameters: move (and broadcast) any trainable
        parameter it did not take, which is still where the model was built."""
        with torch.no_grad():
            for p in self.module.parameters():
                if is_partitioned(p):  # built under dslab.zero.Init and not trained: made whole
                    gather_(p)
                    forget_partition(p)
                if p.device != self.device:
                    p.data = p.data.to(self.device)
                    if self.world_size > 1:
                        comm.broadcast(p.data, src=0)

    def _configure_optimizer(self, optimizer, params):
        if optimizer is not None and self.config.optimizer is not None:
            raise ValueError(
                "an optimizer was passed to initialize() and the config has an 'optimizer' "
                "section; keep one of them"
            )
        if self.config.zero_optimization.stage > 0:
            self.zero, built = build_zero(
                self.module, self.config, optimizer, params,
                lambda groups, fused_ok: build_optimizer(self.config.optimizer, groups, fused_ok=fused_ok),
                device=self.device, broadcast=self.config.zero_optimization.stage == 3,
                group=self.seq_dp_group)
            return built
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        if callable(optimizer):
            built = optimizer(params)
            if not isinstance(built, torch.optim.Optimizer):
                raise ValueError("the optimizer callable must return a torch.optim.Optimizer")
            return built
        if optimizer is not None:
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}"
            )
        if self.config.optimizer is None:
            return None
        if self.weight_copies is not None:
            return weight_copies.build_optimizer(self.config.optimizer, params)
        return build_optimizer(self.config.optimizer, params, fused_ok=fused_kernels_supported(
            expert_parallel.parameters_of(params)))

    def _configure_scheduler(self, lr_scheduler):
        if lr_scheduler is not None and self.config.scheduler is not None:
            raise ValueError(
                "an lr_scheduler was passed to initialize() and the config has a 'scheduler' "
                "section; keep one of them"
            )
        if lr_scheduler is not None:
            if hasattr(lr_scheduler, "step"):
                return lr_scheduler
            if callable(lr_scheduler):
                return lr_scheduler(self.optimizer)
            raise ValueError("lr_scheduler must have a step() method or be a callable")
        if self.config.scheduler is None:
            return None
        if self.optimizer is None:
            raise ValueError("config key 'scheduler' needs an optimizer")
        return build_scheduler(self.config.scheduler, self.optimizer)

    # -- batch sizes (DeepSpeed exposes these as methods) ---------------------------------------

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    # -- the loop -------------------------------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the micro-step whose ``step()`` updates the parameters."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the boundary for the coming micro-step (None goes back to counting)."""
        self._boundary_override = is_boundary

    def forward(self, *args, **kwargs):
        hooks = self.profilers
        if hooks:
            hooks.begin_micro_step(self.global_steps)
            hooks.call("on_forward_begin")
        if self.zero is not None:
            self.zero.before_forward()
        with autocast_context(self.device, self.autocast_dtype), weight_copies.scope(self.weight_copies):
            out = self._run_module(*args, **kwargs)
        if hooks:
            hooks.call("on_forward_end")
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss`` scaled for accumulation (and fp16); returns the unscaled loss."""
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise ValueError("engine.backward expects a scalar loss tensor")
        hooks = self.profilers
        if hooks:
            hooks.begin_micro_step(self.global_steps)
            hooks.call("on_backward_begin")
        if self.monitor.enabled:
            self._pending_losses.append(loss.detach().float())
        # Dividing by 1 changes no bit of the loss or of any gradient; it would only cost an op
        # in the forward and one in the backward.
        accumulation = self.gradient_accumulation_steps()
        scaled = loss / accumulation if accumulation != 1 else loss
        if self.sequence_layout.size > 1:  # a rank's gradients are its chunk's share (sequence_parallel.py)
            scaled = scaled * self.sequence_layout.loss_multiplier
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.loss_scale
        if self.grad_reducer is not None:
            self.grad_reducer.begin(self.is_gradient_accumulation_boundary())
        # Backward on this thread rather than autograd's per-device worker thread: dslab's kernels
        # have Python backward functions, and the hand-off to the worker costs ~0.1-0.3 ms per op
        # on the host (measured on an H100 host), which small kernels cannot hide.
        # In the copies' scope too, so that a recomputation (activation checkpointing) reads them.
        with torch.autograd.set_multithreading_enabled(False), weight_copies.scope(self.weight_copies):
            scaled.backward(retain_graph=retain_graph)
        if hooks:
            hooks.mark("backward_compute_end")
        if self.grad_reducer is not None:
            self.grad_reducer.finish()
        if hooks:
            hooks.call("on_backward_end")
        return loss

    def _parameters_of_module(self) -> list[nn.Parameter]:
        """``list(self.module.parameters())``, kept between steps
        (:class:`parameters.ModuleParameters`; a new one when ``self.module`` was replaced)."""
        if self._param_cache.module is not self.module:
            self._param_cache = parameters.ModuleParameters(self.module)
        return self._param_cache()

    def _clear_module_grads(self, params: list[nn.Parameter] | None = None) -> None:
        """``self.module.zero_grad(set_to_none=True)``, over ``params`` (the module's parameters,
        fetched when None) unless the module's class has a ``zero_grad`` of its own."""
        if type(self.module).zero_grad is nn.Module.zero_grad:
            parameters.clear_grads(self._parameters_of_module() if params is None else params)
        else:
            self.module.zero_grad(set_to_none=True)
        if self.weight_copies is not None:
            self.weight_copies.clear_grads()

    def step(self) -> None:
        """Update on the accumulation boundary; count the micro-step either way."""
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        if boundary:
            if self.optimizer is None:
                raise RuntimeError(
                    "engine.step() needs an optimizer: pass one to initialize() or add an "
                    "'optimizer' section to the config"
                )
            self.profilers.call("on_optimizer_step_begin")
            self._take_model_step()
            self.profilers.call("on_optimizer_step_end")
        self.profilers.end_micro_step(self.global_steps)
        if boundary:
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self._after_boundary()
        self.micro_steps += 1
        self._boundary_override = None

    def _take_model_step(self) -> None:
        params = self._parameters_of_module()
        if self._sequence_parallel:
            allreduce_sequence_parallel_grads(self.module, self.parallel.tp_group)
        if self.zero is not None:
            applied = self.zero.step(self.optimizer, self.loss_scaler, self.config.gradient_clipping)
        else:
            applied = self._step_replicated(params)
        if not applied:
            self.skipped_steps += 1
            log.info(
                "step %d: gradient overflow, skipped; loss scale now %s",
                self.global_steps, self.loss_scaler.loss_scale,
            )
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._step_applied = applied
        if self.zero is None or not self.zero.stepping():
            # a background offloaded step (offload_optimizer.overlap_step) clears its masters' grads
            self.optimizer.zero_grad(set_to_none=True)
        self._clear_module_grads(params)

    def _step_replicated(self, params: list[nn.Parameter]) -> bool:
        """Stage 0: every rank holds the whole averaged gradient and steps on all of it
        (``params``: the module's parameters). With expert parameters the ranks hold different
        experts: the overflow verdict is all-reduced so that every rank skips or steps together,
        and the clipping norm sums the experts over their expert-parallel groups."""
        experts = self.expert_layout is not None
        if self.loss_scaler is not None:
            grads = parameters.grads_of(params)
            if (experts or self.parallel.model_parallel) and self.world_size > 1:
                found = (self.loss_scaler.unscale_and_find_inf(grads) if grads
                         else torch.zeros((), dtype=torch.float32, device=self.device))
                comm.all_reduce(found, op=comm.ReduceOp.MAX)
                overflow = bool(found.item() > 0)
            else:
                overflow = self.loss_scaler.unscale_and_check(grads)
            self.loss_scaler.update_scale(overflow)
            if overflow:
                return False
        if self.config.gradient_clipping > 0:
            if experts:  # every parameter, so that every rank issues the same collectives
                expert_parallel.clip_gradients(params, self.config.gradient_clipping)
            elif self.parallel.norm_groups:  # the whole model's norm, over its model-parallel ranks
                parameters.clipped_step(self.optimizer, params, self.config.gradient_clipping,
                                        norm_params=[p for p in params if self.parallel.counts_in_norm(p)],
                                        norm_groups=self.parallel.norm_groups)
                return True
            else:
                holders = params if self.weight_copies is None else self.weight_copies.grad_holders(params)
                parameters.clipped_step(self.optimizer, holders, self.config.gradient_clipping,
                                        fp32_norms=self.weight_copies is not None)
                return True
        self.optimizer.step()
        return True

    def _after_boundary(self) -> None:
        print_now = self.global_steps % self.config.steps_per_print == 0
        if self.monitor.enabled:
            events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if self.loss_scaler is not None:
                events.append(("Train/Samples/loss_scale", self.loss_scaler.loss_scale, self.global_samples))
            if self._pending_losses:
                # One host transfer per optimizer step for the whole accumulation window.
                mean_loss = torch.stack(self._pending_losses).mean().item()
                events.append(("Train/Samples/train_loss", mean_loss, self.global_samples))
                self._pending_losses = []
            wall_clock = self.profilers.find("wall_clock")
            if wall_clock is not None:
                for name, times in wall_clock.collect().items():
                    events.append((f"Train/Samples/elapsed_time_ms_{name}", sum(times) / len(times), self.global_samples))
            self.monitor.write_events(events)
        if print_now and self.rank == 0:
            log.info(
                "step=%d, skipped=%d, lr=%s", self.global_steps, self.skipped_steps, self.get_lr()
            )
            wall_clock = self.profilers.find("wall_clock")
            if wall_clock is not None and not self.monitor.enabled:
                times = wall_clock.collect()
                parts = ", ".join(f"{k}: {sum(v) / len(v):.2f}" for k, v in sorted(times.items()) if v)
                log.info("time (ms) | %s", parts)
        if self.autotuning_experiment is not None:
            self.autotuning_experiment.on_optimizer_step_end()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none:
            self._clear_module_grads()
        else:
            self.module.zero_grad(set_to_none=False)
            if self.weight_copies is not None:
                for c in self.weight_copies.copies:
                    if c.grad is not None:
                        c.grad.zero_()
        if self.zero is not None:
            self.zero.zero_grad()

    def was_step_applied(self) -> bool:
        """False when the last boundary step was skipped (fp16 overflow) or was not a boundary."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list:
        if self.optimizer is None:
            return []
        return [group.get("betas", group.get("momentum")) for group in self.optimizer.param_groups]

    @property
    def cur_scale(self) -> float:
        """The fp16 loss scale (1.0 when fp16 is off)."""
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def module_state_dict(self) -> dict:
        """The wrapped model's full state dict (on every rank). With ZeRO stage 3 it is gathered
        from every rank's shards: a collective, so call it on all ranks."""
        if self.zero is not None:
            return self.zero.module_state_dict()
        return self.module.state_dict()

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state: dict | None = None, save_latest: bool = True) -> Path:
        """Save model, optimizer, scheduler, loss scaler, RNG states and counters under
        ``save_dir/tag`` (tag defaults to ``global_step<N>``); call it on every rank. Returns the
        checkpoint's path. With model parallelism (or a pipeline) every (tensor, pipeline)
        coordinate writes its own files and the layout is recorded
        (:mod:`model_parallel_checkpoint`)."""
        if self.zero is not None:
            self.zero.settle()  # deferred parameter gathers (overlap_param_gather) complete first
        tag = f"global_step{self.global_steps}" if tag is None else tag
        check_tag(tag, self.config.checkpoint.tag_validation)
        if model_parallel_checkpoint.applies(self):
            return model_parallel_checkpoint.save(self, save_dir, tag, client_state or {}, save_latest)
        return checkpointing.save(self, save_dir, tag, client_state or {}, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_strict: bool = True):
        """Resume from ``load_dir/tag`` (tag defaults to the ``latest`` file's).

        Returns ``(path, client_state)``, or ``(None, None)`` when ``tag`` is None and
        ``load_dir`` holds no ``latest`` file (nothing to resume from), as DeepSpeed does. A
        model-parallel checkpoint loads only at the layout it was saved with: any other raises a
        ValueError naming both layouts (:mod:`model_parallel_checkpoint`).
        """
        if self.zero is not None:
            self.zero.settle()  # a deferred gather must not land on the loaded parameters
        load = model_parallel_checkpoint.load if model_parallel_checkpoint.applies(self) else checkpointing.load
        loaded = load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_strict)
        if self.weight_copies is not None:
            self.weight_copies.refresh()
        return loaded

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Save the model's full weights in the training precision (bf16/fp16, else as they are)
        as ``save_dir/save_filename`` on rank 0; call it on every rank. Under ZeRO stage 3 it
        gathers the weights only with ``zero_optimization.stage3_gather_16bit_weights_on_model_save``
        and otherwise saves nothing and returns False (DeepSpeed's behaviour)."""
        if self.zero is not None:
            self.zero.settle()
        return checkpointing.save_16bit(self, save_dir, save_filename, exclude_frozen_parameters)

    def set_measured_peak(self, bf16_matmul_tflops: float) -> None:
        """The bf16 matmul peak measured on this device: the flops profiler's MFU divides by it
        (beside the datasheet peak). Set it before the profiled step."""
        flops = self.profilers.find("flops")
        if flops is not None:
            flops.measured_peak_tflops = bf16_matmul_tflops
            if flops.profiler is not None:
                flops.profiler.measured_peak_tflops = bf16_matmul_tflops

    def set_profile_output_dir(self, path, echo_text: bool = False) -> None:
        """Directory for the files profilers write: the memory tracer's allocator snapshot, and the
        text reports that otherwise print to standard output (the flops profile unless
        ``flops_profiler.output_file`` names a file, the comms logger's verbose lines).
        ``echo_text`` prints those reports as well."""
        self.profilers.set_output_dir(path, echo_text=echo_text)

    def profiler_records(self) -> dict[str, dict]:
        """Each running profiler's records, keyed by its run-report section."""
        return self.profilers.records()

    def destroy(self) -> None:
        """Remove hooks, stop the profilers, close the monitor's files and free the model's CUDA
        graphs (captured again if the model trains on)."""
        if self.grad_reducer is not None:
            self.grad_reducer.remove()
        self.profilers.close()
        self.monitor.close()
        release = getattr(self.module, "release_cuda_graphs", None)
        if callable(release):
            release()
