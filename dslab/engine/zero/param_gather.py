"""Stage 1–2's all-gathers of updated parameters, waited where the next forward first reads them
(``zero_optimization.overlap_param_gather``, dslab's key; Megatron's ``--overlap-param-gather``).

After the optimizer steps the shards, each rank all-gathers every unit's new shard into the
parameters (:meth:`ZeroRuntime._publish`). Waited at the end of the step, those gathers hold the
next forward back for their whole duration (GPT-2 1.5B on 2 H200s: 6.2 GB of fp32 parameters,
most of a 24 ms optimizer phase). Deferred, each unit is waited just before the first module
that reads it runs:

* a model whose layer stack runs as :class:`~dslab.models.graphs.SegmentedLayerGraphs` calls
  ``before_segment(k)`` before segment ``k``: the units holding that segment's parameters are
  waited there, so the gathers of later segments run beside the forward of earlier ones;
* every other unit (embeddings, final norm and head, a unit that spans the stack's edge) is waited
  when the engine's forward begins (:meth:`DeferredGathers.before_forward`), before the model runs;
* a model without segments, or one that checkpoints its layers (the checkpointed stack does not
  go through the segments), has every unit waited there.

The engine's forward is the entry: a module hook would do the same for direct calls of the model,
but a hook on the model tells the profilers that another tool instruments the step.

The gathers are issued in the order they are waited (units outside the stack first, then by
segment), since NCCL runs them one after another. Waiting on an NCCL handle makes the current
stream wait on the device; the host does not block. Anything else that reads the parameters
between a step and the next forward of the engine must call :meth:`DeferredGathers.settle` first:
the engine does it for checkpoints and state dicts; a user reading ``module.parameters()``, or
calling the model itself, after a step sees the new parameters after the engine's next forward
began or after ``engine.zero.settle()``.
"""

from __future__ import annotations

from collections import Counter

import torch.nn as nn

#: the segment index of a unit read before the layer stack runs
BEFORE_STACK = -1
#: defer on a host (gloo) process group too; only tests set it (see :func:`defers_on`)
HOST_DEFERRAL = False


def defers_on(device) -> bool:
    """Whether gathers of units on ``device`` are deferred: on CUDA devices. On a host (gloo) they
    are waited at the step as before: gloo's wait blocks the host, so deferring buys nothing there,
    and gloo's worker threads, which run the gathers' copies, raced torch.profiler's stop at the flops
    profiler's step (a segmentation fault in about one run in five). Tests set
    :data:`HOST_DEFERRAL` to check the waits' placement on gloo without the profilers."""
    return getattr(device, "type", None) == "cuda" or HOST_DEFERRAL


def check_config(config, *, model_parallel: bool) -> None:
    """Refuse ``zero_optimization.overlap_param_gather`` beside what it cannot wait inside (the
    stage and offload checks are :meth:`ZeroConfig.check_supported`'s)."""
    if not config.zero_optimization.overlap_param_gather:
        return
    if model_parallel:
        raise ValueError("config key 'zero_optimization.overlap_param_gather' with a tensor- or "
                         "pipeline-parallel model: its waits sit in the engine's forward and the layer "
                         "stack's segments, which a pipeline stage does not run through; turn it off")
    if config.compile.enabled:
        raise ValueError("config key 'zero_optimization.overlap_param_gather' with 'compile.enabled': "
                         "torch.compile would trace the waits before each segment of the layer stack; "
                         "turn one off")


def segment_of_units(module: nn.Module, units) -> dict[int, int]:
    """``{unit.index: segment}``: the first segment of ``module``'s segmented layer stack that
    reads the unit's parameters, or :data:`BEFORE_STACK` for a unit with any parameter outside
    the stack. Every unit is :data:`BEFORE_STACK` when the stack is not segmented."""
    graphs = getattr(module, "_layer_graphs", None)
    segments = getattr(graphs, "segments", None)
    if not segments or getattr(getattr(module, "config", None), "checkpoint_layers", 0):
        return {unit.index: BEFORE_STACK for unit in units}
    where = {id(p): k for k, segment in enumerate(segments) for p in segment.layers.parameters()}
    out = {}
    for unit in units:
        places = [where.get(id(p)) for p in unit.params]
        out[unit.index] = BEFORE_STACK if any(k is None for k in places) else min(places)
    return out


class DeferredGathers:
    """Holds the pending all-gather of each unit of ``units`` and waits it where ``module``'s
    next forward first reads the unit (see the module docstring). ``stats`` counts the waits by
    place: ``"before_forward"``, ``"before_segment"``, ``"settle"``."""

    def __init__(self, module: nn.Module, units):
        self.module = module
        self.segment_of = segment_of_units(module, units)
        self._pending: dict[int, object] = {}
        self.stats: Counter = Counter()
        graphs = getattr(module, "_layer_graphs", None)
        self._graphs = graphs if any(k != BEFORE_STACK for k in self.segment_of.values()) else None
        if self._graphs is not None:
            self._graphs.before_segment = self._before_segment

    def issue_order(self, units: list) -> list:
        """``units`` in the order their gathers should run: the ones read before the stack
        first, then by segment (stable within each)."""
        return sorted(units, key=lambda u: self.segment_of[u.index])

    def add(self, unit, handle) -> None:
        """``unit``'s gather was issued; ``handle`` (None: it already completed) is waited later."""
        if handle is not None:
            self._pending[unit.index] = handle

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _wait(self, indices, place: str) -> None:
        for index in indices:
            handle = self._pending.pop(index, None)
            if handle is not None:
                handle.wait()
                self.stats[place] += 1

    def before_forward(self) -> None:
        """The engine's forward begins: wait for the units read before the layer stack (every
        unit when the stack has no segments)."""
        if not self._pending:
            return
        if self._graphs is None:
            self._wait(list(self._pending), "before_forward")
        else:
            self._wait([i for i in list(self._pending) if self.segment_of[i] == BEFORE_STACK], "before_forward")

    def _before_segment(self, segment: int) -> None:
        if self._pending:
            self._wait([i for i in list(self._pending) if self.segment_of[i] <= segment], "before_segment")

    def settle(self) -> None:
        """Wait for every pending gather: the parameters are complete after it."""
        self._wait(list(self._pending), "settle")

    def remove(self) -> None:
        self.settle()
        if self._graphs is not None and getattr(self._graphs, "before_segment", None) == self._before_segment:
            self._graphs.before_segment = None
