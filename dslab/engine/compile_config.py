"""The ``compile`` section: run the wrapped model under ``torch.compile``.

DeepSpeed's key (``"compile": {"enabled": true, "backend": "inductor", "kwargs": {}}``). dslab's
custom kernels are registered ``torch.library`` ops, so they stay single nodes of the compiled
graph while Inductor fuses what lies between them and removes the per-op Python overhead.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from pydantic import Field

from dslab.config_base import ConfigSection, accepted_off


class CompileConfig(ConfigSection):
    enabled: bool = False
    backend: str = "inductor"
    kwargs: dict = Field(default_factory=dict)
    # DeepSpeed's DeepCompile (ZeRO's collectives scheduled inside the compiled graph): off only
    deepcompile: bool = False
    _no_deepcompile = accepted_off("deepcompile", why="a DeepSpeed feature dslab does not support yet")

    def wrap(self, module: nn.Module):
        """``module`` itself when off, else its compiled callable (sharing its parameters)."""
        if not self.enabled:
            return module
        allowed = {"mode", "fullgraph", "dynamic", "options"}
        unknown = sorted(set(self.kwargs) - allowed)
        if unknown:
            raise ValueError(
                f"config key 'compile.kwargs' has {', '.join(unknown)}; torch.compile takes "
                f"{', '.join(sorted(allowed))}"
            )
        # Keep data-dependent shapes in the graph (a sparse head gathers its rows with nonzero);
        # without it Dynamo breaks the graph there and recompiles every step.
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
        return torch.compile(module, backend=self.backend, **self.kwargs)
