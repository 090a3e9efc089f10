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

Which layers are checkpointed is the model's choice: dslab's GPT-2, BERT and Llama take
``checkpoint_layers`` (their config field, a suite's ``model_options``); any model may call
:func:`dslab.checkpointing.checkpoint` itself. dslab's own key ``checkpoint_layers`` switches it
from the config with no code change (what ``dslab autotune`` searches)::

    "activation_checkpointing": {"checkpoint_layers": 1}

sets the model's ``config.checkpoint_layers`` (segments of that many layers, 0 = none) when the
engine is built; a model without that field is refused by name.
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
    # dslab's key: segments of this many layers checkpointed in the model (None: the model's own choice)
    checkpoint_layers: int | None = Field(None, ge=0)

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

    def apply_to_model(self, model) -> None:
        """Set ``model.config.checkpoint_layers`` from ``checkpoint_layers`` (nothing when it is None).
        The models read the field at each forward, so this holds from the first step on."""
        if self.checkpoint_layers is None:
            return
        model_config = getattr(model, "config", None)
        if model_config is None or not hasattr(model_config, "checkpoint_layers"):
            raise ValueError(f"activation_checkpointing.checkpoint_layers: the model ({type(model).__name__}) has "
                             f"no config.checkpoint_layers to set; dslab's GPT-2, BERT and Llama have one, other "
                             f"models call dslab.checkpointing.checkpoint themselves")
        model_config.checkpoint_layers = self.checkpoint_layers
