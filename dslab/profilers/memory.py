"""Memory tracer: peak memory every step, and on one profiled step where the memory went.

Every step (CUDA only): the caching allocator's peak allocated and peak reserved bytes since the
step began (``reset_peak_memory_stats`` at step begin, ``max_memory_allocated`` /
``max_memory_reserved`` at step end). These are host-side counters that the allocator updates
when a kernel is enqueued, so reading them needs no device synchronisation. With gradient
accumulation the micro-steps of one optimizer step share one entry. The reset is process-wide:
while the tracer is on, ``torch.cuda.max_memory_allocated()`` means "since this step began", and
the run's peak is ``records()["peak"]``. At most ``MAX_STEP_ENTRIES`` step entries are kept,
thinned evenly as telemetry's samples are (:class:`dslab.profilers.telemetry.BoundedSeries`);
``records()["peak"]`` covers every step.

On ``profile_step`` (the engine's ``global_steps``; its first micro-step):

- **Phases** (CUDA): ``memory_allocated()`` at each hook, giving the change across forward,
  backward and the optimizer step (same host-side counter, no synchronisation).
- **Activations** (CPU and CUDA): the bytes autograd holds for backward, per module.
  :class:`SavedTensorTracker` keeps a stack of the modules being run (forward pre/post hooks) and
  a ``torch.autograd.graph.saved_tensors_hooks`` pack hook that charges each tensor saved for
  backward to the innermost module. What a saved tensor holds alive is its whole storage, so a
  storage is charged once, to the first module that saved it (``nn.Linear`` saves its input,
  ``nn.ReLU`` its output: a Linear after a ReLU saves the same storage again and is charged
  nothing for it; ``shared_bytes`` shows it). Storages of parameters and buffers are model state,
  not activations, and are left out (a saved transposed weight is a view of the parameter). A
  storage is counted only if a tensor saved with it is still alive when forward ends. Tensors
  saved inside activation checkpointing go to its own hooks and are not seen, which is right:
  they are not held. Tensors saved outside every module of the model (a loss computed by the
  caller between the forward hooks) are charged to ``(outside modules)``, the model's own
  forward to ``(root)``. While the hooks are on (the profiled step's forward only), autograd does
  not check saved tensors for in-place modification; every other step it does.
- **Model states** (CPU and CUDA, tensor sizes): parameters, gradients and optimizer states
  (every tensor in ``optimizer.state``, plus optimizer parameters that are not model parameters,
  such as fp32 master copies), next to the ZeRO stage-0 estimate (Rajbhandari et al. 2020, §3.1:
  every rank holds all model states)::

      estimate = sum over parameters p of numel(p) * bytes(dtype of p) * (1 + g(p) + k(p))

  where ``g(p)`` is 1 if p requires grad (the gradient has p's dtype) and ``k(p)`` the number
  of optimizer state tensors the optimizer keeps per parameter in p's dtype (Adam family: 2, 3
  with amsgrad; SGD: 1 with momentum, else 0; RMSprop: 1 + momentum + centered; Adagrad: 1).
  fp32 Adam: 4 + 4 + 8 = 16 bytes per parameter. Per-tensor step counters are in the measured
  figure, not the estimate. Under ZeRO stage >= 1 the measured optimizer states are this rank's
  shard, so they fall below the stage-0 estimate by the sharding factor. ``zero_estimate``
  partitions the same three totals for ZeRO stages 0-3 over this run's world size
  (:func:`dslab.profilers.zero_memory_model.partition_per_gpu`; stage 3 adds the largest
  module's own parameters and gradients as its gather buffer), so the measured ``total`` of this
  rank sits beside the per-GPU estimate of the stage the engine runs (``zero_estimate.stage``,
  when the engine has called :meth:`MemoryTracer.set_zero_stage`).
- **Snapshot** (CUDA, ``snapshot: true``): the allocator's event history over the profiled step,
  ``torch.cuda.memory._record_memory_history(max_entries=snapshot_max_entries)`` from the
  profiled step's begin to its end (after the optimizer step), written with
  ``torch.cuda.memory._dump_snapshot`` to ``<output_dir>/memory_snapshot_step<N>.pickle``. The
  engine or bench gives the directory with :meth:`MemoryTracer.set_output_dir`; without one no
  snapshot is recorded and the records say so. Open the file at https://pytorch.org/memory_viz.

On CPU the allocator counters do not exist: ``records()`` says ``"cuda": false`` with a note, and
still holds the activation and model-state figures.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import torch
import torch.nn as nn
from pydantic import Field

from dslab import comm
from dslab.config_base import ConfigSection
from dslab.profilers.base import Profiler
from dslab.profilers.telemetry import BoundedSeries
from dslab.profilers.zero_memory_model import STAGES, partition_per_gpu

logger = logging.getLogger(__name__)

CPU_NOTE = "CUDA memory is not traced on CPU: no allocator peaks, phase deltas or snapshot"
ROOT = "(root)"
OUTSIDE = "(outside modules)"
MAX_STEP_ENTRIES = 4096


class MemoryTracerConfig(ConfigSection):
    """dslab's ``memory_tracer`` section."""

    enabled: bool = False
    profile_step: int = Field(1, ge=0, description="global step whose memory is broken down")
    snapshot: bool = Field(False, description="record the allocator history over profile_step")
    snapshot_max_entries: int = Field(100_000, ge=1, description="allocator events kept")


def _storage_key(t: torch.Tensor) -> tuple[tuple, int]:
    """(identity, bytes) of the storage behind ``t``; tensors without one count their own size."""
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some subclasses
        return ("tensor", id(t)), t.numel() * t.element_size()


class _Storage:
    __slots__ = ("module", "nbytes", "refs")

    def __init__(self, module: str, nbytes: int):
        self.module, self.nbytes, self.refs = module, nbytes, []

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.refs)


class SavedTensorTracker:
    """Bytes saved for backward during one forward, by module (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._stack: list[str] = []
        self._handles: list = []
        self._hooks = None
        self._model_storages: set = set()
        self._storages: list[_Storage] = []
        self._by_key: dict = {}
        self._order: list[str] = []
        self._counts: dict[str, dict] = {}

    def start(self) -> None:
        self._model_storages = {_storage_key(t)[0] for t in self.model.parameters()}
        self._model_storages |= {_storage_key(t)[0] for t in self.model.buffers()}
        for name, module in self.model.named_modules():
            label = name or ROOT
            self._handles.append(module.register_forward_pre_hook(self._pusher(label)))
            self._handles.append(
                module.register_forward_hook(self._popper(label), always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def stop(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []

    def _pusher(self, label: str):
        def hook(module, args):
            self._stack.append(label)
        return hook

    def _popper(self, label: str):
        def hook(module, args, output):
            if self._stack and self._stack[-1] == label:
                self._stack.pop()
            elif label in self._stack:  # a child raised past its own post hook
                del self._stack[len(self._stack) - 1 - self._stack[::-1].index(label):]
        return hook

    def _module_counts(self, module: str) -> dict:
        if module not in self._counts:
            self._counts[module] = {"tensors": 0, "shared": []}
            self._order.append(module)
        return self._counts[module]

    def _pack(self, t):
        # Autograd keeps what pack returns. Returning ``t`` itself would make an output saved by
        # its own grad_fn a reference cycle through C++ (tensor -> grad_fn -> tensor) that Python
        # cannot collect, leaking graphs thrown away without backward; a detached alias shares
        # the storage and references no graph. Double backward still works: autograd rebuilds
        # the saved variable's graph edges on unpack.
        if not isinstance(t, torch.Tensor):
            return t
        saved = t.detach()
        key, nbytes = _storage_key(t)
        if key in self._model_storages:
            return saved
        module = self._stack[-1] if self._stack else OUTSIDE
        counts = self._module_counts(module)
        counts["tensors"] += 1
        storage = self._by_key.get(key)
        if storage is None or not storage.alive():
            storage = _Storage(module, nbytes)
            self._by_key[key] = storage
            self._storages.append(storage)
        elif storage.module != module and storage not in counts["shared"]:
            counts["shared"].append(storage)
        storage.refs.append(weakref.ref(saved))
        return saved

    @staticmethod
    def _unpack(t):
        return t

    def results(self) -> list[dict]:
        """``[{"module", "bytes", "tensors", "storages", "shared_bytes"}]`` in order of first
        save; ``bytes`` sums the live storages charged to the module, ``shared_bytes`` the live
        storages it saved that an earlier module was charged for."""
        rows = {m: {"module": m, "bytes": 0, "tensors": self._counts[m]["tensors"], "storages": 0,
                    "shared_bytes": sum(s.nbytes for s in self._counts[m]["shared"] if s.alive())}
                for m in self._order}
        for storage in self._storages:
            if storage.alive():
                rows[storage.module]["bytes"] += storage.nbytes
                rows[storage.module]["storages"] += 1
        return [rows[m] for m in self._order]


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def optimizer_states_per_param(group: dict) -> int | None:
    """State tensors of a parameter's size that the optimizer of this param group keeps, from the
    group's hyperparameter keys (torch's Adam/AdamW/Lamb/FusedAdam, SGD, RMSprop, Adagrad); None
    for an optimizer not recognised."""
    if "betas" in group:
        return 3 if group.get("amsgrad") else 2
    if "dampening" in group:
        return 1 if group.get("momentum") else 0
    if "alpha" in group and "centered" in group:
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    if "lr_decay" in group:
        return 1
    return None


def _zero_estimate(model: nn.Module, moments: dict[int, int | None], world_size: int) -> dict:
    """Per-GPU bytes of the stage-0 estimate's parameters, gradients and optimizer states when
    ZeRO stages 0-3 partition them over ``world_size`` ranks (see the module docstring)."""
    params = grads = states = 0
    for p in model.parameters():
        nbytes = _tensor_bytes(p)
        params += nbytes
        grads += nbytes * int(p.requires_grad)
        states += nbytes * (moments.get(id(p)) or 0)
    layer_buffer = max((sum(_tensor_bytes(p) * (1 + int(p.requires_grad)) for p in m.parameters(recurse=False))
                        for m in model.modules()), default=0)
    rows = [{"stage": stage, **partition_per_gpu(stage, world_size, params, grads, states, layer_buffer)}
            for stage in STAGES]
    return {"world_size": world_size, "per_gpu": rows}


def model_state_bytes(model: nn.Module, optimizer=None, world_size: int | None = None) -> dict:
    """Bytes of parameters, gradients and optimizer states now held, and the stage-0 estimate.

    Returns ``{"num_params", "params", "grads", "optimizer_states", "optimizer_params", "total",
    "bytes_per_param", "estimate", "estimate_bytes_per_param", "estimate_note",
    "zero_estimate"}``; ``optimizer_params`` are parameters the optimizer updates that the model
    does not hold (master copies), included in ``total``. ``zero_estimate`` is ``{"world_size",
    "per_gpu": [{"stage", "params", "grads", "optimizer_states", "buffer", "total"}]}`` over
    ``world_size`` ranks (default: the process group's), None where ``estimate`` is.
    """
    params = list(model.parameters())
    model_ids = {id(p) for p in params}
    num_params = sum(p.numel() for p in params)
    param_bytes = sum(_tensor_bytes(p) for p in params)
    grad_bytes = sum(_tensor_bytes(p.grad) for p in params if p.grad is not None)

    state_bytes = 0
    extra_param_bytes = 0
    moments: dict[int, int | None] = {}
    note = None
    if optimizer is not None:
        seen: set = set()
        for state in optimizer.state.values():
            for value in state.values() if isinstance(state, dict) else ():
                if isinstance(value, torch.Tensor):
                    key = (str(value.device), value.data_ptr(), value.numel(), value.dtype)
                    if key not in seen:
                        seen.add(key)
                        state_bytes += _tensor_bytes(value)
        for group in optimizer.param_groups:
            k = optimizer_states_per_param(group)
            if k is None:
                note = (f"optimizer {type(optimizer).__name__} not recognised: "
                        "its states per parameter are unknown, so there is no estimate")
            for p in group["params"]:
                moments[id(p)] = k
                if id(p) not in model_ids:
                    extra_param_bytes += _tensor_bytes(p)
                    if p.grad is not None:
                        grad_bytes += _tensor_bytes(p.grad)

    estimate = None
    if note is None:
        estimate = 0
        for p in params:
            k = moments.get(id(p)) or 0
            estimate += _tensor_bytes(p) * (1 + int(p.requires_grad) + k)
    total = param_bytes + grad_bytes + state_bytes + extra_param_bytes
    estimate_per_param = estimate / num_params if estimate is not None and num_params else None
    return {
        "num_params": num_params,
        "params": param_bytes,
        "grads": grad_bytes,
        "optimizer_states": state_bytes,
        "optimizer_params": extra_param_bytes,
        "total": total,
        "bytes_per_param": total / num_params if num_params else None,
        "estimate": estimate,
        "estimate_bytes_per_param": estimate_per_param,
        "estimate_formula": "sum_p numel(p) * bytes(p.dtype) * (1 + requires_grad(p) + k), "
                            "k = optimizer state tensors per parameter (ZeRO stage 0)",
        "estimate_note": note,
        "zero_estimate": None if estimate is None else _zero_estimate(
            model, moments, comm.get_world_size() if world_size is None else world_size),
    }


class MemoryTracer(Profiler):
    """Peak memory per step; phases, activations by module, model states (and a snapshot) on
    ``profile_step``. See the module docstring."""

    section = "memory"

    def __init__(self, profile_step: int = 1, snapshot: bool = False,
                 snapshot_max_entries: int = 100_000, output_dir: str | Path | None = None):
        if profile_step < 0:
            raise ValueError(f"memory_tracer.profile_step must be >= 0, got {profile_step}")
        if snapshot_max_entries < 1:
            raise ValueError(f"memory_tracer.snapshot_max_entries must be >= 1, "
                             f"got {snapshot_max_entries}")
        self.profile_step = profile_step
        self.snapshot = snapshot
        self.snapshot_max_entries = snapshot_max_entries
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.zero_stage: int | None = None
        self.model: nn.Module | None = None
        self.optimizer = None
        self.device: torch.device | None = None
        self.cuda = False
        self._profiling = False
        self._tracker: SavedTensorTracker | None = None
        self._activations: list[dict] | None = None
        self._allocated: dict[str, int] = {}
        self._model_states: dict | None = None
        self._optimizer_stepped = False
        self._steps = BoundedSeries(MAX_STEP_ENTRIES)
        self._current: dict | None = None
        self._peak = {"allocated": 0, "reserved": 0}
        self._recording = False
        self._snapshot_path: str | None = None
        self._snapshot_note: str | None = None

    @classmethod
    def from_config(cls, cfg: MemoryTracerConfig, output_dir: str | Path | None = None
                    ) -> MemoryTracer | None:
        if not cfg.enabled:
            return None
        return cls(profile_step=cfg.profile_step, snapshot=cfg.snapshot,
                   snapshot_max_entries=cfg.snapshot_max_entries, output_dir=output_dir)

    def set_output_dir(self, path: str | Path) -> None:
        """Where the snapshot file goes (the run's report directory); set before profile_step."""
        self.output_dir = Path(path)

    def set_zero_stage(self, stage: int) -> None:
        """The ZeRO stage the engine runs, recorded as ``model_states.zero_estimate.stage``."""
        if stage not in STAGES:
            raise ValueError(f"zero_optimization.stage must be one of {STAGES}, got {stage!r}")
        self.zero_stage = stage

    def attach(self, model: nn.Module, optimizer=None) -> None:
        self.model, self.optimizer = model, optimizer
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()

    # --- hooks -------------------------------------------------------------------------------

    def _mark(self, name: str) -> None:
        if self.cuda:
            self._allocated[name] = torch.cuda.memory_allocated(self.device)

    def on_step_begin(self, step: int) -> None:
        if self._recording and step > self.profile_step:
            self._stop_snapshot()
        if self.cuda and (self._current is None or self._current["step"] != step):
            if self._current is not None:
                self._steps.offer(self._current)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._current = {"step": step, "peak_allocated": 0, "peak_reserved": 0}
        self._profiling = step == self.profile_step and self.model is not None
        first_time = self._snapshot_path is None and self._snapshot_note is None
        if self._profiling and self.snapshot and first_time and not self._recording:
            self._start_snapshot()

    def on_forward_begin(self) -> None:
        if not self._profiling or self._activations is not None:
            return
        self._mark("forward_begin")
        self._tracker = SavedTensorTracker(self.model)
        self._tracker.start()

    def on_forward_end(self) -> None:
        if self._tracker is None:
            return
        self._tracker.stop()
        self._activations = self._tracker.results()
        self._tracker = None
        self._mark("forward_end")

    def on_backward_begin(self) -> None:
        if self._profiling and "backward_begin" not in self._allocated:
            self._mark("backward_begin")

    def on_backward_end(self) -> None:
        if self._profiling and "backward_end" not in self._allocated:
            self._mark("backward_end")
        if self._profiling and self._model_states is None:
            self._model_states = model_state_bytes(self.model, self.optimizer)

    def on_optimizer_step_begin(self) -> None:
        if self._profiling:
            self._mark("optimizer_begin")
            self._model_states = model_state_bytes(self.model, self.optimizer)

    def on_optimizer_step_end(self) -> None:
        if not self._profiling:
            return
        self._mark("optimizer_end")
        before = self._model_states
        after = model_state_bytes(self.model, self.optimizer)
        if before is not None:  # the gradients the step consumed: an engine may free them in it
            after["total"] += before["grads"] - after["grads"]
            after["grads"] = before["grads"]
            n = after["num_params"]
            after["bytes_per_param"] = after["total"] / n if n else None
        self._model_states = after
        self._optimizer_stepped = True

    def on_step_end(self, step: int) -> None:
        if self.cuda and self._current is not None:
            self._current["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
            self._current["peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
            self._peak["allocated"] = max(self._peak["allocated"], self._current["peak_allocated"])
            self._peak["reserved"] = max(self._peak["reserved"], self._current["peak_reserved"])
        if self._recording and (self._optimizer_stepped or self.optimizer is None):
            self._stop_snapshot()
        if self._optimizer_stepped or self.optimizer is None:
            self._profiling = False

    # --- snapshot ----------------------------------------------------------------------------

    def _start_snapshot(self) -> None:
        if not self.cuda:
            self._snapshot_note = "snapshot needs CUDA: " + CPU_NOTE
            return
        if self.output_dir is None:
            self._snapshot_note = ("snapshot requested but no output directory was set "
                                   "(set_output_dir)")
            logger.warning("memory tracer: %s", self._snapshot_note)
            return
        torch.cuda.memory._record_memory_history(max_entries=self.snapshot_max_entries)
        self._recording = True

    def _stop_snapshot(self) -> None:
        self._recording = False
        path = self.output_dir / f"memory_snapshot_step{self.profile_step}.pickle"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            self._snapshot_path = str(path)
        except (OSError, RuntimeError) as exc:
            self._snapshot_note = f"snapshot could not be written to {path}: {exc}"
            logger.warning("memory tracer: %s", self._snapshot_note)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    # --- report ------------------------------------------------------------------------------

    def _phases(self) -> dict:
        def delta(end: str, begin: str) -> int | None:
            if end in self._allocated and begin in self._allocated:
                return self._allocated[end] - self._allocated[begin]
            return None

        return {
            "forward_delta": delta("forward_end", "forward_begin"),
            "backward_delta": delta("backward_end", "backward_begin"),
            "optimizer_delta": delta("optimizer_end", "optimizer_begin"),
            "allocated": dict(self._allocated),
        }

    def records(self) -> dict:
        """``{"cuda", "note", "device", "profile_step", "steps": [{"step", "peak_allocated",
        "peak_reserved"}], "peak": {"allocated", "reserved"}, "phases": {"forward_delta",
        "backward_delta", "optimizer_delta", "allocated"}, "activations": [...],
        "activation_bytes", "model_states": {...}, "snapshot", "snapshot_note"}`` (bytes)."""
        steps = list(self._steps.items)
        if self._current is not None:
            steps.append(dict(self._current))
        model_states = self._model_states
        if model_states is None and self.model is not None:
            model_states = model_state_bytes(self.model, self.optimizer)
        if model_states is not None and model_states.get("zero_estimate") is not None:
            model_states = {**model_states,
                            "zero_estimate": {**model_states["zero_estimate"], "stage": self.zero_stage}}
        activations = self._activations or []
        return {
            "cuda": self.cuda,
            "note": None if self.cuda else CPU_NOTE,
            "device": None if self.device is None else str(self.device),
            "profile_step": self.profile_step,
            "steps": [dict(s) for s in steps],
            "steps_stride": self._steps.stride,
            "peak": dict(self._peak) if self.cuda else None,
            "phases": self._phases(),
            "activations": [dict(row) for row in activations],
            "activation_bytes": sum(row["bytes"] for row in activations),
            "model_states": model_states,
            "snapshot": self._snapshot_path,
            "snapshot_note": self._snapshot_note,
        }

    def close(self) -> None:
        if self._tracker is not None:
            self._tracker.stop()
            self._tracker = None
        if self._recording:
            self._stop_snapshot()
