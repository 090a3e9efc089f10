"""Capture and restore every random number generator a training step draws from, so that a run
resumed from a checkpoint makes the same random draws (dropout masks, sampler shuffles) as the
run that saved it.

The captured state holds only plain Python values and CPU uint8 tensors, so it can be stored in
a checkpoint and read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a dependency, but the RNG code does not need it
    np = None

RNG_STATE_VERSION = 1


def capture_rng_state() -> dict:
    """The state of python ``random``, numpy's global generator (when numpy is importable), the
    torch CPU generator and, when CUDA is initialised, the generator of every CUDA device.

    Returns::

        {"version": 1,
         "python": [version, [625 ints], gauss_next],
         "numpy": {"bit_generator": "MT19937", "keys": [624 ints], "pos": int,
                   "has_gauss": int, "cached_gaussian": float},      # absent without numpy
         "torch_cpu": uint8 tensor,
         "cuda": [uint8 tensor per device]}                          # [] when CUDA is not used
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "version": RNG_STATE_VERSION,
        "python": [version, list(internal), gauss_next],
        "torch_cpu": torch.get_rng_state().clone(),
        "cuda": [],
    }
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "bit_generator": str(name),
            "keys": [int(k) for k in keys.tolist()],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    """Put every generator back to ``state`` (from :func:`capture_rng_state`); the draws that
    follow are bit-identical to those that followed the capture.

    CUDA states are restored for the devices present both in ``state`` and on this machine; a
    different device count, or CUDA states on a machine without CUDA, gives a warning.
    Raises ValueError naming the part of ``state`` that is malformed.
    """
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict from capture_rng_state, got {type(state).__name__}")
    for key in ("python", "torch_cpu"):
        if key not in state:
            raise ValueError(f"state is missing {key!r}; it was not made by capture_rng_state")
    version = state.get("version")
    if version != RNG_STATE_VERSION:
        raise ValueError(f"state['version'] is {version!r}; this dslab reads {RNG_STATE_VERSION}")

    try:
        py_version, internal, gauss_next = state["python"]
        random.setstate((py_version, tuple(internal), gauss_next))
    except (TypeError, ValueError) as err:
        raise ValueError(f"state['python'] is not a python random state: {err}") from None

    cpu = state["torch_cpu"]
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        raise ValueError("state['torch_cpu'] must be a uint8 tensor from torch.get_rng_state()")
    torch.set_rng_state(cpu.cpu())

    np_state = state.get("numpy")
    if np_state is not None:
        if np is None:
            warnings.warn("the RNG state holds a numpy state but numpy is not importable; "
                          "numpy draws will not be reproduced", RuntimeWarning, stacklevel=2)
        else:
            try:
                np.random.set_state((
                    np_state["bit_generator"],
                    np.asarray(np_state["keys"], dtype=np.uint32),
                    np_state["pos"],
                    np_state["has_gauss"],
                    np_state["cached_gaussian"],
                ))
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"state['numpy'] is not a numpy random state: {err}") from None

    cuda_states = state.get("cuda") or []
    if not cuda_states:
        return
    if not torch.cuda.is_available():
        warnings.warn(f"the RNG state holds {len(cuda_states)} CUDA generator states but CUDA is "
                      "not available; CUDA draws will not be reproduced",
                      RuntimeWarning, stacklevel=2)
        return
    count = torch.cuda.device_count()
    if count != len(cuda_states):
        warnings.warn(f"the RNG state holds {len(cuda_states)} CUDA generator states but "
                      f"{count} devices are visible; restoring the first "
                      f"{min(count, len(cuda_states))}", RuntimeWarning, stacklevel=2)
    for device, device_state in enumerate(cuda_states[:count]):
        torch.cuda.set_rng_state(device_state.cpu(), device)
