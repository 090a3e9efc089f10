"""Page-locked host tensors of the size asked for, for ZeRO's offloaded shards and gradients.

``torch.empty(n, pin_memory=True)`` takes its memory from torch's pinned-host cache, which rounds
every block up to a power of two: a 13B GPT-2 layer's fp32 shards (QKV 315 MB, the MLP's 420 MB)
take 512 MiB blocks, about 490 MB a layer more than they hold. With half of 13B's units
offloaded on one H200 that was about 18 GiB of host memory for the parameter shards and their
gradient buffers together, on a 128 GiB host whose optimizer states already fill most of it.

:class:`HostBuffers` allocates ordinary (pageable) memory of the exact size instead, page-aligned,
and registers it with CUDA (``cudaHostRegister``), which makes it page-locked like pinned memory:
copies from and to it run asynchronously, at pinned memory's bandwidth (54.5 GB/s host to
device on an H200 host, as torch's pinned memory). torch's ``is_pinned()`` reports False for
it (torch 2.11 asks its own pinned allocator), so nothing here calls ``pin_memory()`` on these
tensors, which would copy them. Buffers under :data:`REGISTER_MIN_BYTES` come from torch's
pinned allocator as before; a failed registration is an error that names the owner. The registrations are undone by :meth:`HostBuffers.close` (or when the owner is
collected); the tensors stay valid after, as ordinary host memory.
"""

from __future__ import annotations

import weakref

import torch

#: Smaller buffers come from torch's pinned allocator (its rounding costs little there).
REGISTER_MIN_BYTES = 1 << 20
PAGE = 4096


def _cudart():
    return torch.cuda.cudart()


def _error_text(error) -> str:
    try:
        return f"cudaError {int(error)}: {_cudart().cudaGetErrorString(error)}"
    except (AttributeError, RuntimeError, TypeError):
        return f"cudaError {int(error)}"


def _unregister(registered: list[tuple[int, torch.Tensor]]) -> None:
    """Undo each registration, then let its memory go (never freed while registered)."""
    while registered:
        pointer, _raw = registered.pop()
        _cudart().cudaHostUnregister(pointer)


class HostBuffers:
    """Host tensors for one owner (a parameter home, an optimizer offload), each page-locked or
    not as asked (page-locking needs CUDA)."""

    def __init__(self, what: str):
        self.what = what  # the owner, for errors
        # each registered range's start, with its allocation (kept until the range is unregistered)
        self._registered: list[tuple[int, torch.Tensor]] = []
        self.registered_bytes = 0
        self._finalizer = weakref.finalize(self, _unregister, self._registered)

    def empty(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not pin:
            return torch.empty(numel, dtype=dtype)
        if nbytes < REGISTER_MIN_BYTES:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        span = -(-nbytes // PAGE) * PAGE  # whole pages, all inside this allocation
        raw = torch.empty(span + PAGE, dtype=torch.uint8)
        offset = -raw.data_ptr() % PAGE
        pages = raw[offset:offset + span]
        error = _cudart().cudaHostRegister(pages.data_ptr(), span, 0)
        if int(error) != 0:
            raise RuntimeError(f"page-locking {span} bytes of host memory failed ({_error_text(error)}); "
                               f"{self.what} needs pinned memory: free host memory, or set its pin_memory "
                               f"to false")
        self._registered.append((pages.data_ptr(), raw))
        self.registered_bytes += span
        return pages[:nbytes].view(dtype)

    def zeros(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return self.empty(numel, dtype, pin).zero_()

    def close(self) -> None:
        """Undo the registrations (the tensors stay, as ordinary host memory)."""
        self._finalizer()
