"""The search space of ``dslab autotune``, read from the user's config, and its experiments.

A list where the config holds a scalar makes that key a dimension (DeepSpeed's "tuning scope");
a scalar fixes the key; a key that is absent takes dslab's default dimension::

    key                                          list / keyword             absent
    zero_optimization.stage                      [0, 2] | "all" (0-3)        0, 1, 2, 3
    train_micro_batch_size_per_gpu               [2, 4, 8] | "auto"          "auto"
    gradient_accumulation_steps                  [1, 2]                      1
    zero_optimization.offload_optimizer.device   ["none", "cpu"]             not fast: none, cpu
    activation_checkpointing.enabled             [false, true]               not fast: off, on
      (or dslab's checkpoint_layers: [0, 1, 2])
    cuda_graphs.enabled                          [false, true]               not fast, on CUDA: off, on
    kernels                                      ["auto", "torch"]           not fast: auto, torch

``"auto"`` micro-batch sizes are the powers of two from ``min_train_micro_batch_size_per_gpu`` to
``max_train_micro_batch_size_per_gpu`` (and to ``max_train_batch_size / (gas * world)`` when that
is set); :func:`choose_micro_batches` keeps ``num_tuning_micro_batch_sizes`` of those the memory
model lets through (:mod:`.memory_model`). Offloading the optimizer needs stage 1-3, so stage 0
is paired with ``"none"`` only. Activation checkpointing is written as the engine's section
spells it: ``checkpoint_layers`` (0 off, n segments of n layers) where the engine has that key
(a fixed ``enabled: true`` too becomes ``checkpoint_layers: 1``), else ``enabled``; the default
dimension exists only where the engine has one of them.

A user who fixes ``train_batch_size`` keeps it: each experiment's gradient accumulation is then
``train_batch_size / (micro-batch * world)``, and micro-batch sizes that do not divide it are
left out (a note says which). Otherwise an experiment's config sets the micro-batch size and the
gradient accumulation and drops ``train_batch_size``; ``min_train_batch_size`` and
``max_train_batch_size`` bound ``micro-batch * gas * world``.

Experiments are ordered as the grid search runs them: stage, then the other dimensions in the
table's order, then micro-batch ascending, then gradient accumulation ascending.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
KERNEL_CHOICES = ("auto", "torch", "triton")
# The dimensions besides stage, micro-batch and gradient accumulation, in name order.
EXTRA_DIMENSIONS = ("offload_optimizer", "activation_checkpointing", "cuda_graphs", "kernels")
_NAME_PREFIX = {"offload_optimizer": "off", "activation_checkpointing": "ckpt", "cuda_graphs": "cg", "kernels": "k"}


def checkpoint_key() -> str | None:
    """The key that switches activation checkpointing in the engine's ``activation_checkpointing``
    section: ``checkpoint_layers`` (dslab's), ``enabled``, or None when it has neither."""
    from dslab.engine.activation_checkpointing import ActivationCheckpointingConfig

    fields = ActivationCheckpointingConfig.model_fields
    for key in ("checkpoint_layers", "enabled"):
        if key in fields:
            return key
    return None


def _section(config: dict, key: str) -> dict:
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"config key '{key}' must be an object, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One point of the space. ``extras`` holds ``(dimension, value)`` for the dimensions of
    :data:`EXTRA_DIMENSIONS` the space has, in that order; ``train_batch_size`` is the user's fixed
    one (None: the experiment's config drops the key)."""

    stage: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    extras: tuple[tuple[str, Any], ...] = ()
    train_batch_size: int | None = None

    @property
    def name(self) -> str:
        """A stable name, e.g. ``z2_mbs8_gas1`` or ``z2_mbs8_gas1_offcpu_ckpt1``."""
        parts = [f"z{self.stage}", f"mbs{self.micro_batch_size}", f"gas{self.gradient_accumulation_steps}"]
        for key, value in self.extras:
            parts.append(_NAME_PREFIX[key] + (str(int(value)) if isinstance(value, bool) else str(value)))
        return "_".join(parts)

    @property
    def group(self) -> tuple:
        """``(stage, extras)``: experiments that differ only in batch sizes."""
        return self.stage, self.extras

    def extra(self, key: str, default: Any = None) -> Any:
        return dict(self.extras).get(key, default)

    def overrides(self) -> dict:
        """What this experiment sets, under the report's names (``profilers.autotuning``)."""
        return {"zero_stage": self.stage, "micro_batch_size": self.micro_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps, **dict(self.extras)}

    def apply(self, config: dict) -> dict:
        """The experiment's full config: ``config`` (the user's) with every dimension resolved to
        this experiment's value, the batch keys consistent and the ``autotuning`` section removed
        (the experiment protocol, not the config, tells the engine it is an experiment)."""
        out = copy.deepcopy(config)
        out.pop("autotuning", None)
        zero = dict(_section(out, "zero_optimization"))
        zero["stage"] = self.stage
        extras = dict(self.extras)
        if "offload_optimizer" in extras:
            zero["offload_optimizer"] = {**_section(zero, "offload_optimizer"), "device": extras["offload_optimizer"]}
        out["zero_optimization"] = zero
        out["train_micro_batch_size_per_gpu"] = self.micro_batch_size
        out["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        if self.train_batch_size is None:
            out.pop("train_batch_size", None)
        else:
            out["train_batch_size"] = self.train_batch_size
        checkpointing = _section(out, "activation_checkpointing")
        if "activation_checkpointing" in extras:
            layers = extras["activation_checkpointing"]
        elif "enabled" in checkpointing and checkpoint_key() == "checkpoint_layers":
            # a fixed DeepSpeed-style switch, in the engine's spelling
            layers = (checkpointing.get("checkpoint_layers") or 1) if checkpointing["enabled"] else 0
        else:
            layers = None
        if layers is not None:
            section = {k: v for k, v in checkpointing.items() if k not in ("enabled", "checkpoint_layers")}
            if checkpoint_key() == "checkpoint_layers":
                section["checkpoint_layers"] = layers
            else:
                section["enabled"] = layers > 0
            out["activation_checkpointing"] = section
        if "cuda_graphs" in extras:
            out["cuda_graphs"] = {**_section(out, "cuda_graphs"), "enabled": extras["cuda_graphs"]}
        if "kernels" in extras:
            out["kernels"] = extras["kernels"]
        return out


def offload_device(config: dict) -> str:
    """``zero_optimization.offload_optimizer.device`` of an experiment's config ("none" if unset)."""
    return str(_section(_section(config, "zero_optimization"), "offload_optimizer").get("device", "none"))


def checkpoint_layers(config: dict) -> int:
    """Activation checkpointing in an experiment's config: ``checkpoint_layers``, 1 for
    ``enabled: true``, 0 when off or unset."""
    section = _section(config, "activation_checkpointing")
    if section.get("checkpoint_layers") is not None:
        return int(section["checkpoint_layers"])
    return 1 if section.get("enabled") is True else 0


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _ints(key: str, values: Any, low: int, allowed: tuple | None = None) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (allowed is not None and v not in allowed):
            want = f"one of {', '.join(map(str, allowed))}" if allowed else f"an integer >= {low}"
            raise ValueError(f"config key '{key}': every value must be {want}, got {v!r} in {list(values)!r}")
        out.append(v)
    if not out:
        raise ValueError(f"config key '{key}': an empty list leaves nothing to tune")
    return tuple(sorted(set(out)))


def _choices(key: str, values: Any, allowed: tuple) -> tuple:
    out = []
    for v in values:
        if v not in allowed or isinstance(v, bool) != isinstance(allowed[0], bool):
            raise ValueError(f"config key '{key}': every value must be one of "
                             f"{', '.join(map(repr, allowed))}, got {v!r} in {list(values)!r}")
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError(f"config key '{key}': an empty list leaves nothing to tune")
    return tuple(out)


def powers_of_two(low: int, high: int) -> list[int]:
    """The powers of two ``p`` with ``low <= p <= high``, ascending."""
    out, p = [], 1
    while p <= high:
        if p >= low:
            out.append(p)
        p *= 2
    return out


def choose_micro_batches(fitting: list[int], count: int, spread: bool) -> list[int]:
    """``count`` of the ascending ``fitting`` sizes: evenly spread over the list (its first and last
    always among them) when ``spread`` (the memory model knows where the list ends), else the
    ``count`` smallest (the tuner grows the micro-batch until one runs out of memory)."""
    if len(fitting) <= count:
        return list(fitting)
    if not spread:
        return list(fitting[:count])
    if count == 1:
        return [fitting[-1]]
    picks = sorted({round(i * (len(fitting) - 1) / (count - 1)) for i in range(count)})
    return [fitting[i] for i in picks]


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The dimensions read from a config (module docstring).

    ``micro_batch_sizes`` are the candidates (before the memory model); ``micro_batch_auto`` says
    they came from ``"auto"``, so that :func:`choose_micro_batches` picks among them.
    ``world_size`` is the data-parallel world (processes / ``mp_size``)."""

    stages: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]
    micro_batch_auto: bool
    gradient_accumulation_steps: tuple[int, ...]
    extras: tuple[tuple[str, tuple], ...]
    train_batch_size: int | None
    world_size: int
    min_train_batch_size: int = 1
    max_train_batch_size: int | None = None
    num_tuning_micro_batch_sizes: int = 3
    notes: tuple[str, ...] = ()

    def groups(self) -> list[tuple[int, tuple[tuple[str, Any], ...]]]:
        """``(stage, extras)`` in space order; stage 0 never with an offloaded optimizer."""
        keys = [key for key, _ in self.extras]
        out = []
        for stage in self.stages:
            for values in itertools.product(*(values for _, values in self.extras)):
                extras = tuple(zip(keys, values))
                if stage == 0 and dict(extras).get("offload_optimizer", "none") != "none":
                    continue
                out.append((stage, extras))
        return out

    def accumulation_steps(self, micro_batch_size: int) -> list[int]:
        """The gradient accumulation values that go with ``micro_batch_size`` within the batch
        limits (one derived value when ``train_batch_size`` is fixed; none when it does not divide)."""
        if self.train_batch_size is not None:
            per_step = micro_batch_size * self.world_size
            if self.train_batch_size % per_step:
                return []
            candidates = [self.train_batch_size // per_step]
        else:
            candidates = list(self.gradient_accumulation_steps)
        return [gas for gas in candidates if self._batch_ok(micro_batch_size * gas * self.world_size)]

    def _batch_ok(self, batch: int) -> bool:
        return batch >= self.min_train_batch_size and (self.max_train_batch_size is None
                                                       or batch <= self.max_train_batch_size)

    def experiments(self, stage: int, extras: tuple, micro_batch_sizes: list[int] | None = None) -> list[Experiment]:
        """A group's experiments over ``micro_batch_sizes`` (default: the candidates), in space order."""
        sizes = self.micro_batch_sizes if micro_batch_sizes is None else micro_batch_sizes
        return [Experiment(stage, mbs, gas, extras, self.train_batch_size)
                for mbs in sorted(sizes) for gas in self.accumulation_steps(mbs)]

    def all_experiments(self) -> list[Experiment]:
        """Every candidate experiment, in space order (before the memory model)."""
        return [e for stage, extras in self.groups() for e in self.experiments(stage, extras)]


def _stage_values(zero: dict) -> tuple[int, ...] | None:
    stage = zero.get("stage")
    if stage is None or stage == "all":
        return None
    return _ints("zero_optimization.stage", stage if _is_list(stage) else [stage], 0, STAGES)


def _extra_dimensions(config: dict, fast: bool, cuda_available: bool, notes: list[str]) -> list[tuple[str, tuple]]:
    zero = _section(config, "zero_optimization")
    dims: list[tuple[str, tuple]] = []
    offload = _section(zero, "offload_optimizer").get("device")
    if _is_list(offload):
        dims.append(("offload_optimizer",
                     _choices("zero_optimization.offload_optimizer.device", offload, OFFLOAD_DEVICES)))
    elif offload is None and not fast:
        dims.append(("offload_optimizer", ("none", "cpu")))
    ckpt = _section(config, "activation_checkpointing")
    if _is_list(ckpt.get("enabled")):
        values = _choices("activation_checkpointing.enabled", ckpt["enabled"], (False, True))
        dims.append(("activation_checkpointing", tuple(int(v) for v in values)))
    elif _is_list(ckpt.get("checkpoint_layers")):
        dims.append(("activation_checkpointing",
                     _ints("activation_checkpointing.checkpoint_layers", ckpt["checkpoint_layers"], 0)))
    elif not fast and "enabled" not in ckpt and "checkpoint_layers" not in ckpt:
        if checkpoint_key() is None:
            notes.append("activation checkpointing is not searched: the engine's activation_checkpointing "
                         "section has no key that switches it")
        else:
            dims.append(("activation_checkpointing", (0, 1)))
    graphs = _section(config, "cuda_graphs").get("enabled")
    if _is_list(graphs):
        dims.append(("cuda_graphs", _choices("cuda_graphs.enabled", graphs, (False, True))))
    elif graphs is None and not fast and cuda_available:
        dims.append(("cuda_graphs", (False, True)))
    kernels = config.get("kernels")
    if _is_list(kernels):
        dims.append(("kernels", _choices("kernels", kernels, KERNEL_CHOICES)))
    elif kernels is None and not fast:
        dims.append(("kernels", ("auto", "torch")))
    return dims


def _micro_batch_candidates(config: dict, settings, world: int, min_gas: int) -> tuple[tuple, bool]:
    value = config.get("train_micro_batch_size_per_gpu")
    key = "train_micro_batch_size_per_gpu"
    if value is not None and value != "auto":
        return _ints(key, value if _is_list(value) else [value], 1), False
    high = settings.max_train_micro_batch_size_per_gpu
    if settings.max_train_batch_size is not None:
        high = min(high, settings.max_train_batch_size // (min_gas * world))
    sizes = powers_of_two(settings.min_train_micro_batch_size_per_gpu, high)
    if not sizes:
        raise ValueError(
            f"no power-of-two micro-batch size lies between autotuning.min_train_micro_batch_size_per_gpu "
            f"({settings.min_train_micro_batch_size_per_gpu}) and {high} (autotuning.max_train_micro_batch_size_per_gpu"
            + (", autotuning.max_train_batch_size / (gradient_accumulation_steps x world size)"
               if settings.max_train_batch_size is not None else "") + ")")
    return tuple(sizes), True


def build_space(config: dict, settings, processes: int = 1, cuda_available: bool = False) -> SearchSpace:
    """The search space of the user's ``config`` (a dict holding lists where dimensions are) under
    the autotuning ``settings`` (the config's ``autotuning`` section), for ``processes`` processes.
    Bad values raise ValueError naming the key."""
    if processes < 1:
        raise ValueError(f"the number of processes must be >= 1, got {processes}")
    if processes % settings.mp_size:
        raise ValueError(f"autotuning.mp_size ({settings.mp_size}) must divide the number of processes ({processes})")
    world = processes // settings.mp_size
    notes: list[str] = []
    zero = _section(config, "zero_optimization")
    stages = _stage_values(zero) or STAGES
    tb = config.get("train_batch_size")
    if _is_list(tb):
        raise ValueError("config key 'train_batch_size': a list is not a tuning dimension; list "
                         "train_micro_batch_size_per_gpu and gradient_accumulation_steps instead")
    if tb is not None:
        (tb,) = _ints("train_batch_size", [tb], 1)
    gas = config.get("gradient_accumulation_steps")
    if tb is not None and _is_list(gas):
        raise ValueError("config keys 'train_batch_size' and 'gradient_accumulation_steps': with a fixed "
                         "train_batch_size the accumulation follows from the micro-batch size; drop one of them")
    gas_values = (1,) if gas is None else _ints("gradient_accumulation_steps", gas if _is_list(gas) else [gas], 1)
    sizes, auto = _micro_batch_candidates(config, settings, world, min(gas_values))
    extras = _extra_dimensions(config, settings.fast, cuda_available, notes)
    space = SearchSpace(tuple(stages), tuple(sizes), auto, gas_values, tuple(extras), tb, world,
                        settings.min_train_batch_size, settings.max_train_batch_size,
                        settings.num_tuning_micro_batch_sizes)
    left_out = [mbs for mbs in sizes if not space.accumulation_steps(mbs)]
    if left_out:
        why = (f"do not divide train_batch_size ({tb}) over {world} process(es)" if tb is not None
               else "give a batch outside autotuning.min_train_batch_size/max_train_batch_size")
        notes.append(f"micro-batch sizes {left_out} left out: they {why}")
    if not space.all_experiments():
        raise ValueError("the tuning space is empty: no micro-batch size and gradient accumulation fit the batch "
                         "limits (train_batch_size, autotuning.min_train_batch_size, autotuning.max_train_batch_size)")
    return dataclasses.replace(space, notes=tuple(notes))
