"""The machinery under :class:`~dslab.io.handle.AsyncIOHandle`: requests cut into chunks, and the
lanes (one thread each) that keep up to ``queue_depth`` chunks of a request in flight.

A :class:`Request` is one ``pread``/``pwrite`` of a contiguous byte range of memory to or from a
byte range of one file. The handle cuts it into :class:`Chunk` s of at most ``block_size``
bytes and deals them to its ``intra_op_parallelism`` lanes, each lane a contiguous part of the
range. A lane drives its chunks through one of two backends:

- ``aio``: its own kernel AIO context (:mod:`.kernel_aio`). With ``overlap_events`` it tops up to
  ``queue_depth`` requests in flight as each completes; without, it submits a batch of
  ``queue_depth``, waits for all of it, then submits the next. ``single_submit`` makes one
  ``io_submit`` system call per chunk instead of one per batch. This is DeepNVMe's scheme.
- ``threads``: ``queue_depth`` threads per lane, each chunk one ``os.preadv``/``os.pwritev``
  (both release the GIL); ``overlap_events`` as above; ``single_submit`` has no counterpart (a
  thread pool takes chunks one at a time either way). The fallback where the kernel refuses AIO.

A chunk whose memory is not aligned for ``O_DIRECT`` goes through one of the lane's aligned
*bounce slots* (a copy before a write, after a read). A chunk that comes back short or with an
error fails its request with :class:`AsyncIOError` naming the file and offset; the request's
other chunks still complete (or are skipped when not yet started), and its completion callbacks
then run on the thread that finished the last chunk.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from dslab.io import kernel_aio
from dslab.io.buffers import DIRECT_IO_ALIGNMENT

BOUNCE_BYTES_PER_LANE = 64 << 20  # the most memory a lane's bounce slots take

log = logging.getLogger(__name__)


class AsyncIOError(OSError):
    """A read or write that failed or came back short; the message names the file and offset."""


@dataclass(eq=False)
class Chunk:
    """``nbytes`` at ``address`` to or from ``offset`` of the file open as ``fd``; ``bounce``:
    through an aligned slot (the memory is not aligned for the ``O_DIRECT`` descriptor)."""

    request: "Request"
    fd: int
    offset: int
    address: int
    nbytes: int
    bounce: bool = False


class Request:
    """One read or write: its chunks' completion, its first error, and callbacks run once every
    chunk is done (``callback(request)``; an exception there becomes the request's error). The
    submitter calls :meth:`expect` with the chunk count before the chunks run."""

    def __init__(self, op: str, path: str, file_offset: int, nbytes: int):
        self.op = op
        self.path = path
        self.file_offset = file_offset
        self.nbytes = nbytes
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()
        self.finished: float | None = None
        self._remaining = 0
        self._completed = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable[["Request"], None]] = []

    @property
    def seconds(self) -> float | None:
        """From submission to the last chunk's completion (None while in flight)."""
        return None if self.finished is None else self.finished - self.submitted

    def on_done(self, callback: Callable[["Request"], None]) -> None:
        """Run ``callback(self)`` when every chunk is done (now, if they are)."""
        with self._lock:
            if not self._completed:
                self._callbacks.append(callback)
                return
        callback(self)

    def expect(self, chunk_count: int) -> None:
        """Set how many chunks complete this request (before any of them runs); a request of
        none completes now."""
        self._remaining = chunk_count
        if chunk_count == 0:
            self._complete()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    def chunk_done(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.fail(error)
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        self.finished = time.perf_counter()
        while True:
            with self._lock:
                callbacks, self._callbacks = self._callbacks, []
                if not callbacks:
                    self._completed = True
                    break
            for callback in callbacks:
                try:
                    callback(self)
                except BaseException as err:  # a failed rename, say: the request failed
                    self.fail(err)
        self._done.set()

    def abandon(self) -> None:
        """Complete a failed request whose remaining chunks will never report (a lane broke)."""
        with self._lock:
            self._remaining = 0
        self._complete()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> int:
        """Block until done; raise its error, else return its byte count."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.nbytes


def _short(chunk: Chunk, got: int) -> AsyncIOError:
    what = "read" if chunk.request.op == "read" else "write"
    return AsyncIOError(f"short {what} of {chunk.request.path} at offset {chunk.offset}: "
                        f"{got} of {chunk.nbytes} bytes" + (" (the file ends there)"
                                                            if what == "read" else ""))


def _failed(chunk: Chunk, code: int) -> AsyncIOError:
    what = "reading" if chunk.request.op == "read" else "writing"
    return AsyncIOError(code, f"{os.strerror(code)} {what} {chunk.nbytes} bytes of "
                              f"{chunk.request.path} at offset {chunk.offset}")


def _view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class Lane:
    """One lane: a thread that runs chunk lists (:meth:`run`) with at most ``queue_depth``
    chunks in flight on ``backend`` ("aio" or "threads")."""

    def __init__(self, backend: str, block_size: int, queue_depth: int, single_submit: bool,
                 overlap_events: bool, name: str):
        self.backend = backend
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.single_submit = single_submit
        self.overlap_events = overlap_events
        self._context = kernel_aio.AioContext(queue_depth) if backend == "aio" else None
        self._pool = (concurrent.futures.ThreadPoolExecutor(queue_depth, f"{name}-io")
                      if backend == "threads" else None)
        self._slots: list[ctypes.Array] = []
        self._free_slots: list[int] = []
        self._max_slots = max(1, min(queue_depth, BOUNCE_BYTES_PER_LANE // block_size))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, chunks: list[Chunk]) -> None:
        """Queue ``chunks`` (run after those queued before)."""
        if chunks:
            self._queue.put(chunks)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._context is not None:
            self._context.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        while (chunks := self._queue.get()) is not None:
            try:
                self._drive(collections.deque(chunks))
            except BaseException as err:  # a bug here must fail the requests, not hang them
                log.exception("dslab.io lane failed")
                for request in {id(c.request): c.request for c in chunks}.values():
                    if not request.done():
                        request.fail(err)
                        request.abandon()
                self._reset()

    def _reset(self) -> None:
        """Start clean after a failure: a new AIO context (destroying the old one waits for
        what it still had in flight) and every bounce slot free."""
        if self._context is not None:
            self._context.close()
            self._context = kernel_aio.AioContext(self.queue_depth)
        self._free_slots = list(range(len(self._slots)))

    def _slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        if len(self._slots) < self._max_slots:
            # over-allocate by one alignment unit, then start at the first aligned address
            raw = ctypes.create_string_buffer(self.block_size + DIRECT_IO_ALIGNMENT)
            self._slots.append(raw)
            return len(self._slots) - 1
        return None

    def _slot_address(self, slot: int) -> int:
        address = ctypes.addressof(self._slots[slot])
        return address + (-address) % DIRECT_IO_ALIGNMENT

    def _drive(self, pending: collections.deque) -> None:
        in_flight: dict[int, tuple[Chunk, int | None, object]] = {}
        tag = 0
        while pending or in_flight:
            if self.overlap_events or not in_flight:
                batch = []
                while pending and len(in_flight) + len(batch) < self.queue_depth:
                    chunk = pending[0]
                    if chunk.request.error is not None:  # its request failed: skip the rest
                        pending.popleft()
                        chunk.request.chunk_done()
                        continue
                    slot = None
                    if chunk.bounce:
                        slot = self._slot()
                        if slot is None:
                            break
                        if chunk.request.op == "write":
                            ctypes.memmove(self._slot_address(slot), chunk.address, chunk.nbytes)
                    pending.popleft()
                    tag += 1
                    batch.append((tag, chunk, slot))
                if batch:
                    self._submit(batch, in_flight)
            if in_flight:
                self._reap(in_flight)

    def _io_address(self, chunk: Chunk, slot: int | None) -> int:
        return chunk.address if slot is None else self._slot_address(slot)

    def _submit(self, batch: list, in_flight: dict) -> None:
        if self._context is None:
            for tag, chunk, slot in batch:
                future = self._pool.submit(_blocking_io, chunk, self._io_address(chunk, slot))
                in_flight[tag] = (chunk, slot, future)
            return
        iocbs = []
        for tag, chunk, slot in batch:
            iocb = kernel_aio.Iocb()
            iocb.aio_data = tag
            iocb.aio_lio_opcode = (kernel_aio.IOCB_CMD_PREAD if chunk.request.op == "read"
                                   else kernel_aio.IOCB_CMD_PWRITE)
            iocb.aio_fildes = chunk.fd
            iocb.aio_buf = self._io_address(chunk, slot)
            iocb.aio_nbytes = chunk.nbytes
            iocb.aio_offset = chunk.offset
            in_flight[tag] = (chunk, slot, iocb)
            iocbs.append(iocb)
        try:
            if self.single_submit:
                for iocb in iocbs:
                    self._context.submit([iocb])
            else:
                self._context.submit(iocbs)
        except OSError as err:
            for iocb in iocbs:  # a refused submission fails its chunks at once
                chunk, slot, _ = in_flight.pop(iocb.aio_data)
                self._finish(chunk, slot, -(err.errno or 5))

    def _reap(self, in_flight: dict) -> None:
        wanted = 1 if self.overlap_events else len(in_flight)
        if self._context is None:
            futures = {entry[2]: tag for tag, entry in in_flight.items()}
            mode = (concurrent.futures.FIRST_COMPLETED if self.overlap_events
                    else concurrent.futures.ALL_COMPLETED)
            done, _ = concurrent.futures.wait(futures, return_when=mode)
            results = [(futures[f], f.result()) for f in done]
        else:
            results = []
            while len(results) < wanted:
                results += self._context.get_events(wanted - len(results), len(in_flight))
        for tag, result in results:
            chunk, slot, _ = in_flight.pop(tag)
            self._finish(chunk, slot, result)

    def _finish(self, chunk: Chunk, slot: int | None, result: int) -> None:
        error = None
        if result < 0:
            error = _failed(chunk, -result)
        elif result != chunk.nbytes:
            error = _short(chunk, result)
        elif slot is not None and chunk.request.op == "read":
            ctypes.memmove(chunk.address, self._slot_address(slot), chunk.nbytes)
        if slot is not None:
            self._free_slots.append(slot)
        chunk.request.chunk_done(error)


def _blocking_io(chunk: Chunk, address: int) -> int:
    """One chunk with ``os.preadv``/``os.pwritev`` (the threads backend): the byte count, or
    -errno. A regular file returns fewer bytes only at its end (read) or when it cannot grow."""
    view = _view(address, chunk.nbytes)
    done = 0
    try:
        while done < chunk.nbytes:
            if chunk.request.op == "read":
                got = os.preadv(chunk.fd, [view[done:]], chunk.offset + done)
            else:
                got = os.pwritev(chunk.fd, [view[done:]], chunk.offset + done)
            if got == 0:
                break
            done += got
    except OSError as err:
        return -(err.errno or 5)
    return done
