"""DeepSpeed's ``zero_optimization`` section.

dslab runs stage 0 (plain data parallelism with bucketed, overlapped gradient all-reduce). The
other keys are accepted with DeepSpeed's meaning so that existing configs validate; a stage above
0 is refused with a clear message rather than silently ignored.
"""

from __future__ import annotations

import warnings

from pydantic import Field, model_validator

from dslab.config_base import ConfigSection

SUPPORTED_STAGES = (0,)


class DslabDeprecationWarning(DeprecationWarning):
    """A config form dslab still reads but will stop reading; shown by default."""


warnings.simplefilter("default", DslabDeprecationWarning)


class OffloadOptimizerConfig(ConfigSection):
    device: str = "none"
    pin_memory: bool = False


class ZeroConfig(ConfigSection):
    stage: int = Field(0, ge=0, le=3)
    # dslab's default bucket is 25M elements rather than DeepSpeed's 5e8: a 5e8-element bucket
    # holds a whole BERT-large, so the all-reduce could only start after backward had finished.
    reduce_bucket_size: int = Field(25_000_000, ge=1)
    allgather_bucket_size: int = Field(500_000_000, ge=1)
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()

    @model_validator(mode="before")
    @classmethod
    def _legacy_bool(cls, data):
        if isinstance(data, bool):
            if data:
                warnings.warn(
                    '"zero_optimization": true is the 2020 form; it is read as {"stage": 1}. '
                    'Write {"stage": 1} instead.',
                    DslabDeprecationWarning,
                    stacklevel=2,
                )
                return {"stage": 1}
            return {"stage": 0}
        return data

    def check_supported(self) -> None:
        if self.stage not in SUPPORTED_STAGES:
            raise ValueError(
                f"config key 'zero_optimization.stage' = {self.stage} is not supported yet: dslab "
                f"runs ZeRO stage 0 (data parallel) only; set the stage to 0 or remove the section"
            )
