"""The ``activation_checkpointing`` section (DeepSpeed's keys), which sets the process's
checkpoint settings (:mod:`dslab.models.checkpoint`) when an engine is built with it::

    "activation_checkpointing": {"cpu_checkpointing": true, "synchronize_checkpoint_boundary": false}

- ``cpu_checkpointing``: a checkpoint's kept inputs wait in pinned host memory;
- ``synchronize_checkpoint_boundary``: the device synchronised around each checkpoint;
- ``number_checkpoints``: sizes DeepSpeed's contiguous checkpoint buffer; accepted, and unused
  (dslab leaves checkpoint memory to the caching allocator);
- ``partition_activations`` (checkpoints split over model-parallel ranks),
  ``contiguous_memory_optimization`` (one preallocated buffer for them) and ``profile`` (DeepSpeed's
  checkpoint timers) are refused by name when switched on.

Which layers are checkpointed is the model's choice: dslab's GPT-2 and BERT take
``checkpoint_layers`` (their config field, a suite's ``model_options``); any model may call
:func:`dslab.checkpointing.checkpoint` itself.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from dslab.config_base import ConfigSection
from dslab.models import checkpoint as model_checkpoint

REFUSED = {
    "partition_activations": "splitting checkpoints over model-parallel ranks needs tensor parallelism, which "
                             "this engine does not run",
    "contiguous_memory_optimization": "dslab keeps checkpoints in the caching allocator, not one preallocated buffer",
    "profile": "DeepSpeed's checkpoint timers are not implemented; the flops profiler and the wall-clock "
               "breakdown time the steps",
}


class ActivationCheckpointingConfig(ConfigSection):
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    @model_validator(mode="after")
    def _refuse(self):
        for key, why in REFUSED.items():
            if getattr(self, key):
                raise ValueError(f"activation_checkpointing.{key}: not supported ({why}); set it to false")
        return self

    def apply(self) -> None:
        """Make these the process's checkpoint settings."""
        model_checkpoint.configure(checkpoint_in_cpu=self.cpu_checkpointing,
                                   synchronize=self.synchronize_checkpoint_boundary)
