"""ZeRO-Offload of the optimizer (Ren et al., 2021, arXiv:2101.06840): masters, gradients and
optimizer states of each rank's shards in CPU memory, the optimizer stepping on the CPU.

Per unit (:mod:`.partition`) this rank keeps in CPU memory:

- ``masters[i]``: the fp32 copy of the unit's shard that the optimizer updates (``S`` elements,
  pinned with ``offload_optimizer.pin_memory`` when CUDA is in use, so that copying it back to
  the GPU is asynchronous);
- ``grads[i]``: the shard's averaged gradient for the current accumulation window. On CUDA it is
  always pinned: it is the target of device-to-host copies issued during backward, which must not
  block the host;
- ``staging[i]`` (only with gradient accumulation at stages 2 and 3, which reduce every
  backward): where later micro-steps' shards land before they are added into ``grads[i]``;
- the optimizer's states, created by the optimizer next to the masters.

How one optimizer step flows, and what overlaps what:

1. Backward: as each unit's reduce-scatter completes, :meth:`CpuOptimizerOffload.receive` copies
   the shard to CPU on a side stream (the copy overlaps the rest of backward) and drops the GPU
   shard, so no gradient partition stays on the GPU (the allocator keeps the memory until the
   copy has read it: ``record_stream``). A later micro-step's copy goes to ``staging`` and is
   added on the CPU before the next backward or the step (:meth:`settle`).
2. Step: wait for the copies, then fp16 unscale, the overflow verdict and the clipping norm over
   the CPU gradients (:meth:`gradients`; the runtime all-reduces the scalars).
3. The optimizer steps in *chunks* of units of about ``chunk_numel`` elements
   (:meth:`step_in_chunks`): the masters of one chunk get their gradients (scaled by the clip
   coefficient), ``optimizer.step()`` updates them (torch optimizers skip parameters whose
   ``.grad`` is None), and the new shards are copied to the GPU and published (all-gathered)
   asynchronously while the CPU steps the next chunk.

Memory traffic per step on the host: read the gradients once for the norm (twice with fp16:
unscale, then norm) plus the optimizer's own (Adam: read master, grad and two moments, write
master and moments); over PCIe: ``4·S`` bytes per unit each way.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from dslab.engine.zero.partition import FlatUnit


class CpuOptimizerOffload:
    """The CPU side of ZeRO-Offload for ``units`` (module docstring)."""

    def __init__(self, units: list[FlatUnit], pin_memory: bool, chunk_numel: int):
        self.units = units
        self.cuda = any(u.device.type == "cuda" for u in units)
        pin_masters = pin_memory and self.cuda
        self.masters: list[nn.Parameter] = []
        self.grads: list[torch.Tensor] = []
        for unit in units:
            master = torch.empty(unit.shard_numel, dtype=unit.dtype, pin_memory=pin_masters)
            master.copy_(unit.shard)
            self.masters.append(nn.Parameter(master))
            self.grads.append(torch.zeros(unit.shard_numel, dtype=unit.dtype, pin_memory=self.cuda))
        self.staging: list[torch.Tensor | None] = [None] * len(units)
        self.chunks = plan_chunks(units, chunk_numel)
        self._filled = [False] * len(units)
        self._copied: list[torch.cuda.Event | None] = [None] * len(units)
        self._to_add: list[tuple[int, torch.cuda.Event | None]] = []
        self._published: torch.cuda.Event | None = None
        self._copy_stream = None
        if self.cuda:
            device = next(u.device for u in units if u.device.type == "cuda")
            self._copy_stream = torch.cuda.Stream(device=device)

    # -- gradients in -------------------------------------------------------------------------

    def receive(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        """Take ``unit``'s reduced gradient shard (on the unit's device) into CPU memory; the
        caller drops its reference to ``shard`` afterwards."""
        i = unit.index
        if self._filled[i]:
            if self.staging[i] is None:
                self.staging[i] = torch.empty_like(self.grads[i], pin_memory=self.cuda)
            target = self.staging[i]
        else:
            target = self.grads[i]
        event = self._copy_to_host(target, shard)
        if self._filled[i]:
            self._to_add.append((i, event))
        else:
            self._copied[i] = event
            self._filled[i] = True

    def _copy_to_host(self, target: torch.Tensor, source: torch.Tensor):
        if not source.is_cuda:
            target.copy_(source)
            return None
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        source.record_stream(stream)
        return event

    def settle(self) -> None:
        """Add the gradients of finished later micro-steps into ``grads`` (waits for their
        copies). Called before each backward and at the step, so ``staging`` is free again."""
        for i, event in self._to_add:
            if event is not None:
                event.synchronize()
            self.grads[i].add_(self.staging[i])
        self._to_add = []

    def gradients(self) -> list[torch.Tensor]:
        """Every unit's CPU gradient for this window, complete: waits for the copies; a unit
        that received nothing (a step without a reducing backward) holds zeros."""
        self.settle()
        for i, event in enumerate(self._copied):
            if event is not None:
                event.synchronize()
            self._copied[i] = None
            if not self._filled[i]:
                self.grads[i].zero_()
        return self.grads

    # -- the step -----------------------------------------------------------------------------

    def step_in_chunks(self, optimizer: torch.optim.Optimizer, coefficient: float | None,
                       publish: Callable[[FlatUnit, torch.Tensor], object]) -> list:
        """Step the masters chunk by chunk, each chunk's gradients scaled by ``coefficient``
        (clipping; None leaves them), and after each chunk call ``publish(unit, master)`` for its
        units (which starts copying the master to the GPU and gathering it). Returns what the
        publish calls returned (collective handles to wait on)."""
        if self._published is not None:  # last step's copies to the GPU read the masters
            self._published.synchronize()
            self._published = None
        handles = []
        try:
            for chunk in self.chunks:
                grads = [self.grads[u.index] for u in chunk]
                if coefficient is not None:
                    torch._foreach_mul_(grads, coefficient)
                for unit, grad in zip(chunk, grads):
                    self.masters[unit.index].grad = grad
                optimizer.step()
                for unit in chunk:
                    self.masters[unit.index].grad = None
                    handles.append(publish(unit, self.masters[unit.index]))
        finally:
            for master in self.masters:
                master.grad = None
        if self.cuda:
            self._published = torch.cuda.Event()
            self._published.record()
        return handles

    def zero_grad(self) -> None:
        """Start a new accumulation window: the next received shard overwrites ``grads``."""
        self.settle()
        self._filled = [False] * len(self.units)

    def buffers(self) -> list[torch.Tensor]:
        """The CPU gradient buffers (accumulators and staging): model-state memory."""
        return self.grads + self.staging_buffers()

    def staging_buffers(self) -> list[torch.Tensor]:
        """The staging buffers allocated so far (gradient accumulation at stages 2 and 3)."""
        return [s for s in self.staging if s is not None]


def plan_chunks(units: list[FlatUnit], chunk_numel: int) -> list[list[FlatUnit]]:
    """``units`` in index order cut into runs of at least ``chunk_numel`` shard elements (the
    last run may be shorter)."""
    chunks, current, numel = [], [], 0
    for unit in units:
        current.append(unit)
        numel += unit.shard_numel
        if numel >= chunk_numel:
            chunks.append(current)
            current, numel = [], 0
    if current:
        chunks.append(current)
    return chunks
