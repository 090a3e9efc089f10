"""Linux native asynchronous I/O (``io_setup``, ``io_submit``, ``io_getevents``, ``io_destroy``)
called through ctypes, the kernel interface that libaio wraps and DeepNVMe's ``aio_handle`` uses.

Nothing is compiled and no library is needed: the four system calls are made through libc's
``syscall()``; the structures are the kernel's ``struct iocb`` and ``struct io_event``
(``include/uapi/linux/aio_abi.h``, little-endian layout). ctypes releases the GIL around each
call, so a thread blocked in ``io_getevents`` lets the others run.

With ``O_DIRECT`` the kernel queues every submitted request to the device and returns at once
(what makes ``queue_depth`` real); on a file opened without it (page-cache I/O) a request is
carried out inside ``io_submit`` and completes before it returns: correct, but synchronous.

:func:`available` says whether this kernel and architecture allow it (a seccomp filter or an
``fs.aio-max-nr`` exhausted by other processes refuse ``io_setup``); callers fall back to threads
otherwise.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

IOCB_CMD_PREAD = 0
IOCB_CMD_PWRITE = 1

# (io_setup, io_destroy, io_submit, io_getevents) by machine: x86_64's own table, and the
# generic table of arm64.
_SYSCALL_NUMBERS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4),
                    "arm64": (0, 1, 2, 4)}


class Iocb(ctypes.Structure):
    """``struct iocb`` (64 bytes), little-endian: ``aio_key`` before ``aio_rw_flags``."""

    _fields_ = [("aio_data", ctypes.c_uint64), ("aio_key", ctypes.c_uint32),
                ("aio_rw_flags", ctypes.c_int32), ("aio_lio_opcode", ctypes.c_uint16),
                ("aio_reqprio", ctypes.c_int16), ("aio_fildes", ctypes.c_uint32),
                ("aio_buf", ctypes.c_uint64), ("aio_nbytes", ctypes.c_uint64),
                ("aio_offset", ctypes.c_int64), ("aio_reserved2", ctypes.c_uint64),
                ("aio_flags", ctypes.c_uint32), ("aio_resfd", ctypes.c_uint32)]


class IoEvent(ctypes.Structure):
    """``struct io_event``: the request's ``aio_data`` and its result (bytes, or -errno)."""

    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


assert ctypes.sizeof(Iocb) == 64 and ctypes.sizeof(IoEvent) == 32

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _numbers() -> tuple[int, int, int, int] | None:
    if os.name != "posix" or platform.system() != "Linux":
        return None
    return _SYSCALL_NUMBERS.get(platform.machine())


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


class AioContext:
    """One kernel AIO context with room for ``depth`` requests in flight."""

    def __init__(self, depth: int):
        numbers = _numbers()
        if numbers is None:
            raise OSError(errno.ENOSYS, f"Linux AIO is not available on {platform.system()} "
                                        f"{platform.machine()}")
        self._setup, self._destroy, self._submit, self._getevents = numbers
        self.depth = depth
        self._ctx = ctypes.c_ulong(0)
        _check(_syscall(ctypes.c_long(self._setup), ctypes.c_long(depth),
                        ctypes.byref(self._ctx)), f"io_setup({depth})")
        self._events = (IoEvent * depth)()

    def submit(self, iocbs: list[Iocb]) -> None:
        """Queue ``iocbs`` (kept alive by the caller until their events come back); retries
        the rest when the kernel takes only some of them."""
        done = 0
        while done < len(iocbs):
            batch = iocbs[done:]
            pointers = (ctypes.POINTER(Iocb) * len(batch))(*(ctypes.pointer(i) for i in batch))
            result = _syscall(ctypes.c_long(self._submit), self._ctx,
                              ctypes.c_long(len(batch)), pointers)
            if result < 0 and ctypes.get_errno() in (errno.EINTR, errno.EAGAIN):
                continue
            done += _check(result, "io_submit")

    def get_events(self, min_nr: int, max_nr: int) -> list[tuple[int, int]]:
        """Block until at least ``min_nr`` requests completed; ``[(aio_data, result)]`` of up
        to ``max_nr`` of them."""
        max_nr = min(max_nr, self.depth)
        while True:
            result = _syscall(ctypes.c_long(self._getevents), self._ctx, ctypes.c_long(min_nr),
                              ctypes.c_long(max_nr), self._events, None)
            if result < 0 and ctypes.get_errno() == errno.EINTR:
                continue
            count = _check(result, "io_getevents")
            return [(self._events[i].data, self._events[i].res) for i in range(count)]

    def close(self) -> None:
        if self._ctx.value:
            _syscall(ctypes.c_long(self._destroy), self._ctx)
            self._ctx = ctypes.c_ulong(0)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def available() -> tuple[bool, str]:
    """``(True, "")`` when an AIO context can be set up here, else ``(False, why)``."""
    try:
        AioContext(1).close()
    except OSError as err:
        return False, str(err)
    return True, ""
