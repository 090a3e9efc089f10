"""Activation checkpointing: a function's activations dropped after its forward and recomputed
in the backward, with the random state of the forward replayed (DeepSpeed's
``deepspeed.checkpointing``; :mod:`dslab.checkpointing` is its import name).

:func:`checkpoint` runs ``function(*args)`` keeping only its inputs; the backward runs it again
under the same CPU and CUDA random states (and the tensor-parallel streams of
:mod:`dslab.parallel.random`), so dropout (dslab's ops draw their seeds from the device
generator) drops the same elements, and the gradients are those of the run without
checkpointing. The settings are process-wide, as DeepSpeed's are (:func:`configure`, set by the
engine from its ``activation_checkpointing`` section):

- ``checkpoint_in_cpu`` (``cpu_checkpointing``): the kept inputs wait in pinned host memory,
  copied there asynchronously, and come back for the recompute;
- ``synchronize`` (``synchronize_checkpoint_boundary``): the device is synchronised before and
  after each checkpointed function (for timing them).

dslab's models checkpoint their layer stacks in segments of ``checkpoint_layers`` layers (their
config's field; :func:`run_checkpointed_stack` in :mod:`dslab.models.ops`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as torch_checkpoint

from dslab.parallel.random import get_rng_tracker

__all__ = ["CheckpointSettings", "configure", "is_configured", "reset", "settings", "checkpoint"]


@dataclass(frozen=True)
class CheckpointSettings:
    checkpoint_in_cpu: bool = False
    synchronize: bool = False


_settings: CheckpointSettings | None = None


def configure(checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None) -> CheckpointSettings:
    """Set the process's checkpoint settings (None leaves one as it is); returns them."""
    global _settings
    current = _settings or CheckpointSettings()
    _settings = CheckpointSettings(
        checkpoint_in_cpu=current.checkpoint_in_cpu if checkpoint_in_cpu is None else bool(checkpoint_in_cpu),
        synchronize=current.synchronize if synchronize is None else bool(synchronize))
    return _settings


def is_configured() -> bool:
    """Whether :func:`configure` (or an engine with an ``activation_checkpointing`` section) ran."""
    return _settings is not None


def reset() -> None:
    """Forget the settings (back to the defaults, not configured)."""
    global _settings
    _settings = None


def settings() -> CheckpointSettings:
    return _settings or CheckpointSettings()


def _synchronize(tensors) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            torch.cuda.synchronize(t.device)
            return


class _ReplayTrackedStreams:
    """``function`` run first as it is, then (the recompute) on the tensor-parallel streams'
    states of that first run (:mod:`dslab.parallel.random`), which are put back afterwards: torch
    replays only the default generators."""

    def __init__(self, function):
        self.function = function
        self.states = None

    def __call__(self, *args):
        tracker = get_rng_tracker()
        if self.states is None:
            self.states = tracker.get_states()
            return self.function(*args)
        after_forward = tracker.get_states()
        tracker.set_states(self.states)
        try:
            return self.function(*args)
        finally:
            tracker.set_states(after_forward)


def checkpoint(function, *args):
    """``function(*args)``, its activations recomputed in the backward (module docstring)."""
    current = settings()
    if get_rng_tracker().states:
        function = _ReplayTrackedStreams(function)
    if current.synchronize:
        _synchronize(args)
    if current.checkpoint_in_cpu:
        out = _CpuCheckpoint.apply(function, *args)
    else:
        out = torch_checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    if current.synchronize:
        _synchronize(args)
    return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (pinned and asynchronous from a GPU)."""
    if not t.is_cuda:
        return t.detach().clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    return host


class _CpuCheckpoint(torch.autograd.Function):
    """The checkpoint whose kept inputs wait in host memory: the forward runs ``function``
    without autograd and keeps host copies of its tensor inputs and the random states; the
    backward brings them back, replays the states and differentiates a second forward."""

    @staticmethod
    def forward(ctx, function, *args):
        ctx.function = function
        ctx.devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
        ctx.grad_inputs = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        ctx.kept = [_to_host(a) if isinstance(a, torch.Tensor) else a for a in args]
        cuda = [d for d in ctx.devices if d is not None and d.type == "cuda"]
        ctx.cuda_devices = sorted({d.index if d.index is not None else torch.cuda.current_device() for d in cuda})
        ctx.cpu_state = torch.get_rng_state()
        ctx.cuda_states = [torch.cuda.get_rng_state(i) for i in ctx.cuda_devices]
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = []
        for kept, device, needs in zip(ctx.kept, ctx.devices, ctx.grad_inputs):
            if device is None:
                inputs.append(kept)
                continue
            moved = kept.to(device, non_blocking=True).detach()
            inputs.append(moved.requires_grad_(needs))
        with torch.random.fork_rng(devices=ctx.cuda_devices), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_state)
            for index, state in zip(ctx.cuda_devices, ctx.cuda_states):
                torch.cuda.set_rng_state(state, index)
            outputs = ctx.function(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *[x.grad if isinstance(x, torch.Tensor) and needs else None
                        for x, needs in zip(inputs, ctx.grad_inputs)])


@contextlib.contextmanager
def settings_for(checkpoint_in_cpu: bool = False, synchronize: bool = False):
    """The settings within the block, the previous ones after it (for tests and benchmarks)."""
    global _settings
    before = _settings
    _settings = CheckpointSettings(checkpoint_in_cpu, synchronize)
    try:
        yield _settings
    finally:
        _settings = before
