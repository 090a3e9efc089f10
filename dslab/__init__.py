"""dslab: a profiling-first performance lab for PyTorch.

The training loop is DeepSpeed's::

    engine, optimizer, loader, scheduler = dslab.initialize(model=model, config="ds_config.json")
    loss = engine(batch)
    engine.backward(loss)
    engine.step()

and its inference engine is DeepSpeed's ``init_inference``::

    engine = dslab.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True)
    tokens = engine.generate(input_ids, max_new_tokens=32)

The top-level names load their modules on first use, so that ``import dslab.kernels`` or
``import dslab.report`` does not pull in the engine.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "initialize": "dslab.engine.initialize",
    "add_config_arguments": "dslab.engine.initialize",
    "init_distributed": "dslab.comm",
    "estimate_zero_memory": "dslab.engine.zero_estimate",
    "estimate_activation_memory": "dslab.profilers.activation_model",
    "init_inference": "dslab.inference.engine",
}

__all__ = ["__version__", *_EXPORTS]


# DeepSpeed's submodule names, loaded on first use (``dslab.zero.Init``, ``dslab.checkpointing``,
# ``dslab.pipe.PipelineModule``)
_SUBMODULES = ("zero", "checkpointing", "pipe")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"dslab.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dslab' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
