"""The CUDA caching allocator's peaks, for readers that reset them at different times.

torch keeps one peak per device (``max_memory_allocated``, ``max_memory_reserved``) and one way to
start it again (``reset_peak_memory_stats``). The memory tracer wants each step's peak, so it
resets at every step's begin; a benchmark trial wants the peak over all of its steps, so it resets
at the trial's begin. Both resetting torch's one counter made a trial's peak that of its last step
only. Here a step's reset (:func:`reset_step_peak`) first folds the peak so far into a keeper, and
the outer readers (:func:`reset_peak`, :func:`peak_allocated`, :func:`peak_reserved`) see the
largest of the keeper and torch's counter: the trial's peak over every step, whatever the tracer
did inside it, and the tracer's step peaks unchanged.
"""

from __future__ import annotations

import torch

# device index -> [allocated, reserved]: the largest peaks folded since the last reset_peak
_kept: dict[int, list[int]] = {}


def _index(device) -> int:
    device = torch.device(device) if device is not None else torch.device("cuda")
    return device.index if device.index is not None else torch.cuda.current_device()


def _read(index: int) -> tuple[int, int]:
    return torch.cuda.max_memory_allocated(index), torch.cuda.max_memory_reserved(index)


def _reset(index: int) -> None:
    torch.cuda.reset_peak_memory_stats(index)


def reset_peak(device=None) -> None:
    """Start the outer peak of ``device`` again (a trial's begin): forget what was kept."""
    index = _index(device)
    _kept.pop(index, None)
    _reset(index)


def reset_step_peak(device=None) -> None:
    """Start torch's peak of ``device`` again for a step, keeping the peak so far for the outer
    readers."""
    index = _index(device)
    allocated, reserved = _read(index)
    kept = _kept.setdefault(index, [0, 0])
    kept[0] = max(kept[0], allocated)
    kept[1] = max(kept[1], reserved)
    _reset(index)


def peak_allocated(device=None) -> int:
    """The most bytes allocated on ``device`` since the last :func:`reset_peak`."""
    index = _index(device)
    return max(_kept.get(index, (0, 0))[0], _read(index)[0])


def peak_reserved(device=None) -> int:
    """The most bytes the allocator reserved on ``device`` since the last :func:`reset_peak`."""
    index = _index(device)
    return max(_kept.get(index, (0, 0))[1], _read(index)[1])
