"""The ``autotuning`` config section: DeepSpeed's keys and defaults, typed.

The section configures the tuner (:mod:`dslab.engine.autotuning`), not the training step: an engine
built from a config that has it trains as it would without it. The experiments the tuner launches
learn what to measure from their ``exp.json`` (:mod:`dslab.engine.autotuning.experiment`), which
the tuner fills from these keys.

DeepSpeed's internal keys (``metric_path``, ``model_info_path``, ``model_info``), which its tuner
writes into the configs of its own experiments, are not part of the section: dslab's experiments
exchange those through files in the experiment folder.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field

from dslab.config_base import ConfigSection

# A profiled step of an experiment that is this much worse than the best so far ends it early
# (DeepSpeed's METRIC_PERCENT_DIFF_CONST).
EARLY_STOP_MARGIN = 0.05


class AutotuningConfig(ConfigSection):
    """DeepSpeed's ``autotuning`` section.

    ``metric``: what the tuner maximises (``throughput``: samples/s of the data-parallel world;
    ``flops``: achieved FLOP/s per GPU) or minimises (``latency``: seconds per optimizer step).
    ``start_profile_step`` .. ``end_profile_step`` (inclusive, 1-based optimizer steps) are the
    steps each experiment times; the steps before warm up. ``fast``: tune the ZeRO stage and the
    micro-batch size only. Micro-batch sizes are searched between
    ``min_train_micro_batch_size_per_gpu`` and ``max_train_micro_batch_size_per_gpu``
    (``num_tuning_micro_batch_sizes`` of them), global batches between ``min_train_batch_size``
    and ``max_train_batch_size`` (None: no upper bound). ``tuner_early_stopping``: stop after this
    many experiments without a better one; ``tuner_num_trials``: experiments at most.
    ``arg_mappings``: config key -> the script's command-line option that sets it (for scripts
    that take batch sizes as arguments).

    dslab's key ``prune_dominated_stages`` (default true): hold back the ZeRO stages that can only
    buy memory where a lower stage fits (:func:`dslab.engine.autotuning.tuner.dominated_stages`);
    false runs every stage of the space (a full grid).

    dslab's key ``refine_micro_batch`` (default true): with ``"auto"`` micro-batch sizes and a
    throughput or flops metric, when the best experiment is the largest size of its group that ran
    and a larger one of that group did not fit (out of memory, or over the memory model's budget),
    the search goes on between the two (:func:`dslab.engine.autotuning.tuner.refine_midpoint`)
    while each step improves the best; the powers of two alone can leave most of the memory unused.
    """

    enabled: bool = False
    fast: bool = True
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    start_profile_step: int = Field(3, ge=1)
    end_profile_step: int = 5
    max_train_batch_size: int | None = Field(None, ge=1)
    min_train_batch_size: int = Field(1, ge=1)
    mp_size: int = Field(1, ge=1)
    num_tuning_micro_batch_sizes: int = Field(3, ge=1)
    min_train_micro_batch_size_per_gpu: int = Field(1, ge=1)
    max_train_micro_batch_size_per_gpu: int = Field(1024, ge=1)
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: int = Field(5, ge=1)
    tuner_num_trials: int = Field(50, ge=1)
    results_dir: str = Field("autotuning_results", min_length=1)
    exps_dir: str = Field("autotuning_exps", min_length=1)
    overwrite: bool = True
    arg_mappings: dict[str, str] = Field(default_factory=dict)
    # dslab's key
    prune_dominated_stages: bool = True
    refine_micro_batch: bool = True

    @pydantic.field_validator("arg_mappings", mode="before")
    @classmethod
    def _no_mappings(cls, value):
        # DeepSpeed's default is null
        return {} if value is None else value

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> AutotuningConfig:
        if self.end_profile_step <= self.start_profile_step:
            raise ValueError(
                f"autotuning.end_profile_step ({self.end_profile_step}) must be greater than "
                f"autotuning.start_profile_step ({self.start_profile_step})")
        if self.metric == "flops" and self.start_profile_step < 2:
            raise ValueError(
                "autotuning.start_profile_step (1) must be at least 2 with autotuning.metric "
                "'flops': an experiment counts the flops of the step before the profiled ones, so "
                "that the counting stays out of the timed steps")
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ValueError(
                f"autotuning.max_train_micro_batch_size_per_gpu ({self.max_train_micro_batch_size_per_gpu}) "
                f"must be at least autotuning.min_train_micro_batch_size_per_gpu "
                f"({self.min_train_micro_batch_size_per_gpu})")
        if self.max_train_batch_size is not None and self.max_train_batch_size < self.min_train_batch_size:
            raise ValueError(
                f"autotuning.max_train_batch_size ({self.max_train_batch_size}) must be at least "
                f"autotuning.min_train_batch_size ({self.min_train_batch_size})")
        return self
