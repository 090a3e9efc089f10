"""The ``cuda_graphs`` section (dslab's own): replay the model's layer stack from captured CUDA
graphs in training, so that a step whose kernels are small is bound by the GPU, not by the host
issuing them one by one.

``"cuda_graphs": {"enabled": true}``. The model provides the capture: dslab's BERT and GPT-2 do
(:mod:`dslab.models.graphs`: ``enable_cuda_graphs()``; GPT-2-MoE and the Evoformer too); any other model is refused with an error
naming this key. Steps that profilers instrument with hooks or a dispatch mode run eagerly, so
their counts and timings stay those of the ops that ran.
"""

from __future__ import annotations

import torch.nn as nn

from dslab.config_base import ConfigSection


class CudaGraphConfig(ConfigSection):
    enabled: bool = False

    def apply(self, module: nn.Module) -> None:
        """Switch graphs on in ``module`` when enabled (a ValueError when it cannot have them)."""
        if not self.enabled:
            return
        enable = getattr(module, "enable_cuda_graphs", None)
        if not callable(enable):
            raise ValueError(
                f"config key 'cuda_graphs.enabled': the model ({type(module).__name__}) has no "
                f"enable_cuda_graphs(); dslab's BERT, GPT-2, GPT-2-MoE and Evoformer models have it"
            )
        enable(True)
