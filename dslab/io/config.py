"""DeepSpeed's ``aio`` config section: the parameters of the engine's async I/O handles.

Keys and defaults are DeepSpeed's (``block_size`` 1 MiB, ``queue_depth`` 8,
``intra_op_parallelism`` 1, ``single_submit`` false, ``overlap_events`` true, ``use_gds``
false); ``thread_count`` is DeepSpeed's earlier name of ``intra_op_parallelism`` and is read as
it. ``dslab nvme-tune`` prints a block to paste here. What each key does is in
:class:`dslab.io.handle.AsyncIOHandle`.

In the engine the section drives ZeRO's NVMe optimizer offload
(``zero_optimization.offload_optimizer.device: nvme``) and, when present, checkpoint writes
(through a handle instead of ``torch.save`` to a path).
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from dslab.config_base import ConfigSection, accepted_off
from dslab.io.buffers import DIRECT_IO_ALIGNMENT



class AioConfig(ConfigSection):
    """The ``aio`` section (module docstring)."""

    block_size: int = Field(1_048_576, ge=DIRECT_IO_ALIGNMENT)
    queue_depth: int = Field(8, ge=1, le=4096)
    intra_op_parallelism: int = Field(1, ge=1, le=256)
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    @model_validator(mode="before")
    @classmethod
    def _thread_count(cls, data):
        if isinstance(data, dict) and "thread_count" in data:
            data = dict(data)
            count = data.pop("thread_count")
            if "intra_op_parallelism" in data and data["intra_op_parallelism"] != count:
                raise ValueError(
                    "config key 'aio.thread_count' (DeepSpeed's earlier name of "
                    "'aio.intra_op_parallelism') disagrees with 'aio.intra_op_parallelism'; "
                    "keep one of them")
            data["intra_op_parallelism"] = count
        return data

    @field_validator("block_size")
    @classmethod
    def _aligned_block(cls, value: int) -> int:
        if value % DIRECT_IO_ALIGNMENT:
            raise ValueError(f"must be a multiple of {DIRECT_IO_ALIGNMENT} bytes (O_DIRECT's "
                             f"alignment), got {value}")
        return value

    _no_gds = accepted_off("use_gds", why="GPUDirect Storage is not supported by dslab: CUDA tensors go "
                                          "through pinned bounce buffers")

    def handle_kwargs(self) -> dict:
        """The constructor arguments of :class:`~dslab.io.handle.AsyncIOHandle`."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth,
                "single_submit": self.single_submit, "overlap_events": self.overlap_events,
                "intra_op_parallelism": self.intra_op_parallelism}
