"""Memory tracer: peak memory every step, and on one profiled step where the memory went.

Every step (CUDA only): the caching allocator's peak allocated and peak reserved bytes since the
step began (``reset_peak_memory_stats`` at step begin, ``max_memory_allocated`` /
``max_memory_reserved`` at step end). These are host-side counters that the allocator updates
when a kernel is enqueued, so reading them needs no device synchronisation. With gradient
accumulation the micro-steps of one optimizer step share one entry. The reset is process-wide:
while the tracer is on, ``torch.cuda.max_memory_allocated()`` means "since this step began", and
the run's peak is ``records()["peak"]``; the reset keeps the peak so far for
:mod:`dslab.profilers.peaks`, whose readers (a benchmark trial, an autotuning experiment) get the
peak over every step since their own reset. At most ``MAX_STEP_ENTRIES`` step entries are kept,
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
  not activations, and are left out (a saved transposed weight is a view of the parameter), as
  is any saved parameter or view of one (ZeRO stage 3 gathers a parameter into a buffer made
  during the forward, whose storage the tracer could not know beforehand). A
  storage is counted only if a tensor saved with it is still alive when forward ends. Tensors
  saved inside activation checkpointing go to its own hooks and are not seen, which is right:
  they are not held. Tensors saved outside every module of the model (a loss computed by the
  caller between the forward hooks) are charged to ``(outside modules)``, the model's own
  forward to ``(root)``. While the hooks are on (the profiled step's forward only), autograd does
  not check saved tensors for in-place modification; every other step it does.
- **Model states** (CPU and CUDA): parameters, gradients and optimizer states this rank holds,
  counted by unique storage so that nothing counts twice (ZeRO's masters share the shards'
  storage; a released stage-3 parameter is empty and its shard is the parameter storage), next
  to the stage-0 estimate and its ZeRO partitions over the world size
  (:mod:`dslab.profilers.model_states`). They are measured after each backward of the profiled
  step and before and after its optimizer step; ``grads`` is the most gradient bytes held at any
  of those points (an engine frees gradients inside the step, and ZeRO stage 1 holds whole
  gradients only between micro-steps of an accumulation window), parameters and optimizer states
  are read after the step (the optimizer's states exist from the first step on). When the engine
  has called :meth:`MemoryTracer.set_zero_stage` (its stage, world size and ZeRO runtime),
  ``zero_estimate.compared`` puts this rank's measured ``total`` beside the per-GPU estimate of
  that stage.
- **Snapshot** (CUDA, ``snapshot: true``): the allocator's event history over the profiled step,
  ``torch.cuda.memory._record_memory_history(max_entries=snapshot_max_entries)`` from the
  profiled step's begin to its end (after the optimizer step), written with
  ``torch.cuda.memory._dump_snapshot`` to ``<output_dir>/memory_snapshot_step<N>.pickle``. The
  engine or bench gives the directory with :meth:`MemoryTracer.set_output_dir`; without one no
  snapshot is recorded and the records say so. Open the file at https://pytorch.org/memory_viz.
  The records also keep ``peak_sites``: the blocks live at the step's traced peak (those from
  before the step counted through the snapshot's end state), summed by the innermost dslab line
  that allocated them, the :data:`PEAK_SITES` largest (:mod:`dslab.profilers.memory_sites`).

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

from dslab.config_base import ConfigSection
from dslab.profilers import peaks
from dslab.profilers.memory_sites import by_site, live_at_peak, live_blocks
from dslab.profilers.base import Profiler
from dslab.profilers.model_states import (  # noqa: F401  (optimizer_states_per_param: re-exported)
    model_state_bytes,
    optimizer_states_per_param,
    storage_key,
    with_grads,
)
from dslab.profilers.telemetry import BoundedSeries
from dslab.profilers.zero_memory_model import STAGES

logger = logging.getLogger(__name__)

CPU_NOTE = "CUDA memory is not traced on CPU: no allocator peaks, phase deltas or snapshot"
ROOT = "(root)"
OUTSIDE = "(outside modules)"
MAX_STEP_ENTRIES = 4096
#: Allocation sites kept in ``records()["peak_sites"]``.
PEAK_SITES = 15


class MemoryTracerConfig(ConfigSection):
    """dslab's ``memory_tracer`` section."""

    enabled: bool = False
    profile_step: int = Field(1, ge=0, description="global step whose memory is broken down")
    snapshot: bool = Field(False, description="record the allocator history over profile_step")
    snapshot_max_entries: int = Field(100_000, ge=1, description="allocator events kept")


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
        self._model_storages = {storage_key(t)[0] for t in self.model.parameters()}
        self._model_storages |= {storage_key(t)[0] for t in self.model.buffers()}
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
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return saved  # a parameter (at ZeRO stage 3 gathered into a buffer made after start())
        key, nbytes = storage_key(t)
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
        self.world_size: int | None = None
        self.zero_runtime = None
        self._max_grads = 0
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
        self._peak_sites: dict | None = None
        self._snapshot_note: str | None = None

    @classmethod
    def from_config(cls, cfg: MemoryTracerConfig, output_dir: str | Path | None = None
                    ) -> MemoryTracer | None:
        if not cfg.enabled:
            return None
        return cls(profile_step=cfg.profile_step, snapshot=cfg.snapshot,
                   snapshot_max_entries=cfg.snapshot_max_entries, output_dir=output_dir)

    def set_zero_stage(self, stage: int, world_size: int | None = None, runtime=None) -> None:
        """The ZeRO stage the engine runs (``model_states.zero_estimate.stage`` and
        ``.compared``), its data-parallel world size (default: the process group's) and its ZeRO
        runtime (stages 1-3: an object with ``units`` and ``masters``, whose flat buffers, shards
        and gradient shards are counted as this rank's parameters and gradients)."""
        if stage not in STAGES:
            raise ValueError(f"zero_optimization.stage must be one of {STAGES}, got {stage!r}")
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                       or world_size < 1):
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.zero_stage = stage
        self.world_size = world_size
        self.zero_runtime = runtime

    def _measure_states(self) -> dict:
        states = model_state_bytes(self.model, self.optimizer, self.world_size,
                                   runtime=self.zero_runtime, stage=self.zero_stage)
        self._max_grads = max(self._max_grads, states["grads"])
        return states

    def attach(self, model: nn.Module, optimizer=None) -> None:
        self.model, self.optimizer = model, optimizer
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()

    def one_off_steps(self) -> tuple[int, ...]:
        """``profile_step``: its forward runs under the saved-tensor tracker's hooks."""
        return (self.profile_step,)

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
            peaks.reset_step_peak(self.device)  # the step's peak, the trial's kept (peaks.py)
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
        if self._profiling and not self._optimizer_stepped:
            self._model_states = self._measure_states()

    def on_optimizer_step_begin(self) -> None:
        if self._profiling:
            self._mark("optimizer_begin")
            self._model_states = self._measure_states()

    def on_optimizer_step_end(self) -> None:
        if not self._profiling:
            return
        self._mark("optimizer_end")
        # The gradients the step consumed: an engine frees them in it.
        after = model_state_bytes(self.model, self.optimizer, self.world_size,
                                  runtime=self.zero_runtime, stage=self.zero_stage)
        self._model_states = with_grads(after, max(self._max_grads, after["grads"]))
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
            snapshot = torch.cuda.memory._snapshot()
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            peak, blocks = live_at_peak(snapshot["device_traces"][index], live_at_end=live_blocks(snapshot, index))
            self._peak_sites = {"peak_bytes": peak, "sites": by_site(blocks, top=PEAK_SITES)}
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
        "activation_bytes", "model_states": {...}, "snapshot", "snapshot_note", "peak_sites":
        {"peak_bytes", "sites": [{"site", "bytes", "blocks"}]} or None}`` (bytes)."""
        steps = list(self._steps.items)
        if self._current is not None:
            steps.append(dict(self._current))
        model_states = self._model_states
        if model_states is None and self.model is not None:
            model_states = model_state_bytes(self.model, self.optimizer, self.world_size,
                                             runtime=self.zero_runtime, stage=self.zero_stage)
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
            "peak_sites": self._peak_sites,
        }

    def close(self) -> None:
        if self._tracker is not None:
            self._tracker.stop()
            self._tracker = None
        if self._recording:
            self._stop_snapshot()
