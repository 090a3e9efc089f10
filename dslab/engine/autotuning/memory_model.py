"""Which experiments fit in memory: model states estimated, activations measured.

An experiment's peak memory per GPU is estimated as::

    model_states(stage, offload, world) + activation_bytes_per_sample(checkpointing) * micro_batch

- Model states come from :func:`dslab.estimate_zero_memory` in dslab's engine layout (fp32
  parameters and gradients, no master copy: ``param_bytes=4, master_bytes=0``), for the model's
  ``num_params`` (reported by the profile experiment), the optimizer's state count (Adam, AdamW and
  Lamb 2, SGD 1 with momentum and 0 without), ZeRO stage, optimizer offload and data-parallel
  world size. Stage 3's gathered-layer buffer is not counted (experiments do not report the
  largest layer); it is inside the measured activation figure of a stage 3 profile.
- Activation bytes per sample are measured: the tuner runs one profile experiment at the smallest
  micro-batch (:func:`activation_per_sample`: its ``peak_memory_bytes`` minus the estimated model
  states, over its micro-batch size), and one more at each activation-checkpointing setting of the
  space. The figure holds everything besides the model states that grows with the batch or not
  (activations, temporary buffers, collective buckets). Each later experiment that runs teaches
  the model again (:meth:`MemoryModel.learn`): the figure of the largest micro-batch measured at a
  checkpointing setting replaces a smaller one's, since a one-sample peak can sit far from the
  slope. On one H200, GPT-2 355M with CUDA graphs peaked 0.15 GB over its model states at
  micro-batch 1 and 0.93 GB a sample from 16 on; the one-sample figure let micro-batches 512,
  264 and 144 run out of memory, where the figure of 16 prunes 512 and 264 unlaunched. Where a checkpointing profile did not run or failed, its experiments are estimated
  with the non-checkpointed figure (:data:`CHECKPOINT_FALLBACK_FACTOR` = 1.0): checkpointing only
  ever lowers activation memory, so this is an upper bound.

The budget is the device's memory (``torch.cuda.get_device_properties(0).total_memory``) times
:data:`BUDGET_FRACTION` (0.95: the CUDA context and allocator fragmentation are not in the
estimate), or the ``--memory-budget`` the user gives (:func:`parse_memory_size`). Without either
(a CPU and no option) nothing is pruned; without a measured activation figure (a profile on a CPU
reports no peak) only the model states are compared with the budget. GB here is 10^9 bytes.
"""

from __future__ import annotations

import dataclasses
import re

from dslab.engine.autotuning.space import Experiment, checkpoint_layers, offload_device

GB = 1e9
BUDGET_FRACTION = 0.95
CHECKPOINT_FALLBACK_FACTOR = 1.0
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]?)(I?)B?\s*$", re.IGNORECASE)
_UNIT_POWER = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_memory_size(text: str, name: str = "--memory-budget") -> int:
    """``"40GB"`` or ``"40G"`` (10^9 bytes each), ``"40GiB"`` (2^30), ``"512MB"``, ``"4096"`` (bytes)
    -> bytes; a ValueError naming ``name`` for anything else."""
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"{name} must be a size like 40GB, 80GiB or 512MB, got {text!r}")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    value = float(number) * base ** _UNIT_POWER[unit.upper()]
    if value < 1:
        raise ValueError(f"{name} must be at least one byte, got {text!r}")
    return int(value)


def format_gb(num_bytes: float) -> str:
    """Bytes as GB (10^9), one decimal (two below 1 GB)."""
    value = num_bytes / GB
    return f"{value:.2f} GB" if value < 1 else f"{value:.1f} GB"


def device_memory_budget() -> int | None:
    """:data:`BUDGET_FRACTION` of the first CUDA device's memory; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory * BUDGET_FRACTION)


def optimizer_state_count(config: dict) -> int:
    """fp32 tensors per parameter the config's optimizer keeps (Adam, AdamW, Lamb, none given: 2;
    SGD: 1 with momentum, 0 without)."""
    optimizer = config.get("optimizer") or {}
    kind = str(optimizer.get("type", "Adam")).lower()
    if kind == "sgd":
        return 1 if (optimizer.get("params") or {}).get("momentum", 0) else 0
    return 2


@dataclasses.dataclass
class MemoryModel:
    """Estimates of one model on one data-parallel world (module docstring).

    ``activation_per_sample`` maps an activation-checkpointing setting (0 = off) to its measured
    bytes per sample; empty when nothing was measured."""

    num_params: int
    world_size: int
    budget_bytes: int | None
    optimizer_states: int = 2
    activation_per_sample: dict[int, float] = dataclasses.field(default_factory=dict)
    measured_at: dict[int, int] = dataclasses.field(default_factory=dict)

    def model_states(self, stage: int, offload: str = "none") -> int:
        """Model-state bytes per GPU (:func:`dslab.estimate_zero_memory`, dslab's layout)."""
        from dslab.engine.zero_estimate import estimate_zero_memory

        (row,) = estimate_zero_memory(self.num_params, num_gpus=self.world_size, stage=stage,
                                      offload_optimizer=offload, precision="fp32", param_bytes=4, master_bytes=0,
                                      optimizer_states=self.optimizer_states, largest_layer=0)
        return row.gpu_total

    @property
    def knows_activations(self) -> bool:
        return bool(self.activation_per_sample)

    def learn(self, experiment: Experiment, config: dict, peak_memory_bytes: int) -> str | None:
        """Take in the measured peak of an experiment that ran: its per-sample figure replaces the
        one of its checkpointing setting when its micro-batch is at least as large as the one that
        figure came from (module docstring). Returns a note when the figure changed by more than
        10%, else None."""
        layers = checkpoint_layers(experiment.apply(config))
        size = experiment.micro_batch_size
        if size < self.measured_at.get(layers, 0):
            return None
        per_sample, _ = activation_per_sample(self, experiment, config, peak_memory_bytes)
        before = self.activation_per_sample.get(layers)
        self.activation_per_sample[layers] = per_sample
        self.measured_at[layers] = size
        if before is None or abs(per_sample - before) > 0.1 * max(before, 1.0):
            was = f"{before / 1e6:.1f} MB" if before is not None else "unmeasured"
            return (f"activation memory per sample (checkpointing {layers}) re-measured at {experiment.name}: "
                    f"{per_sample / 1e6:.1f} MB (was {was})")
        return None

    def activation_bytes(self, layers: int, micro_batch_size: int) -> float | None:
        """Activation bytes of a micro-batch at checkpointing setting ``layers`` (module
        docstring); None when no profile measured any."""
        if not self.activation_per_sample:
            return None
        per_sample = self.activation_per_sample.get(layers)
        if per_sample is None:
            base = self.activation_per_sample.get(0, max(self.activation_per_sample.values()))
            per_sample = base * CHECKPOINT_FALLBACK_FACTOR
        return per_sample * micro_batch_size

    def estimate(self, experiment: Experiment, config: dict) -> int:
        """Estimated peak bytes per GPU of ``experiment`` over the user's ``config``; model states
        only when no activation figure was measured."""
        applied = experiment.apply(config)
        states = self.model_states(experiment.stage, offload_device(applied))
        activations = self.activation_bytes(checkpoint_layers(applied), experiment.micro_batch_size)
        return int(states + (activations or 0))

    def over_budget(self, experiment: Experiment, config: dict) -> str | None:
        """Why ``experiment`` is pruned (``"estimated 91.2 GB > 80.0 GB budget (...)"``), or None
        when it fits or there is no budget."""
        if self.budget_bytes is None:
            return None
        estimate = self.estimate(experiment, config)
        if estimate <= self.budget_bytes:
            return None
        applied = experiment.apply(config)
        states = self.model_states(experiment.stage, offload_device(applied))
        detail = f"model states {format_gb(states)}"
        if self.knows_activations:
            detail += f" + activations {format_gb(estimate - states)}"
        return f"estimated {format_gb(estimate)} > {format_gb(self.budget_bytes)} budget ({detail})"


def activation_per_sample(model: MemoryModel, experiment: Experiment, config: dict,
                          peak_memory_bytes: int) -> tuple[float, str | None]:
    """Activation bytes per sample from a profile experiment's measured peak: (peak - estimated
    model states) / micro-batch, and a note when the estimate exceeded the peak (then 0)."""
    states = model.model_states(experiment.stage, offload_device(experiment.apply(config)))
    left = peak_memory_bytes - states
    if left < 0:
        return 0.0, (f"profile {experiment.name}: measured peak {format_gb(peak_memory_bytes)} is below the "
                     f"estimated model states {format_gb(states)}; activations taken as 0")
    return left / experiment.micro_batch_size, None


@dataclasses.dataclass
class Plan:
    """The experiments the tuner may run (space order), the pruned ones with their reasons, and
    every estimate made (bytes, by experiment name)."""

    experiments: list[Experiment]
    pruned: list[tuple[Experiment, str]]
    estimates: dict[str, int]


def plan(space, config: dict, model: MemoryModel | None) -> Plan:
    """Apply the memory model to ``space`` (a :class:`~.space.SearchSpace`) group by group.

    In each ``(stage, extras, gas)`` the micro-batch sizes the model lets through are kept; from
    ``"auto"`` candidates :func:`~.space.choose_micro_batches` keeps
    ``num_tuning_micro_batch_sizes`` of them (spread over the range when activations were
    measured, else the smallest), and only the first size over budget is listed as pruned (the
    list stops at the largest power of two that fits); every size of a user's list over budget is
    listed."""
    from dslab.engine.autotuning.space import choose_micro_batches

    kept: list[Experiment] = []
    pruned: list[tuple[Experiment, str]] = []
    estimates: dict[str, int] = {}
    for stage, extras in space.groups():
        by_gas: dict[int, list[Experiment]] = {}
        for experiment in space.experiments(stage, extras):
            by_gas.setdefault(experiment.gradient_accumulation_steps, []).append(experiment)
        chosen: list[Experiment] = []
        for experiments in by_gas.values():
            fitting = []
            for experiment in experiments:
                reason = None
                if model is not None:
                    estimates[experiment.name] = model.estimate(experiment, config)
                    reason = model.over_budget(experiment, config)
                if reason is None:
                    fitting.append(experiment)
                    continue
                pruned.append((experiment, reason))
                if space.micro_batch_auto:
                    break
            if space.micro_batch_auto:
                spread = model is not None and model.knows_activations and model.budget_bytes is not None
                sizes = choose_micro_batches([e.micro_batch_size for e in fitting],
                                             space.num_tuning_micro_batch_sizes, spread)
                fitting = [e for e in fitting if e.micro_batch_size in sizes]
            chosen.extend(fitting)
        kept.extend(sorted(chosen, key=lambda e: (e.micro_batch_size, e.gradient_accumulation_steps)))
    return Plan(kept, pruned, estimates)
