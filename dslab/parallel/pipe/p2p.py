"""Moving activations and gradients between neighbouring pipeline stages, through ``dslab.comm``
(so the comms logger records each send and receive).

What a stage sends forward is a tensor or a tuple of tensors. The receiver learns their dtypes,
shapes and which ones carry a gradient from a small header (:func:`encode_header`) sent before the
first micro-batch of each batch; the gradients that come back are those of the tensors that
carry one, in order.
"""

from __future__ import annotations

import torch

from dslab import comm

#: dtypes a header can name (its index in this tuple)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool)
#: int64 slots of a header: [count, then per tensor: dtype, carries a gradient, ndim, *shape]
HEADER_SLOTS = 128


def as_tuple(x) -> tuple[torch.Tensor, ...]:
    """A stage's output as a tuple of tensors (ValueError naming what is not a tensor)."""
    items = x if isinstance(x, (tuple, list)) else (x,)
    for i, t in enumerate(items):
        if not torch.is_tensor(t):
            raise ValueError(f"a pipeline stage sends tensors; item {i} of its output is {type(t).__name__}")
    return tuple(items)


def carries_grad(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.requires_grad


def encode_header(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The header describing ``tensors`` (int64, ``HEADER_SLOTS`` long)."""
    slots = [len(tensors)]
    for t in tensors:
        if t.dtype not in DTYPES:
            raise ValueError(f"a pipeline stage cannot send {t.dtype} tensors (sends {DTYPES})")
        slots += [DTYPES.index(t.dtype), int(carries_grad(t)), t.dim(), *t.shape]
    if len(slots) > HEADER_SLOTS:
        raise ValueError(f"a stage's output of {len(tensors)} tensors needs a header of {len(slots)} "
                         f"slots; {HEADER_SLOTS} are available")
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    header[: len(slots)] = torch.tensor(slots, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    """``[(dtype, carries a gradient, shape), ...]`` from :func:`encode_header`'s tensor."""
    slots = header.tolist()
    out, pos = [], 1
    for _ in range(slots[0]):
        dtype, grad, ndim = slots[pos: pos + 3]
        shape = tuple(slots[pos + 3: pos + 3 + ndim])
        out.append((DTYPES[dtype], bool(grad), shape))
        pos += 3 + ndim
    return out


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    """Post every send ``(tensor, global rank)`` and receive ``(buffer, global rank)`` at once and
    wait for all of them."""
    ops = [comm.P2POp("send", t.contiguous() if not t.is_contiguous() else t, peer) for t, peer in sends]
    ops += [comm.P2POp("recv", t, peer) for t, peer in recvs]
    for work in comm.batch_isend_irecv(ops):
        if work is not None:
            work.wait()
