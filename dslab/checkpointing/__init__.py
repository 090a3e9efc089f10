"""``deepspeed.checkpointing``'s import name: activation checkpointing
(:mod:`dslab.models.checkpoint`, configured from :mod:`dslab.engine.activation_checkpointing`).

``configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None)`` sets the process's
settings from a config (a dict or a JSON file; its ``activation_checkpointing`` section) and the
keywords, which win; ``checkpoint(function, *args)`` runs a checkpointed function;
``is_configured()`` says whether ``configure`` ran; ``reset()`` forgets the settings.
"""

from __future__ import annotations

from dslab.models.checkpoint import checkpoint, is_configured, reset

__all__ = ["configure", "checkpoint", "is_configured", "reset"]


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's ``checkpointing.configure`` (module docstring); ValueError for what dslab refuses."""
    from dslab.engine.activation_checkpointing import ActivationCheckpointingConfig
    from dslab.engine.config import load_config

    if mpu_ is not None:
        raise ValueError("checkpointing.configure: mpu_ (a model-parallel unit) is for partition_activations, "
                         "which dslab does not support; pass None")
    section = {}
    if deepspeed_config is not None:
        section = load_config(deepspeed_config).activation_checkpointing.model_dump()
    for key, value in (("partition_activations", partition_activations),
                       ("contiguous_memory_optimization", contiguous_checkpointing),
                       ("number_checkpoints", num_checkpoints), ("cpu_checkpointing", checkpoint_in_cpu),
                       ("synchronize_checkpoint_boundary", synchronize), ("profile", profile)):
        if value is not None:
            section[key] = value
    ActivationCheckpointingConfig(**section).apply()
