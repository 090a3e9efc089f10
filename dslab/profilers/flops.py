"""Flops profiler: the floating-point operations of every op that ran, forward and backward, per
module, with per-module latency and MFU; DeepSpeed's ``flops_profiler`` section and API.

How it counts (STYLE.md #7, count don't patch): while profiling, a ``TorchDispatchMode`` sees every
aten op and every dslab custom op that runs, functional calls and ``@`` included, and prices it
with :mod:`dslab.profilers.flops_formulas` (torch's ``flop_counter`` formulas for aten ops, so the
total equals ``FlopCounterMode``'s, but for causal fused attention, which counts the half of the
score square its kernels compute). Nothing is estimated from the forward: the backward is what
the autograd engine executed (a linear whose input needs no gradient costs one matmul in backward,
not two; recomputation under activation checkpointing is counted where it runs).

Attribution: forward pre/post hooks keep the stack of modules being called; an op counts for every
module on the stack (a parent's figures are its subtree's, once each). When a module's forward
returns, the autograd nodes created by its call are found by walking back from its outputs to its
inputs, and remembered with the module stack; in the backward an op counts for the modules of the
node the engine is executing (``torch._C._current_autograd_node``). A module called twice has both
calls' flops; parameters are counted once per module (``nn.Module.parameters`` deduplicates tied
weights).

Timing never synchronises per module: forward latency is a pair of CUDA events per module call
(host clock on CPU, where the work is synchronous), the backward is split into segments at the
first op of each module's backward work (one event per segment), and all events are read at
:meth:`FlopsProfiler.stop_profile` after one ``torch.cuda.synchronize``. The dispatch mode and the
hooks exist only between ``start_profile`` and ``stop_profile``: the engine driver
(:class:`dslab.profilers.flops_step.FlopsStepProfiler`) installs them for the one step it
profiles. That step's latencies include the counting's host work (a Python call per op): they say
where the host bounds the step, not where the device spends its time. The engine driver therefore
times the next step's modules by the kernels they ran (:mod:`dslab.profilers.device_time`) and the
steps after it as the steady state; the counting never runs on a timed step.

Blind spot: work launched outside the dispatcher (a Triton kernel called from a Python
``autograd.Function``) is invisible to any dispatch mode, ``FlopCounterMode`` included. Such a
Function is named in ``records()["uncounted_autograd_functions"]`` when its backward ran without a
counted op, so a missing count shows instead of passing silently.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Literal

import pydantic
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dslab.config_base import ConfigSection
from dslab.profilers import flops_formulas, flops_output
from dslab.profilers.flops_formulas import CPU_ATTENTION, ELEMENTWISE, MATMUL

PHASES = ("forward", "backward", "optimizer")
FIGURES = (MATMUL, ELEMENTWISE, CPU_ATTENTION)


class FlopsProfilerConfig(ConfigSection):
    """DeepSpeed's ``flops_profiler`` section, same keys and defaults.

    ``profile_step`` is the engine's global step (optimizer steps, 0-based) whose first micro-step
    is profiled; ``module_depth`` -1 prints every depth; ``top_modules`` is how many modules per
    depth the aggregated profile lists; ``output_file`` None prints to stdout. ``device_time``
    (dslab's own key) times the next step's modules by device activity
    (:mod:`dslab.profilers.device_time`) and the steps after it as the steady state.
    ``every_n_steps`` (dslab's own key, a positive int; None: off) times the modules again every N
    steps after that first device-timed step, at steps ``profile_step + 1 + k * N``, and keeps each
    profile in the records (:mod:`dslab.profilers.flops_continuous`); it needs ``device_time``.
    ``continuous_timer`` (dslab's own key) says how those later profiles time the modules:
    ``"events"`` (the default) by stream marks from module and gradient hooks
    (:mod:`dslab.profilers.event_time`, cheap enough to leave on), ``"kernels"`` by every kernel's
    duration under ``torch.profiler``, as the first device-timed step (exact, ~2.7x a plain step).
    """

    enabled: bool = False
    profile_step: int = pydantic.Field(1, ge=0)
    module_depth: int = pydantic.Field(-1, ge=-1)
    top_modules: int = pydantic.Field(1, ge=1)
    detailed: bool = True
    output_file: str | None = None
    device_time: bool = True
    every_n_steps: int | None = None
    continuous_timer: Literal["events", "kernels"] = "events"

    @pydantic.field_validator("every_n_steps", mode="before")
    @classmethod
    def _positive_int(cls, value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config key 'flops_profiler.every_n_steps' must be a positive int (profile "
                             f"every N steps), got {value!r}")
        return value

    @pydantic.model_validator(mode="after")
    def _continuous_needs_device_time(self) -> FlopsProfilerConfig:
        if self.every_n_steps is not None and not self.device_time:
            raise ValueError("config key 'flops_profiler.every_n_steps' re-takes the device-time profile, "
                             "which 'flops_profiler.device_time' = false switches off; set device_time "
                             "to true or remove every_n_steps")
        return self


# Ops that answer questions about a tensor's layout; FlopCounterMode lets subclasses handle them.
_LAYOUT_QUERIES = frozenset({
    torch.ops.aten.sym_is_contiguous.default, torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format, torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default, torch.ops.aten.size.default,
    torch.ops.aten.sym_size.default, torch.ops.aten.stride.default, torch.ops.aten.sym_stride.default,
    torch.ops.aten.storage_offset.default, torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.numel.default, torch.ops.aten.sym_numel.default, torch.ops.aten.dim.default,
    torch.ops.prim.layout.default,
})


def whole_numel(p: torch.Tensor) -> int:
    """A parameter's whole element count: ``ds_numel`` where ZeRO stage 3 (dslab's or DeepSpeed's)
    or ``dslab.zero.Init`` left it holding a shard or nothing, else its own."""
    numel = getattr(p, "ds_numel", None)
    return numel if isinstance(numel, int) else p.numel()


def _in_backward() -> bool:
    """True while the autograd engine executes a graph task on this thread (backward, or the
    recomputation that activation checkpointing runs inside it)."""
    return torch._C._current_graph_task_id() >= 0


class _Clock:
    """Time marks: CUDA events on the current stream, or the host clock on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def elapsed_ms(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1e3


class _ModuleStats:
    """What one module accumulated while profiling; figures are inclusive of its submodules."""

    __slots__ = ("name", "type", "depth", "params", "children", "calls", "flops", "forward_marks",
                 "forward_ms", "backward_ms")

    def __init__(self, name: str, module: nn.Module, depth: int):
        self.name = name
        self.type = type(module).__name__
        self.depth = depth
        self.params = sum(whole_numel(p) for p in module.parameters())
        self.children: list[_ModuleStats] = []  # the nearest hooked submodules
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.flops = {figure: dict.fromkeys(PHASES, 0) for figure in FIGURES}
        self.forward_marks: list = []
        self.forward_ms = 0.0
        self.backward_ms = 0.0


class _CountingMode(TorchDispatchMode):
    """Runs each op, then hands it to the profiler to be priced and attributed. Ops that are
    composite at this level are decomposed first, as ``FlopCounterMode`` does, so both count the
    same ops."""

    def __init__(self, profiler: FlopsProfiler):
        super().__init__()
        self.profiler = profiler

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LAYOUT_QUERIES:
            return NotImplemented
        if func is not torch.ops.prim.device.default:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        self.profiler._on_op(func, args, kwargs, out)
        return out


class FlopsProfiler:
    """Counts, attributes and times one stretch of work on ``model`` (DeepSpeed's API).

    ``ds_engine`` (optional) supplies the micro-batch size for samples/second. ``measured_peak_tflops``
    is the peak measured on this device (a matmul benchmark) that MFU is also reported against,
    beside the datasheet peak of the device (:func:`dslab.report.hardware.lookup_gpu`).
    """

    def __init__(self, model: nn.Module, ds_engine=None, measured_peak_tflops: float | None = None):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if measured_peak_tflops is not None and not measured_peak_tflops > 0:
            raise ValueError(f"measured_peak_tflops must be > 0, got {measured_peak_tflops!r}")
        self.model = model
        self.ds_engine = ds_engine
        self.measured_peak_tflops = measured_peak_tflops
        self.started = False
        self._stats: list[_ModuleStats] = []
        self._handles: list = []
        self._mode: _CountingMode | None = None
        self._clock = _Clock(False)
        self._device = torch.device("cpu")
        self.reset_profile()

    # -- lifecycle ------------------------------------------------------------------------------

    def start_profile(self, ignore_list=None) -> None:
        """Reset the counts, hook the modules (except those whose type is in ``ignore_list``) and
        start counting every op."""
        if self.started:
            raise RuntimeError("start_profile called while already profiling; call stop_profile first")
        ignore = tuple(ignore_list or ())
        if not all(isinstance(t, type) for t in ignore):
            raise ValueError(f"ignore_list must hold module types, got {ignore_list!r}")
        self.reset_profile()
        self._device = _model_device(self.model)
        self._clock = _Clock(self._device.type == "cuda")
        self._stats = []
        hooked: dict[int, _ModuleStats] = {}
        for name, module in self.model.named_modules():
            if ignore and isinstance(module, ignore):
                continue
            stats = _ModuleStats(name, module, 0 if not name else name.count(".") + 1)
            self._stats.append(stats)
            hooked[id(module)] = stats
            self._handles.append(module.register_forward_pre_hook(self._make_pre_hook(stats), with_kwargs=True))
            self._handles.append(
                module.register_forward_hook(self._make_post_hook(stats), with_kwargs=True, always_call=True)
            )
        for module in self.model.modules():
            if id(module) in hooked:
                hooked[id(module)].children = _nearest_hooked(module, hooked)
        self._mode = _CountingMode(self)
        self._mode.__enter__()
        torch.empty(0)  # the first op under a dispatch mode imports torch._dynamo: not in the step's time
        self._start_mark = self._clock.mark()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting, remove the hooks, and read every timing (one device synchronisation)."""
        if not self.started:
            return
        self._mode.__exit__(None, None, None)
        self._mode = None
        self._remove_hooks()
        self._close_backward_segment()
        self._stop_mark = self._clock.mark()
        self.started = False
        self._resolve_timings()
        self._node_paths.clear()

    def reset_profile(self) -> None:
        """Forget everything counted and timed so far (the hooks stay if profiling)."""
        self._totals = {figure: dict.fromkeys(PHASES, 0) for figure in FIGURES}
        self._by_op: dict[str, list] = {}
        self._flops_by_dtype: dict[str, int] = defaultdict(int)
        self._functions: dict[str, int] = {}  # Python autograd Functions run in backward -> flops counted in them
        for stats in self._stats:
            stats.reset()
        self._path: tuple[_ModuleStats, ...] = ()
        self._frames: list[tuple] = []
        self._node_paths: dict = {}
        self._phase_override: str | None = None
        self._phase_marks: dict[str, list] = defaultdict(list)
        self._phase_ms: dict[str, float] = defaultdict(float)
        self._segments: list[tuple] = []
        self._segment_path = None
        self._graph_task = None
        self._start_mark = self._stop_mark = None
        self._duration_ms = 0.0
        self._backward_ms = 0.0

    def end_profile(self) -> None:
        """Stop profiling if needed and detach from the model; the last counts stay readable."""
        self.stop_profile()
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def set_phase(self, phase: str | None) -> None:
        """Count the ops that follow as ``phase`` ("optimizer") until ``set_phase(None)``; the
        interval is timed. Forward and backward are told apart without this."""
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES} or None, got {phase!r}")
        if not self.started:
            return
        if self._phase_override is not None:
            self._phase_marks[self._phase_override][-1].append(self._clock.mark())
        self._phase_override = phase
        if phase is not None:
            self._phase_marks[phase].append([self._clock.mark()])

    # -- counting -------------------------------------------------------------------------------

    def _on_op(self, func, args, kwargs, out) -> None:
        backward = _in_backward()
        phase = self._phase_override or ("backward" if backward else "forward")
        path = self._path
        function = None
        if backward:
            node = torch._C._current_autograd_node()
            if not path:
                path = self._node_paths.get(node, ())
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                function = type(node).__name__.removesuffix("Backward")
                self._functions.setdefault(function, 0)
            self._enter_backward_segment(path)
        counted = flops_formulas.count(func, args, kwargs, out)
        if counted is None or counted[1] == 0:
            return
        figure, flops = counted
        if function is not None:
            self._functions[function] += flops
        self._totals[figure][phase] += flops
        entry = self._by_op.setdefault(flops_formulas.op_name(func), [figure, 0])
        entry[1] += flops
        if figure == MATMUL:
            dtype = next((a.dtype for a in tree_leaves(args) if isinstance(a, torch.Tensor)), None)
            self._flops_by_dtype[str(dtype).replace("torch.", "")] += flops
        for stats in path:
            stats.flops[figure][phase] += flops

    def _enter_backward_segment(self, path) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._graph_task:
            self._graph_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._close_backward_segment)
        if path != self._segment_path:
            self._segments.append((path, self._clock.mark()))
            self._segment_path = path

    def _close_backward_segment(self) -> None:
        if self._segment_path is not None:
            self._segments.append((None, self._clock.mark()))
            self._segment_path = None
        self._graph_task = None

    # -- module hooks ---------------------------------------------------------------------------

    def _make_pre_hook(self, stats: _ModuleStats):
        def pre_hook(module, args, kwargs):
            recompute = _in_backward()
            stop_nodes = {t.grad_fn for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor) and t.grad_fn is not None}
            start = None if recompute else self._clock.mark()
            self._frames.append((self._path, stop_nodes, start))
            if recompute and not self._path:
                # Checkpoint recomputation: the node being unpacked carries the outer modules.
                self._path = self._node_paths.get(torch._C._current_autograd_node(), ())
            if stats not in self._path:
                self._path = self._path + (stats,)
            if not recompute:
                stats.calls += 1
        return pre_hook

    def _make_post_hook(self, stats: _ModuleStats):
        def post_hook(module, args, kwargs, output):
            outer_path, stop_nodes, start = self._frames.pop()
            path, self._path = self._path, outer_path
            if start is not None:
                stats.forward_marks.append((start, self._clock.mark()))
            if output is not None and torch.is_grad_enabled():
                self._claim_nodes(output, stop_nodes, path)
        return post_hook

    def _claim_nodes(self, output, stop_nodes: set, path: tuple) -> None:
        """Remember ``path`` for the autograd nodes this module call created: those reachable from
        its outputs without passing its inputs' nodes. Nodes a submodule claimed keep the submodule's
        path (walked through: the parent's own ops may lie behind them)."""
        todo = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen = set(stop_nodes)
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            self._node_paths.setdefault(node, path)
            todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    # -- timings --------------------------------------------------------------------------------

    def _resolve_timings(self) -> None:
        self._clock.sync()
        elapsed = self._clock.elapsed_ms
        self._duration_ms = elapsed(self._start_mark, self._stop_mark)
        for stats in self._stats:
            stats.forward_ms = sum(elapsed(a, b) for a, b in stats.forward_marks)
            stats.forward_marks = []
        self._backward_ms = 0.0
        for (path, begin), (_, end) in zip(self._segments, self._segments[1:]):
            if path is None:
                continue
            ms = elapsed(begin, end)
            self._backward_ms += ms
            for stats in path:
                stats.backward_ms += ms
        self._segments = []
        for phase, intervals in self._phase_marks.items():
            self._phase_ms[phase] = sum(elapsed(m[0], m[1]) for m in intervals if len(m) == 2)
        self._phase_marks.clear()

    # -- results --------------------------------------------------------------------------------

    def _figure(self, figure: str, phase: str | None) -> int:
        if phase is None:
            return sum(self._totals[figure].values())
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES} or None, got {phase!r}")
        return self._totals[figure][phase]

    def get_total_flops(self, as_string: bool = False, phase: str | None = None):
        """Matmul-like flops that ran (all phases, or ``phase``): the figure FlopCounterMode gives
        for aten ops, plus dslab's attention."""
        flops = self._figure(MATMUL, phase)
        return flops_output.number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False, phase: str | None = None):
        """Multiply-accumulates of the counted flops (flops / 2)."""
        macs = self._figure(MATMUL, phase) // 2
        return flops_output.number_to_string(macs, "MACs") if as_string else macs

    def get_elementwise_flops(self, as_string: bool = False, phase: str | None = None):
        """The elementwise estimate (norms, activations, softmax, pointwise), not in the total."""
        flops = self._figure(ELEMENTWISE, phase)
        return flops_output.number_to_string(flops) if as_string else flops

    def get_total_params(self, as_string: bool = False):
        """Parameters of the model, each counted once (tied weights too)."""
        params = sum(whole_numel(p) for p in self.model.parameters())
        return flops_output.number_to_string(params, "") if as_string else params

    def get_total_duration(self, as_string: bool = False):
        """Seconds from start_profile to stop_profile (device time on CUDA)."""
        seconds = self._duration_ms / 1e3
        return flops_output.duration_to_string(seconds) if as_string else seconds

    def records(self, profile_step: int | None = None) -> dict:
        """The profile as plain data (see :func:`dslab.profilers.flops_output.build_records`)."""
        if self.started:
            raise RuntimeError("records() needs the profile stopped: call stop_profile first")
        return flops_output.build_records(self, profile_step)

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> str:
        """Print DeepSpeed's text profile (summary, aggregated, detailed) to stdout, or append it
        to ``output_file``; returns the text."""
        if module_depth < -1:
            raise ValueError(f"module_depth must be >= -1, got {module_depth}")
        if top_modules < 1:
            raise ValueError(f"top_modules must be >= 1, got {top_modules}")
        text = flops_output.render_text(self.records(profile_step), module_depth, top_modules, detailed)
        if output_file:
            with open(output_file, "a", encoding="utf-8") as f:
                f.write(text + "\n")
        else:
            print(text)
        return text


def _nearest_hooked(module: nn.Module, hooked: dict) -> list:
    """The stats of ``module``'s nearest hooked descendants (through ignored modules)."""
    found = []
    for child in module.children():
        stats = hooked.get(id(child))
        found.extend([stats] if stats is not None else _nearest_hooked(child, hooked))
    return found


def _model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _loss_of(output) -> torch.Tensor:
    """The scalar to differentiate in ``mode="train"``: the output if it is a scalar tensor, else
    the ``.sum()`` of the output tensor (a mapping's ``"loss"``, or its / a sequence's first tensor)."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.sum()
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return _loss_of(output["loss"])
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for value in values:
        if isinstance(value, torch.Tensor):
            return _loss_of(value)
    raise ValueError(f"mode='train' needs the model to return a tensor, got {type(output).__name__}")


def get_model_profile(model: nn.Module, input_shape=None, args=None, kwargs=None, print_profile: bool = True,
                      detailed: bool = True, module_depth: int = -1, top_modules: int = 1, warm_up: int = 1,
                      as_string: bool = True, output_file: str | None = None, ignore_modules=None,
                      mode: str = "forward", measured_peak_tflops: float | None = None):
    """Profile one pass of ``model`` and return ``(flops, macs, params)`` (strings if ``as_string``).

    Inputs: ``input_shape`` (a tuple: one random tensor of that shape in the model's dtype and
    device) or ``args``/``kwargs``. ``mode="forward"`` runs the forward under ``torch.no_grad``;
    ``mode="train"`` runs forward and backward of the scalar output (or its ``.sum()``), and the
    flops then include the backward. ``warm_up`` unprofiled passes run first; parameter gradients
    are restored afterwards.
    """
    if mode not in ("forward", "train"):
        raise ValueError(f"mode must be 'forward' or 'train', got {mode!r}")
    if isinstance(warm_up, bool) or not isinstance(warm_up, int) or warm_up < 0:
        raise ValueError(f"warm_up must be an int >= 0, got {warm_up!r}")
    args, kwargs = list(args or ()), dict(kwargs or {})
    if input_shape is not None:
        if args or kwargs:
            raise ValueError("pass either input_shape or args/kwargs, not both")
        if not isinstance(input_shape, tuple) or not all(isinstance(d, int) and d > 0 for d in input_shape):
            raise ValueError(f"input_shape must be a tuple of positive ints, got {input_shape!r}")
        like = next(iter(model.parameters()), None)
        dtype = like.dtype if like is not None else torch.get_default_dtype()
        args = [torch.randn(input_shape, dtype=dtype, device=_model_device(model))]
    elif not args and not kwargs:
        raise ValueError("get_model_profile needs input_shape, args or kwargs")

    saved_grads = [(p, p.grad) for p in model.parameters()]

    def run_once():
        if mode == "forward":
            with torch.no_grad():
                model(*args, **kwargs)
        else:
            _loss_of(model(*args, **kwargs)).backward()

    for _ in range(warm_up):
        run_once()
    profiler = FlopsProfiler(model, measured_peak_tflops=measured_peak_tflops)
    profiler.start_profile(ignore_list=ignore_modules)
    try:
        run_once()
    finally:
        profiler.stop_profile()
        for p, grad in saved_grads:
            p.grad = grad
    if print_profile:
        profiler.print_model_profile(profile_step=None, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    profiler.end_profile()
    if as_string:
        return (flops_output.number_to_string(flops), flops_output.number_to_string(macs, "MACs"),
                flops_output.number_to_string(params))
    return flops, macs, params
