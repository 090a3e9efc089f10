"""An async tensor I/O handle with DeepNVMe's API: ``AsyncIOHandle`` (also ``aio_handle``).

Parameters are DeepNVMe's ``aio_handle(block_size, queue_depth, single_submit, overlap_events,
intra_op_parallelism)`` with its defaults; how each maps onto the kernel is in :mod:`.lanes`.
Methods: ``sync_pread``/``sync_pwrite`` (block), ``async_pread``/``async_pwrite`` (return at once;
``wait()`` blocks for everything submitted, returns how many requests completed and raises the
first error), ``pread``/``pwrite``/``read``/``write``, ``new_cpu_locked_tensor``/
``free_cpu_locked_tensor`` and the ``get_*`` probes. ``submit_read``/``submit_write`` are dslab's
own: they return the :class:`~dslab.io.lanes.Request` to wait on alone.

What a request does:

- **Direct I/O.** Files are opened with ``O_DIRECT`` (no page cache, the device's DMA straight
  into the buffer). The 4096-aligned part of the file range goes that way in ``block_size``
  chunks, through the lanes' aligned bounce slots when the tensor's memory is not 4096-aligned
  (:func:`~dslab.io.buffers.aligned_empty` and ``new_cpu_locked_tensor`` are); an unaligned head
  or tail (odd sizes and offsets) goes through a second, ordinary descriptor. Where the file
  system refuses ``O_DIRECT`` (tmpfs, some network file systems) every chunk takes the ordinary
  descriptor, and the handle logs it once per directory (:attr:`AsyncIOHandle.buffered_dirs`).
- **Whole-file writes.** A write at ``file_offset`` 0 (the DeepNVMe use: one tensor, one file)
  makes the file hold exactly the buffer: it is written to a hidden temporary name in the same
  directory and renamed over the target once every chunk succeeded; on failure the temporary is
  removed and the target is untouched. A write at another offset, or with ``in_place=True``,
  writes into the existing file.
- **Errors.** A missing file or directory, a read past the end of the file and a refused open
  raise at submission, naming the file. A chunk that fails or comes back short (a file truncated
  under the reader, a full disk) fails its request with :class:`~dslab.io.lanes.AsyncIOError`
  naming the file and offset, raised by ``wait()`` / the sync call.
- **CUDA tensors** go through two pinned, aligned staging buffers per request (at most
  :data:`CUDA_STAGING_BYTES` each) on a side stream: while one segment moves between file and
  staging buffer, the other moves between staging buffer and device. A write first waits for the
  work queued on the tensor's current stream; a read's data is on the device when ``wait()``
  returns. GPUDirect Storage is not used (dslab's note in the README says why).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from pathlib import Path

import torch

from dslab.io import kernel_aio
from dslab.io.buffers import DIRECT_IO_ALIGNMENT, aligned_empty, byte_view, pinning_available
from dslab.io.config import AioConfig
from dslab.io.lanes import AsyncIOError, Chunk, Lane, Request

log = logging.getLogger(__name__)

CUDA_STAGING_BYTES = 64 << 20
BACKENDS = ("auto", "aio", "threads")


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _round_down(value: int, unit: int) -> int:
    return value // unit * unit


def _reopen_error(err: OSError, action: str, path: str) -> OSError:
    """The same OSError class, its message naming ``path`` and what was being done."""
    return type(err)(err.errno, f"{err.strerror or err}: cannot {action} {path}")


class _OpenFile:
    """The descriptors of one request's file: ``direct`` (``O_DIRECT``, or None where refused)
    and ``buffered``; for a whole-file write the hidden temporary that :meth:`finish` renames."""

    def __init__(self, handle: "AsyncIOHandle", path: str, op: str, whole: bool, size: int):
        self.path = path
        self.temp = None
        target = Path(path)
        if op == "read":
            flags, opened = os.O_RDONLY, path
            action = "read"
        elif whole:
            if not target.parent.is_dir():
                raise FileNotFoundError(f"directory {target.parent} does not exist: cannot "
                                        f"write {path}")
            opened = str(target.parent / f".{target.name}.tmp-{secrets.token_hex(8)}")
            flags, action = os.O_WRONLY | os.O_CREAT | os.O_EXCL, "write"
            self.temp = opened
        else:
            flags, opened, action = os.O_WRONLY, path, "write into"
        try:
            self.buffered = os.open(opened, flags, 0o644)
        except OSError as err:
            raise _reopen_error(err, action, path) from None
        self.direct = None
        if handle.direct_io:
            try:
                self.direct = os.open(opened, (flags & ~(os.O_CREAT | os.O_EXCL)) | os.O_DIRECT)
            except OSError:
                handle._note_buffered(target.parent)
        if self.temp is not None and size > 0:
            try:  # as fio lays out its files: extents first, then the data
                os.posix_fallocate(self.buffered, 0, size)
            except OSError:
                pass

    def size(self) -> int:
        return os.fstat(self.buffered).st_size

    def finish(self, ok: bool) -> None:
        for fd in (self.direct, self.buffered):
            if fd is not None:
                os.close(fd)
        self.direct = self.buffered = None
        if self.temp is None:
            return
        if ok:
            os.replace(self.temp, self.path)
        else:
            try:
                os.unlink(self.temp)
            except FileNotFoundError:
                pass


class AsyncIOHandle:
    """DeepNVMe's ``aio_handle`` for CPU and CUDA tensors (module docstring).

    Args:
        block_size: bytes per chunk (a multiple of 4096).
        queue_depth: chunks each lane keeps in flight.
        single_submit: one ``io_submit`` per chunk instead of one per batch.
        overlap_events: top the queue up as each chunk completes (else batch by batch).
        intra_op_parallelism: lanes (threads) each request is spread over.
        backend: dslab's own: ``"aio"`` (kernel AIO), ``"threads"`` (``os.preadv``/``pwritev``
            on a thread pool) or ``"auto"`` (aio where the kernel allows it).
        direct_io: dslab's own: False never opens with ``O_DIRECT`` (page-cache I/O).
    """

    def __init__(self, block_size: int = 1_048_576, queue_depth: int = 128,
                 single_submit: bool = False, overlap_events: bool = False,
                 intra_op_parallelism: int = 1, *, backend: str = "auto", direct_io: bool = True):
        for name, value, low in (("block_size", block_size, DIRECT_IO_ALIGNMENT),
                                 ("queue_depth", queue_depth, 1),
                                 ("intra_op_parallelism", intra_op_parallelism, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if block_size % DIRECT_IO_ALIGNMENT:
            raise ValueError(f"block_size must be a multiple of {DIRECT_IO_ALIGNMENT}, got "
                             f"{block_size}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if backend in ("auto", "aio"):
            ok, why = kernel_aio.available()
            if not ok and backend == "aio":
                raise OSError(f"backend 'aio' is not available here: {why}")
            if not ok:
                log.warning("kernel AIO is not available (%s): dslab.io uses threads", why)
            backend = "aio" if ok else "threads"
        self.backend = backend
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.single_submit = bool(single_submit)
        self.overlap_events = bool(overlap_events)
        self.intra_op_parallelism = intra_op_parallelism
        self.direct_io = direct_io
        self.buffered_dirs: set[str] = set()
        self._lanes = [Lane(backend, block_size, queue_depth, self.single_submit,
                            self.overlap_events, f"dslab-io-lane{i}")
                       for i in range(intra_op_parallelism)]
        self._outstanding: list[Request] = []
        self._locked: dict[int, torch.Tensor] = {}
        self._staging: dict[torch.device, list[list[torch.Tensor]]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- DeepNVMe's probes --------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: AioConfig, **kwargs) -> "AsyncIOHandle":
        """A handle with the ``aio`` section's parameters (``kwargs``: dslab's own options,
        ``backend`` and ``direct_io``)."""
        return cls(**config.handle_kwargs(), **kwargs)

    def get_block_size(self) -> int:
        return self.block_size

    def get_queue_depth(self) -> int:
        return self.queue_depth

    def get_single_submit(self) -> bool:
        return self.single_submit

    def get_overlap_events(self) -> bool:
        return self.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self.intra_op_parallelism

    get_thread_count = get_intra_op_parallelism  # DeepSpeed's earlier name

    # -- locked tensors -----------------------------------------------------------------------

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor | torch.dtype
                              ) -> torch.Tensor:
        """A 1-D CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype, 4096-aligned
        and pinned where CUDA is (:mod:`.buffers`); release it with
        :meth:`free_cpu_locked_tensor`."""
        dtype = example_tensor if isinstance(example_tensor, torch.dtype) else example_tensor.dtype
        tensor = aligned_empty(int(num_elem), dtype)
        with self._lock:
            self._locked[tensor.data_ptr()] = tensor
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Drop the handle's reference to a tensor from :meth:`new_cpu_locked_tensor`; False when
        it is not one."""
        with self._lock:
            return self._locked.pop(tensor.data_ptr(), None) is not None

    # -- I/O ----------------------------------------------------------------------------------

    def submit_read(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> Request:
        """Start reading ``buffer.nbytes`` bytes of ``filename`` from ``file_offset`` into
        ``buffer``; the returned request's ``wait()`` blocks for it alone."""
        return self._submit("read", buffer, filename, file_offset, whole=False)

    def submit_write(self, buffer: torch.Tensor, filename, file_offset: int = 0, *,
                     in_place: bool | None = None) -> Request:
        """Start writing ``buffer``'s bytes to ``filename`` at ``file_offset``: the whole file
        (temporary, then renamed) at offset 0 unless ``in_place``; otherwise into the existing
        file."""
        in_place = file_offset != 0 if in_place is None else in_place
        if not in_place and file_offset != 0:
            raise ValueError(f"file_offset {file_offset}: a whole-file write starts at offset 0; "
                             "pass in_place=True to write into the existing file")
        return self._submit("write", buffer, filename, file_offset, whole=not in_place)

    def async_pread(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        """Non-blocking read (``wait()`` for it); returns 0 once submitted."""
        self._track(self.submit_read(buffer, filename, file_offset))
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename, file_offset: int = 0, *,
                     in_place: bool | None = None) -> int:
        """Non-blocking write (``wait()`` for it); returns 0 once submitted."""
        self._track(self.submit_write(buffer, filename, file_offset, in_place=in_place))
        return 0

    def sync_pread(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        """Blocking read; returns the bytes read."""
        return self.submit_read(buffer, filename, file_offset).wait()

    def sync_pwrite(self, buffer: torch.Tensor, filename, file_offset: int = 0, *,
                    in_place: bool | None = None) -> int:
        """Blocking write; returns the bytes written."""
        return self.submit_write(buffer, filename, file_offset, in_place=in_place).wait()

    def pread(self, buffer: torch.Tensor, filename, validate: bool = False,
              async_op: bool = False, file_offset: int = 0) -> int:
        """DeepNVMe's ``pread(buffer, filename, validate, async)``: with ``validate`` the bytes
        read are compared with a plain read of the file (at ``wait()`` when async)."""
        request = self.submit_read(buffer, filename, file_offset)
        return self._finish_or_track(request, buffer, validate, async_op)

    def pwrite(self, buffer: torch.Tensor, filename, validate: bool = False,
               async_op: bool = False, file_offset: int = 0) -> int:
        """DeepNVMe's ``pwrite(buffer, filename, validate, async)``; ``validate`` reads the file
        back and compares."""
        request = self.submit_write(buffer, filename, file_offset)
        return self._finish_or_track(request, buffer, validate, async_op)

    def read(self, buffer: torch.Tensor, filename, validate: bool = False) -> int:
        return self.pread(buffer, filename, validate, False)

    def write(self, buffer: torch.Tensor, filename, validate: bool = False) -> int:
        return self.pwrite(buffer, filename, validate, False)

    def wait(self) -> int:
        """Block until every request submitted with ``async_*`` completed; return how many did.
        Raises the first failure (after all of them finished)."""
        with self._lock:
            requests, self._outstanding = self._outstanding, []
        first = None
        for request in requests:
            try:
                request.wait()
                validate = getattr(request, "validate_against", None)
                if validate is not None:
                    _validate(request, validate)
            except BaseException as err:
                first = first or err
        if first is not None:
            raise first
        return len(requests)

    def close(self) -> None:
        """Wait for what is in flight and stop the lanes."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            for lane in self._lanes:
                lane.close()
            self._locked.clear()
            self._staging.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _note_buffered(self, directory: Path) -> None:
        key = str(directory)
        if key not in self.buffered_dirs:
            self.buffered_dirs.add(key)
            log.warning("the file system of %s refuses O_DIRECT: dslab.io reads and writes there "
                        "through the page cache", key)

    def _track(self, request: Request) -> None:
        with self._lock:
            self._outstanding.append(request)

    def _finish_or_track(self, request: Request, buffer, validate: bool, async_op: bool) -> int:
        if validate:
            request.validate_against = buffer
        if async_op:
            self._track(request)
            return 0
        nbytes = request.wait()
        if validate:
            _validate(request, buffer)
        return nbytes

    def _submit(self, op: str, buffer: torch.Tensor, filename, file_offset: int,
                whole: bool) -> Request:
        if self._closed:
            raise ValueError("this AsyncIOHandle is closed")
        if not isinstance(file_offset, int) or isinstance(file_offset, bool) or file_offset < 0:
            raise ValueError(f"file_offset must be an int >= 0, got {file_offset!r}")
        data = byte_view(buffer)
        path = os.fspath(filename)
        nbytes = data.numel()
        opened = _OpenFile(self, path, op, whole, file_offset + nbytes)
        try:
            if op == "read" and file_offset + nbytes > (size := opened.size()):
                raise AsyncIOError(f"{path} holds {size} bytes: cannot read {nbytes} bytes at "
                                   f"offset {file_offset}")
        except BaseException:
            opened.finish(False)
            raise
        request = Request(op, path, file_offset, nbytes)
        request.keepalive = buffer
        request.on_done(lambda r: opened.finish(r.error is None))
        if data.is_cuda:
            self._start_cuda(request, data, opened)
        else:
            self._start_cpu(request, data.data_ptr(), nbytes, opened, file_offset)
        return request

    def _start_cpu(self, request: Request, address: int, nbytes: int, opened: _OpenFile,
                   file_offset: int) -> None:
        plans = self._plan(request, address, nbytes, opened, file_offset)
        request.expect(sum(len(p) for p in plans))
        for lane, chunks in zip(self._lanes, plans):
            lane.run(chunks)

    def _plan(self, request: Request, address: int, nbytes: int, opened: _OpenFile,
              file_offset: int) -> list[list[Chunk]]:
        """Each lane's chunks: the aligned middle of the range over ``O_DIRECT`` in contiguous
        parts, one per lane; an unaligned head (first lane) and tail (last lane) buffered."""
        lanes: list[list[Chunk]] = [[] for _ in self._lanes]
        end = file_offset + nbytes

        def add(chunks, fd, lo, hi, bounce):
            while lo < hi:
                n = min(self.block_size, hi - lo)
                chunks.append(Chunk(request, fd, lo, address + lo - file_offset, n, bounce))
                lo += n

        def spread(fd, lo, hi, bounce):
            per = _round_up(_round_up(hi - lo, len(lanes)), DIRECT_IO_ALIGNMENT)
            for i, chunks in enumerate(lanes):
                add(chunks, fd, lo + i * per, min(hi, lo + (i + 1) * per), bounce)

        first, last = _round_up(file_offset, DIRECT_IO_ALIGNMENT), _round_down(end, DIRECT_IO_ALIGNMENT)
        if opened.direct is None or last <= first:
            spread(opened.buffered, file_offset, end, False)
            return lanes
        add(lanes[0], opened.buffered, file_offset, first, False)
        bounce = (address + first - file_offset) % DIRECT_IO_ALIGNMENT != 0
        spread(opened.direct, first, last, bounce)
        add(lanes[-1], opened.buffered, last, end, False)
        return lanes

    # -- CUDA ---------------------------------------------------------------------------------

    def _start_cuda(self, request: Request, data: torch.Tensor, opened: _OpenFile) -> None:
        device = data.device
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        request.expect(1)

        def drive():
            try:
                self._cuda_pipeline(request, data, opened, ready)
            except BaseException as err:
                request.fail(err)
            finally:
                request.chunk_done()

        threading.Thread(target=drive, name="dslab-io-cuda", daemon=True).start()

    def _take_staging(self, device: torch.device, nbytes: int) -> list[torch.Tensor]:
        size = min(CUDA_STAGING_BYTES, _round_up(max(nbytes, 1), DIRECT_IO_ALIGNMENT))
        with self._lock:
            free = self._staging.setdefault(device, [])
            for i, pair in enumerate(free):
                if pair[0].numel() >= size:
                    return free.pop(i)
        pin = pinning_available()
        return [aligned_empty(size, torch.uint8, pin=pin) for _ in range(2)]

    def _give_staging(self, device: torch.device, pair: list[torch.Tensor]) -> None:
        with self._lock:
            self._staging.setdefault(device, []).append(pair)

    def _copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            return self._streams[device]

    def _cuda_pipeline(self, request: Request, data: torch.Tensor, opened: _OpenFile,
                       ready: torch.cuda.Event) -> None:
        """Move ``data`` (uint8 on a CUDA device) through two pinned staging buffers: segment
        ``i`` uses buffer ``i % 2``, so one segment's device copy overlaps the other's file I/O."""
        device, total = data.device, data.numel()
        staging = self._take_staging(device, total)
        segment = staging[0].numel()
        stream = self._copy_stream(device)
        bounds = [(lo, min(total, lo + segment)) for lo in range(0, total, segment)]
        in_flight: dict[int, Request] = {}
        copies: list[torch.cuda.Event | None] = [None, None]
        try:
            with torch.cuda.device(device):
                stream.wait_event(ready)
                for i, (lo, hi) in enumerate(bounds):
                    slot = staging[i % 2][:hi - lo]
                    if request.op == "write":
                        if i - 2 in in_flight:
                            in_flight.pop(i - 2).wait()
                        with torch.cuda.stream(stream):
                            slot.copy_(data[lo:hi], non_blocking=True)
                        stream.synchronize()
                        in_flight[i] = self._sub_request(request, slot, opened,
                                                         request.file_offset + lo)
                        continue
                    if i == 0:
                        in_flight[0] = self._sub_request(request, slot, opened, request.file_offset)
                    if i + 1 < len(bounds):  # prefetch the next segment into the other buffer
                        nlo, nhi = bounds[i + 1]
                        if copies[(i + 1) % 2] is not None:
                            copies[(i + 1) % 2].synchronize()
                        in_flight[i + 1] = self._sub_request(
                            request, staging[(i + 1) % 2][:nhi - nlo], opened,
                            request.file_offset + nlo)
                    in_flight.pop(i).wait()
                    with torch.cuda.stream(stream):
                        data[lo:hi].copy_(slot, non_blocking=True)
                        copies[i % 2] = torch.cuda.Event()
                        copies[i % 2].record(stream)
                stream.synchronize()
                while in_flight:  # the last writes: their errors are the request's
                    in_flight.pop(min(in_flight)).wait()
        finally:
            for sub in in_flight.values():
                try:
                    sub.wait()
                except BaseException:
                    pass
            self._give_staging(device, staging)

    def _sub_request(self, parent: Request, data: torch.Tensor, opened: _OpenFile,
                     file_offset: int) -> Request:
        request = Request(parent.op, parent.path, file_offset, data.numel())
        self._start_cpu(request, data.data_ptr(), data.numel(), opened, file_offset)
        return request


def _validate(request: Request, buffer: torch.Tensor) -> None:
    """Compare ``buffer``'s bytes with a plain read of the request's file range."""
    expected = byte_view(buffer).cpu().numpy().tobytes()
    with open(request.path, "rb") as f:
        f.seek(request.file_offset)
        actual = f.read(len(expected))
    if actual != expected:
        mismatch = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b),
                        min(len(actual), len(expected)))
        raise AsyncIOError(f"validation of {request.path} failed: the file and the buffer differ "
                           f"at offset {request.file_offset + mismatch}")


aio_handle = AsyncIOHandle
