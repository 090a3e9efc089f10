"""ZeRO-Infinity's optimizer offload to NVMe (Rajbhandari et al., 2021, arXiv:2104.07857): the
CPU offload of :mod:`.offload`, with the optimizer states kept in files and brought into pinned
memory only around each sub-group's CPU step.

What lives where (per rank): the fp32 masters and the gradient buffers stay in CPU memory as
with ``device: cpu``; the optimizer's elementwise states (Adam's ``exp_avg`` and
``exp_avg_sq``, SGD's momentum: every state tensor with a master's element count) live in one
file per sub-group (a chunk of :func:`~.offload.plan_chunks`) under
``<nvme_path>/dslab_zero_rank<r>_<random>/``. Between steps the optimizer holds empty
placeholders in their place; scalars such as Adam's ``step`` stay in memory.

One optimizer step over chunks ``0 .. C-1`` with ``buffer_count = B`` pinned, 4096-aligned
buffers (chunk ``k`` always uses buffer ``k % B``):

1. before chunk ``k`` steps, chunk ``k + 1``'s read is submitted into its buffer (after that
   buffer's previous write finished): ``pipeline_read``;
2. chunk ``k`` waits for its own read, the optimizer's states are pointed at views of its buffer,
   and the optimizer steps it exactly as the CPU offload does (same chunks, same calls: the
   parameters match ``device: cpu`` bit for bit);
3. its buffer is written back to its file while the next chunk steps (``pipeline_write``), the
   states become placeholders again.

The first step creates the states (the optimizer's own zeros) and writes them out; a step
that an fp16 overflow skips touches nothing. Swap traffic per step and rank: every state byte
read once and written once (Adam: 8 bytes per shard element each way). Every swap is an
:class:`~dslab.io.events.IoEvent` (``swap_in`` with the time the step waited for it, and
``swap_out``), which the engine's ``io`` profiler puts in the run report.

Memory: ``B`` buffers of the largest chunk's states (Adam: ``8 * sub_group_size`` bytes each)
instead of all states; the masters and gradients (8 bytes per shard element) as with CPU
offload. Checkpoints read the states back in full for ``optimizer.state_dict()``
(:meth:`NvmeOptimizerOffload.optimizer_state_dict`), and a loaded state is written out again
(:meth:`NvmeOptimizerOffload.states_loaded`).
"""

from __future__ import annotations

import secrets
import shutil
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from dslab.engine.zero.offload import CpuOptimizerOffload, folded_factor
from dslab.engine.zero.partition import FlatUnit
from dslab.io import events
from dslab.io.buffers import DIRECT_IO_ALIGNMENT, aligned_empty
from dslab.io.config import AioConfig
from dslab.io.handle import AsyncIOHandle
from dslab.io.lanes import Request

_STATE_ALIGNMENT = 64  # bytes between state tensors inside a chunk's buffer


@dataclass(frozen=True)
class StateSlot:
    """One state tensor inside a chunk's buffer and file: unit ``unit``'s state ``key``."""

    unit: int
    key: str
    dtype: torch.dtype
    numel: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ChunkLayout:
    slots: tuple[StateSlot, ...]
    nbytes: int  # padded to a multiple of 4096: every transfer is O_DIRECT


def _remove(handle, directory: Path) -> None:
    try:
        handle.close()
    except Exception:
        pass
    shutil.rmtree(directory, ignore_errors=True)


class NvmeOptimizerOffload(CpuOptimizerOffload):
    """The NVMe side of ZeRO-Infinity's optimizer offload (module docstring)."""

    def __init__(self, units: list[FlatUnit], pin_memory: bool, chunk_numel: int,
                 nvme_path: str, aio: AioConfig, buffer_count: int, rank: int,
                 pipeline_read: bool = True, pipeline_write: bool = True, home=None,
                 on_device: set[int] = frozenset(), accumulate_on: str = "gpu", staging_buffers: int = 4,
                 staging_dtype: str | None = None):
        super().__init__(units, pin_memory, chunk_numel, home=home, on_device=on_device,
                         accumulate_on=accumulate_on, staging_buffers=staging_buffers, staging_dtype=staging_dtype)
        root = Path(nvme_path)
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.directory = root / f"dslab_zero_rank{rank}_{secrets.token_hex(4)}"
            self.directory.mkdir()
        except OSError as err:
            raise ValueError(f"config key 'zero_optimization.offload_optimizer.nvme_path' = "
                             f"{nvme_path!r}: cannot create the swap directory there ({err})") from None
        self.handle = AsyncIOHandle.from_config(aio)
        self.buffer_count = buffer_count
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self.steps = 0
        self._layouts: list[ChunkLayout | None] = [None] * len(self.chunks)
        self._on_disk: set[int] = set()
        self._buffers: list[torch.Tensor | None] = [None] * buffer_count
        self._writes: list[Request | None] = [None] * buffer_count
        self._cleanup = weakref.finalize(self, _remove, self.handle, self.directory)

    # -- files and buffers --------------------------------------------------------------------

    def chunk_file(self, k: int) -> Path:
        return self.directory / f"chunk{k:05d}.states"

    def _buffer(self, k: int, nbytes: int) -> torch.Tensor:
        """Chunk ``k``'s buffer with room for ``nbytes``, once its previous write finished."""
        index = k % self.buffer_count
        self._finish_write(index)
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < nbytes:
            if buffer is not None:
                self.handle.free_cpu_locked_tensor(buffer)
            buffer = self.handle.new_cpu_locked_tensor(nbytes, torch.uint8)
            self._buffers[index] = buffer
        return buffer

    def _finish_write(self, index: int) -> None:
        write, self._writes[index] = self._writes[index], None
        if write is not None:
            write.wait()

    def _drain(self) -> None:
        for index in range(self.buffer_count):
            self._finish_write(index)

    def flush(self) -> None:
        """Wait for the write-behind of the last step (its ``swap_out`` events are then
        recorded); raises a failed write."""
        self._drain()

    def _layout(self, k: int, optimizer: torch.optim.Optimizer) -> ChunkLayout:
        """Chunk ``k``'s states as the optimizer holds them now."""
        slots, offset = [], 0
        for unit in self.chunks[k]:
            state = optimizer.state.get(self.masters[unit.index], {})
            for key in sorted(state):
                value = state[key]
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() == unit.shard_numel:
                    slot = StateSlot(unit.index, key, value.dtype, value.numel(), offset)
                    slots.append(slot)
                    offset += -(-slot.nbytes // _STATE_ALIGNMENT) * _STATE_ALIGNMENT
        padded = -(-max(offset, 1) // DIRECT_IO_ALIGNMENT) * DIRECT_IO_ALIGNMENT
        return ChunkLayout(tuple(slots), padded)

    @staticmethod
    def _view(buffer: torch.Tensor, slot: StateSlot) -> torch.Tensor:
        return buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype)

    # -- swapping -----------------------------------------------------------------------------

    def _swap_in(self, k: int) -> tuple[Request, torch.Tensor] | None:
        """Submit chunk ``k``'s read into its buffer (None before its states exist)."""
        layout = self._layouts[k]
        if layout is None:
            return None
        buffer = self._buffer(k, layout.nbytes)
        return self.handle.submit_read(buffer[:layout.nbytes], self.chunk_file(k)), buffer

    def _attach(self, k: int, pending, optimizer: torch.optim.Optimizer) -> None:
        """Wait for chunk ``k``'s read and point the optimizer's states at its buffer."""
        if pending is None:
            return
        request, buffer = pending
        waited = time.perf_counter()
        request.wait()
        waited = time.perf_counter() - waited
        events.emit(events.IoEvent(events.SWAP_IN, request.path, request.nbytes,
                                   request.seconds, wait_s=waited, step=self.steps))
        for slot in self._layouts[k].slots:
            optimizer.state[self.masters[slot.unit]][slot.key] = self._view(buffer, slot)

    def _swap_out(self, k: int, optimizer: torch.optim.Optimizer) -> None:
        """Copy chunk ``k``'s states into its buffer (unless they are its views already), put
        placeholders in their place and submit the write of the buffer to the chunk's file."""
        layout = self._layouts[k]
        if layout is None:
            layout = self._layouts[k] = self._layout(k, optimizer)
            self._on_disk.discard(k)
        buffer = self._buffer(k, layout.nbytes)
        for slot in layout.slots:
            state = optimizer.state[self.masters[slot.unit]]
            view = self._view(buffer, slot)
            value = state[slot.key]
            if value.data_ptr() != view.data_ptr():
                view.copy_(value)
            state[slot.key] = torch.empty(0, dtype=slot.dtype)
        write = self.handle.submit_write(buffer[:layout.nbytes], self.chunk_file(k),
                                         in_place=k in self._on_disk)
        self._on_disk.add(k)
        step = self.steps

        def done(request: Request) -> None:
            if request.error is None:
                events.emit(events.IoEvent(events.SWAP_OUT, request.path, request.nbytes,
                                           request.seconds, step=step))

        write.on_done(done)
        self._writes[k % self.buffer_count] = write
        if not self.pipeline_write:
            self._finish_write(k % self.buffer_count)

    # -- the step -----------------------------------------------------------------------------

    def step_in_chunks(self, optimizer: torch.optim.Optimizer, factor: float | None,
                       publish: Callable[[FlatUnit, torch.Tensor], object]) -> list:
        """:meth:`CpuOptimizerOffload.step_in_chunks` with each chunk's states swapped in before
        and out after its step, the next chunk's read overlapping this one's step (module
        docstring)."""
        if self._published is not None:
            self._published.synchronize()
            self._published = None
        start = time.perf_counter()
        handles = self.step_on_device(optimizer, factor, publish)
        reads = {0: self._swap_in(0)} if self.chunks else {}
        try:
            with folded_factor(optimizer, factor) as left:
                for k, chunk in enumerate(self.chunks):
                    if self.pipeline_read and k + 1 < len(self.chunks):
                        reads[k + 1] = self._swap_in(k + 1)
                    self._attach(k, reads.pop(k), optimizer)
                    handles.extend(self._step_chunk(chunk, optimizer.step, left, publish))
                    self._swap_out(k, optimizer)
                    if not self.pipeline_read and k + 1 < len(self.chunks):
                        reads[k + 1] = self._swap_in(k + 1)
        finally:
            for master in self.masters:
                master.grad = None
            for pending in reads.values():  # a failed step: let its reads land before moving on
                if pending is not None:
                    try:
                        pending[0].wait()
                    except OSError:
                        pass
            self.totals["cpu_step_s"] += time.perf_counter() - start
        self.steps += 1
        if self.cuda:
            self._published = torch.cuda.Event()
            self._published.record()
        return handles

    # -- checkpoints --------------------------------------------------------------------------

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer.state_dict()`` with the swapped states read back (copies in CPU memory;
        the optimizer keeps its placeholders)."""
        self._drain()
        state_dict = optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                                for p in g["params"])}
        states = {i: dict(s) for i, s in state_dict["state"].items()}
        for k, layout in enumerate(self._layouts):
            if layout is None:
                continue
            buffer = aligned_empty(layout.nbytes, torch.uint8, pin=False)
            self.handle.sync_pread(buffer, self.chunk_file(k))
            for slot in layout.slots:
                states[index[id(self.masters[slot.unit])]][slot.key] = self._view(buffer, slot).clone()
        return dict(state_dict, state=states)

    def states_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict``: write every chunk's loaded states to its file
        and leave placeholders."""
        for k in range(len(self.chunks)):
            self._layouts[k] = None
            if any(optimizer.state.get(self.masters[u.index]) for u in self.chunks[k]):
                self._swap_out(k, optimizer)
        self._drain()

    def close(self) -> None:
        """Wait for the writes in flight, close the handle and remove the swap directory."""
        try:
            self._drain()
        finally:
            try:
                super().close()
            finally:
                self._cleanup()
