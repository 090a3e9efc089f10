"""The engine's config: DeepSpeed's JSON keys, typed.

A config is a dict, a path to a JSON file, or a :class:`DslabConfig`. Each component owns its
section's model next to its code (``fp16``/``bf16`` in :mod:`precision`, ``optimizer`` in
:mod:`optimizers`, ``scheduler`` in :mod:`schedulers`, ``csv_monitor``/``tensorboard`` in
:mod:`monitor`, ``zero_optimization`` in :mod:`zero_config`, ``aio`` in
:mod:`dslab.io.config`, ``autotuning`` in :mod:`autotuning.config`, ``checkpoint`` in
:mod:`checkpoint_tags`); this module gathers them,
derives the batch sizes, and turns every problem into a ``ValueError`` that names the key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from dslab.config_base import ConfigSection, closest_key, known_keys, parse_section
from dslab.engine.activation_checkpointing import ActivationCheckpointingConfig
from dslab.engine.autotuning.config import AutotuningConfig
from dslab.engine.checkpoint_tags import CheckpointConfig
from dslab.engine.compile_config import CompileConfig
from dslab.engine.cuda_graph_config import CudaGraphConfig
from dslab.engine.monitor import CSVMonitorConfig, TensorBoardConfig
from dslab.engine.optimizers import OptimizerConfig
from dslab.engine.pipeline_config import PipelineConfig
from dslab.engine.precision import BF16Config, DataTypesConfig, FP16Config
from dslab.engine.schedulers import SchedulerConfig
from dslab.engine.zero_config import ZeroConfig
from dslab.io.config import AioConfig
from dslab.profilers.comms import CommsLoggerConfig
from dslab.profilers.flops import FlopsProfilerConfig
from dslab.profilers.memory import MemoryTracerConfig
from dslab.profilers.telemetry import TelemetryConfig

# DeepSpeed keys that dslab knows and does not implement. A section that is present but switched
# off ({"enabled": false}, false, null) is accepted and ignored; anything else is refused.
UNSUPPORTED_DEEPSPEED_KEYS = (
    "amp",
    "comet",
    "compression_training",
    "curriculum_learning",
    "data_efficiency",
    "dump_state",
    "eigenvalue",
    "elasticity",
    "graph_harvesting",
    "hybrid_engine",
    "memory_breakdown",
    "nebula",
    "progressive_layer_drop",
    "sparse_attention",
    "sparse_gradients",
    "wandb",
    "zero_force_ds_cpu_optimizer",
)


class DslabConfig(ConfigSection):
    """The whole engine config. Batch sizes are resolved by :meth:`resolve_batch_size`."""

    train_batch_size: int | None = Field(None, ge=1)
    train_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    steps_per_print: int = Field(10, ge=1)
    gradient_clipping: float = Field(0.0, ge=0.0)
    # DeepSpeed-Ulysses: ranks each sequence is split over (dslab.engine.sequence_parallel)
    sequence_parallel_size: int = Field(1, ge=1)
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = Field(BF16Config(), alias="bf16")
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    wall_clock_breakdown: bool = False
    csv_monitor: CSVMonitorConfig = CSVMonitorConfig()
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    zero_optimization: ZeroConfig = ZeroConfig()
    # None when absent: checkpoints are written with torch.save to a path; NVMe offload then
    # uses the section's defaults
    aio: AioConfig | None = None
    checkpoint: CheckpointConfig = CheckpointConfig()
    # DeepSpeed's pipeline engine keys, read by the pipeline engine (engine/pipeline_config.py)
    pipeline: PipelineConfig = PipelineConfig()
    # the dtype data-parallel gradients are reduced in (stages 0-2); None: the gradients' own
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    data_types: DataTypesConfig = DataTypesConfig()
    # DeepSpeed's: divide data-parallel gradients by the group's size before their sum
    # (prescale_gradients), or by gradient_predivide_factor before it and by size / factor after
    # (engine/data_parallel.py: GradientScaling); by default the collective averages
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0

    @field_validator("gradient_predivide_factor")
    @classmethod
    def _positive_predivide(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 0:
            raise ValueError("must be a positive number (gradients are divided by it before their all-reduce)")
        return value
    # DeepSpeed asks for this to run ZeRO with an optimizer it has not tested; dslab's ZeRO steps
    # any torch.optim optimizer (engine/zero/runtime.py: ZeroRuntime.adopt), so either value runs
    zero_allow_untested_optimizer: bool = False
    compile: CompileConfig = CompileConfig()
    # read by the tuner (dslab.engine.autotuning), not by the training step
    autotuning: AutotuningConfig = AutotuningConfig()
    # dslab's own keys
    cuda_graphs: CudaGraphConfig = CudaGraphConfig()
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    kernels: Literal["auto", "torch", "triton"] = "auto"
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()
    comms_logger: CommsLoggerConfig = CommsLoggerConfig()
    memory_tracer: MemoryTracerConfig = MemoryTracerConfig()
    telemetry: TelemetryConfig = TelemetryConfig()

    def resolve_batch_size(self, world_size: int) -> None:
        """Fill in the missing one of the three batch keys with DeepSpeed's rules and check that
        ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps *
        world_size``."""
        if world_size < 1:
            raise ValueError(f"data-parallel world size must be >= 1, got {world_size}")
        tb = self.train_batch_size
        mb = self.train_micro_batch_size_per_gpu
        gas = self.gradient_accumulation_steps
        if tb is None and mb is None:
            raise ValueError(
                "config needs 'train_batch_size' or 'train_micro_batch_size_per_gpu' (or both)"
            )
        if tb is not None and mb is not None and gas is None:
            gas = tb // (mb * world_size)
            if gas < 1:
                raise ValueError(
                    f"'train_batch_size' ({tb}) is smaller than 'train_micro_batch_size_per_gpu' "
                    f"({mb}) x world size ({world_size})"
                )
        elif tb is not None and mb is None:
            gas = gas or 1
            mb = tb // (gas * world_size)
            if mb < 1:
                raise ValueError(
                    f"'train_batch_size' ({tb}) is smaller than 'gradient_accumulation_steps' "
                    f"({gas}) x world size ({world_size})"
                )
        elif tb is None:
            gas = gas or 1
            tb = mb * gas * world_size
        if tb != mb * gas * world_size:
            raise ValueError(
                f"'train_batch_size' ({tb}) must equal 'train_micro_batch_size_per_gpu' ({mb}) x "
                f"'gradient_accumulation_steps' ({gas}) x data-parallel world size ({world_size}) "
                f"= {mb * gas * world_size}"
            )
        self.train_batch_size = tb
        self.train_micro_batch_size_per_gpu = mb
        self.gradient_accumulation_steps = gas

    @property
    def gradient_scaling(self):
        """``prescale_gradients`` and ``gradient_predivide_factor`` for the gradient reducers."""
        from dslab.engine.data_parallel import GradientScaling

        return GradientScaling(self.prescale_gradients, self.gradient_predivide_factor)

    @property
    def communication_dtype(self) -> torch.dtype | None:
        """``communication_data_type`` as a torch dtype (None: reduce in the gradients' dtype)."""
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        return names.get(self.communication_data_type)

    def to_dict(self) -> dict:
        """The config as DeepSpeed-style JSON data (only what differs from defaults is kept)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


def _switched_off(value: Any) -> bool:
    if value in (None, False):
        return True
    return isinstance(value, dict) and value.get("enabled") is False


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"config file {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a JSON object, not {type(data).__name__}")
    return data


def load_config(config: dict | str | Path | DslabConfig) -> DslabConfig:
    """Validate ``config`` (a dict, a JSON file path, or a DslabConfig) into a DslabConfig."""
    if isinstance(config, DslabConfig):
        return config
    if isinstance(config, (str, Path)):
        config = _read_json(Path(config))
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict or a path to a JSON file, not {type(config).__name__}")
    data = {}
    for key, value in config.items():
        if key in UNSUPPORTED_DEEPSPEED_KEYS:
            if _switched_off(value):
                continue
            raise ValueError(
                f"config key '{key}' is a DeepSpeed feature that dslab does not support yet; "
                f"remove it or switch it off"
            )
        data[key] = value
    unknown = [k for k in data if k not in known_keys(DslabConfig)]
    if unknown:
        key = unknown[0]
        hint = closest_key(key, known_keys(DslabConfig) + list(UNSUPPORTED_DEEPSPEED_KEYS))
        raise ValueError(
            f"unknown config key '{key}'" + (f"; did you mean '{hint}'?" if hint else "")
        )
    parsed = parse_section(DslabConfig, data)
    parsed.zero_optimization.check_supported(
        parsed.optimizer.type if parsed.optimizer is not None else None)
    if parsed.communication_data_type is not None and parsed.zero_optimization.stage == 3:
        raise ValueError(
            "config key 'communication_data_type' with 'zero_optimization.stage' = 3 is not supported: stage 3's "
            "graphed layer stack reduces its gradients inside CUDA graphs, in the gradients' dtype; remove it "
            "or use stage 0-2")
    if parsed.zero_optimization.stage == 3 and parsed.compile.enabled:
        raise ValueError(
            "config key 'compile.enabled' cannot be combined with 'zero_optimization.stage' = 3: "
            "stage 3 swaps each parameter's storage in and out around every module's forward, "
            "which a compiled graph does not see; use stage 2 with compile, or stage 3 without")
    return parsed
