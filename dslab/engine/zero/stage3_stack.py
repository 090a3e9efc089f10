"""ZeRO stage 3 for a model's stack of transformer layers: each layer's parameters gathered in the
autocast dtype just before the layer, its gradients reduce-scattered as soon as its backward is
done, the whole stack replayed from two CUDA graphs with the collectives inside.

Why: with a hook per module (:mod:`.stage3`), a stage 3 step of GPT-2 355M (micro-batch 8 x 1024)
on 4 H200 took the host 97-126 ms for 59 ms of compute kernels (``benchmarks/zero_step_profile.py``),
and each rank's collectives waited for the slowest host: 147-282 ms of NCCL kernel time a step,
against 8 ms at stage 2 with graphs. Stages 0 to 2 replay the layer stack from CUDA graphs
(:mod:`dslab.models.graphs`); here stage 3 does too, and the graphs carry its collectives.

How, for a model whose forward calls ``run_layers`` (:class:`dslab.models.graphs.CudaGraphLayers`)
when the engine's ``cuda_graphs`` are on:

* The stack's *sharded* units (those of its modules above ``stage3_param_persistence_threshold``:
  the projections) are taken out of the per-module hooks. Each keeps a copy of its shard in the
  gather dtype (the autocast dtype, bf16 or fp16; the unit's own dtype without autocast),
  refreshed after every optimizer step, so a layer's gather moves half the bytes of an fp32 one.
  The stack's *resident* units (layer norms, biases) stay as they are, whole on every rank.
* The forward runs layer by layer: wait for layer ``i``'s gathers, start layer ``i + 1``'s on a
  side stream, bind the layer's parameters to the gathered buffers, run it on an input detached
  from the previous layer's output (so each layer keeps an autograd graph of its own), then free
  the buffers. Gathering the weights in the autocast dtype computes what autocast computes from
  fp32 weights: the same casts, done once on the shard.
* The backward runs the layers in reverse: gather layer ``i`` again (the forward saved its
  weights by reference), ``torch.autograd.grad`` through its graph alone, pack its sharded
  units' gradients into fp32 flat buffers and reduce-scatter them on the side stream into a
  shard per unit (averaged), then free the weights. The resident parameters' gradients leave the
  stack through autograd, where the engine's reduce-scatter takes them as it takes every other
  unit's; the sharded units' shards go straight to the reducer
  (:meth:`~dslab.engine.zero.grads.GradientReduceScatter.deliver_shard`).
* On a CUDA device in training, outside profiling hooks and dispatch modes, the forward and the
  backward are captured once per input signature (three eager warm-up runs first, as
  :mod:`dslab.models.graphs` does) and replayed; the gathers and reduce-scatters run inside the
  graphs, overlapping the layers' kernels through the side stream. The comm observers saw them
  at capture and are told of every replay (:func:`dslab.comm.announce_replay`). Elsewhere (a CPU,
  a profiled step, ``torch.compile``) the same layer-by-layer passes run eagerly, with the
  collectives issued as they come. Without autograd (evaluation) each layer is gathered, run and
  freed.

Memory: one layer's full gradients at a time, and a layer's gathered weights plus the next one's
in flight. ``F.linear`` would save a view of its weight (``weight.t()``) for the backward, which
would keep each layer's gathered buffer alive from its forward to its backward (the whole stack's
weights at the end of the forward); inside the stack the layers' linears save the weight
parameter itself instead (:func:`dslab.models.weight_cast.linear_saves_weights`), which the
backward's gather binds again. The graphs keep these buffers in their pool; the gradient shards
the backward writes live outside it (one fp32 shard per sharded unit), beside each unit's shard
copy in the gather dtype.

A capture that fails (an error inside ``torch.cuda.graph``) is logged, counted
(``eager_capture_failed``), and the stack runs its passes eagerly from then on.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, OrderedDict

import torch
import torch.nn as nn

from dslab import comm
from dslab.engine.zero.grads import GradientReduceScatter
from dslab.engine.zero.partition import FlatUnit
from dslab.kernels.dispatch import graphed_launches
from dslab.models.graphs import WARMUP_RUNS, capture_blocker, clear_cublas_workspaces
from dslab.models.ops import chains_into
from dslab.models.weight_cast import linear_saves_weights

__all__ = ["Stage3LayerStack", "stack_units"]

log = logging.getLogger(__name__)


def stack_units(layers: nn.ModuleList, units: list[FlatUnit], owners: list[nn.Module]) -> list[list[FlatUnit]]:
    """The sharded (non-resident) units each layer of ``layers`` owns, by layer; a unit whose
    owner is inside no layer is in none."""
    layer_of: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for m in layer.modules():
            layer_of[id(m)] = i
    by_layer: list[list[FlatUnit]] = [[] for _ in layers]
    for unit, owner in zip(units, owners):
        if not unit.resident and id(owner) in layer_of:
            by_layer[layer_of[id(owner)]].append(unit)
    return by_layer


class _Gather:
    """One layer's units gathered (or being gathered) into buffers of the gather dtype."""

    def __init__(self, buffers: list[torch.Tensor], event):
        self.buffers = buffers
        self.event = event


class _Pass:
    """What a forward through the stack leaves for its backward: per layer its detached inputs
    and its outputs."""

    def __init__(self):
        self.inputs: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        self.outputs: list[tuple[torch.Tensor, ...]] = []


class _Captured:
    """The forward and backward graphs of one input signature and their static tensors."""

    def __init__(self, stack: "Stage3LayerStack", x: torch.Tensor, mask: torch.Tensor | None,
                 autocast_dtype: torch.dtype | None):
        self.static_x = x.detach().clone().requires_grad_(True)
        self.static_mask = None if mask is None else mask.clone()

        def forward():
            cast = (torch.autocast("cuda", dtype=autocast_dtype, cache_enabled=False)
                    if autocast_dtype is not None else contextlib.nullcontext())
            with cast, torch.enable_grad():
                return stack.forward_pass(self.static_x, self.static_mask, track=True)

        with graphed_launches():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    y, state = forward()
                    stack.backward_pass(state, torch.ones_like(y))
                    del y, state
            torch.cuda.current_stream().wait_stream(side)
            pool = torch.cuda.graph_pool_handle()
            clear_cublas_workspaces()
            self.forward_graph = torch.cuda.CUDAGraph()
            with comm.recording_calls(self.forward_graph) as self.forward_calls, \
                    torch.cuda.graph(self.forward_graph, pool=pool):
                y, state = forward()
            self.static_grad_y = torch.empty_like(y)
            self.backward_graph = torch.cuda.CUDAGraph()
            with comm.recording_calls(self.backward_graph) as self.backward_calls, \
                    torch.cuda.graph(self.backward_graph, pool=pool):
                grad_x, resident_grads = stack.backward_pass(state, self.static_grad_y)
            clear_cublas_workspaces()
        self.static_y = y.detach()
        self.static_grad_x = grad_x
        self.static_resident_grads = resident_grads
        del state, y


class _StackFunction(torch.autograd.Function):
    """The stack as one autograd node: forward replays (or runs) the layer-by-layer pass, backward
    the reverse pass; the resident parameters are its inputs so that their gradients flow."""

    @staticmethod
    def forward(ctx, stack, captured, x, mask, *resident):
        ctx.stack, ctx.captured = stack, captured
        if captured is not None:
            if x.data_ptr() != captured.static_x.data_ptr():
                captured.static_x.copy_(x)
            if mask is not None:
                captured.static_mask.copy_(mask)
            stack.unalias_resident_grads(captured)
            captured.forward_graph.replay()
            comm.announce_replay(captured.forward_calls)
            stack._awaiting_backward = True
            return captured.static_y.detach()
        with torch.enable_grad():
            y, ctx.state = stack.forward_pass(x.detach().requires_grad_(True), mask, track=True)
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y):
        stack, captured = ctx.stack, ctx.captured
        if captured is not None:
            stack._awaiting_backward = False
            captured.static_grad_y.copy_(grad_y)
            stack.unalias_resident_grads(captured)
            captured.backward_graph.replay()
            comm.announce_replay(captured.backward_calls)
            grad_x, resident_grads = captured.static_grad_x, captured.static_resident_grads
        else:
            grad_x, resident_grads = stack.backward_pass(ctx.state, grad_y)
            ctx.state = None
        stack.deliver_shards()
        return (None, None, grad_x, None, *resident_grads)


class Stage3LayerStack:
    """Runs a model's layer stack at ZeRO stage 3 (module docstring). ``layers`` is the model's
    ``nn.ModuleList``; ``by_layer[i]`` the sharded units layer ``i`` owns; ``reducer`` the
    runtime's gradient reduce-scatter, which stops waiting for those units' gradients and receives
    their shards instead. Called as ``stack(x, key_padding_mask)`` in place of the model's
    :class:`~dslab.models.graphs.LayerStackGraphs`."""

    def __init__(self, layers: nn.ModuleList, by_layer: list[list[FlatUnit]], reducer: GradientReduceScatter,
                 group=None, max_signatures: int = 2):
        self.layers = layers
        self.by_layer = by_layer
        self.reducer = reducer
        self.group = group
        self.max_signatures = max_signatures
        self.units = [u for units in by_layer for u in units]
        reducer.exclude(self.units)
        sharded = {id(p) for u in self.units for p in u.params}
        # the stack's other trainable parameters: whole on every rank, their gradients through autograd
        self.resident = [p for p in layers.parameters() if p.requires_grad and id(p) not in sharded]
        # per unit: its shard in the gather dtype (None: the unit's own shard is gathered)
        self._gather_shards: dict[int, torch.Tensor] = {}
        self._gather_dtype: torch.dtype | None = None
        self._grad_shards = {u.index: torch.zeros(u.shard_numel, dtype=u.dtype, device=u.device)
                             for u in self.units}
        self._side: torch.cuda.Stream | None = None
        self._captured: OrderedDict[tuple, _Captured] = OrderedDict()
        self._awaiting_backward = False
        self._capture_error: str | None = None
        self.stats: Counter = Counter()

    # -- the gather dtype's shard copies ------------------------------------------------------

    def _use_gather_dtype(self, dtype: torch.dtype) -> None:
        if dtype == self._gather_dtype:
            return
        self._gather_dtype = dtype
        self._captured.clear()
        self._gather_shards = {u.index: torch.empty(u.shard_numel, dtype=dtype, device=u.device)
                               for u in self.units if u.dtype != dtype}
        self.refresh_shards()

    def refresh_shards(self) -> None:
        """Copy every unit's shard into its gather-dtype copy (after each optimizer step, and after
        shards are loaded)."""
        with torch.no_grad():
            for unit in self.units:
                copy = self._gather_shards.get(unit.index)
                if copy is not None:
                    copy.copy_(unit.shard)

    # -- gather, bind, release ----------------------------------------------------------------

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    def _gather_start(self, i: int) -> _Gather:
        """Start gathering layer ``i``'s units (on the side stream on CUDA)."""
        units = self.by_layer[i]
        if not units:
            return _Gather([], None)
        side = self._side_stream(units[0].device)
        buffers = [torch.empty(u.padded, dtype=self._gather_dtype or u.dtype, device=u.device) for u in units]
        if side is None:
            for unit, buffer in zip(units, buffers):
                comm.all_gather_into_tensor(buffer, self._gather_shards.get(unit.index, unit.shard), group=unit.group)
            return _Gather(buffers, None)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for unit, buffer in zip(units, buffers):
                comm.all_gather_into_tensor(buffer, self._gather_shards.get(unit.index, unit.shard), group=unit.group)
            event = torch.cuda.Event()
            event.record(side)
        return _Gather(buffers, event)

    def _bind(self, i: int, gathered: _Gather) -> None:
        """Wait for layer ``i``'s gathers and point its parameters at them."""
        if gathered.event is not None:
            torch.cuda.current_stream().wait_event(gathered.event)
        for unit, buffer in zip(self.by_layer[i], gathered.buffers):
            for p, shape, offset, size in zip(unit.params, unit.layout.shapes, unit.layout.offsets,
                                              unit.layout.sizes):
                p.data = buffer[offset: offset + size].view(shape)

    def _release(self, i: int) -> None:
        for unit in self.by_layer[i]:
            empty = torch.empty(0, dtype=self._gather_dtype or unit.dtype, device=unit.device)
            for p in unit.params:
                p.data = empty

    # -- the passes ---------------------------------------------------------------------------

    def _calls(self):
        layers = list(self.layers)
        return [(layer, after) for layer, after in zip(layers, [*layers[1:], None])]

    def forward_pass(self, x: torch.Tensor, mask: torch.Tensor | None, track: bool):
        """The layers in turn, each gathered just before it and freed after it. With ``track``,
        each layer runs on a detached copy of its input and the pass is returned for
        :meth:`backward_pass`: ``(output, pass)``; else ``(output, None)``."""
        state = _Pass() if track else None
        normed = None
        calls = self._calls()
        pending = self._gather_start(0) if calls else None
        for i, (layer, after) in enumerate(calls):
            gathered = pending
            self._bind(i, gathered)
            pending = self._gather_start(i + 1) if i + 1 < len(calls) else None
            if track:
                x = x.detach().requires_grad_(True)
                normed = None if normed is None else normed.detach().requires_grad_(True)
                state.inputs.append((x, normed))
            extra = {} if normed is None else {"normed": normed}
            with linear_saves_weights():  # the layer's saved weights are its parameters (docstring)
                if chains_into(layer, after):
                    normed, x = layer(x, mask, next_norm=after.attention_norm, **extra)
                    outputs = (normed, x)
                else:
                    x, normed = layer(x, mask, **extra), None
                    outputs = (x,)
            if track:
                state.outputs.append(outputs)
            self._release(i)
            del gathered
        return x, state

    def backward_pass(self, state: _Pass, grad_y: torch.Tensor):
        """The layers in reverse: gather, differentiate the layer alone, reduce-scatter its
        sharded units' gradients into the shards :meth:`deliver_shards` hands over, free. Returns
        the stack input's gradient and the resident parameters' gradients (in
        :attr:`resident` order; None where unused)."""
        n = len(state.outputs)
        resident_index = {id(p): k for k, p in enumerate(self.resident)}
        resident_grads: list[torch.Tensor | None] = [None] * len(self.resident)
        grads_out: tuple = (grad_y,)
        in_flight: list[tuple[object, list[torch.Tensor]]] = []
        pending = self._gather_start(n - 1) if n else None
        for i in reversed(range(n)):
            gathered = pending
            self._bind(i, gathered)
            pending = self._gather_start(i - 1) if i > 0 else None
            inputs = [t for t in state.inputs[i] if t is not None]
            sharded = [p for u in self.by_layer[i] for p in u.params]
            outputs = state.outputs[i]
            grads_out = tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outputs, grads_out))
            grads = torch.autograd.grad(outputs, inputs + sharded + self.resident, grads_out, allow_unused=True)
            input_grads = grads[:len(inputs)]
            unit_grads = grads[len(inputs):len(inputs) + len(sharded)]
            for p, g in zip(self.resident, grads[len(inputs) + len(sharded):]):
                if g is not None:
                    k = resident_index[id(p)]
                    resident_grads[k] = g if resident_grads[k] is None else resident_grads[k] + g
            in_flight.append(self._reduce_scatter(i, unit_grads))
            del grads, unit_grads
            self._release(i)
            del gathered
            # the previous layer's outputs are this layer's inputs, in (normed, x) or (x,) order
            x_grad, normed_grad = input_grads[0], (input_grads[1] if len(input_grads) > 1 else None)
            grads_out = (x_grad,) if i == 0 or len(state.outputs[i - 1]) == 1 else (normed_grad, x_grad)
            if len(in_flight) > 1:
                self._finish_reduce(in_flight.pop(0))
        while in_flight:
            self._finish_reduce(in_flight.pop(0))
        return grads_out[0] if n else grad_y, resident_grads

    def _reduce_scatter(self, i: int, grads):
        """Start reduce-scattering layer ``i``'s unit gradients (fp32 flat buffers, averaged)."""
        units = self.by_layer[i]
        flats, offset = [], 0
        for unit in units:
            flat = torch.zeros(unit.padded, dtype=unit.dtype, device=unit.device)
            at = 0
            for size, g in zip(unit.layout.sizes, grads[offset: offset + len(unit.params)]):
                if g is not None:
                    flat[at: at + size].copy_(g.reshape(-1))
                at += size
            offset += len(unit.params)
            flats.append(flat)
        side = self._side_stream(units[0].device) if units else None
        stream = contextlib.nullcontext() if side is None else torch.cuda.stream(side)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with stream:
            for unit, flat in zip(units, flats):
                op = comm.averaging_op(unit.group) if unit.grad_divisor == unit.world_size else None
                if op is None:
                    flat.div_(unit.grad_divisor)
                comm.reduce_scatter_tensor(self._grad_shards[unit.index], flat, op=op or comm.ReduceOp.SUM,
                                           group=unit.group)
            event = None
            if side is not None:
                event = torch.cuda.Event()
                event.record(side)
        return event, flats

    @staticmethod
    def _finish_reduce(item) -> None:
        """The current stream waits for a layer's reduce-scatters before its flat buffers go."""
        event, flats = item
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        flats.clear()

    def deliver_shards(self) -> None:
        """Hand the backward's gradient shards to the reducer (after each backward of the stack)."""
        for unit in self.units:
            self.reducer.deliver_shard(unit, self._grad_shards[unit.index])

    def unalias_resident_grads(self, captured: _Captured) -> None:
        """A resident parameter's ``.grad`` adopted from the graph's static gradient must move out
        before the graphs write that buffer again."""
        for p, g in zip(self.resident, captured.static_resident_grads):
            if g is not None and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                p.grad = p.grad.clone()

    # -- the call -----------------------------------------------------------------------------

    def _capture(self, x: torch.Tensor, mask: torch.Tensor | None, autocast_dtype) -> _Captured | None:
        """The graphs of this signature, or None when capturing them failed: the error is logged
        once and the stack runs its passes eagerly from then on (every rank fails alike, the
        capture being the same code on each)."""
        try:
            return _Captured(self, x, mask, autocast_dtype)
        except Exception as err:
            self._capture_error = f"{type(err).__name__}: {err}"
            log.warning("ZeRO stage 3 layer stack: capturing its CUDA graphs failed (%s); the stack runs its "
                        "layer-by-layer passes eagerly", self._capture_error)
            return None

    def eager_reason(self, x: torch.Tensor) -> str | None:
        """Why this call runs the passes eagerly instead of replaying graphs (None: it replays)."""
        if self._capture_error is not None:
            return "capture_failed"
        return capture_blocker(self.layers, x) or ("awaiting_backward" if self._awaiting_backward else None)

    def __call__(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        autocast_dtype = (torch.get_autocast_dtype(x.device.type)
                          if torch.is_autocast_enabled(x.device.type) else None)
        self._use_gather_dtype(autocast_dtype or (self.units[0].dtype if self.units else x.dtype))
        if not self.layers.training or not torch.is_grad_enabled():
            self.stats["eager_" + ("eval" if not self.layers.training else "no_grad")] += 1
            return self.forward_pass(x, key_padding_mask, track=False)[0]
        reason = self.eager_reason(x)
        captured = None
        if reason is not None:
            self.stats[f"eager_{reason}"] += 1
        else:
            key = (tuple(x.shape), x.dtype, x.device, None if key_padding_mask is None else
                   (tuple(key_padding_mask.shape), key_padding_mask.dtype), autocast_dtype,
                   tuple(p.data_ptr() for p in self.resident))
            captured = self._captured.get(key)
            if captured is None:
                while len(self._captured) >= self.max_signatures:
                    self._captured.popitem(last=False)
                captured = self._capture(x, key_padding_mask, autocast_dtype)
                if captured is not None:
                    self._captured[key] = captured
                    self.stats["captures"] += 1
            else:
                self._captured.move_to_end(key)
            self.stats["replays" if captured is not None else "eager_capture_failed"] += 1
        return _StackFunction.apply(self, captured, x, key_padding_mask, *self.resident)

    def release(self) -> None:
        """Drop the captured graphs (captured again on the next graphed call)."""
        self._captured.clear()
        self._awaiting_backward = False
