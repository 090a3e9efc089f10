"""dslab's kernels: one module per op, each with its PyTorch reference, its Triton kernel, a
custom op registered with ``torch.library`` and the dispatch between them (see
:mod:`dslab.kernels.dispatch`).

Names are imported lazily so that ``import dslab`` does not import Triton.
"""

from __future__ import annotations

import importlib

from dslab.kernels.dispatch import backend, kernel_backend, planned_backend, set_backend, use_triton

_EXPORTS = {
    "layer_norm": "dslab.kernels.layer_norm",
    "bias_gelu": "dslab.kernels.bias_gelu",
    "bias_dropout_residual": "dslab.kernels.bias_dropout_residual",
    "attention": "dslab.kernels.attention",
    "softmax_cross_entropy": "dslab.kernels.cross_entropy",
    "FusedAdam": "dslab.kernels.fused_adam",
}

OPS = tuple(_EXPORTS)

__all__ = [*_EXPORTS, "OPS", "backend", "kernel_backend", "planned_backend", "set_backend", "use_triton"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dslab.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
