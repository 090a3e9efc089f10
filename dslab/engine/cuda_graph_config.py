"""The ``cuda_graphs`` section (dslab's own): replay the model's layer stack from captured CUDA
graphs in training, so that a step whose kernels are small is bound by the GPU, not by the host
issuing them one by one.

``"cuda_graphs": {"enabled": true, "segments": "auto"}``. The model provides the capture: dslab's BERT and GPT-2 do
(:mod:`dslab.models.graphs`: ``enable_cuda_graphs()``; GPT-2-MoE and the Evoformer too); any other model is refused with an error
naming this key. Steps that profilers instrument with hooks or a dispatch mode run eagerly, so
their counts and timings stay those of the ops that ran.
"""

from __future__ import annotations

import inspect
from typing import Literal

import torch.nn as nn
from pydantic import Field, field_validator

from dslab.config_base import ConfigSection


#: the segments "auto" picks when data-parallel reductions run in backward
AUTO_DATA_PARALLEL_SEGMENTS = 4


class CudaGraphConfig(ConfigSection):
    """``segments``: how many graphed runs of layers the stack is cut into
    (:class:`dslab.models.graphs.SegmentedLayerGraphs`). ``"auto"``: 4 where gradients are reduced
    across data-parallel ranks during backward (ZeRO stages 0 to 2 on more than one rank), so the
    reductions overlap the stack's backward; 1 elsewhere (one rank; stage 3, whose own graphed stack
    reduces inside its graphs; a tensor- or pipeline-parallel model, whose graphs hold its
    collectives and are kept whole unless ``segments`` says otherwise)."""

    enabled: bool = False
    segments: Literal["auto"] | int = Field("auto")

    @field_validator("segments")
    @classmethod
    def _positive(cls, value):
        if value != "auto" and value < 1:
            raise ValueError(f"must be >= 1 or \"auto\", got {value}")
        return value

    def segment_count(self, *, data_parallel_world: int, zero_stage: int, model_parallel: bool = False) -> int:
        """The segments to capture under this config (see the class docstring)."""
        if zero_stage >= 3 and self.segments not in ("auto", 1):
            raise ValueError(f"config key 'cuda_graphs.segments' is {self.segments} with "
                             "'zero_optimization.stage' 3: stage 3 graphs its whole layer stack with the "
                             "gathers and reductions inside; leave segments at \"auto\" or 1")
        if self.segments != "auto":
            return self.segments
        overlaps = data_parallel_world > 1 and zero_stage < 3 and not model_parallel
        return AUTO_DATA_PARALLEL_SEGMENTS if overlaps else 1

    def apply(self, module: nn.Module, *, data_parallel_world: int = 1, zero_stage: int = 0,
              model_parallel: bool = False) -> None:
        """Switch graphs on in ``module`` when enabled (a ValueError when it cannot have them)."""
        if not self.enabled:
            return
        enable = getattr(module, "enable_cuda_graphs", None)
        if not callable(enable):
            raise ValueError(
                f"config key 'cuda_graphs.enabled': the model ({type(module).__name__}) has no "
                f"enable_cuda_graphs(); dslab's BERT, GPT-2, GPT-2-MoE and Evoformer models have it"
            )
        segments = self.segment_count(data_parallel_world=data_parallel_world, zero_stage=zero_stage,
                                      model_parallel=model_parallel)
        if segments == 1:
            enable(True)
        elif "segments" in inspect.signature(enable).parameters:
            enable(True, segments=segments)
        elif self.segments == "auto":
            enable(True)  # a model whose stack runs as one graph only (GPT-2-MoE, the Evoformer)
        else:
            raise ValueError(f"config key 'cuda_graphs.segments' is {self.segments}: the model "
                             f"({type(module).__name__}) graphs its stack as one; dslab's BERT and GPT-2 "
                             "cut theirs into segments")
