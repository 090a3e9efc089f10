"""DeepSpeed's ``pipeline`` config section, read by the pipeline engine (:mod:`dslab.engine.pipe_engine`).

DeepSpeed's keys and defaults. What each does in dslab:

- ``stages`` ("auto" or a count): "auto" takes the :class:`~dslab.parallel.pipe.PipelineModule`'s
  stages; a count must equal them (refused by name otherwise), since the module's topology
  places the ranks.
- ``activation_checkpoint_interval``: above 0 it replaces the module's own interval, as
  DeepSpeed's pipeline engine does; 0 keeps the module's.
- ``partition`` and ``seed_layers``: arguments of DeepSpeed's ``PipelineModule`` that some scripts
  pass from the config; the engine does not read them (the module was built already), in
  DeepSpeed as here.
- ``pipe_partitioned`` and ``grad_partitioned``: with tensor parallelism DeepSpeed splits the
  activations and gradients sent between stages over the tensor-parallel ranks and gathers them
  on arrival; dslab sends them whole from every tensor-parallel rank, so the keys load and change
  nothing (the same values arrive; the bytes are not cut).
- ``use_reentrant``: DeepSpeed's choice of checkpoint implementation for the interval above;
  dslab's checkpoint (:func:`dslab.models.checkpoint.checkpoint`) has one, which replays the
  forward's random state, so either value gives the same gradients.

A model that is not a ``PipelineModule`` ignores the section, as DeepSpeed's engine does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from dslab.config_base import ConfigSection


class PipelineConfig(ConfigSection):
    stages: Literal["auto"] | int = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True

    @field_validator("stages", mode="before")
    @classmethod
    def _positive_stages(cls, value):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError("must be \"auto\" or a number of stages >= 1")
        return value

    def apply(self, module) -> None:
        """Check ``stages`` against ``module`` (a PipelineModule) and set its checkpoint interval."""
        if self.stages != "auto" and self.stages != module.num_stages:
            raise ValueError(f"config key 'pipeline.stages' is {self.stages}, but the PipelineModule has "
                             f"{module.num_stages} stages (its num_stages or topology places the ranks); "
                             f"set it to {module.num_stages} or \"auto\"")
        if self.activation_checkpoint_interval > 0:
            module.activation_checkpoint_interval = self.activation_checkpoint_interval
