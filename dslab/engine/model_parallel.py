"""The engine's view of a model-parallel layout: which ranks it averages gradients over, and
which ranks hold the rest of the model.

``dslab.initialize(..., mpu=...)`` takes a Megatron-style object (``get_data_parallel_group``,
``get_data_parallel_world_size``, ``get_data_parallel_rank``, ``get_model_parallel_group``,
``get_model_parallel_world_size``, ``get_model_parallel_rank``; dslab's
:class:`~dslab.parallel.topology.PipelineParallelGrid` is one and adds the pipeline axis). With
it:

- data parallelism (stage 0's all-reduce, ZeRO's shards, the start from one rank's weights) runs
  over the data-parallel group only;
- the global gradient norm (clipping) is the norm of the whole model: each rank sums the squares
  of the gradients it holds and counts once, then the sum is all-reduced over the tensor-parallel
  group and the pipeline group (:attr:`ModelParallelLayout.norm_groups`). A parameter counts on
  every tensor-parallel rank when it is split across them (``param.tensor_model_parallel``),
  else on tensor-parallel rank 0 only (a copy held whole by every rank); a pipeline copy of a
  tied layer (``param.ds_pipe_replicated``) counts on its owning stage only;
- an fp16 overflow found on any rank skips the step on all of them;
- with tensor parallelism each rank gets its own random stream for the dropout of its attention
  heads (:func:`dslab.parallel.random.ensure_model_parallel_stream`, unless
  :func:`~dslab.parallel.random.model_parallel_seed` made one).
"""

from __future__ import annotations

import torch.nn as nn

from dslab import comm
from dslab.parallel.random import ensure_model_parallel_stream

_MPU_METHODS = ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank",
                "get_model_parallel_group", "get_model_parallel_world_size", "get_model_parallel_rank")


def _pipe_axis(mpu):
    """``(group, size)`` of ``mpu``'s pipeline axis, if it has one (dslab's and DeepSpeed's
    grid: ``get_pipe_parallel_*``; Megatron-LM: ``get_pipeline_model_parallel_*``)."""
    for prefix in ("get_pipe_parallel", "get_pipeline_model_parallel"):
        if hasattr(mpu, f"{prefix}_group") and hasattr(mpu, f"{prefix}_world_size"):
            return getattr(mpu, f"{prefix}_group")(), int(getattr(mpu, f"{prefix}_world_size")())
    return None, 1


class ModelParallelLayout:
    """Groups and sizes from ``mpu`` (None: data parallelism over the whole world)."""

    def __init__(self, mpu, config):
        self.mpu = mpu
        if mpu is None:
            self.dp_group = None
            self.dp_world_size = comm.get_world_size()
            self.dp_rank = comm.get_rank()
            self.tp_group, self.tp_world_size, self.tp_rank = None, 1, 0
            self.pp_group, self.pp_world_size = None, 1
            self.norm_groups: list = []
            return
        missing = [m for m in _MPU_METHODS if not callable(getattr(mpu, m, None))]
        if missing:
            raise ValueError(f"mpu ({type(mpu).__name__}) lacks {', '.join(missing)}: dslab.initialize "
                             "needs a Megatron-style mpu or dslab.parallel.PipelineParallelGrid")
        self.dp_group = mpu.get_data_parallel_group()
        self.dp_world_size = int(mpu.get_data_parallel_world_size())
        self.dp_rank = int(mpu.get_data_parallel_rank())
        self.tp_group = mpu.get_model_parallel_group()
        self.tp_world_size = int(mpu.get_model_parallel_world_size())
        self.tp_rank = int(mpu.get_model_parallel_rank())
        self.pp_group, self.pp_world_size = _pipe_axis(mpu)
        world = comm.get_world_size()
        if self.dp_world_size * self.tp_world_size * self.pp_world_size != world:
            raise ValueError(
                f"mpu: data-parallel size {self.dp_world_size} x model-parallel size "
                f"{self.tp_world_size} x pipeline size {self.pp_world_size} != world size {world}")
        if self.dp_world_size != comm.get_world_size(self.dp_group):
            raise ValueError(f"mpu.get_data_parallel_world_size() is {self.dp_world_size} but its "
                             f"data-parallel group has {comm.get_world_size(self.dp_group)} ranks")
        if self.tp_world_size > 1:  # the rank's own stream for dropout in tensor-parallel regions
            ensure_model_parallel_stream(self.tp_group)
        self.norm_groups = [g for g, n in ((self.tp_group, self.tp_world_size),
                                           (self.pp_group, self.pp_world_size)) if n > 1]
        stage = config.zero_optimization.stage
        if stage == 3 and self.model_parallel:
            raise ValueError("config key 'zero_optimization.stage' is 3 with model parallelism "
                             f"(tensor {self.tp_world_size}, pipeline {self.pp_world_size}): stage 3 "
                             "runs over data parallelism alone; use stage 0, 1 or 2")

    @property
    def model_parallel(self) -> bool:
        """True when other ranks hold other parts of the model."""
        return self.tp_world_size > 1 or self.pp_world_size > 1

    def counts_in_norm(self, p: nn.Parameter) -> bool:
        """Whether this rank adds ``p``'s gradient to the global norm (see the module docstring)."""
        if getattr(p, "ds_pipe_replicated", False):
            return False
        return bool(getattr(p, "tensor_model_parallel", False)) or self.tp_rank == 0
