"""Random streams for tensor-parallel regions (Megatron-LM's CUDA RNG tracker).

The ranks of a tensor-parallel group hold the same residual stream, so the dropout on it must
draw the same mask on every rank: they share torch's default generators (seeded alike). Inside a
tensor-parallel region each rank holds *other* elements - its own attention heads - and a shared
stream would give rank 0's head 0 and rank 1's head 0 the same mask. :func:`model_parallel_seed`
therefore keeps a second stream per rank, ``seed + 2718 + tp_rank`` (Megatron's offset), and
:meth:`RngStatesTracker.fork` runs a block on it: the attention of a tensor-parallel layer draws
its dropout there.

The tracker's states are part of what an activation checkpoint replays
(:mod:`dslab.models.checkpoint` records them before the forward and restores them for the
recompute), so a recomputed attention drops the same elements.

A fork swaps the CPU generator and, when CUDA is initialised, the current device's generator
(dslab's kernels draw their dropout seeds from the generator of the tensor's device).
"""

from __future__ import annotations

import contextlib

import torch

from dslab import comm

#: the tracker's stream for tensor-parallel regions (Megatron's name)
MODEL_PARALLEL_RNG = "model-parallel-rng"
#: added to the seed (and the tensor-parallel rank) for that stream, as Megatron-LM does
MODEL_PARALLEL_SEED_OFFSET = 2718


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _current_states() -> dict:
    states = {"cpu": torch.get_rng_state()}
    if _cuda_ready():
        states["cuda"] = (torch.cuda.current_device(), torch.cuda.get_rng_state())
    return states


def _copy(states: dict) -> dict:
    out = {"cpu": states["cpu"].clone()}
    if "cuda" in states:
        out["cuda"] = (states["cuda"][0], states["cuda"][1].clone())
    return out


def _set_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and _cuda_ready():
        device, state = states["cuda"]
        torch.cuda.set_rng_state(state, device)


class RngStatesTracker:
    """Named generator states, each run by :meth:`fork`."""

    def __init__(self):
        self.states: dict[str, dict] = {}

    def reset(self) -> None:
        self.states = {}

    def has(self, name: str = MODEL_PARALLEL_RNG) -> bool:
        return name in self.states

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` starting from ``seed`` (ValueError if it exists)."""
        if name in self.states:
            raise ValueError(f"the random stream {name!r} exists already")
        outside = _current_states()
        try:
            torch.manual_seed(seed)
            self.states[name] = _current_states()
        finally:
            _set_states(outside)

    def get_states(self) -> dict[str, dict]:
        """A copy of every stream's state (for a checkpoint to replay)."""
        return {name: _copy(states) for name, states in self.states.items()}

    def set_states(self, states: dict[str, dict]) -> None:
        self.states = {name: _copy(s) for name, s in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on stream ``name`` (the default generators are back as they were after
        it); a no-op when the stream was never added (one rank, or no seed given)."""
        if name not in self.states:
            yield
            return
        outside = _current_states()
        _set_states(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _current_states()
            _set_states(outside)


_tracker = RngStatesTracker()


def get_rng_tracker() -> RngStatesTracker:
    """The process's tracker."""
    return _tracker


def model_parallel_seed(seed: int, tp_group=None) -> None:
    """Seed the default generators with ``seed`` (the same on every rank of the tensor-parallel
    group) and the tensor-parallel stream with ``seed + 2718 + tp_rank`` (its own per rank)."""
    torch.manual_seed(seed)
    _tracker.reset()
    _tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + comm.get_rank(tp_group))


def ensure_model_parallel_stream(tp_group=None) -> None:
    """Add the tensor-parallel stream if no :func:`model_parallel_seed` did, from the default
    generator's seed (``torch.initial_seed()``, the same on ranks seeded alike) + 2718 + tp_rank;
    the default generators are left as they are."""
    if not _tracker.has(MODEL_PARALLEL_RNG):
        _tracker.add(MODEL_PARALLEL_RNG, torch.initial_seed() + MODEL_PARALLEL_SEED_OFFSET + comm.get_rank(tp_group))
