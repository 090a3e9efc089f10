"""DeepSpeed's ``zero_optimization`` section.

Stage 0 is plain data parallelism (bucketed, overlapped gradient all-reduce); stages 1 to 3 shard
optimizer states, then gradients, then parameters (:mod:`dslab.engine.zero`). The keys keep
DeepSpeed's meaning: ``reduce_bucket_size`` caps a stage 1/2 unit (elements), ``overlap_comm``
lets reductions run during backward, ``stage3_prefetch_bucket_size`` caps the elements gathered
ahead of use, ``stage3_max_live_parameters`` the gathered elements alive at once,
``stage3_param_persistence_threshold`` keeps modules with at most that many elements gathered,
``stage3_max_reuse_distance`` keeps a module gathered after its forward when its backward comes
within that many gathered elements (DeepSpeed's default 1e9 keeps every module of a model under
~0.5e9 parameters gathered from its forward to its backward; 0 releases each after its forward),
``stage3_module_granularity_threshold`` gathers a module whole, with its descendants, when its
parameter elements over ``1 +`` its descendant modules fall below it (fewer, larger gathers;
0, the default, is off),
``stage3_gather_16bit_weights_on_model_save`` (or its earlier name with ``fp16``) lets
``engine.save_16bit_model`` gather stage 3's weights,
``sub_group_size`` is how many elements of its shards an offloaded optimizer steps at a time
before their new values start back to the GPU (DeepSpeed's tile for the CPU step; dslab applies
it at stages 1-3 with ``offload_optimizer``).
``allgather_bucket_size`` caps the elements of one all-gather of updated parameters after the
step (a larger unit is gathered in pieces through a staging buffer of that size);
``reduce_scatter: false`` all-reduces each gradient unit instead of reduce-scattering it (each
rank keeps its slice). ``contiguous_gradients`` is accepted for DeepSpeed configs and has no
effect: dslab always packs a unit's gradients into one contiguous buffer for its collective. So do
``allgather_partitions`` (false asks DeepSpeed for broadcasts instead of one all-gather: the same
parameters), ``round_robin_gradients`` (the order offloaded gradients are copied in) and
``memory_efficient_linear`` (stage 3 releases a module's weights after use either way).
``load_from_fp32_weights`` and ``ignore_unused_parameters`` are accepted true (what dslab does:
masters come back from the checkpoint's fp32 shards; stage 3 trains a model with unused
parameters), ``elastic_checkpoint`` false and the MiCS keys off; otherwise refused by name. The
2021 ``cpu_offload: true`` reads as ``offload_optimizer: {"device": "cpu"}``, with a warning.
``overlap_param_gather`` (dslab's key, stages 1 and 2, default off) waits for each unit's
all-gather of updated parameters where the next forward first reads it instead of at the end of
the step (:mod:`dslab.engine.zero.param_gather`).
"""

from __future__ import annotations

import warnings

from pydantic import Field, field_validator, model_validator

from dslab.config_base import ConfigSection

SUPPORTED_STAGES = (0, 1, 2, 3)


class DslabDeprecationWarning(DeprecationWarning):
    """A config form dslab still reads but will stop reading; shown by default."""


warnings.simplefilter("default", DslabDeprecationWarning)


class OffloadOptimizerConfig(ConfigSection):
    """``offload_optimizer``: ``device: cpu`` keeps each rank's masters, gradient shards and
    optimizer states in CPU memory and steps there (:mod:`dslab.engine.zero.offload`).
    ``pin_memory`` pins the masters when CUDA is in use; the gradient buffers are pinned on CUDA
    regardless, since they receive copies issued during backward.

    ``device: nvme`` (ZeRO-Infinity) does the same and also keeps the optimizer states in files
    under ``nvme_path``, swapped into ``buffer_count`` pinned buffers around each sub-group's
    CPU step through the ``aio`` section's handle (:mod:`dslab.engine.zero.nvme_offload`).
    ``pipeline_read`` (prefetch the next sub-group's states while the current one steps) and
    ``pipeline_write`` (write a stepped sub-group back while the next steps) are DeepSpeed's
    keys; dslab's default for both is true (DeepSpeed's is false), false serialises them.

    ``ratio`` (DeepSpeed's ZeRO-Offload++ key) is the fraction of the shards, by elements, that
    the offload steps on the CPU; the other units keep their masters, gradients and optimizer
    states on the GPU and step there, ahead of the CPU chunks (1.0, the default, offloads all).
    With ``offload_param`` only the CPU-stepped units' parameters leave the GPU.

    ``accumulate_on`` (dslab's key; DeepSpeed has none): where a micro-step's gradient shard is
    added to the window's sum in CPU memory under gradient accumulation. ``"gpu"`` (the default)
    copies the sum to the GPU, adds there and copies it back; ``"cpu"`` copies the shard to one of
    ``staging_buffers`` pinned buffers and adds it on the CPU in a worker thread, so that nothing
    but parameters crosses PCIe towards the GPU (parameter offload's fetches use that direction)
    and the GPU never holds more than that many shards waiting for their copies;
    ``"gpu_resident"`` keeps the window's sum on the GPU (4 bytes per shard element while the
    window lasts) and copies it to the host once, at the window's last micro-step.
    ``staging_dtype`` (dslab's key; with ``accumulate_on: "cpu"`` only): ``"bf16"`` converts those
    later shards to bf16 on the GPU before they cross PCIe (half the bytes copied, and half the
    host's reads of them); the window's sum stays in the masters' dtype on the CPU. Each later
    micro-step's shard is then rounded to bf16 before it is added (the first is copied whole).

    ``overlap_step`` (dslab's key, with ``offload_param: cpu``; off by default): the CPU step of
    the offloaded parameters runs on a worker thread, in forward order, while the next forward
    begins; a fetch of a unit waits until the step has updated it (:mod:`dslab.engine.zero.step_overlap`).
    The results are the serial step's. The optimizer must be one of torch.optim's (the worker
    steps a copy that shares its state; another class is refused). Parameters or optimizer states read outside the engine
    between a step and the next forward need ``engine.zero.settle()`` first, as checkpoints do."""

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    ratio: float = Field(1.0, gt=0.0, le=1.0)
    accumulate_on: str = "gpu"
    staging_buffers: int = Field(4, ge=1)
    staging_dtype: str | None = None
    buffer_count: int = Field(4, ge=2)
    pipeline_read: bool = True
    pipeline_write: bool = True
    overlap_step: bool = False

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value not in ("cpu", "nvme", "none"):
            raise ValueError(f"offload_optimizer.device must be 'cpu', 'nvme' or 'none', got {value!r}")
        return value

    @field_validator("accumulate_on")
    @classmethod
    def _known_accumulation(cls, value: str) -> str:
        if value not in ("gpu", "cpu", "gpu_resident"):
            raise ValueError(f"offload_optimizer.accumulate_on must be 'gpu', 'cpu' or 'gpu_resident', got {value!r}")
        return value

    @field_validator("staging_dtype")
    @classmethod
    def _known_staging_dtype(cls, value: str | None) -> str | None:
        if value not in (None, "bf16"):
            raise ValueError(f"offload_optimizer.staging_dtype must be 'bf16' or null, got {value!r}")
        return value

    @model_validator(mode="after")
    def _staging_dtype_needs_host_adds(self):
        if self.staging_dtype is not None and self.accumulate_on != "cpu":
            raise ValueError(f"config key 'zero_optimization.offload_optimizer.staging_dtype' = "
                             f"{self.staging_dtype!r} needs offload_optimizer.accumulate_on 'cpu' (the staged "
                             f"shards are what it converts), got accumulate_on {self.accumulate_on!r}")
        return self

    @model_validator(mode="after")
    def _nvme_needs_a_path(self):
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("config key 'zero_optimization.offload_optimizer.nvme_path' is "
                             "required with offload_optimizer.device 'nvme': the directory "
                             "(on the NVMe drive) that holds the swapped optimizer states")
        return self


class OffloadParamConfig(ConfigSection):
    """``offload_param`` (ZeRO-Infinity's parameter offload, stage 3 only): every sharded
    parameter unit (:mod:`dslab.engine.zero.partition`) keeps its shard off the GPU between uses
    and is fetched ahead of use (:mod:`dslab.engine.zero.param_offload`).

    ``device: cpu`` keeps the shards in CPU memory (pinned with ``pin_memory`` when CUDA is in
    use, so the copies to the GPU run on a side stream); ``device: nvme`` keeps them in files
    under ``nvme_path``, read through the ``aio`` section's handle into ``buffer_count`` pinned
    buffers, each sized to the largest shard (``buffer_size`` is read for DeepSpeed configs;
    DeepSpeed refuses a parameter larger than it, dslab sizes the buffers to fit). Units under
    ``stage3_param_persistence_threshold`` stay on the GPU, as DeepSpeed keeps them.
    ``max_in_cpu`` (DeepSpeed's key and default, 1e9): under NVMe offload, the first units up to
    that many shard elements stay in (pinned) CPU memory instead of files; 0 puts every shard in
    its file (each fetch reads it).
    Parameter offload needs ``offload_optimizer`` (cpu or nvme): the optimizer updates the
    offloaded shards where they live.

    ``fetch_dtype`` (dslab's key; ``device: cpu`` only): ``"bf16"`` or ``"fp16"`` keeps a copy of
    each offloaded shard in that dtype beside its fp32 master, refreshed whenever the master
    changes (the optimizer step, a checkpoint load), and fetches that copy, half the bytes over
    PCIe, widened to the parameter's dtype on the GPU. The parameters then hold the master's
    values rounded to that dtype, which is what autocast computes the model's matmuls from anyway;
    ops that read fp32 weights directly (an embedding lookup) see the rounding. Off (``None``,
    the default): the master itself is fetched."""

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = Field(5, ge=1)
    buffer_size: int = Field(100_000_000, ge=1)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    fetch_dtype: str | None = None

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value not in ("cpu", "nvme", "none"):
            raise ValueError(f"offload_param.device must be 'cpu', 'nvme' or 'none', got {value!r}")
        return value

    @field_validator("fetch_dtype")
    @classmethod
    def _known_fetch_dtype(cls, value: str | None) -> str | None:
        if value is not None and value not in ("bf16", "fp16"):
            raise ValueError(f"offload_param.fetch_dtype must be 'bf16', 'fp16' or null, got {value!r}")
        return value

    @model_validator(mode="after")
    def _nvme_needs_a_path(self):
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("config key 'zero_optimization.offload_param.nvme_path' is required "
                             "with offload_param.device 'nvme': the directory (on the NVMe "
                             "drive) that holds the parameter shards")
        if self.fetch_dtype is not None and self.device != "cpu":
            raise ValueError(f"config key 'zero_optimization.offload_param.fetch_dtype' = {self.fetch_dtype!r} "
                             f"needs offload_param.device 'cpu' (got {self.device!r}): the copies it fetches "
                             f"are kept in CPU memory")
        return self


class ZeroConfig(ConfigSection):
    stage: int = Field(0, ge=0, le=3)
    # dslab's default bucket is 25M elements rather than DeepSpeed's 5e8: a 5e8-element bucket
    # holds a whole BERT-large, so the all-reduce could only start after backward had finished.
    reduce_bucket_size: int = Field(25_000_000, ge=1)
    allgather_bucket_size: int = Field(500_000_000, ge=1)
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    overlap_param_gather: bool = False
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_gather_fp16_weights_on_model_save: bool = False  # DeepSpeed's earlier name
    stage3_module_granularity_threshold: int = Field(0, ge=0)
    sub_group_size: int = Field(1_000_000_000, ge=1)
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()
    # ZeRO++ (quantized weights and gradients, hierarchical partitioning): read so that configs
    # with them off load; switched on, they are refused by name (_refuse_zeropp)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int = Field(1, ge=1)
    # DeepSpeed keys with nothing to choose in dslab (module docstring)
    allgather_partitions: bool = True
    round_robin_gradients: bool = False
    memory_efficient_linear: bool = True
    load_from_fp32_weights: bool = True
    ignore_unused_parameters: bool = True
    elastic_checkpoint: bool = False
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False

    @model_validator(mode="after")
    def _refuse_other_choices(self):
        refused = {
            "load_from_fp32_weights": (not self.load_from_fp32_weights, "dslab restores the fp32 masters "
                                       "from the checkpoint's fp32 shards"),
            "ignore_unused_parameters": (not self.ignore_unused_parameters, "dslab's stage 3 trains a model "
                                         "whose forward leaves parameters unused, without a check"),
            "elastic_checkpoint": (self.elastic_checkpoint, "DeepSpeed's elastic stage 1-2 checkpoints are "
                                   "not written; dslab's ZeRO checkpoints load at another world size anyway"),
            "mics_shard_size": (self.mics_shard_size not in (-1, 0), "MiCS is not supported"),
            "mics_hierarchical_params_gather": (self.mics_hierarchical_params_gather, "MiCS is not supported"),
        }
        for key, (on, why) in refused.items():
            if on:
                raise ValueError(f"config key 'zero_optimization.{key}' = {getattr(self, key)!r}: {why}; "
                                 f"remove the key")
        return self

    @model_validator(mode="after")
    def _refuse_zeropp(self):
        on = [f"{key} = {getattr(self, key)}" for key in (
            "zero_quantized_weights", "zero_quantized_nontrainable_weights",
            "zero_quantized_gradients") if getattr(self, key)]
        if self.zero_hpz_partition_size != 1:
            on.append(f"zero_hpz_partition_size = {self.zero_hpz_partition_size}")
        if on:
            raise ValueError(
                f"ZeRO++ is not supported by dslab: 'zero_optimization.{on[0]}'"
                f"{' (and ' + ', '.join(on[1:]) + ')' if on[1:] else ''}; remove it, or set the "
                "zero_quantized_* keys to false and zero_hpz_partition_size to 1")
        return self

    @property
    def gather_16bit_weights_on_model_save(self) -> bool:
        return (self.stage3_gather_16bit_weights_on_model_save
                or self.stage3_gather_fp16_weights_on_model_save)

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
        if isinstance(data, dict) and "cpu_offload" in data:
            data = dict(data)
            cpu_offload = data.pop("cpu_offload")
            if cpu_offload is True:
                if "offload_optimizer" in data:
                    raise ValueError("config keys 'zero_optimization.cpu_offload' (the 2021 form) and "
                                     "'zero_optimization.offload_optimizer' are both given; keep offload_optimizer")
                warnings.warn('"cpu_offload": true is the 2021 form; it is read as "offload_optimizer": '
                              '{"device": "cpu"}. Write that instead.', DslabDeprecationWarning, stacklevel=2)
                data["offload_optimizer"] = {"device": "cpu"}
            elif cpu_offload not in (False, None):
                raise ValueError(f"config key 'zero_optimization.cpu_offload' must be true or false, "
                                 f"got {cpu_offload!r}")
        return data

    def check_supported(self, optimizer_type: str | None = None) -> None:
        """Refuse combinations dslab cannot run, naming the keys."""
        if self.stage not in SUPPORTED_STAGES:
            raise ValueError(
                f"config key 'zero_optimization.stage' = {self.stage} is not supported: dslab "
                f"runs stages {', '.join(map(str, SUPPORTED_STAGES))}"
            )
        if self.stage == 0 and self.offload_optimizer.device != "none":
            raise ValueError(
                "config key 'zero_optimization.offload_optimizer.device' = "
                f"{self.offload_optimizer.device!r} needs 'zero_optimization.stage' >= 1: stage 0 "
                "keeps whole optimizer states on every rank"
            )
        if self.overlap_param_gather and (self.stage not in (1, 2) or self.offload_optimizer.device != "none"):
            raise ValueError(
                "config key 'zero_optimization.overlap_param_gather' applies to stages 1 and 2 without "
                f"optimizer offload (stage {self.stage}, offload_optimizer.device "
                f"{self.offload_optimizer.device!r}): stage 0 gathers nothing, stage 3 gathers in "
                "its forward already, and an offloaded step publishes its shards chunk by chunk"
            )
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(
                "config key 'zero_optimization.offload_param.device' = "
                f"{self.offload_param.device!r} needs 'zero_optimization.stage' = 3: only stage 3 "
                f"partitions the parameters (the config has stage {self.stage})")
        if self.offload_param.device != "none" and self.offload_optimizer.device == "none":
            raise ValueError(
                "config key 'zero_optimization.offload_param.device' = "
                f"{self.offload_param.device!r} needs 'zero_optimization.offload_optimizer.device' "
                "'cpu' or 'nvme': the optimizer steps the offloaded parameter shards where they "
                "live, off the GPU")
        if self.offload_optimizer.overlap_step and (self.offload_param.device != "cpu"
                                                   or self.offload_optimizer.device != "cpu"):
            raise ValueError(
                "config key 'zero_optimization.offload_optimizer.overlap_step' = true needs "
                "offload_optimizer.device 'cpu' and offload_param.device 'cpu' (got "
                f"{self.offload_optimizer.device!r} and {self.offload_param.device!r}): the step it "
                "overlaps with the next forward is that of the parameters fetched from CPU memory")
        if self.stage > 0 and optimizer_type == "Lamb":
            raise ValueError(
                f"config key 'optimizer.type' = 'Lamb' cannot run with 'zero_optimization.stage' "
                f"= {self.stage}: LAMB's trust ratio needs each parameter's whole norm and ZeRO "
                "splits parameters across ranks; use stage 0 or Adam/AdamW/SGD"
            )
