"""Pipeline parallelism: the layer-list model cut into stages (:mod:`.module`), the 1F1B
schedule (:mod:`.schedule`) and the transfers between stages (:mod:`.p2p`). The engine that runs
them is :class:`dslab.engine.pipe_engine.PipelineEngine`."""

from dslab.parallel.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from dslab.parallel.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule",
           "PipelineParallelGrid", "ProcessTopology", "TiedLayerSpec"]
