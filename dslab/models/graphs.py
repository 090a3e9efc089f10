"""A model's stack of transformer layers run as two CUDA graphs: one for the forward of every
layer, one for the backward.

Why: BERT-large's 24 layers launch ~1,500 kernels per training step. Issued one by one from
Python (autograd, autocast, Triton's launcher) they take the host longer than the GPU takes to run
them: on an H100 the step's kernels need ~49 ms and the host ~110 ms. Replaying captured graphs
costs the host a few microseconds per graph, so the step becomes device-bound.

How (the same scheme as ``torch.cuda.make_graphed_callables``, with the differences below):

* Per input signature (shape, dtype, whether the input needs a gradient, the key-padding mask's
  shape, the autocast dtype, the parameters' storage), the stack is run three times on a side
  stream (Triton compiles and autotunes there), then its forward is captured into one graph and
  ``torch.autograd.grad`` of its output into a second graph, both in one private memory pool.
  Autocast's weight cache is off inside the capture, so each replay casts the current weights.
* A call copies the input into the static input buffer, replays the forward graph and returns
  the static output; the backward copies the incoming gradient in, replays the backward graph and
  hands autograd the static gradients of the input and of every trainable parameter.
* The warm-up runs and the captures run inside
  :func:`dslab.kernels.dispatch.graphed_launches`: kernels whose launch plan trades host time for
  device time (attention's backward) pick the plan the graph wants in the warm-ups too, so that
  they autotune and compile there, never inside a capture.
* The warm-ups and the captures differentiate with respect to fresh leaves that share the
  parameters' storage (:func:`stand_ins`, swapped in for the modules' parameters), never the
  parameters themselves: a parameter's AccumulateGrad node is bound to the stream it was made on
  and lives as long as any graph that reaches it, such as the loss of an eager step the caller
  still holds, and a capture that accumulates through a node of the default stream is
  invalidated. A stack that reads a parameter other than through its module's attribute keeps
  the parameters (the first warm-up checks; ``stats["captures_on_parameters"]`` counts those).
* Dropout stays random: the ops draw their seeds with ``torch.randint`` on the device, which the
  CUDA generator re-draws on every replay.
* Gradient accumulation stays exact: autograd may adopt a static gradient buffer as a
  parameter's ``.grad``. The forward graph reuses the backward's memory (one pool) and the
  backward graph rewrites its buffers, so before either replays, such a ``.grad`` is copied out
  (only then: a plain step with ``zero_grad(set_to_none=True)`` in between copies nothing).
* Inside a copies scope (:mod:`dslab.engine.weight_copies`) the graphs read the bf16 copies that
  stand in for the parameters (:func:`dslab.models.weight_cast.weight`), so no replay casts a
  weight, and the backward graph's gradients are the copies' (bf16), which the optimizer reads.
* Parameters moved to new storage (``p.data = ...``, as the benchmark runner's parking does)
  change the signature, so the stack is captured again; :meth:`LayerStackGraphs.release` frees
  every graph and its memory pool.
* cuBLAS's workspace belongs to the graphs that use it. A captured matmul writes into the
  workspace torch keeps for its (cuBLAS handle, stream) pair, a caching-allocator block that
  torch frees whenever anyone calls ``torch._C._cuda_clearCublasWorkspaces()`` (torch.compile's
  CUDA-graph trees do, around every warm-up and recording). A graph whose workspace was inherited
  from an earlier capture's pool then writes into memory the allocator has handed back: after a
  recapture, the first pool's segment is returned to the driver once its last block (the
  workspace) is freed, and the replay faults. So the workspaces are cleared before each capture
  (the capture allocates its own inside its pool, which lives as long as its graphs) and after it
  (no later capture inherits a block of this pool).

Collectives inside the stack (tensor-parallel all-reduces, sequence-parallel all-to-alls) are
captured with it: the warm-ups issue them on the side stream as every rank does, each capture
records the calls it issued (:func:`dslab.comm.recording_calls`) and each replay announces them to
the comm layer's observers (:func:`dslab.comm.announce_replay`), so the comms logger counts them as
eager calls. A graph that captured collectives is reset before the process group is destroyed at
exit (NCCL waits on it otherwise). Every rank of the group must replay the same graphs in the same
order, as it would issue the same calls eagerly.

Side outputs: a stack may give a differentiable scalar besides its output (an MoE layer's
load-balancing loss) through a :class:`StackSideOutput`. Its ``loss()`` is called right after the
stack's forward (eagerly, in the warm-up runs and inside the capture) and must hand over the
scalar and drop every reference the modules kept to it, so that no autograd graph of a warm-up run
outlives it (such a graph would keep parameter AccumulateGrad nodes bound to the warm-up stream,
and the capture's backward would then wait on that stream). The scalar becomes a second static
output with its own gradient buffer in the backward graph. ``snapshot()`` runs after the capture
and ``restore(state)`` after every replay, so that module attributes a forward sets (routing
statistics) point at the replayed buffers again after an eager call moved them.

The stack runs eagerly, and is never captured, when graphs cannot be right: outside training or
without autograd, off CUDA, inside another capture or under ``torch.compile``, while a
``TorchDispatchMode`` is active (the flops profiler counts through one), while any module of the
stack or the process has forward/backward hooks (profilers attach them for the steps they
profile), or while a previous graphed output still waits for its backward (its activations live
in the graph's buffers, which a second replay would overwrite). :attr:`LayerStackGraphs.stats`
counts captures, replays and the eager calls by reason.
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from typing import Callable, Protocol

import torch
import torch.nn as nn
from torch.nn.modules import module as module_globals

from dslab import comm
from dslab.kernels.dispatch import graphed_launches
from dslab.models.ops import run_checkpointed_stack, run_layer_stack
from dslab.models.weight_cast import weight

WARMUP_RUNS = 3


def _hooked(layers: nn.ModuleList) -> bool:
    if (module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks
            or module_globals._global_backward_hooks or module_globals._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in layers.modules())


def _dispatch_mode_active() -> bool:
    return torch._C._len_torch_dispatch_stack() > 0


def clear_cublas_workspaces() -> None:
    """Drop torch's cached cuBLAS workspaces (see the module docstring)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def capture_blocker(modules: nn.Module, x: torch.Tensor) -> str | None:
    """Why a training call of ``modules`` on ``x`` cannot be captured or replayed (see the module
    docstring), or None: off CUDA, under ``torch.compile``, inside another capture, under a
    ``TorchDispatchMode``, or while a module or the process has forward/backward hooks."""
    if x.device.type != "cuda":
        return "not_cuda"
    if torch.compiler.is_compiling():
        return "compiling"
    if torch.cuda.is_current_stream_capturing():
        return "capturing"
    if _dispatch_mode_active():
        return "dispatch_mode"
    if _hooked(modules):
        return "hooks"
    return None


class StackSideOutput(Protocol):
    """A differentiable scalar a layer stack yields besides its output (see the module docstring)."""

    def loss(self) -> torch.Tensor:
        """The scalar of the forward that just ran; the modules drop their references to it."""

    def snapshot(self) -> object:
        """The state to put back after each replay (taken right after the capture)."""

    def restore(self, state: object) -> None:
        """Put ``state`` back."""


def stand_ins(modules: nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Fresh leaves standing in for the trainable parameters of ``modules`` in a capture: for each
    parameter ``p`` (in ``parameters()`` order), ``weight(p).detach().requires_grad_()``, which
    shares the storage of what the stack reads for ``p`` (the parameter, or its copy inside a
    copies scope), and the mapping from every name under which ``p`` appears (tied ones included)
    to its stand-in, for ``torch.nn.utils.stateless._reparametrize_module``.

    Why: a parameter's AccumulateGrad node lives as long as any autograd graph that reaches it,
    and it stays bound to the stream it was created on. A stack run eagerly before the first
    capture (a step the flops profiler counts runs it under a dispatch mode) leaves such a node on
    the default stream inside the graph of that step's loss, which the caller may still hold while
    the next step captures (``loss = engine(...)`` rebinds only after the call); the captured
    backward then syncs with the default stream, and on an H200 that invalidated the capture
    (``cudaErrorStreamCaptureInvalidated`` at ``capture_end``). Differentiating the capture with
    respect to fresh leaves creates their nodes on the capture's own stream, whatever graphs of
    the parameters are still alive; replays hand their gradients to the parameters as before."""
    leaves: dict[int, torch.Tensor] = {}
    mapping: dict[str, torch.Tensor] = {}
    for name, p in modules.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        if id(p) not in leaves:
            leaves[id(p)] = weight(p).detach().requires_grad_(True)
        mapping[name] = leaves[id(p)]
    return list(leaves.values()), mapping


def leaves_reached(outs: list[torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of the leaves ``tensors`` whose AccumulateGrad node the autograd graph of ``outs``
    reaches."""
    wanted = {id(t) for t in tensors}
    seen, pending, hits = set(), [o.grad_fn for o in outs if o.grad_fn is not None], []
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in wanted:
            hits.append(variable)
        pending.extend(child for child, _ in node.next_functions)
    return hits


class _Captured:
    """The graphs of one input signature and their static buffers.

    ``run(*inputs, *consts)`` returns a tuple of tensors; ``inputs`` are the differentiable
    inputs (each may or may not need a gradient), ``consts`` the tensors copied in as they are
    (masks; None stays None). ``params`` are what the stack reads for the trainable parameters of
    ``modules`` (:func:`weight`); the warm-ups and the captures run with :func:`stand_ins` in
    their place.
    """

    def __init__(self, run: Callable, inputs: tuple, consts: tuple, params: list[nn.Parameter],
                 autocast_dtype: torch.dtype | None, side: StackSideOutput | None = None,
                 modules: nn.Module | None = None):
        self.params = params
        self.side = side
        self.static_inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        self.static_consts = [None if c is None else c.clone() for c in consts]
        self.grad_input_index = [i for i, x in enumerate(inputs) if x.requires_grad]
        swap = {"mapping": None}
        leaves = params
        if modules is not None:
            leaves, swap["mapping"] = stand_ins(modules)
            if len(leaves) != len(params):
                raise RuntimeError(f"graphed stack: {len(leaves)} stand-ins for {len(params)} parameters")
        grad_inputs = [self.static_inputs[i] for i in self.grad_input_index] + leaves

        def forward():
            cast = (torch.autocast("cuda", dtype=autocast_dtype, cache_enabled=False)
                    if autocast_dtype is not None else contextlib.nullcontext())
            mapping = swap["mapping"]
            stand = (torch.nn.utils.stateless._reparametrize_module(modules, mapping)
                     if mapping is not None else contextlib.nullcontext())
            with cast, stand:
                outs = list(run(*self.static_inputs, *self.static_consts))
                return outs if side is None else outs + [side.loss()]

        with graphed_launches():  # the warm-ups pick (and autotune) the launches the capture makes
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for run_index in range(WARMUP_RUNS):
                    outs = forward()
                    if run_index == 0 and swap["mapping"] is not None and leaves_reached(outs, params):
                        # the stack reads a parameter other than through its module's attribute:
                        # its gradient would not reach the stand-in, so differentiate the parameters
                        swap["mapping"] = None
                        grad_inputs[len(self.grad_input_index):] = params
                        del outs
                        outs = forward()
                    torch.autograd.grad(outs, grad_inputs, [torch.ones_like(o) for o in outs], allow_unused=True)
                    del outs
            torch.cuda.current_stream().wait_stream(stream)

            pool = torch.cuda.graph_pool_handle()
            clear_cublas_workspaces()
            self.forward_graph = torch.cuda.CUDAGraph()
            with comm.recording_calls(self.forward_graph) as self.forward_calls, \
                    torch.cuda.graph(self.forward_graph, pool=pool):
                outs = forward()
            self.side_state = side.snapshot() if side is not None else None
            self.static_grad_outs = [torch.empty_like(o) for o in outs]
            self.backward_graph = torch.cuda.CUDAGraph()
            with comm.recording_calls(self.backward_graph) as self.backward_calls, \
                    torch.cuda.graph(self.backward_graph, pool=pool):
                grads = torch.autograd.grad(outs, grad_inputs, self.static_grad_outs, allow_unused=True)
            clear_cublas_workspaces()
        self.on_stand_ins = swap["mapping"] is not None
        n_grad_inputs = len(self.grad_input_index)
        self.static_grad_inputs = list(grads[:n_grad_inputs])
        self.static_grad_params = list(grads[n_grad_inputs:])
        # The captured outputs' autograd graph is spent; holding it would keep the parameters'
        # AccumulateGrad nodes that the capture stream created alive, and every later
        # accumulation on the default stream would then sync with (and warn about) that stream.
        self.static_outs = [o.detach() for o in outs]
        del outs

    def unalias_param_grads(self) -> None:
        """Copy out any ``.grad`` that is one of the static gradient buffers (see the module doc)."""
        for p, g in zip(self.params, self.static_grad_params):
            if g is not None and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                p.grad = p.grad.clone()


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner, captured, n_inputs, *tensors):
        inputs, consts = tensors[:n_inputs], tensors[n_inputs:n_inputs + len(captured.static_consts)]
        for static, x in zip(captured.static_inputs, inputs):
            if x.data_ptr() != static.data_ptr():
                static.copy_(x)
        for static, c in zip(captured.static_consts, consts):
            if c is not None:
                static.copy_(c)
        # The forward graph may write its activations where the backward graph leaves its
        # gradients (one memory pool): a .grad adopted from those buffers must move out first.
        captured.unalias_param_grads()
        captured.forward_graph.replay()
        comm.announce_replay(captured.forward_calls)
        if captured.side is not None:
            captured.side.restore(captured.side_state)
        ctx.owner, ctx.captured, ctx.n_inputs = owner, captured, n_inputs
        ctx.n_consts = len(captured.static_consts)
        owner._awaiting_backward = True
        return tuple(o.detach() for o in captured.static_outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        captured = ctx.captured
        ctx.owner._awaiting_backward = False
        for buffer, grad in zip(captured.static_grad_outs, grad_outs):
            if grad is None:
                buffer.zero_()
            else:
                buffer.copy_(grad)
        captured.unalias_param_grads()
        captured.backward_graph.replay()
        comm.announce_replay(captured.backward_calls)
        grad_inputs = [None] * ctx.n_inputs
        for i, g in zip(captured.grad_input_index, captured.static_grad_inputs):
            grad_inputs[i] = g.detach() if g is not None else None
        grads = [g.detach() if g is not None else None for g in captured.static_grad_params]
        return (None, None, None, *grad_inputs, *([None] * ctx.n_consts), *grads)


class GraphedStack:
    """Runs ``run(*inputs, *consts)`` (a function over the modules of ``modules``, returning a
    tuple of tensors) through captured CUDA graphs where it can, eagerly elsewhere (see the
    module docstring).

    ``inputs`` are the differentiable tensors (the streams a stack of layers updates), ``consts``
    tensors the stack only reads (masks; None allowed); a call returns the outputs as a tuple.
    ``max_signatures`` bounds how many input signatures keep their graphs (each holds the
    activations of a whole forward in its memory pool); the least recently used goes first. With
    ``side`` (a :class:`StackSideOutput`) the side scalar is appended to the outputs.
    """

    def __init__(self, modules: nn.Module, run: Callable, max_signatures: int = 2,
                 side: StackSideOutput | None = None):
        if not isinstance(modules, nn.Module):
            raise ValueError(f"modules must be an nn.Module, got {type(modules).__name__}")
        if max_signatures < 1:
            raise ValueError(f"max_signatures must be >= 1, got {max_signatures}")
        self.layers = modules
        self.run = run
        self.max_signatures = max_signatures
        self.side = side
        self._captured: OrderedDict[tuple, _Captured] = OrderedDict()
        self._awaiting_backward = False
        self.stats: Counter = Counter()

    def run_eager(self, inputs: tuple, consts: tuple) -> tuple:
        outs = tuple(self.run(*inputs, *consts))
        return outs if self.side is None else (*outs, self.side.loss())

    def eager_reason(self, x: torch.Tensor) -> str | None:
        """Why this call must run eagerly, or None when it can replay graphs."""
        if not self.layers.training:
            return "eval"
        if not torch.is_grad_enabled():
            return "no_grad"
        return capture_blocker(self.layers, x) or ("awaiting_backward" if self._awaiting_backward else None)

    def call(self, inputs: tuple, consts: tuple = ()) -> tuple:
        """The stack's outputs for ``inputs`` and ``consts`` (graphed or eager)."""
        inputs, consts = tuple(inputs), tuple(consts)
        reason = self.eager_reason(inputs[0])
        if reason is not None:
            self.stats[f"eager_{reason}"] += 1
            return self.run_eager(inputs, consts)
        # What the stack's forward reads for each parameter: the parameter, or its copy inside a
        # copies scope (dslab.engine.weight_copies), which then gets the gradient.
        params = [weight(p) for p in self.layers.parameters() if p.requires_grad]
        autocast_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        key = (tuple((tuple(x.shape), x.dtype, x.device, x.requires_grad) for x in inputs),
               tuple(None if c is None else (tuple(c.shape), c.dtype) for c in consts),
               autocast_dtype, tuple(p.data_ptr() for p in params))
        captured = self._captured.get(key)
        if captured is None:
            while len(self._captured) >= self.max_signatures:
                self._captured.popitem(last=False)
            captured = _Captured(self.run, inputs, consts, params, autocast_dtype, self.side, self.layers)
            self._captured[key] = captured
            self.stats["captures"] += 1
            if not captured.on_stand_ins:
                self.stats["captures_on_parameters"] += 1
        else:
            self._captured.move_to_end(key)
        self.stats["replays"] += 1
        return _Replay.apply(self, captured, len(inputs), *inputs, *consts, *params)

    def release(self) -> None:
        """Drop every captured graph (their memory returns to the caching allocator)."""
        self._captured.clear()
        self._awaiting_backward = False

    def note_eager(self, reason: str) -> None:
        """Count a call its caller ran eagerly around the stack (``eager_<reason>``)."""
        self.stats[f"eager_{reason}"] += 1


class LayerStackGraphs(GraphedStack):
    """Runs ``layers`` (each called as ``layer(x, key_padding_mask)``) through captured CUDA
    graphs where it can, eagerly elsewhere (see the module docstring).

    ``max_signatures`` bounds how many input signatures keep their graphs (each holds the
    activations of a whole forward in its memory pool); the least recently used goes first. With
    ``side`` (a :class:`StackSideOutput`) a call returns ``(output, side scalar)``.
    """

    def __init__(self, layers: nn.ModuleList, max_signatures: int = 2, side: StackSideOutput | None = None):
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"layers must be an nn.ModuleList, got {type(layers).__name__}")
        super().__init__(layers, self._run_layers, max_signatures, side)

    def _run_layers(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> tuple[torch.Tensor]:
        return (run_layer_stack(self.layers, x, key_padding_mask),)

    def __call__(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None):
        outs = self.call((x,), (key_padding_mask,))
        return outs[0] if self.side is None else tuple(outs)


class SegmentedLayerGraphs:
    """``layers`` cut into ``segments`` runs of consecutive layers (as equal as the count allows),
    each replayed through graphs of its own (:class:`LayerStackGraphs`); called as one.

    Why: a data-parallel step reduces each gradient bucket as backward produces it. One graph
    for the whole stack hands autograd every layer's gradients together when its backward replay
    ends, so no reduction runs beside the stack's backward. With several segments the last
    segment's gradients are ready after its own backward replay, and their reductions run beside
    the replays of the segments before it. Each replay costs the host a few microseconds; each
    segment's forward activations live in its own memory pool until its backward.
    """

    def __init__(self, layers: nn.ModuleList, segments: int, max_signatures: int = 2):
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"layers must be an nn.ModuleList, got {type(layers).__name__}")
        if segments < 1:
            raise ValueError(f"segments must be >= 1, got {segments}")
        count = min(segments, len(layers))
        bounds = [round(i * len(layers) / count) for i in range(count + 1)]
        self.layers = layers
        self.segments = [LayerStackGraphs(layers[lo:hi], max_signatures) for lo, hi in zip(bounds, bounds[1:])]
        self.side = None
        self._notes: Counter = Counter()
        #: called with a segment's index before it runs (ZeRO's deferred parameter gathers wait
        #: there for the units that segment reads: dslab/engine/zero/param_gather.py)
        self.before_segment: Callable[[int], None] | None = None

    @property
    def stats(self) -> Counter:
        """Captures, replays and eager calls, summed over the segments (a step replays each
        segment once), with the eager calls counted around the whole stack."""
        total = Counter(self._notes)
        for segment in self.segments:
            total.update(segment.stats)
        return total

    def note_eager(self, reason: str) -> None:
        self._notes[f"eager_{reason}"] += 1

    def release(self) -> None:
        for segment in self.segments:
            segment.release()

    def __call__(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        for index, segment in enumerate(self.segments):
            if self.before_segment is not None:
                self.before_segment(index)
            x = segment(x, key_padding_mask)
        return x


class CudaGraphLayers:
    """Mixin for a model whose transformer layers are ``self.layers`` (an ``nn.ModuleList`` of
    layers called as ``layer(x, key_padding_mask)``): :meth:`enable_cuda_graphs` switches the
    stack to :class:`LayerStackGraphs`; the model's forward calls :meth:`run_layers`."""

    _layer_graphs: LayerStackGraphs | SegmentedLayerGraphs | None = None

    def enable_cuda_graphs(self, enabled: bool = True, segments: int = 1) -> None:
        """Run the layer stack through captured CUDA graphs in training (see
        :mod:`dslab.models.graphs`); ``False`` goes back to eager and frees the graphs.
        ``segments`` > 1 cuts the stack into that many graphed runs of layers
        (:class:`SegmentedLayerGraphs`), so that gradient reductions overlap its backward."""
        if self._layer_graphs is not None:
            self._layer_graphs.release()
        self._layer_graphs = None
        if enabled:
            self._layer_graphs = (LayerStackGraphs(self.layers) if segments == 1
                                  else SegmentedLayerGraphs(self.layers, segments))

    def release_cuda_graphs(self) -> None:
        """Free the captured graphs (they are captured again on the next graphed call)."""
        if self._layer_graphs is not None:
            self._layer_graphs.release()

    @property
    def cuda_graph_stats(self) -> dict[str, int]:
        """Captures, replays and eager calls by reason; empty when graphs are off."""
        return dict(self._layer_graphs.stats) if self._layer_graphs is not None else {}

    def run_layers(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        every = getattr(getattr(self, "config", None), "checkpoint_layers", 0)
        if every and self.training and torch.is_grad_enabled():
            # checkpointed segments recompute in the backward under the forward's random state,
            # which a replayed graph cannot restore: they run eagerly
            if self._layer_graphs is not None:
                self._layer_graphs.note_eager("activation_checkpointing")
            return run_checkpointed_stack(self.layers, x, key_padding_mask, every)
        if self._layer_graphs is not None:
            return self._layer_graphs(x, key_padding_mask)
        return run_layer_stack(self.layers, x, key_padding_mask)
