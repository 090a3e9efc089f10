"""``deepspeed.pipe``'s import name: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` and the
topologies (:mod:`dslab.parallel.pipe`, :mod:`dslab.parallel.topology`); the engine that runs a
pipeline module is :class:`dslab.engine.pipe_engine.PipelineEngine`, which ``dslab.initialize``
builds for one."""

from dslab.engine.pipe_engine import PipelineEngine, PipelineError
from dslab.parallel.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipelineModule,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineEngine",
           "PipelineError", "PipelineModule", "PipelineParallelGrid", "ProcessTopology", "TiedLayerSpec"]
