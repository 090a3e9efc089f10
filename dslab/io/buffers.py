"""Host buffers for direct I/O: aligned to ``O_DIRECT``'s 4096 bytes, pinned where CUDA is.

Pinned (page-locked) memory is what lets a device copy run asynchronously and what DeepNVMe's
``new_cpu_locked_tensor`` returns. torch pins through the CUDA driver, so without CUDA (the CPU
build, a machine without a GPU) a locked tensor is ordinary pageable memory, aligned the same way.
"""

from __future__ import annotations

import torch

DIRECT_IO_ALIGNMENT = 4096  # bytes: O_DIRECT offsets, lengths and buffers are multiples of it


def pinning_available() -> bool:
    """True when torch can pin host memory here (a CUDA device is present)."""
    return torch.cuda.is_available()


def is_aligned(tensor: torch.Tensor, alignment: int = DIRECT_IO_ALIGNMENT) -> bool:
    return tensor.data_ptr() % alignment == 0


def aligned_empty(num_elements: int, dtype: torch.dtype, pin: bool | None = None) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``num_elements`` of ``dtype`` whose first byte is
    4096-aligned and whose storage is padded to a multiple of 4096 bytes, pinned when ``pin``
    (default: where :func:`pinning_available`)."""
    if num_elements < 0:
        raise ValueError(f"num_elements must be >= 0, got {num_elements}")
    pin = pinning_available() if pin is None else pin
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = num_elements * itemsize
    padded = -(-max(nbytes, 1) // DIRECT_IO_ALIGNMENT) * DIRECT_IO_ALIGNMENT
    raw = torch.empty(padded + DIRECT_IO_ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % DIRECT_IO_ALIGNMENT
    if start % itemsize:
        raise AssertionError("an allocation not aligned to its element size")
    return raw[start:start + padded].view(dtype)[:num_elements]


def byte_view(tensor: torch.Tensor, name: str = "buffer") -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor sharing its memory. Raises ValueError naming
    ``name`` for a non-contiguous tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a strided view has gaps the file would "
                         "not have); pass tensor.contiguous()")
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
