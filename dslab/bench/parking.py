"""Parking: an idle arm's training state waits in host memory while another arm is timed.

To the host, every tensor of the arm (parameters, gradients, buffers, optimizer states, the bf16
weight copies an optimizer keeps) is copied into one flat, ordinary (pageable) allocation made
for that parking. A single allocation of
gigabytes is its own memory mapping, handed back to the system whole when the arm is unparked.
Two other ways lose memory on every round trip:

- A non-blocking copy from the GPU lands in torch's pinned-host cache, which rounds each block up
  to a power of two and never shrinks.
- One host tensor per parameter (tens of MiB each) comes from the C heap, whose freed pieces stay
  with the process. A five-arm GPT-2 1.5B run on a 128 GiB host grew by about 4 GiB per trial
  that way until it was killed.

The Parameter objects stay the same (only ``.data`` moves), so optimizers and compiled graphs keep
their references.
"""

from __future__ import annotations

import torch

_ALIGN = 64  # bytes; every slice of the flat buffer starts on a cache line


class _Slot:
    """Where one tensor lives: read it with ``get()``, replace it with ``set(tensor)``."""

    __slots__ = ("get", "set")

    def __init__(self, get, set_):
        self.get, self.set = get, set_


def _param_slot(p):
    def set_(t):
        p.data = t
    return _Slot(lambda: p.data, set_)


def _grad_slot(p):
    def set_(t):
        p.grad = t
    return _Slot(lambda: p.grad, set_)


def _state_slot(state: dict, key):
    def set_(t):
        state[key] = t
    return _Slot(lambda: state[key], set_)


def _slots(module: torch.nn.Module, optimizer) -> list[tuple[_Slot, str]]:
    """Every tensor of the training state, with the device kind it belongs on when not parked:
    'device', or 'host' for torch's Adam 'step' counters, which live on the host unless the
    optimizer runs fused or capturable."""
    slots = []
    for p in module.parameters():
        slots.append((_param_slot(p), "device"))
        if p.grad is not None:
            slots.append((_grad_slot(p), "device"))
    for buf in module.buffers():
        slots.append((_param_slot(buf), "device"))
    # Low-precision copies an optimizer keeps of the parameters (dslab's FusedAdam under the
    # engine's bf16 weight copies) and their gradients.
    for copy in getattr(optimizer, "param_copies", lambda: [])():
        slots.append((_param_slot(copy), "device"))
        if copy.grad is not None:
            slots.append((_grad_slot(copy), "device"))
    if optimizer is not None:
        steps_on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    home = "device" if key != "step" or steps_on_device else "host"
                    slots.append((_state_slot(state, key), home))
    return slots


class Parked:
    """An arm's training state in one flat host allocation (see :func:`park_training_state`)."""

    def __init__(self, flat: torch.Tensor | None):
        self.flat = flat

    @property
    def nbytes(self) -> int:
        return 0 if self.flat is None else self.flat.numel()

    def holds(self, t: torch.Tensor) -> bool:
        return self.flat is not None and t.untyped_storage().data_ptr() == self.flat.untyped_storage().data_ptr()


def _key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())


def park_training_state(module: torch.nn.Module, optimizer) -> Parked:
    """Copy the arm's training state (all but the Adam step counters kept on the host) into one
    flat host allocation, blocking, and free its GPU memory."""
    moves = [(slot, slot.get()) for slot, home in _slots(module, optimizer) if home == "device"]
    offsets, total, placed = [], 0, {}
    for _, t in moves:  # a tensor reached twice (tied weights) is copied once
        key = _key(t)
        if key not in placed:
            placed[key] = total
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        offsets.append(placed[key])
    if total == 0:
        return Parked(None)
    flat = torch.empty(total, dtype=torch.uint8)
    views: dict[int, torch.Tensor] = {}
    for (slot, t), offset in zip(moves, offsets):
        view = views.get(offset)
        if view is None:
            nbytes = t.numel() * t.element_size()
            view = flat[offset:offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            views[offset] = view
        slot.set(view)
    del moves, views
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return Parked(flat)


def unpark_training_state(module: torch.nn.Module, optimizer, parked: Parked, device: torch.device) -> None:
    """Copy a parked arm's state back to ``device``; the flat host allocation is freed once the
    caller drops ``parked``."""
    if parked.flat is None:
        return
    moved: dict[tuple, torch.Tensor] = {}
    for slot, _ in _slots(module, optimizer):
        t = slot.get()
        if not parked.holds(t):
            continue
        key = _key(t)
        if key not in moved:
            moved[key] = torch.empty_like(t, device=device).copy_(t, non_blocking=device.type != "cpu")
        slot.set(moved[key])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    parked.flat = None
