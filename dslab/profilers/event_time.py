"""Per-module step time from marks on the device's stream: the cheap timer of the continuous
profiles (``flops_profiler.every_n_steps`` with ``continuous_timer: "events"``).

Why a second timer: :class:`dslab.profilers.device_time.ModuleDeviceTimer` reads every kernel's
own duration from ``torch.profiler``, which is exact whatever the host does, but the profiler
traces every op of the step (~7,000 records for GPT-2 124M) and flushes them at its stop, so
the profiled step costs ~2.7x a plain one. Re-taken every N steps for the whole run, that cost is
the continuous profiles' overhead. This timer records one CUDA event (the host clock on a CPU)
where a module's forward begins and ends, where its backward begins (the first gradient of its
outputs is computed) and ends (the gradients of its inputs and parameters are all computed), and
around the optimizer step: a few events per hooked module, no synchronisation, and the events
are read on a later step once the device has passed them.

When such marks tell the truth: a mark-to-mark time on the stream is the device's time between
them, which is the kernels' time only if the device never waited for the host in between. The
timer checks it for the whole step (``host_lead``): when the host has queued the step's last mark
and the device has not yet reached the step's first one, every kernel of the step was queued
before the device began it, so the device never waited on the host (no host synchronisation in
the step, which would have waited on that first mark). A steady training loop that replays CUDA
graphs runs ahead of the device, and that lead carries the hooked step. ``host_lead`` False says
the device may have waited: the marks then include that waiting, and the records say so.

What it counts: a module's forward is the stream time between its marks (its own kernels and its
submodules'); its backward runs from the first gradient of its outputs to the last of its inputs'
and parameters' (torch's multi-gradient hooks), which for a layer of a sequential stack is the
layer's backward kernels. Only modules down to ``max_depth`` are hooked (the continuous profiles
keep no deeper one; a container that is never called, such as an ``nn.ModuleList``, is timed as
the sum of its direct submodules, which are hooked for it), so the hooks cost the host little. Forwards run again inside the backward
(activation checkpointing's recompute) are part of the enclosing backward, not of a forward. On
a CPU the marks are the host clock, which is the ops' time (they run synchronously).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from dslab.profilers import timers

WAITING = object()  # yielded by :meth:`EventModuleTimer.attribution_steps` while the device has not passed the marks


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() >= 0


def _grad_tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


class _Call:
    """One forward call of a hooked module and the backward it leads to."""

    __slots__ = ("begin", "end", "backward_begin", "backward_end", "handles")

    def __init__(self, begin):
        self.begin = begin
        self.end = None
        self.backward_begin = None
        self.backward_end = None
        self.handles: list = []


class EventModuleTimer:
    """Times one training step's hooked modules by stream marks (module docstring).

    ``start()`` marks the step's begin and hooks every module down to ``max_depth`` (-1: every
    depth; the root always); ``phase("optimizer")`` / ``phase(None)`` bracket the optimizer step;
    ``stop()`` marks the end and removes the forward hooks; :meth:`attribution_steps` yields
    :data:`WAITING` until the device has passed the last mark, then returns the figures in the
    shape of :func:`dslab.profilers.device_time.attribute`'s where they exist: ``{"modules": {name:
    {"forward_ms", "backward_ms"}}, "optimizer_ms", "span_ms", "busy_ms": None, "work_ms": None,
    "records", "host_lead", "method": "events"}``."""

    def __init__(self, model: nn.Module, max_depth: int = -1):
        self.model = model
        self.max_depth = max_depth
        self.cuda = False
        self._handles: list = []
        self._calls: dict[str, list[_Call]] = {}
        self._frames: list = []
        self._phases: list[list] = []
        self._begin = self._end = None
        self.host_lead: bool | None = None
        self.running = False

    def _mark(self):
        return timers.mark(self.cuda)

    def start(self) -> None:
        if self.running:
            raise RuntimeError("EventModuleTimer.start called twice without stop")
        first = next((t for t in (*self.model.parameters(), *self.model.buffers())), None)
        self.cuda = first is not None and first.device.type == "cuda"
        containers = set()  # never called (ModuleList, ModuleDict): timed as their submodules' sum
        for name, module in self.model.named_modules():
            depth = 0 if not name else name.count(".") + 1
            parent = name.rpartition(".")[0] if "." in name else ("" if name else None)
            if self.max_depth != -1 and depth > self.max_depth and parent not in containers:
                continue
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                containers.add(name)
            self._calls[name] = []
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(name), with_kwargs=True,
                                                              always_call=True))
        self._begin = self._mark()
        self.running = True

    def _pre_hook(self, name: str):
        def pre_hook(module, args, kwargs):
            if _in_backward():  # a recompute: part of the enclosing backward
                self._frames.append(None)
                return
            self._frames.append((_Call(self._mark()), _grad_tensors((args, kwargs))))
        return pre_hook

    def _post_hook(self, name: str):
        def post_hook(module, args, kwargs, output):
            frame = self._frames.pop() if self._frames else None
            if frame is None:
                return
            call, inputs = frame
            call.end = self._mark()
            self._calls[name].append(call)
            if not torch.is_grad_enabled():
                return
            outputs = [t for t in _grad_tensors(output) if t.grad_fn is not None]
            if not outputs:
                return
            targets = inputs + [p for p in module.parameters() if p.requires_grad]
            call.handles.append(torch.autograd.graph.register_multi_grad_hook(
                outputs, self._backward_mark(call, "backward_begin"), mode="any"))
            if targets:
                call.handles.append(torch.autograd.graph.register_multi_grad_hook(
                    targets, self._backward_mark(call, "backward_end"), mode="all"))
        return post_hook

    def _backward_mark(self, call: _Call, slot: str):
        def hook(_grads):
            # A parameter's hook stays until stop(): a later micro-step's backward must not move it.
            if getattr(call, slot) is None and (slot == "backward_begin" or call.backward_begin is not None):
                setattr(call, slot, self._mark())
        return hook

    def phase(self, name: str | None) -> None:
        if not self.running:
            return
        if self._phases and len(self._phases[-1]) == 1:
            self._phases[-1].append(self._mark())
        if name is not None:
            self._phases.append([self._mark()])

    def stop(self) -> None:
        """Mark the step's end, remove every hook and note whether the host led the device."""
        if not self.running:
            raise RuntimeError("EventModuleTimer.stop called before start")
        self.phase(None)
        self._end = self._mark()
        self.running = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for calls in self._calls.values():
            for call in calls:
                for handle in call.handles:
                    handle.remove()
                call.handles = []
        self._frames = []
        self.host_lead = (not self._begin.query()) if self.cuda else None

    def ready(self) -> bool:
        """Whether the device has passed every mark (always on a CPU)."""
        return self._end is not None and (not self.cuda or self._end.query())

    def attribution_steps(self):
        """A generator: yields :data:`WAITING` while the device has not passed the step's last
        mark (a caller that must have the figures now waits between polls), then returns them."""
        while not self.ready():
            yield WAITING
        return self.figures()

    def figures(self) -> dict:
        """The step's figures (class docstring); the device must have passed the marks."""
        if self._end is None:
            raise RuntimeError("EventModuleTimer.figures called before stop")
        if self.cuda:
            self._end.synchronize()
        elapsed = functools.partial(timers.elapsed_ms, self.cuda)
        modules, records = {}, 2
        for name, calls in self._calls.items():
            if not calls:
                continue
            forward = backward = 0.0
            for call in calls:
                forward += elapsed(call.begin, call.end)
                records += 2
                if call.backward_begin is not None and call.backward_end is not None:
                    backward += elapsed(call.backward_begin, call.backward_end)
                    records += 2
            modules[name] = {"forward_ms": forward, "backward_ms": backward}
        optimizer = 0.0
        for marks in self._phases:
            if len(marks) == 2:
                optimizer += elapsed(marks[0], marks[1])
                records += 2
        return {"modules": modules, "optimizer_ms": optimizer, "span_ms": elapsed(self._begin, self._end),
                "busy_ms": None, "work_ms": None, "records": records, "host_lead": self.host_lead,
                "method": "events"}
