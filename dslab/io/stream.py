"""``torch.save`` straight through an :class:`~dslab.io.handle.AsyncIOHandle`: the serialised
bytes are copied into a few aligned (pinned where CUDA is) buffers and each full buffer is
written with ``O_DIRECT`` while the next fills, hashed on the way (sha256), so a checkpoint file
is never read back to be checksummed. The digest of each full buffer is taken on a helper thread
(hashlib lets go of the GIL) while serialisation fills the next one.

The file is written under a hidden temporary name in its directory, fsynced and renamed into
place by :meth:`HandleFileWriter.close`; :meth:`HandleFileWriter.abort` (or a failed write)
removes the temporary and leaves any existing file alone.

Memory: ``buffers x buffer_bytes`` (default 3 x 16 MiB). Traffic: one copy of every byte into a
buffer (serialisation writes to the stream) and the device write; the digest is taken from the
same bytes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import secrets
import time
from pathlib import Path

import torch

from dslab.io import events
from dslab.io.handle import AsyncIOHandle
from dslab.io.lanes import Request


class HandleFileWriter:
    """A write-only file object over ``handle`` for ``path`` (module docstring); use it with
    ``torch.save(obj, writer)`` and then :meth:`close`."""

    def __init__(self, handle: AsyncIOHandle, path, buffer_bytes: int = 16 << 20,
                 buffers: int = 3, kind: str = events.CHECKPOINT_WRITE):
        if buffers < 2:
            raise ValueError(f"buffers must be >= 2 (one fills while one is written), got {buffers}")
        if buffer_bytes % handle.block_size and buffer_bytes > handle.block_size:
            buffer_bytes -= buffer_bytes % handle.block_size
        self.handle = handle
        self.path = Path(path)
        self.kind = kind
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"directory {self.path.parent} does not exist: cannot write "
                                    f"{self.path}")
        self.temp = self.path.parent / f".{self.path.name}.tmp-{secrets.token_hex(8)}"
        self.temp.touch(exist_ok=False)
        self._buffers = [handle.new_cpu_locked_tensor(buffer_bytes, torch.uint8)
                         for _ in range(buffers)]
        self._views = [b.numpy().data for b in self._buffers]
        self._pending: list[tuple[Request, concurrent.futures.Future] | None] = [None] * buffers
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, "dslab-io-sha256")
        self._current = 0
        self._fill = 0
        self._written = 0
        self._digest = hashlib.sha256()
        self._started = time.perf_counter()
        self._closed = False

    # -- the file object torch.save needs -------------------------------------------------------

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        pos = 0
        capacity = len(self._views[0])
        while pos < size:
            take = min(capacity - self._fill, size - pos)
            self._views[self._current][self._fill:self._fill + take] = view[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == capacity:
                self._submit()
        return size

    def flush(self) -> None:
        """Nothing to do: full buffers are already on their way; the rest goes at :meth:`close`."""

    def _submit(self) -> None:
        if self._fill == 0:
            return
        buffer = self._buffers[self._current][:self._fill]
        hashed = self._hasher.submit(self._digest.update, self._views[self._current][:self._fill])
        self._pending[self._current] = (
            self.handle.submit_write(buffer, self.temp, self._written, in_place=True), hashed)
        self._written += self._fill
        self._fill = 0
        self._current = (self._current + 1) % len(self._buffers)
        waiting = self._pending[self._current]
        if waiting is not None:  # the next buffer to fill is still being written and hashed
            self._pending[self._current] = None
            waiting[0].wait()
            waiting[1].result()

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> tuple[int, str]:
        """Write what is left, wait, fsync, rename into place; returns ``(bytes, sha256 hex)``.
        On failure the temporary is removed and the error raised."""
        if self._closed:
            raise ValueError(f"{self.path}: the writer is already closed")
        self._closed = True
        try:
            self._submit()
            for pending in self._pending:
                if pending is not None:
                    pending[0].wait()
                    pending[1].result()
            fd = os.open(self.temp, os.O_RDONLY)
            try:
                os.fsync(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size != self._written:
                raise OSError(f"{self.path}: wrote {self._written} bytes but the file holds {size}")
            os.replace(self.temp, self.path)
        except BaseException:
            self._drop()
            raise
        finally:
            self._release()
        seconds = time.perf_counter() - self._started
        events.emit(events.IoEvent(self.kind, str(self.path), self._written, seconds))
        return self._written, self._digest.hexdigest()

    def abort(self) -> None:
        """Give up: wait for what is in flight and remove the temporary."""
        if self._closed:
            return
        self._closed = True
        self._drop()
        self._release()

    def _drop(self) -> None:
        for pending in self._pending:
            if pending is not None:
                try:
                    pending[0].wait()
                    pending[1].result()
                except BaseException:
                    pass
        self.temp.unlink(missing_ok=True)

    def _release(self) -> None:
        self._hasher.shutdown(wait=True)
        for buffer in self._buffers:
            self.handle.free_cpu_locked_tensor(buffer)
        self._buffers, self._views = [], []


def save_through_handle(obj, path, handle: AsyncIOHandle) -> tuple[int, str]:
    """``torch.save(obj, path)`` through ``handle`` (module docstring); returns the file's
    ``(bytes, sha256 hex)``."""
    writer = HandleFileWriter(handle, path)
    try:
        torch.save(obj, writer)
    except BaseException:
        writer.abort()
        raise
    return writer.close()
