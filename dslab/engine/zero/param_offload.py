"""ZeRO-Infinity's parameter offload (``offload_param``, Rajbhandari et al., 2021,
arXiv:2104.07857): stage 3's released parameter shards live off the GPU between uses.

Stage 3 already keeps each released unit (:mod:`.partition`) as this rank's ``S``-element shard
and gathers the full unit before its module's forward and backward (:mod:`.stage3`). With
parameter offload the shard's home is not the GPU:

- ``device: cpu`` (:class:`CpuParamHome`): ``unit.shard`` is a CPU tensor, pinned with
  ``pin_memory`` on CUDA (page-locked at its own size, :mod:`.pinned`). It is also the optimizer's master for the unit (the CPU optimizer
  offload steps it in place, :mod:`.offload`), so host memory holds each shard once.
- ``device: nvme`` (:class:`NvmeParamHome`): the units that fit, in order, in ``max_in_cpu``
  shard elements (DeepSpeed's key and default, 1e9) stay in (pinned) CPU memory as with ``cpu``; every
  other shard lives in a file of its own under ``<nvme_path>/dslab_params_rank<r>_<random>/``, and
  so does its master: the optimizer offload reads a sub-group's shards into pinned memory around
  its CPU step and writes them back after (:meth:`NvmeParamHome.open_masters`), and such a unit's
  ``unit.shard`` is an empty placeholder. Without the cache every fetch of every micro-step reads
  its shard from disk again (GPT-2 1.3B on one H200: 37.6 GB read per step, the host waiting 22.5
  s of the 32.8 s step).

A gather fetches the home copy into the GPU first (:meth:`fetch`): on a side stream for pinned
CPU shards (so the copy of the next units overlaps the current module's compute), after an
asynchronous file read through :mod:`dslab.io` for NVMe, into a pinned buffer from a pool of
``buffer_count``. With one rank the fetched shard *is* the unit; with more it is all-gathered
over the unit's group after the copy. Resident units (under
``stage3_param_persistence_threshold``) stay on the GPU, as without offload.

With ``offload_param.fetch_dtype`` (``cpu`` only) the home also keeps each shard in that dtype
(bf16 or fp16), refreshed whenever the master changes (:meth:`ParamHome.refresh`, called as the
optimizer publishes a unit, and by :meth:`ParamHome.write`), and a fetch copies that: half an fp32
shard's bytes over PCIe, widened to the unit's dtype on the device's side stream.

What the fetches cost is counted per step (:meth:`stats`): bytes copied to the device, bytes
read from disk, the time the host waited for file reads, and the time the device stream stood
waiting for a copy to land (measured with CUDA events around each wait: the part of the copy
that did not overlap compute), and with ``offload_optimizer.overlap_step`` the time fetches
waited for a background optimizer step to update their unit (``update_wait_s``).
"""

from __future__ import annotations

import abc
import contextlib
import secrets
import shutil
import threading
import time
import weakref
from pathlib import Path

import torch

from dslab.engine.zero.partition import FlatUnit
from dslab.engine.zero.pinned import HostBuffers
from dslab.io import events
from dslab.io.buffers import DIRECT_IO_ALIGNMENT
from dslab.io.handle import AsyncIOHandle


def _nbytes(unit: FlatUnit) -> int:
    return unit.shard_numel * torch.empty((), dtype=unit.dtype).element_size()


class _Fetch:
    """A fetch in flight into ``dest``: :meth:`wait` makes the current stream see ``dest``."""

    def __init__(self, home: "ParamHome", dest: torch.Tensor, event=None, finish=None):
        self.home = home
        self.dest = dest
        self.event = event
        self.finish = finish  # NVMe: completes the read and issues the copy
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self.finish is not None:
            self.event = self.finish()
            self.finish = None
        if self.event is not None:
            self.home._wait_on(self.event)
        self.done = True


class ParamHome(abc.ABC):
    """Where the released units' shards live off the GPU (subclasses: cpu, nvme)."""

    kind = "none"

    def __init__(self, units: list[FlatUnit], device: torch.device):
        self.units = [u for u in units if not u.resident]
        self._held = {u.index for u in self.units}
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._stalls: list[tuple] = []
        self.totals = {"fetches": 0, "h2d_bytes": 0, "disk_read_bytes": 0,
                       "disk_write_bytes": 0, "disk_wait_s": 0.0, "copy_stall_ms": 0.0,
                       "update_wait_s": 0.0}
        # the shards kept in host memory, page-locked at their size (pinned.py)
        self.host_buffers = HostBuffers("offload_param")
        # offload_optimizer.overlap_step (step_overlap.py): units a background step has yet to
        # update, each with the event its update sets
        self._updating: dict[int, threading.Event] = {}
        self._update_error: BaseException | None = None

    def holds(self, unit: FlatUnit) -> bool:
        return unit.index in self._held

    # -- updates by a background optimizer step (step_overlap.py) ------------------------------

    def begin_updates(self, units: list[FlatUnit]) -> None:
        """``units`` are about to be stepped off this thread: until :meth:`finish_update` marks
        each, a fetch of it waits. The copies to the device in flight (which read the home
        copies) complete first."""
        if self.stream is not None:
            self.stream.synchronize()
        self._update_error = None
        self._updating = {u.index: threading.Event() for u in units}

    def finish_update(self, unit: FlatUnit) -> None:
        """``unit``'s master and what derives from it are up to date."""
        event = self._updating.get(unit.index)
        if event is not None:
            event.set()

    def fail_updates(self, err: BaseException) -> None:
        """The background step failed: release every waiting fetch (each then raises)."""
        self._update_error = err
        for event in list(self._updating.values()):
            event.set()

    def updated(self, unit: FlatUnit) -> bool:
        """Whether ``unit`` has no background update pending."""
        event = self._updating.get(unit.index)
        return event is None or event.is_set()

    def wait_updated(self, unit: FlatUnit) -> None:
        """Wait until ``unit``'s background update is done (timed as ``update_wait_s``)."""
        event = self._updating.get(unit.index)
        if event is None:
            return
        if not event.is_set():
            start = time.perf_counter()
            event.wait()
            self.totals["update_wait_s"] += time.perf_counter() - start
        if self._update_error is not None:  # the step is incomplete: no unit of it may be used
            raise RuntimeError(f"the background optimizer step (offload_optimizer.overlap_step) failed; "
                               f"unit {unit.index} was to be fetched from its incomplete step") from self._update_error

    def end_updates(self) -> None:
        """The background step is over (joined): nothing is pending."""
        self._updating = {}
        self._update_error = None

    # -- fetching -----------------------------------------------------------------------------

    @abc.abstractmethod
    def fetch(self, unit: FlatUnit, dest: torch.Tensor, async_op: bool) -> _Fetch | None:
        """Start copying ``unit``'s shard into ``dest`` (``shard_numel`` elements on the
        device); returns the fetch to :meth:`_Fetch.wait` on, or None when it is complete."""

    def _copy(self, source: torch.Tensor, dest: torch.Tensor):
        """Copy ``source`` (host) into ``dest``; on CUDA on the side stream, returning its
        completion event."""
        self.totals["fetches"] += 1
        self.totals["h2d_bytes"] += source.numel() * source.element_size()
        if not self.cuda:
            dest.copy_(source)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dest.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def _copy_widened(self, source: torch.Tensor, dest: torch.Tensor):
        """Copy ``source`` (host, a narrower dtype) into ``dest``: its bytes over the bus, then
        widened on the device (on the side stream on CUDA)."""
        if not self.cuda:
            self.totals["fetches"] += 1
            self.totals["h2d_bytes"] += source.numel() * source.element_size()
            dest.copy_(source)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            staged = torch.empty(source.shape, dtype=source.dtype, device=dest.device)
        event = self._copy(source, staged)
        with torch.cuda.stream(self.stream):
            dest.copy_(staged)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def _wait_on(self, event) -> None:
        """The current stream waits for ``event``; the wait is timed between two events."""
        stream = torch.cuda.current_stream(self.device)
        before = torch.cuda.Event(enable_timing=True)
        after = torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(event)
        after.record(stream)
        self._stalls.append((before, after))

    def stats(self) -> dict:
        """Totals since the start (module docstring); resolves the timed waits recorded so far."""
        if self._stalls:
            self._stalls[-1][1].synchronize()
            self.totals["copy_stall_ms"] += sum(b.elapsed_time(a) for b, a in self._stalls)
            self._stalls = []
        return dict(self.totals, device=self.kind)

    # -- the masters (the CPU optimizer offload steps the shards where they live) --------------

    def master(self, unit: FlatUnit) -> torch.Tensor:
        """The tensor the optimizer's master for ``unit`` is built on (shares the home copy)."""
        return unit.shard

    @contextlib.contextmanager
    def open_masters(self, units: list[FlatUnit], masters: list[torch.Tensor]):
        """The masters of ``units`` hold their values inside the block (written home after)."""
        yield

    def refresh(self, unit: FlatUnit) -> None:
        """``unit``'s master has changed (the optimizer stepped it): what the home derives from it
        follows (nothing here)."""

    def read(self, unit: FlatUnit) -> torch.Tensor:
        """A CPU copy of ``unit``'s shard."""
        return unit.shard.detach().clone()

    def write(self, unit: FlatUnit, values: torch.Tensor) -> None:
        """Set ``unit``'s shard to ``values``."""
        with torch.no_grad():
            unit.shard.copy_(values)

    def close(self) -> None:
        """Release what the home holds outside the process (files, page locks)."""
        self.host_buffers.close()


class CpuParamHome(ParamHome):
    """``offload_param.device: cpu``: each released unit's shard in (pinned) CPU memory; with
    ``fetch_dtype`` also a copy of it in that dtype, which is what a fetch copies (widened to the
    unit's dtype on the device)."""

    kind = "cpu"

    def __init__(self, units: list[FlatUnit], device: torch.device, pin_memory: bool,
                 fetch_dtype: torch.dtype | None = None):
        super().__init__(units, device)
        pin = pin_memory and self.cuda
        self.copies: dict[int, torch.Tensor] = {}  # unit index -> its shard in fetch_dtype
        self._issued = False  # a copy to the device was issued since the side stream last drained
        for unit in self.units:
            host = self.host_buffers.empty(unit.shard_numel, unit.dtype, pin)
            host.copy_(unit.shard)
            unit.shard = host
            if fetch_dtype is not None and fetch_dtype != unit.dtype:
                self.copies[unit.index] = self.host_buffers.empty(unit.shard_numel, fetch_dtype, pin)
                self.refresh(unit)

    def refresh(self, unit: FlatUnit) -> None:
        """Bring ``unit``'s fetch copy up to its master (after the master changed); waits first for
        the copies to the device in flight, which may read it."""
        copy = self.copies.get(unit.index)
        if copy is None:
            return
        if unit.index not in self._updating:
            if self._issued and self.stream is not None:
                self.stream.synchronize()
            self._issued = False
        # else a background step's update (step_overlap.py): no copy of it is in flight (begin_updates
        # drained them, and its next fetch waits for this update), and the worker must not wait on
        # the copies the forward issues meanwhile
        with torch.no_grad():
            copy.copy_(unit.shard)

    def write(self, unit: FlatUnit, values: torch.Tensor) -> None:
        super().write(unit, values)
        self.refresh(unit)

    def fetch(self, unit, dest, async_op):
        self.wait_updated(unit)
        copy = self.copies.get(unit.index)
        if copy is not None:
            event = self._copy_widened(copy, dest)
        else:
            event = self._copy(unit.shard, dest)
        self._issued = True
        if event is None:
            return None
        fetch = _Fetch(self, dest, event)
        if not async_op:
            fetch.wait()
            return None
        return fetch


class NvmeParamHome(ParamHome):
    """``offload_param.device: nvme``: each released unit's shard (and master) in a file."""

    kind = "nvme"

    def __init__(self, units: list[FlatUnit], device: torch.device, nvme_path: str,
                 handle: AsyncIOHandle, buffer_count: int, rank: int, max_in_cpu: int = 0,
                 pin_memory: bool = False):
        super().__init__(units, device)
        root = Path(nvme_path)
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.directory = root / f"dslab_params_rank{rank}_{secrets.token_hex(4)}"
            self.directory.mkdir()
        except OSError as err:
            raise ValueError(f"config key 'zero_optimization.offload_param.nvme_path' = "
                             f"{nvme_path!r}: cannot create the parameter directory there "
                             f"({err})") from None
        self.handle = handle
        self._cleanup = weakref.finalize(self, _remove, handle, self.directory)
        # every buffer holds the largest released shard (DeepSpeed sizes them by buffer_size
        # and refuses a larger parameter; dslab sizes them to fit)
        # the units kept in CPU memory (those that fit in max_in_cpu elements, in order), and those in files
        self._on_disk: set[int] = set()
        cached = 0
        for unit in self.units:
            if cached + unit.shard_numel <= max_in_cpu:
                host = self.host_buffers.empty(unit.shard_numel, unit.dtype, pin_memory and self.cuda)
                host.copy_(unit.shard)
                unit.shard = host
                cached += unit.shard_numel
            else:
                self._on_disk.add(unit.index)
        self.totals["cached_numel"] = cached
        disk_units = [u for u in self.units if u.index in self._on_disk]
        self.buffer_bytes = max((_padded_bytes(u) for u in disk_units), default=DIRECT_IO_ALIGNMENT)
        self.buffer_count = buffer_count
        self._free: list[torch.Tensor] = []
        self._busy: list[tuple[torch.Tensor, object]] = []  # (buffer, event of its last copy)
        self._in_flight: list[_Fetch] = []
        for unit in disk_units:
            self._write_file(unit, unit.shard.detach().to("cpu"))
            unit.shard = torch.empty(0, dtype=unit.dtype)

    def on_disk(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s shard lives in a file (else in CPU memory, the ``max_in_cpu`` cache)."""
        return unit.index in self._on_disk

    def file(self, unit: FlatUnit) -> Path:
        return self.directory / f"unit{unit.index:05d}.param"

    # -- pinned buffers -----------------------------------------------------------------------

    def _buffer(self) -> torch.Tensor:
        """A free pinned buffer; with none free, the oldest fetch in flight completes first."""
        while True:
            for i, (buffer, event) in enumerate(self._busy):
                if event is None or event.query():
                    del self._busy[i]
                    self._free.append(buffer)
                    break
            if self._free:
                return self._free.pop()
            if len(self._busy) + len(self._in_flight) < self.buffer_count:
                return self.handle.new_cpu_locked_tensor(self.buffer_bytes, torch.uint8)
            if self._in_flight:
                self._in_flight[0].wait()
            elif self._busy:
                buffer, event = self._busy.pop(0)
                event.synchronize()
                self._free.append(buffer)

    def _release(self, buffer: torch.Tensor, event) -> None:
        self._busy.append((buffer, event))

    # -- files --------------------------------------------------------------------------------

    def _write_file(self, unit: FlatUnit, values: torch.Tensor) -> None:
        buffer = self._buffer()
        nbytes = _padded_bytes(unit)
        staged = buffer[:nbytes]
        staged.zero_()
        staged[:_nbytes(unit)].view(unit.dtype).copy_(values.reshape(-1))
        request = self.handle.submit_write(staged, self.file(unit))
        start = time.perf_counter()
        request.wait()
        self.totals["disk_write_bytes"] += nbytes
        events.emit(events.IoEvent("param_out", request.path, request.nbytes, request.seconds,
                                   wait_s=time.perf_counter() - start))
        self._free.append(buffer)

    def _submit_read(self, unit: FlatUnit):
        buffer = self._buffer()
        nbytes = _padded_bytes(unit)
        return buffer, self.handle.submit_read(buffer[:nbytes], self.file(unit))

    def _finish_read(self, request) -> None:
        start = time.perf_counter()
        request.wait()
        waited = time.perf_counter() - start
        self.totals["disk_read_bytes"] += request.nbytes
        self.totals["disk_wait_s"] += waited
        events.emit(events.IoEvent("param_in", request.path, request.nbytes, request.seconds,
                                   wait_s=waited))

    # -- fetching -----------------------------------------------------------------------------

    def fetch(self, unit, dest, async_op):
        if not self.on_disk(unit):  # cached in CPU memory: a copy, as the cpu home's
            event = self._copy(unit.shard, dest)
            fetch = _Fetch(self, dest, event)
            if event is None or not async_op:
                fetch.wait()
                return None
            return fetch
        buffer, request = self._submit_read(unit)

        def finish():
            self._finish_read(request)
            event = self._copy(buffer[:_nbytes(unit)].view(unit.dtype), dest)
            self._release(buffer, event)
            if fetch in self._in_flight:
                self._in_flight.remove(fetch)
            return event

        fetch = _Fetch(self, dest, finish=finish)
        self._in_flight.append(fetch)
        if not async_op:
            fetch.wait()
            return None
        return fetch

    # -- masters ------------------------------------------------------------------------------

    def master(self, unit: FlatUnit) -> torch.Tensor:
        return torch.empty(0, dtype=unit.dtype) if self.on_disk(unit) else unit.shard

    @contextlib.contextmanager
    def open_masters(self, units, masters):
        """Read the shards of ``units`` that live in files into pinned buffers of their own and
        point ``masters`` at them; after the block, write them back and leave placeholders (the
        cached units' masters are their shards in CPU memory all along)."""
        held = [u for u in units if self.holds(u) and self.on_disk(u)]
        opened = []
        try:
            for unit in held:
                buffer = self.handle.new_cpu_locked_tensor(_padded_bytes(unit), torch.uint8)
                opened.append((unit, buffer, self.handle.submit_read(buffer, self.file(unit))))
            for unit, buffer, request in opened:
                self._finish_read(request)
                masters[unit.index].data = buffer[:_nbytes(unit)].view(unit.dtype)
            yield
            writes = [(u, b, self.handle.submit_write(b, self.file(u))) for u, b, _ in opened]
            for unit, buffer, request in writes:
                start = time.perf_counter()
                request.wait()
                self.totals["disk_write_bytes"] += request.nbytes
                events.emit(events.IoEvent("param_out", request.path, request.nbytes,
                                           request.seconds, wait_s=time.perf_counter() - start))
        finally:
            for unit, buffer, _ in opened:
                masters[unit.index].data = torch.empty(0, dtype=unit.dtype)
                self.handle.free_cpu_locked_tensor(buffer)

    def read(self, unit):
        if not self.holds(unit) or not self.on_disk(unit):
            return super().read(unit)
        buffer, request = self._submit_read(unit)
        self._finish_read(request)
        values = buffer[:_nbytes(unit)].view(unit.dtype).clone()
        self._free.append(buffer)
        return values

    def write(self, unit, values):
        if not self.holds(unit) or not self.on_disk(unit):
            return super().write(unit, values)
        self._write_file(unit, values.detach().to("cpu"))

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._cleanup()


def _round_up(nbytes: int) -> int:
    return -(-nbytes // DIRECT_IO_ALIGNMENT) * DIRECT_IO_ALIGNMENT


def _padded_bytes(unit: FlatUnit) -> int:
    return _round_up(max(_nbytes(unit), 1))


def _remove(handle, directory: Path) -> None:
    with contextlib.suppress(Exception):
        handle.wait()
    shutil.rmtree(directory, ignore_errors=True)


def build_param_home(config, units: list[FlatUnit], device, aio, rank: int) -> ParamHome | None:
    """The home of ``offload_param`` (the config's section), or None when it is off."""
    if config.device == "cpu":
        fetch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[config.fetch_dtype]
        return CpuParamHome(units, device, config.pin_memory, fetch_dtype)
    if config.device == "nvme":
        return NvmeParamHome(units, device, config.nvme_path, AsyncIOHandle.from_config(aio),
                             config.buffer_count, rank, max_in_cpu=config.max_in_cpu,
                             pin_memory=config.pin_memory)
    return None
