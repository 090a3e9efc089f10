"""The pipeline engine: DeepSpeed's ``engine.train_batch(data_iter)`` and ``eval_batch`` over a
:class:`~dslab.parallel.pipe.PipelineModule`.

One ``train_batch`` is one optimizer step over ``gradient_accumulation_steps`` micro-batches (the
pipeline's micro-batches) run by the 1F1B schedule (:mod:`dslab.parallel.pipe.schedule`):

1. Each stage runs its schedule's steps. The first and the last stage read each micro-batch from
   ``data_iter`` (``(inputs, labels)``: the first uses the inputs, the last the labels; the other
   stages do not read it). Activations go forward and gradients back between neighbouring stages
   through ``dslab.comm`` (:mod:`dslab.parallel.pipe.p2p`). The last stage's loss is
   ``loss_fn(outputs, labels)``, divided by the number of micro-batches before its backward, so
   that the accumulated gradients are the mean over the batch.
2. Tied layers' gradients are summed over the stages that hold them, into the owning stage's
   copy (:meth:`PipelineModule.reduce_tied_gradients`).
3. The data-parallel reduction over the data-parallel group (stage 0's all-reduce or ZeRO-1's
   reduce-scatter), issued after the last backward of the schedule.
4. The step: clipping by the norm of the whole model (summed over the pipeline's stages), the
   optimizer and scheduler; then the owning stages hand their tied weights to the others.

``train_batch`` returns the batch's mean loss (averaged over the micro-batches and the
data-parallel replicas) on every rank of the pipeline.

Supported: fp32, bf16 and fp16 (the last stage's loss is scaled, so the gradients travel back
scaled; an overflow on any rank skips the step on all of them), ZeRO stages 0 and 1 over the
data-parallel group (DeepSpeed's pipeline engine takes the same; stages 2 and 3 partition
gradients that the schedule keeps accumulating over micro-batches), activation checkpointing
(``activation_checkpoint_interval``). ``save_checkpoint``/``load_checkpoint`` write and read
one file of layers per (stage, tensor-parallel rank) and record the partition
(:mod:`dslab.engine.model_parallel_checkpoint`).

Each stage's time is measured (CUDA events on a GPU, the host clock on a CPU): the time its
forwards and backwards ran (busy) and the rest of the batch (idle: waiting on a neighbour, the
transfers, the bubble). :meth:`PipelineEngine.pipeline_stats` has them, and the run report's
``pipeline`` section has every stage's (a collective at report time).
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.nn as nn

from dslab import comm
from dslab.engine.engine import DslabEngine
from dslab.engine.precision import autocast_context
from dslab.engine import weight_copies
from dslab.models.checkpoint import checkpoint as activation_checkpoint
from dslab.parallel.pipe.module import PipelineModule
from dslab.parallel.pipe.p2p import as_tuple, carries_grad, decode_header, encode_header, exchange, HEADER_SLOTS
from dslab.parallel.pipe.schedule import bubble_fraction, inference_schedule, train_schedule


class PipelineError(RuntimeError):
    """A call that the pipeline engine does not take (DeepSpeed's name)."""


class _StageTimer:
    """Spans of one stage's work: the whole batch, and each forward and backward in it. CUDA
    events on a GPU, read only when the statistics are asked for (no synchronisation in the
    batch); the host clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list = []
        self.batches: list[tuple[int, list]] = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, kind: str, begun, micro_batch: int = -1) -> None:
        self.spans.append((kind, micro_batch, begun, self.start()))

    def end_batch(self, step: int) -> None:
        self.batches.append((step, self.spans))
        self.spans = []

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def resolve(self) -> list[dict]:
        """Per batch: ``{step, wall_ms, forward_ms, backward_ms, busy_ms, idle_ms, timeline}``,
        ``timeline`` the batch's forwards and backwards as ``[kind, micro-batch, start_ms,
        end_ms]`` from the batch's start."""
        out = []
        for step, spans in self.batches:
            totals = {"wall": 0.0, "forward": 0.0, "backward": 0.0}
            origin = next((begun for kind, _, begun, _ in spans if kind == "wall"), None)
            timeline = []
            for kind, micro, begun, end in spans:
                totals[kind] += self._ms(begun, end)
                if kind != "wall" and origin is not None:
                    timeline.append([kind, micro, self._ms(origin, begun), self._ms(origin, end)])
            busy = totals["forward"] + totals["backward"]
            out.append({"step": step, "wall_ms": totals["wall"], "forward_ms": totals["forward"],
                        "backward_ms": totals["backward"], "busy_ms": busy,
                        "idle_ms": max(totals["wall"] - busy, 0.0), "timeline": timeline})
        return out


class PipelineEngine(DslabEngine):
    """The engine for a :class:`PipelineModule`; built by :func:`dslab.initialize`."""

    def __init__(self, model: PipelineModule, config, optimizer=None, model_parameters=None,
                 lr_scheduler=None, mpu=None):
        if not isinstance(model, PipelineModule):
            raise ValueError(f"the pipeline engine needs a PipelineModule, got {type(model).__name__}")
        grid = model.mpu()
        if mpu is not None and mpu is not grid:
            raise ValueError("a PipelineModule brings its own grid (module.mpu()); do not pass mpu= too")
        if config.zero_optimization.stage > 1:
            raise ValueError(f"config key 'zero_optimization.stage' is {config.zero_optimization.stage} "
                             "with a PipelineModule: the pipeline engine takes stages 0 and 1 "
                             "(gradients accumulate over the micro-batches of a batch)")
        if config.compile.enabled:
            raise ValueError("config key 'compile.enabled' with a PipelineModule is not supported")
        config.pipeline.apply(model)  # DeepSpeed's pipeline section: stages, checkpoint interval
        self.num_stages = grid.get_pipe_parallel_world_size()
        self.stage_id = grid.get_stage_id()
        self.grid = grid
        not_owned = model.tied_parameters_not_owned()
        for p in not_owned:
            p.ds_pipe_replicated = True  # counted in the gradient norm by its owner only
        skip = {id(p) for p in not_owned}
        if model_parameters is None:
            model_parameters = model.parameters()
        owned = [p for p in model_parameters if id(p) not in skip]
        if not owned:  # a stage holding only copies of tied layers: an optimizer with no parameters
            owned = [{"params": []}]
        if model.activation_checkpoint_interval and model.activation_checkpoint_func is None:
            model.activation_checkpoint_func = activation_checkpoint
        super().__init__(model, config, optimizer=optimizer, model_parameters=owned,
                         lr_scheduler=lr_scheduler, mpu=grid)
        self.micro_batches = self.gradient_accumulation_steps()
        self.prev_rank = grid.stage_to_global(self.stage_id - 1) if self.stage_id > 0 else None
        self.next_rank = grid.stage_to_global(self.stage_id + 1) if self.stage_id < self.num_stages - 1 else None
        self.agg_train_loss = None
        self.training_dataloader = None
        self._data_iterator = None
        self._timer = _StageTimer(self.device)
        self._stats: list[dict] = []

    # -- what the pipeline engine does not take -----------------------------------------------

    def forward(self, *args, **kwargs):
        raise PipelineError("the pipeline engine runs whole batches: call train_batch() or eval_batch()")

    def backward(self, *args, **kwargs):
        raise PipelineError("the pipeline engine runs whole batches: call train_batch()")

    def step(self, *args, **kwargs):
        raise PipelineError("the pipeline engine runs whole batches: call train_batch()")

    def _data_parallel_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if not getattr(p, "ds_pipe_replicated", False)]

    # -- stage facts ----------------------------------------------------------------------------

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator) -> None:
        """The iterator ``train_batch()`` reads when it is given none."""
        self._data_iterator = iterator

    # -- batches --------------------------------------------------------------------------------

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches read from
        ``data_iter`` (see the module docstring); returns the mean loss on every stage."""
        if not self.module.training:
            self.module.train()
        data_iter = self._take_micro_batches(self._iterator(data_iter), self.micro_batches)
        hooks = self.profilers
        if hooks:
            hooks.begin_micro_step(self.global_steps)
        begun = self._timer.start()
        losses = self._run(train_schedule(self.stage_id, self.num_stages, self.micro_batches), data_iter,
                           train=True)
        self.module.reduce_tied_gradients()
        if self.grad_reducer is not None:  # the data-parallel reduction, after the last backward
            self.grad_reducer.begin(True)
            self.grad_reducer.finish()
        if self.optimizer is None:
            raise RuntimeError("train_batch() needs an optimizer: pass one to initialize() or add an "
                               "'optimizer' section to the config")
        hooks.call("on_optimizer_step_begin")
        self._take_model_step()
        hooks.call("on_optimizer_step_end")
        self.module.broadcast_tied_weights()
        self.agg_train_loss = self._aggregate_loss(losses)
        self._timer.stop("wall", begun)
        self._timer.end_batch(self.global_steps)
        if self.monitor.enabled:
            self._pending_losses.append(self.agg_train_loss)
        hooks.end_micro_step(self.global_steps)
        self.global_steps += 1
        self.micro_steps += self.micro_batches
        self.global_samples += self.train_batch_size()
        self._after_boundary()
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", num_micro_batches: int | None = None):
        """Forward ``num_micro_batches`` (default: ``gradient_accumulation_steps``) micro-batches
        without gradients. Returns the loss averaged over them (``reduce_output="avg"``) or their
        list (None), on every stage; with ``return_logits``, ``(loss, outputs)`` where the last
        stage's outputs are the last stage's, None elsewhere. ``compute_loss=False`` returns the
        last stage's outputs instead of a loss."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output={reduce_output!r}: 'avg' or None")
        micro = num_micro_batches or self.micro_batches
        was_training = self.module.training
        self.module.eval()
        try:
            batches = self._take_micro_batches(self._iterator(data_iter), micro)
            with torch.no_grad():
                results = self._run(inference_schedule(self.stage_id, self.num_stages, micro),
                                    batches, train=False, compute_loss=compute_loss)
        finally:
            self.module.train(was_training)
        if not compute_loss:
            return results if self.is_last_stage() else None
        loss = self._aggregate_loss(results) if reduce_output == "avg" else self._broadcast_losses(results, micro)
        if return_logits:
            return loss, (self._last_outputs if self.is_last_stage() else None)
        return loss

    def _take_micro_batches(self, data_iter, count: int):
        """The batch's ``count`` micro-batches, read up front by the stages that read data (the
        first and the last); every stage of the pipeline learns whether both got them all (one
        small all-reduce), so that a short iterator is a ValueError on every stage rather than a
        stage waiting forever for a neighbour that stopped."""
        reads = self.is_first_stage() or self.is_last_stage()
        batches = list(itertools.islice(data_iter, count)) if reads else []
        got = torch.tensor([len(batches) if reads else count], dtype=torch.int64, device=self.device)
        if self.num_stages > 1:
            comm.all_reduce(got, op=comm.ReduceOp.MIN, group=self.grid.get_pipe_parallel_group())
        if int(got.item()) < count:
            raise ValueError(f"data_iter gave {int(got.item())} of the batch's {count} micro-batches "
                             "(gradient_accumulation_steps) on a stage that reads data; the pipeline "
                             "stopped on every stage")
        return iter(batches)

    def _iterator(self, data_iter):
        if data_iter is not None:
            return data_iter
        if self._data_iterator is None:
            raise ValueError("train_batch() needs data_iter (or set_dataiterator() first)")
        return self._data_iterator

    # -- the schedule's steps -----------------------------------------------------------------

    def _run(self, schedule, data_iter, train: bool, compute_loss: bool = True) -> list:
        inputs: dict[int, tuple] = {}
        outputs: dict[int, tuple] = {}
        labels: dict[int, object] = {}
        losses: dict[int, torch.Tensor] = {}
        results: list = []
        header_in = None
        header_sent = False
        self._last_outputs = None
        for step in schedule:
            if step.kind == "load":
                batch = next(data_iter)
                if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                    raise ValueError("a pipeline micro-batch is (inputs, labels); data_iter gave "
                                     f"{type(batch).__name__}")
                if self.is_first_stage():
                    inputs[step.micro_batch] = _to_device(batch[0], self.device)
                if self.is_last_stage():
                    labels[step.micro_batch] = _to_device(batch[1], self.device)
            elif step.kind == "forward":
                i = step.micro_batch
                x = inputs[i] if self.is_first_stage() else self._stage_input(inputs[i])
                begun = self._timer.start()
                if self.profilers:
                    self.profilers.call("on_forward_begin")
                with autocast_context(self.device, self.autocast_dtype), weight_copies.scope(self.weight_copies):
                    out = self.module(x)
                    if self.is_last_stage() and compute_loss:
                        out = self.module.loss_fn(out, labels.pop(i)) if self.module.loss_fn is not None else out
                if self.profilers:
                    self.profilers.call("on_forward_end")
                self._timer.stop("forward", begun, i)
                if self.is_last_stage():
                    if compute_loss and (not torch.is_tensor(out) or out.dim() != 0):
                        raise ValueError("the last stage's loss must be a scalar tensor: give the "
                                         "PipelineModule a loss_fn(outputs, labels)")
                    if train:
                        losses[i] = out
                    results.append(out.detach() if torch.is_tensor(out) else out)
                    if not compute_loss:
                        self._last_outputs = out
                else:
                    outputs[i] = as_tuple(out)
                if not train:
                    inputs.pop(i, None)
            elif step.kind == "backward":
                self._backward(step.micro_batch, inputs, outputs, losses)
            else:
                sends, recvs = [], []
                for kind, i in step.sends:
                    if kind == "activation":
                        tensors = outputs[i] if train else outputs.pop(i)
                        if not header_sent:
                            header = encode_header(tensors).to(self.device)
                            exchange([(header, self.next_rank)], [])
                            header_sent = True
                        sends += [(t.detach(), self.next_rank) for t in tensors]
                    else:
                        sends += [(g, self.prev_rank) for g in self._input_grads(inputs.pop(i))]
                for kind, i in step.recvs:
                    if kind == "activation":
                        if header_in is None:
                            buffer = torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=self.device)
                            exchange([], [(buffer, self.prev_rank)])
                            header_in = decode_header(buffer.cpu())
                        received = tuple(torch.empty(shape, dtype=dtype, device=self.device)
                                         for dtype, _, shape in header_in)
                        inputs[i] = received
                        recvs += [(t, self.prev_rank) for t in received]
                    else:
                        grads = tuple(torch.empty_like(t) for t in outputs[i] if carries_grad(t))
                        outputs[i] = (outputs[i], grads)
                        recvs += [(g, self.next_rank) for g in grads]
                exchange(sends, recvs)
                for kind, i in step.recvs:
                    if kind == "activation" and header_in is not None:
                        inputs[i] = tuple(t.requires_grad_() if flag and train else t
                                          for t, (_, flag, _) in zip(inputs[i], header_in))
        return results

    def _stage_input(self, received: tuple):
        return received[0] if len(received) == 1 else received

    def _backward(self, i: int, inputs: dict, outputs: dict, losses: dict) -> None:
        begun = self._timer.start()
        if self.profilers:
            self.profilers.call("on_backward_begin")
        with torch.autograd.set_multithreading_enabled(False), weight_copies.scope(self.weight_copies):
            if self.is_last_stage():
                loss = losses.pop(i)
                scaled = loss / self.micro_batches if self.micro_batches != 1 else loss
                if self.loss_scaler is not None:  # fp16: the gradients travel back scaled
                    scaled = scaled * self.loss_scaler.loss_scale
                scaled.backward()
            else:
                sent, grads = outputs.pop(i)
                tensors = [t for t in sent if carries_grad(t)]
                if tensors:
                    torch.autograd.backward(tensors, grad_tensors=list(grads))
        if self.profilers:
            self.profilers.call("on_backward_end")
        self._timer.stop("backward", begun, i)

    @staticmethod
    def _input_grads(received: tuple) -> list[torch.Tensor]:
        """The gradients of a stage's received inputs that carry one (zeros where the stage's
        layers did not use an input)."""
        out = []
        for t in received:
            if t.requires_grad:
                out.append(t.grad if t.grad is not None else torch.zeros_like(t))
        return out

    # -- losses and statistics ----------------------------------------------------------------

    def _aggregate_loss(self, losses: list) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses, averaged over the data-parallel
        replicas, on every stage (broadcast from the last stage of this pipeline)."""
        if self.is_last_stage():
            total = torch.stack([loss.float() for loss in losses]).mean()
            if self.dp_world_size > 1:
                total = total / self.dp_world_size
                comm.all_reduce(total, group=self.dp_group)
        else:
            total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.num_stages > 1:
            comm.broadcast(total, src=self.grid.stage_to_global(self.num_stages - 1),
                           group=self.grid.get_pipe_parallel_group())
        return total

    def _broadcast_losses(self, losses: list, count: int) -> list[torch.Tensor]:
        stacked = (torch.stack([loss.float() for loss in losses]) if self.is_last_stage()
                   else torch.zeros(count, dtype=torch.float32, device=self.device))
        if self.num_stages > 1:
            comm.broadcast(stacked, src=self.grid.stage_to_global(self.num_stages - 1),
                           group=self.grid.get_pipe_parallel_group())
        return list(stacked.unbind())

    def pipeline_stats(self) -> dict:
        """This stage's busy and idle time per batch so far, their totals, its idle fraction and
        the 1F1B bubble it is compared with; the latest batch also has its ``timeline`` (every
        forward and backward, from the batch's start)."""
        resolved = self._timer.resolve()
        self._timer.batches = []
        if resolved:  # the timeline of the latest batch only (a report stays small)
            for earlier in self._stats:
                earlier.pop("timeline", None)
            for batch in resolved[:-1]:
                batch.pop("timeline")
        self._stats.extend(resolved)
        wall = sum(s["wall_ms"] for s in self._stats)
        busy = sum(s["busy_ms"] for s in self._stats)
        return {"stage": self.stage_id, "stages": self.num_stages, "micro_batches": self.micro_batches,
                "batches": list(self._stats), "wall_ms": wall, "busy_ms": busy,
                "idle_fraction": (wall - busy) / wall if wall > 0 else None,
                "bubble_fraction": bubble_fraction(self.num_stages, self.micro_batches)}

    def profiler_records(self) -> dict[str, dict]:
        """The profilers' records plus ``pipeline``: every stage's :meth:`pipeline_stats` (a
        collective over the pipeline group: call it on every rank)."""
        records = super().profiler_records()
        mine = self.pipeline_stats()
        stages = comm.all_gather_object(mine, group=self.grid.get_pipe_parallel_group()) \
            if self.num_stages > 1 else [mine]
        records["pipeline"] = {"stages": self.num_stages, "micro_batches": self.micro_batches,
                               "bubble_fraction": bubble_fraction(self.num_stages, self.micro_batches),
                               "per_stage": stages}
        return records


def _to_device(x, device: torch.device):
    if torch.is_tensor(x):
        return x.to(device, non_blocking=True)
    if isinstance(x, (tuple, list)):
        return tuple(_to_device(t, device) for t in x)
    return x
