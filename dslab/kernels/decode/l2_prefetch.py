"""Asking L2 for bytes a later kernel will read, from a kernel that leaves memory bandwidth idle.

A batch-1 decode step streams its weights kernel after kernel, and between the QKV and the
attention-output projections sits decode attention: a few microseconds of latency-bound work that
reads a few hundred KB of cache while the memory system, able to move 4 TB/s, idles. The next
large read is the gate/up projection (67 MB a Llama-3.2-1B layer). :func:`prefetch_l2` lets a
kernel issue Hopper's bulk L2 prefetch (``cp.async.bulk.prefetch.L2.global``, PTX ISA 8.0,
sm_90) for a range of such bytes: the copy runs in the memory system, asynchronously, while the
kernel goes on (nothing is loaded into registers or shared memory; the instruction returns at
once), and the later kernel finds the first part of its weights in L2.

The range is split into :data:`CHUNK` byte chunks, one a thread, spread over the launch's
programs; a chunk's size is a multiple of 16 bytes and its address 16-byte aligned (a tensor's
storage is, and chunks are multiples of 16). A prefetch is a hint: it changes no result, only
where later reads are served from. No kernel of a decode step writes weights, so a kernel may
issue it before it waits on the kernel before it (programmatic dependent launch).

Compiled code only: the Triton interpreter has no inline assembly, so interpreted kernels take
``HAS_PREFETCH = False`` (:func:`prefetch_args`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Bytes of one prefetch (one thread's).
CHUNK = tl.constexpr(4096)


@triton.jit
def prefetch_l2(PTR, nbytes, pid, programs, THREADS: tl.constexpr, CHUNK_BYTES: tl.constexpr):
    """Program ``pid`` of ``programs`` asks L2 for its chunks of the ``nbytes`` bytes at ``PTR``:
    chunk ``c`` (``CHUNK_BYTES`` bytes, the last one shorter) by thread ``c % THREADS`` of program
    ``(c // THREADS) % programs``. ``THREADS``: the launch's threads a program (32 x num_warps)."""
    lanes = tl.arange(0, THREADS)
    chunks = tl.cdiv(nbytes, CHUNK_BYTES)
    base = PTR.to(tl.pointer_type(tl.int8))
    for first in range(pid * THREADS, chunks, programs * THREADS):
        offset = (first + lanes).to(tl.int64) * CHUNK_BYTES
        size = tl.minimum(tl.maximum(nbytes - offset, 0), CHUNK_BYTES).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base + offset, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_args(prefetch: torch.Tensor | None, interpret: bool, fallback: torch.Tensor):
    """``(pointer, nbytes, HAS_PREFETCH)`` of a kernel launch that prefetches ``prefetch``'s bytes
    (a contiguous tensor on the launch's device, or None: no prefetch; never under the
    interpreter). ``fallback``: any tensor of the launch, the pointer when nothing is prefetched.
    ``nbytes`` is rounded down to a multiple of 16 (the instruction's unit)."""
    if prefetch is None:
        return fallback, 0, False
    if not prefetch.is_contiguous():
        raise ValueError(f"prefetch must be a contiguous tensor (one range of bytes), got strides {prefetch.stride()}")
    if prefetch.device != fallback.device:
        raise ValueError(f"prefetch must be on the launch's device {fallback.device}, got {prefetch.device}")
    if prefetch.data_ptr() % 16:
        raise ValueError("prefetch must start 16-byte aligned (a tensor's storage does; an offset view may not)")
    nbytes = prefetch.numel() * prefetch.element_size() // 16 * 16
    if interpret or nbytes == 0:
        return fallback, 0, False
    return prefetch, nbytes, True
