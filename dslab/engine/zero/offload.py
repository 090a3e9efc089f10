"""ZeRO-Offload of the optimizer (Ren et al., 2021, arXiv:2101.06840): masters, gradients and
optimizer states of each rank's shards in CPU memory, the optimizer stepping on the CPU.

Per unit (:mod:`.partition`) this rank keeps in CPU memory:

- ``masters[i]``: the fp32 copy of the unit's shard that the optimizer updates (``S`` elements,
  pinned with ``offload_optimizer.pin_memory`` when CUDA is in use, so that copying it back to
  the GPU is asynchronous);
- ``grads[i]``: the shard's averaged gradient, summed over the accumulation window. On CUDA it is
  always pinned: it is the target of device-to-host copies issued during backward, which must not
  block the host;
- the optimizer's states, created by the optimizer next to the masters.

Pinned buffers are page-locked at their own size (:mod:`.pinned`), not taken from torch's pinned
cache, which rounds each up to a power of two.

How one optimizer step flows, and what overlaps what (on CUDA; without it the same steps run
synchronously on the CPU):

1. Backward: as each unit's reduce-scatter completes, :meth:`CpuOptimizerOffload.receive` works on
   a side stream, overlapping the rest of backward: the first shard of a window is copied to
   ``grads[i]``; a later micro-step's shard is added to ``grads[i]`` on the GPU (copied in,
   added, copied back), so no CPU work and no second CPU buffer is needed; on the window's last
   backward the squared norm of the unit's final gradient is taken on the GPU, before it leaves.
   The GPU shard is then dropped (the allocator keeps the memory until the side stream has read
   it: ``record_stream``), so no gradient partition stays on the GPU.
   With ``accumulate_on="cpu"`` (``offload_optimizer.accumulate_on``) a later micro-step's shard
   is copied to one of a few pinned staging buffers instead and added to ``grads[i]`` on the CPU
   by a worker thread, in arrival order: nothing crosses PCIe towards the GPU, where parameter
   offload's fetches need that direction (13B with half its units offloaded on one H200 moved
   51 GB of parameters and 26 GB of gradients for accumulation to the GPU per micro-step), and
   the shards waiting for a copy are bounded by the staging buffers (a receive with none free
   waits for the oldest add), so they cannot pile up on the GPU while the copies lag behind.
   With ``accumulate_on="gpu_resident"`` the window's sum stays on the GPU (``4·S`` bytes a unit
   while the window lasts, the shards added where they are) and crosses PCIe once, on the
   window's last backward: at 2.7B parameters with everything offloaded and 16 micro-steps of
   8 × 1024 tokens on one H200, the other two modes moved 170 GB of gradients to the host per
   step where this moves 10.6 GB, at a GPU peak of 12 GiB.
   ``staging_dtype="bf16"`` (``offload_optimizer.staging_dtype``) converts those later shards to
   bf16 on the GPU before the copy: half the bytes to the host and half the host's reads of
   them (an addition streams the staged shard and the sum through host memory), the sum staying
   in the masters' dtype.
2. Step: wait for the copies; the squared norms (one GPU tensor, all-reduced by the runtime) give
   the clipping norm and the fp16 overflow verdict (a non-finite norm), without reading the CPU
   gradients.
3. The optimizer steps in *chunks* of units of at least ``chunk_numel`` shard elements
   (``zero_optimization.sub_group_size``, :meth:`step_in_chunks`): one CPU pass scales a chunk's
   gradients (fp16 unscale and clipping in one factor; a fused torch optimizer takes the factor
   as its ``grad_scale`` instead and scales each gradient as it reads it, :func:`folded_factor`,
   which spares the host that pass), ``optimizer.step()`` updates its masters
   (torch optimizers skip parameters whose ``.grad`` is None), and the new shards are copied to
   the GPU and published (all-gathered) asynchronously while the CPU steps the next chunk.
   DeepSpeed's default of 1e9 elements makes one chunk of any model below a billion parameters
   per rank. On an H100 host, chunks gained nothing (GPT-2 355M at stage 2, median of 3 trials:
   one chunk 258 ms per step, chunks of 25M elements 260 ms): the CPU step is bound by host
   memory bandwidth, which the copies back draw on too. With parameter offload and
   ``offload_optimizer.overlap_step`` (:meth:`step_in_background`, :mod:`.step_overlap`) the
   chunks of the units the parameter home holds run on a worker thread, in forward order, while
   the next forward starts; a fetch of a unit waits for its update.

Traffic per unit and window of ``G`` micro-steps: over PCIe ``4·S·(2G - 1)`` bytes to the host
side and ``4·S·(G - 1)`` back for accumulation (with ``accumulate_on="cpu"``: ``4·S·G`` to the
host, nothing back, and ``G - 1`` additions on the host; with ``staging_dtype`` bf16,
``4·S + 2·S·(G - 1)`` to the host; with ``accumulate_on="gpu_resident"``, ``4·S`` to the host
and nothing back), then ``4·S`` for the new shard; on the
host one pass over the gradients (the scale, unless the optimizer folds it) plus the
optimizer's own (Adam: read master, gradient and two moments, write master and moments).
"""

from __future__ import annotations

import collections
import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn as nn

from dslab.engine.parameters import steps_with_grad_scale
from dslab.engine.zero.partition import FlatUnit
from dslab.engine.zero.pinned import HostBuffers


#: ``offload_optimizer.accumulate_on``'s values (module docstring, step 1).
ACCUMULATE_ON = ("gpu", "cpu", "gpu_resident")

#: Elements widened at a time when a staged shard narrower than the sum is added (8 MB of fp32).
WIDEN_CHUNK = 1 << 21


def foldable(factor: float | None) -> bool:
    """Whether ``1 / factor`` is a finite fp32 scale: not for None, nor for the 0 (or the
    denormal) that clipping an overflowed gradient norm gives, which the scale pass applies."""
    return factor is not None and factor > 0.0 and 1.0 / max(factor, 1e-300) < torch.finfo(torch.float32).max


@contextlib.contextmanager
def folded_factor(optimizer: torch.optim.Optimizer, factor: float | None):
    """Within the block ``optimizer`` applies ``factor`` itself where it can (torch's fused Adam or
    AdamW, :func:`~dslab.engine.parameters.steps_with_grad_scale`: its ``grad_scale`` holds
    ``1 / factor`` until the block ends and it divides each gradient by it as it reads it) and
    the block gets None, the factor left for the caller to apply; otherwise the block gets
    ``factor``. The fused step then reads each gradient once instead of twice (a scale pass,
    then the step): the host's step is bound by memory bandwidth (on a 2-core CPU machine, 256M
    fp32 elements: a fused AdamW step 0.105 s, the scale pass 0.031 s)."""
    if not foldable(factor) or not steps_with_grad_scale(optimizer):
        yield factor
        return
    optimizer.grad_scale = torch.tensor(1.0 / factor, dtype=torch.float32)
    try:
        yield None
    finally:
        del optimizer.grad_scale


class CpuOptimizerOffload:
    """The CPU side of ZeRO-Offload for ``units`` (module docstring)."""

    def __init__(self, units: list[FlatUnit], pin_memory: bool, chunk_numel: int, home=None,
                 on_device: set[int] = frozenset(), accumulate_on: str = "gpu", staging_buffers: int = 4,
                 staging_dtype: str | None = None):
        if accumulate_on not in ACCUMULATE_ON:
            raise ValueError(f"offload_optimizer.accumulate_on must be one of {', '.join(map(repr, ACCUMULATE_ON))}, "
                             f"got {accumulate_on!r}")
        if staging_dtype not in (None, "bf16"):
            raise ValueError(f"offload_optimizer.staging_dtype must be 'bf16' or None, got {staging_dtype!r}")
        if staging_dtype is not None and accumulate_on != "cpu":
            raise ValueError("offload_optimizer.staging_dtype needs accumulate_on 'cpu'")
        #: the dtype later micro-steps' shards are staged in (None: the shard's own)
        self.staging_dtype = torch.bfloat16 if staging_dtype == "bf16" else None
        self.units = units
        self.accumulate_on = accumulate_on
        self.cuda = any(u.device.type == "cuda" for u in units)
        # parameter offload (param_offload.py): an offloaded unit's master is its home copy
        self.home = home
        # partial offload (offload_optimizer.ratio): these units step where they live
        self.on_device = [u.index in on_device for u in units]
        pin_masters = pin_memory and self.cuda
        # masters, gradient buffers and staging buffers, page-locked at their size (pinned.py)
        self.host_buffers = HostBuffers("offload_optimizer")
        self.masters: list[nn.Parameter] = []
        self.grads: list[torch.Tensor | None] = []
        for unit, device in zip(units, self.on_device):
            if device:
                self.masters.append(nn.Parameter(unit.shard))  # shares the shard, as without offload
                self.grads.append(None)  # the gradient stays in unit.grad_shard
                continue
            if home is not None and home.holds(unit):
                master = home.master(unit)
            else:
                master = self.host_buffers.empty(unit.shard_numel, unit.dtype, pin_masters)
                master.copy_(unit.shard)
            self.masters.append(nn.Parameter(master))
            self.grads.append(self.host_buffers.zeros(unit.shard_numel, unit.dtype, self.cuda))
        self.device_units = [u for u, device in zip(units, self.on_device) if device]
        self.chunk_numel = chunk_numel
        self.chunks = plan_chunks([u for u, device in zip(units, self.on_device) if not device],
                                  chunk_numel)
        self.last_backward = True
        self._filled = [False] * len(units)
        self._squares: list[torch.Tensor | None] = [None] * len(units)
        self._copied: list[torch.cuda.Event | None] = [None] * len(units)
        # accumulate_on="gpu_resident": each unit's running sum of the window, where its shards are
        self._sums: list[torch.Tensor | None] = [None] * len(units)
        self._published: torch.cuda.Event | None = None
        self._background = None  # a step_overlap.BackgroundStep in flight
        self._copy_stream = None
        if self.cuda:
            device = next(u.device for u in units if u.device.type == "cuda")
            self._copy_stream = torch.cuda.Stream(device=device)
        # accumulate_on="cpu": staging buffers (made at the first addition), the worker that adds
        # them into grads, and the additions in flight, oldest first
        self._staging_count = staging_buffers
        self._staging_free: list[torch.Tensor] = []
        self._staging_made = 0
        self._adds: collections.deque[Future] = collections.deque()
        self._worker: ThreadPoolExecutor | None = None
        self._widen_scratch: torch.Tensor | None = None  # the worker's, for staging_dtype's additions
        # gradient traffic since the start (:meth:`stats`)
        self.totals = {"grad_d2h_bytes": 0, "grad_h2d_bytes": 0, "host_adds": 0, "staging_wait_s": 0.0,
                       "adds_wait_s": 0.0, "add_copy_wait_s": 0.0, "add_s": 0.0,
                       "cpu_step_s": 0.0, "overlap_step_s": 0.0, "overlap_join_wait_s": 0.0}

    # -- gradients in -------------------------------------------------------------------------

    def begin(self, last_backward: bool) -> None:
        """Before each reducing backward: whether it is the window's last (its shards are final,
        so their norms are taken)."""
        self.last_backward = last_backward

    def receive(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        """Take ``unit``'s reduced gradient shard (on the unit's device) into ``grads`` (module
        docstring, step 1); the caller drops its reference to ``shard`` afterwards."""
        self.settle()  # a background step still reading the gradients finishes first
        i = unit.index
        accumulate, self._filled[i] = self._filled[i], True
        if self.on_device[i]:  # summed where it is, as without offload
            if not accumulate:
                unit.grad_shard = shard.clone() if shard._base is not None else shard
            else:
                unit.grad_shard.add_(shard)
            return
        if accumulate and self.accumulate_on == "cpu":
            self._add_on_host(i, shard)
            return
        if self.accumulate_on == "gpu_resident":
            if accumulate:
                self._sums[i].add_(shard)
            else:
                self._sums[i] = shard.clone() if shard._base is not None else shard
            if not self.last_backward:
                return  # the sum stays where it is until the window's last shard
            shard, self._sums[i] = self._sums[i], None
            accumulate = False  # the sum is the window's gradient: copied over grads[i]
        if not shard.is_cuda:
            total = self.grads[i].add_(shard) if accumulate else self.grads[i].copy_(shard)
            self._squares[i] = _square_norm(total) if self.last_backward else None
            return
        nbytes = shard.numel() * shard.element_size()
        self.totals["grad_d2h_bytes"] += nbytes
        if accumulate:
            self.totals["grad_h2d_bytes"] += nbytes
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(shard.device))
        with torch.cuda.stream(stream):
            total = shard
            if accumulate:
                total = torch.empty_like(shard)
                total.copy_(self.grads[i], non_blocking=True)
                total.add_(shard)
            self._squares[i] = _square_norm(total) if self.last_backward else None
            self.grads[i].copy_(total, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        shard.record_stream(stream)
        self._copied[i] = event

    def _add_on_host(self, i: int, shard: torch.Tensor) -> None:
        """``accumulate_on="cpu"``: copy ``shard`` into a staging buffer (on the side stream from
        the GPU) and have the worker add it to ``grads[i]`` once it has landed; its squared norm
        is taken there on the window's last backward."""
        staging = self._take_staging(shard.numel())
        view = staging[:shard.numel()]
        event = None
        self.totals["host_adds"] += 1
        if shard.is_cuda:
            self.totals["grad_d2h_bytes"] += shard.numel() * view.element_size()
            stream = self._copy_stream
            stream.wait_stream(torch.cuda.current_stream(shard.device))
            with torch.cuda.stream(stream):
                # staging_dtype: converted on the GPU (on this stream, which owns the copy), so
                # only the narrower bytes cross PCIe
                source = shard if view.dtype == shard.dtype else shard.to(view.dtype)
                view.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            shard.record_stream(stream)
        else:
            view.copy_(shard)  # rounded to the staging dtype, as the GPU's conversion does
        self._squares[i] = None
        last = self.last_backward
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dslab-grad-add")
        # the window's first copy into grads[i] was issued on the same stream before: done
        # once this one's event is
        self._adds.append(self._worker.submit(self._add_staged, i, staging, view, event, last))

    def _add_staged(self, i: int, staging: torch.Tensor, view: torch.Tensor, event, last: bool) -> torch.Tensor:
        start = time.perf_counter()
        if event is not None:
            event.synchronize()
        landed = time.perf_counter()
        if view.dtype == self.grads[i].dtype:
            self.grads[i].add_(view)
        else:
            self._add_widened(self.grads[i], view)
        if last:
            self._squares[i] = _square_norm(self.grads[i])
        # only this worker writes these two
        self.totals["add_copy_wait_s"] += landed - start
        self.totals["add_s"] += time.perf_counter() - landed
        return staging

    def _add_widened(self, total: torch.Tensor, staged: torch.Tensor) -> None:
        """``total += staged`` for a narrower ``staged`` (``staging_dtype``), widened a cache-sized
        piece at a time: torch's CPU add would first widen all of it into a fresh tensor (on a
        2-core host 63 ms for 50M elements against 9 ms this way, the same as an fp32 add)."""
        if self._widen_scratch is None:
            self._widen_scratch = torch.empty(WIDEN_CHUNK, dtype=total.dtype)
        for start in range(0, staged.numel(), WIDEN_CHUNK):
            end = min(start + WIDEN_CHUNK, staged.numel())
            piece = self._widen_scratch[:end - start]
            piece.copy_(staged[start:end])
            total[start:end].add_(piece)

    def _take_staging(self, numel: int) -> torch.Tensor:
        """A free staging buffer of at least ``numel`` elements: a new one while fewer than
        ``staging_buffers`` exist, else the oldest addition's once it is done."""
        while not self._staging_free:
            if self._staging_made < self._staging_count:
                largest = max(u.shard_numel for u, device in zip(self.units, self.on_device) if not device)
                dtype = self.staging_dtype or next(u.dtype for u, device in zip(self.units, self.on_device)
                                                   if not device)
                self._staging_free.append(self.host_buffers.empty(largest, dtype, self.cuda))
                self._staging_made += 1
            else:
                start = time.perf_counter()
                self._staging_free.append(self._adds.popleft().result())
                self.totals["staging_wait_s"] += time.perf_counter() - start
        return self._staging_free.pop()

    def _finish_adds(self) -> None:
        """Wait for every addition in flight (and raise the first that failed)."""
        start = time.perf_counter()
        while self._adds:
            self._staging_free.append(self._adds.popleft().result())
        self.totals["adds_wait_s"] += time.perf_counter() - start

    def stats(self) -> dict:
        """Gradient traffic since the start: bytes of gradient shards copied to the host
        (``grad_d2h_bytes``) and of sums copied back to the GPU for accumulation
        (``grad_h2d_bytes``), additions made on the host (``host_adds``), and the host's waits
        for them: for a free staging buffer during backward (``staging_wait_s``) and for the
        last ones before a step or a new window (``adds_wait_s``); and the adding worker's own
        time, waiting for a shard's copy to land (``add_copy_wait_s``) and adding it (``add_s``,
        with the last micro-step's norms): which of the two bounds ``staging_wait_s``. The
        optimizer step's time on the caller's thread (``cpu_step_s``: scaling, stepping and
        publishing the chunks it steps itself, and with NVMe their swaps); with
        ``overlap_step``, the background steps' own time (``overlap_step_s``) and the time spent
        joining them (``overlap_join_wait_s``; the forward's waits for single units are the
        parameter home's ``update_wait_s``)."""
        return dict(self.totals)

    def gradients(self) -> list[torch.Tensor]:
        """Every unit's CPU gradient for this window, complete: waits for the copies and the
        host additions; a unit that received nothing (a step without a reducing backward) holds
        zeros."""
        self.settle()
        self._finish_adds()
        for i, total in enumerate(self._sums):  # a unit whose last shard came before the last backward
            if total is not None:
                self.grads[i].copy_(total)
                self._sums[i] = None
                self._squares[i] = None
        for i, event in enumerate(self._copied):
            if event is not None:
                event.synchronize()
            self._copied[i] = None
            if self.on_device[i]:
                unit = self.units[i]
                if not self._filled[i] or unit.grad_shard is None:
                    unit.grad_shard = torch.zeros(unit.shard_numel, dtype=unit.dtype,
                                                  device=unit.shard.device)
            elif not self._filled[i]:
                self.grads[i].zero_()
        return self.grads

    def squared_norm(self, device: torch.device) -> torch.Tensor:
        """The sum of the squared norms of this rank's gradient shards for the window, a 0-dim
        float32 tensor on ``device`` (call after :meth:`gradients`). Units whose last shard
        arrived before the window's last backward, or that received nothing, are measured from
        their CPU gradients."""
        parts = []
        for i, square in enumerate(self._squares):
            if self.on_device[i]:
                parts.append(_square_norm(self.units[i].grad_shard))
            else:
                parts.append(square if square is not None else _square_norm(self.grads[i]))
        if not parts:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([p.to(device) for p in parts]).sum()

    # -- the step -----------------------------------------------------------------------------

    def step_in_chunks(self, optimizer: torch.optim.Optimizer, factor: float | None,
                       publish: Callable[[FlatUnit, torch.Tensor], object]) -> list:
        """Step the masters chunk by chunk, each chunk's gradients first multiplied by
        ``factor`` (fp16 unscale and clipping; None leaves them), and after each chunk call
        ``publish(unit, master)`` for its units (which starts copying the master to the GPU and
        gathering it). Returns what the publish calls returned (collective handles to wait on)."""
        if self._published is not None:  # last step's copies to the GPU read the masters
            self._published.synchronize()
            self._published = None
        start = time.perf_counter()
        handles = self.step_on_device(optimizer, factor, publish)
        try:
            with folded_factor(optimizer, factor) as left:
                for chunk in self.chunks:
                    handles.extend(self._step_chunk(chunk, optimizer.step, left, publish))
        finally:
            for master in self.masters:
                master.grad = None
            self.totals["cpu_step_s"] += time.perf_counter() - start
        if self.cuda:
            self._published = torch.cuda.Event()
            self._published.record()
        return handles

    def _step_chunk(self, chunk: list[FlatUnit], step: Callable[[], object], factor: float | None,
                    publish: Callable[[FlatUnit, torch.Tensor], object]) -> list:
        """Scale ``chunk``'s gradients by ``factor``, ``step()`` its masters, publish each unit."""
        handles = []
        with self.open_masters(chunk):
            grads = [self.grads[u.index] for u in chunk]
            if factor is not None:
                torch._foreach_mul_(grads, factor)
            for unit, grad in zip(chunk, grads):
                self.masters[unit.index].grad = grad
            try:
                step()
            finally:
                for unit in chunk:
                    self.masters[unit.index].grad = None
            for unit in chunk:
                handles.append(publish(unit, self.masters[unit.index]))
        return handles

    def step_in_background(self, optimizer: torch.optim.Optimizer, factor: float | None,
                           publish: Callable[[FlatUnit, torch.Tensor], object],
                           order: list[int] | None = None) -> list:
        """:meth:`step_in_chunks` with the units the parameter home holds stepped on a worker
        thread (``offload_optimizer.overlap_step``, :mod:`.step_overlap`): the units kept on the
        device and those no home holds are stepped and published here, first; the rest by the
        worker, in chunks of ``chunk_numel`` elements in ``order`` (unit indices in the order the
        forward gathers them; units it does not list follow in index order), each marked updated
        in the home once published. Returns the handles of the units published here;
        :meth:`settle` joins the worker."""
        from dslab.engine.zero.step_overlap import BackgroundStep, snapshot_optimizer

        step, shadow = snapshot_optimizer(optimizer)  # refuses an optimizer it cannot copy, before any update
        self.settle()
        if self._published is not None:
            self._published.synchronize()
            self._published = None
        start = time.perf_counter()
        handles = self.step_on_device(optimizer, factor, publish)
        here = [[u for u in chunk if not self.home.holds(u)] for chunk in self.chunks]
        position = {index: i for i, index in enumerate(order or [])}
        held = sorted((u for chunk in self.chunks for u in chunk if self.home.holds(u)),
                      key=lambda u: (position.get(u.index, len(position)), u.index))
        later = plan_chunks(held, self.chunk_numel)
        try:
            with folded_factor(optimizer, factor) as left:
                for chunk in here:
                    if chunk:
                        handles.extend(self._step_chunk(chunk, optimizer.step, left, publish))
        finally:
            for master in self.masters:
                master.grad = None
            self.totals["cpu_step_s"] += time.perf_counter() - start
        if self.cuda:
            self._published = torch.cuda.Event()
            self._published.record()
        if not later:
            return handles
        home = self.home
        home.begin_updates([u for chunk in later for u in chunk])
        if foldable(factor) and steps_with_grad_scale(optimizer):  # asked of the original: a copy lacks its flag
            shadow.grad_scale, factor = torch.tensor(1.0 / factor, dtype=torch.float32), None  # the worker's alone

        def work() -> None:
            for chunk in later:
                for handle in self._step_chunk(chunk, step, factor, publish):
                    if handle is not None:  # a home-held unit publishes nothing to wait for
                        handle.wait()
                for unit in chunk:
                    home.finish_update(unit)

        self._background = BackgroundStep(work, home.fail_updates)
        setattr(optimizer, "_opt_called", True)  # what the step through the scheduler's wrapper sets
        return handles

    def stepping(self) -> bool:
        """Whether a background step is still running."""
        return self._background is not None and not self._background.done()

    def settle(self) -> None:
        """Join a background step (raising what it raised): masters, gradients and optimizer
        states are then this step's."""
        background, self._background = self._background, None
        if background is None:
            return
        try:
            background.wait()
        finally:
            self.totals["overlap_step_s"] += background.seconds
            self.totals["overlap_join_wait_s"] += background.waited_s
            if self.home is not None:
                self.home.end_updates()

    def step_on_device(self, optimizer: torch.optim.Optimizer, factor: float | None,
                       publish: Callable[[FlatUnit, torch.Tensor], object]) -> list:
        """Step the units kept on the device (``offload_optimizer.ratio`` < 1) in one
        ``optimizer.step()``, before the CPU chunks: its kernels run while the host steps."""
        if not self.device_units:
            return []
        grads = [u.grad_shard for u in self.device_units]
        if factor is not None:
            torch._foreach_mul_(grads, factor)
        masters = [self.masters[u.index] for u in self.device_units]
        for master, grad in zip(masters, grads):
            master.grad = grad
        try:
            optimizer.step()
        finally:
            for master in masters:
                master.grad = None
        return [publish(u, m) for u, m in zip(self.device_units, masters)]

    def open_masters(self, chunk: list[FlatUnit]):
        """A context in which ``chunk``'s masters hold their values (NVMe parameter offload
        reads them in and writes them back after; otherwise they always do)."""
        if self.home is None:
            return contextlib.nullcontext()
        return self.home.open_masters(chunk, self.masters)

    def zero_grad(self) -> None:
        """Start a new accumulation window: the next received shard overwrites ``grads``."""
        self._finish_adds()  # no addition of the last window may land in the new one
        self._filled = [False] * len(self.units)
        self._sums = [None] * len(self.units)
        self._squares = [None] * len(self.units)

    def buffers(self) -> list[torch.Tensor]:
        """The CPU gradient buffers: model-state memory."""
        return [g for g in self.grads if g is not None]

    # -- what the NVMe offload (:mod:`.nvme_offload`) does differently --------------------------

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state dict for a checkpoint (its states are all in memory here)."""
        return optimizer.state_dict()

    def states_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """Called after ``optimizer.load_state_dict``; nothing to do when the states stay in
        memory."""

    def close(self) -> None:
        """Finish a background step and the host additions in flight, stop their worker and undo
        the page locks."""
        try:
            self.settle()
            if self._worker is not None:
                try:
                    self._finish_adds()
                finally:
                    self._worker.shutdown(wait=True)
                    self._worker = None
        finally:
            self.host_buffers.close()


def _square_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()


def plan_chunks(units: list[FlatUnit], chunk_numel: int) -> list[list[FlatUnit]]:
    """``units`` in their order cut into runs of at least ``chunk_numel`` shard elements (the
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
