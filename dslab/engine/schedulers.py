"""DeepSpeed's five learning-rate schedules, with DeepSpeed's parameter names, and their config.

Every schedule is stepped once per optimizer step by the engine. After ``step()`` the schedule's
iteration ``t`` (``last_batch_iteration``) is the number of optimizer steps taken so far minus
one, so the first ``step()`` gives ``t = 0``. A schedule built with ``last_batch_iteration=-1``
(the default) writes its ``t = -1`` value into the optimizer at construction: the warm-up
schedules start at their minimum, OneCycle at ``cycle_min_lr`` (and ``cycle_max_mom``),
LRRangeTest at ``lr_range_test_min_lr``.

Each schedule has ``step(last_batch_iteration=None)``, ``get_lr()`` (the values at the current
iteration), ``get_last_lr()`` (the values last written into the optimizer) and
``state_dict()``/``load_state_dict()``. A state dict holds plain ints, floats and lists only, so a
checkpoint holding it loads with ``torch.load(weights_only=True)``; loading one writes the
restored iteration's values back into the optimizer.

The formulas of each schedule are in its docstring. The config section is
:class:`SchedulerConfig` (``{"type": "WarmupLR", "params": {...}}``), and
:func:`build_scheduler` builds a schedule from it.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Literal

import pydantic
import torch
from pydantic import Field, ValidationInfo, field_validator

from dslab.config_base import ConfigSection, closest_key, parse_section


class ScheduleParamError(ValueError):
    """A bad schedule parameter; ``name`` is the parameter's name, ``detail`` what is wrong."""

    def __init__(self, name: str, detail: str):
        super().__init__(f"{name}: {detail}")
        self.name = name
        self.detail = detail


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScheduleParamError(name, f"must be an integer >= {minimum} (got {value!r})")
    return value


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ScheduleParamError(name, f"must be a finite number (got {value!r})")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ScheduleParamError(name, f"must be true or false (got {value!r})")
    return value


def _check_warmup_type(value: Any) -> str:
    if value not in ("log", "linear"):
        raise ScheduleParamError("warmup_type", f"must be 'log' or 'linear' (got {value!r})")
    return value


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    """A number, or a list with one number per param group, as one float per param group."""
    n_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ScheduleParamError(
                name, f"has {len(value)} values but the optimizer has {n_groups} param groups")
        return [_check_float(name, v) for v in value]
    return [_check_float(name, value)] * n_groups


def _warmup_fraction(t: int, num_steps: int, warmup_type: str) -> float:
    """How far warm-up has gone at iteration ``t < num_steps``: log(t+1)/log(N) or t/N, 0 if t<0."""
    if t < 0:
        return 0.0
    if warmup_type == "log":
        return math.log(t + 1) / math.log(num_steps)
    return t / num_steps


class _Schedule:
    """What every schedule shares: the iteration counter, writing values, the state dict.

    A subclass sets up its parameters, then calls ``_start(last_batch_iteration)``, and
    implements ``get_lr()`` (one lr per param group at ``self.last_batch_iteration``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer (got {type(optimizer).__name__})")
        self.optimizer = optimizer
        self.last_batch_iteration = -1
        self._last_lr: list[float] = []

    def _start(self, last_batch_iteration: int) -> None:
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, -1)
        self._apply()

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        """Write the current iteration's values into the optimizer's param groups."""
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: one past the current) and apply it."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, -1)
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer, one per param group."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "last_batch_iteration" not in state_dict:
            raise ValueError("scheduler state_dict lacks 'last_batch_iteration'")
        self.last_batch_iteration = _check_int(
            "last_batch_iteration", state_dict["last_batch_iteration"], -1)
        self._apply()


class WarmupLR(_Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold ``warmup_max_lr``.

    With ``N = max(2, warmup_num_steps)`` (raised so that log(N) > 0) and iteration ``t``::

        gamma = log(t + 1) / log(N)   ("log")     or   t / N   ("linear")    for t < N
        gamma = 1                                                             for t >= N
        lr    = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma

    ``warmup_min_lr`` / ``warmup_max_lr`` are a number or a list with one per param group.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001,
                 warmup_num_steps: int = 1000,
                 warmup_type: Literal["log", "linear"] = "log",
                 last_batch_iteration: int = -1):
        super().__init__(optimizer)
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, _check_int("warmup_num_steps", warmup_num_steps, 0))
        self.warmup_type = _check_warmup_type(warmup_type)
        self._setup()
        self._start(last_batch_iteration)

    def _setup(self) -> None:
        """Subclass hook: more parameter checks, run before the first values are applied."""

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        gamma = self._gamma(self.last_batch_iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`'s warm-up, then a linear decay to 0 at ``total_num_steps``.

    For ``t >= N`` (``N = max(2, warmup_num_steps)``)::

        gamma = max(0, (total_num_steps - t) / max(1, total_num_steps - N))
        lr    = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma

    ``total_num_steps`` smaller than ``N`` is a ValueError.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 total_num_steps: int,
                 warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001,
                 warmup_num_steps: int = 1000,
                 warmup_type: Literal["log", "linear"] = "log",
                 last_batch_iteration: int = -1):
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, 0)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                         warmup_type, last_batch_iteration)

    def _setup(self) -> None:
        if self.total_num_steps < self.warmup_num_steps:
            raise ScheduleParamError(
                "total_num_steps",
                f"must be at least warmup_num_steps ({self.warmup_num_steps}, which is raised "
                f"to at least 2) (got {self.total_num_steps})")

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - t) / decay_steps)


class WarmupCosineLR(_Schedule):
    """Warm up then cosine-anneal, as ratios of each param group's initial lr.

    The initial lr of a group is its ``lr`` when the schedule is built (kept in the state dict).
    With ``N = max(2, warmup_num_steps)``::

        w     = log(t + 1) / log(N)   ("log")   or   t / N   ("linear"),    0 for t < 0
        ratio = warmup_min_ratio + (1 - warmup_min_ratio) * w                for t < N
        s = min(t - N + 1, T),  T = max(1, total_num_steps - N)
        ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * s / T)) / 2)  t >= N
        lr    = initial_lr * ratio

    ``s`` stops at ``T``: past ``total_num_steps`` the ratio stays at ``cos_min_ratio`` rather
    than following the cosine back up. ``total_num_steps`` smaller than ``N`` is a ValueError.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 total_num_steps: int,
                 warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001,
                 warmup_type: Literal["log", "linear"] = "log",
                 last_batch_iteration: int = -1):
        super().__init__(optimizer)
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, 0)
        self.warmup_min_ratio = _check_float("warmup_min_ratio", warmup_min_ratio)
        self.warmup_num_steps = max(2, _check_int("warmup_num_steps", warmup_num_steps, 0))
        self.cos_min_ratio = _check_float("cos_min_ratio", cos_min_ratio)
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            raise ScheduleParamError(
                "total_num_steps",
                f"must be at least warmup_num_steps ({self.warmup_num_steps}, which is raised "
                f"to at least 2) (got {self.total_num_steps})")
        self.initial_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self._start(last_batch_iteration)

    def lr_ratio(self) -> float:
        """The ratio of initial lr at the current iteration (the formula above)."""
        t, n = self.last_batch_iteration, self.warmup_num_steps
        if t < n:
            w = _warmup_fraction(t, n, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * w
        total = max(1, self.total_num_steps - n)
        s = min(t - n + 1, total)
        cosine = (1.0 + math.cos(math.pi * s / total)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.lr_ratio()
        return [lr * ratio for lr in self.initial_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration,
                "initial_lrs": list(self.initial_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        initial = state_dict.get("initial_lrs")
        if not isinstance(initial, (list, tuple)) or len(initial) != len(self.initial_lrs):
            raise ValueError(
                f"scheduler state_dict 'initial_lrs' must list {len(self.initial_lrs)} lrs, one "
                f"per param group (got {initial!r})")
        self.initial_lrs = [float(v) for v in initial]
        super().load_state_dict(state_dict)


class OneCycle(_Schedule):
    """One triangular cycle of lr (and inverse momentum), then a decay.

    ``F = cycle_first_step_size``, ``S = cycle_second_step_size`` (default ``F``), total
    ``C = F + S``. With ``i = t + 1`` the continuous scale follows the brief's closed form::

        cycle = floor(1 + i / C),  x = 1 + i / C - cycle,  step_ratio = F / C
        scale = x / step_ratio               if x <= step_ratio
              = (x - 1) / (step_ratio - 1)   otherwise

    i.e. with ``k = i mod C``: ``scale = k / F`` rising over the first ``F`` steps, then
    ``1 - (k - F) / S`` falling over the next ``S``. It is computed from the integers, so stair
    boundaries are exact.

    Stairs: ``cycle_first_stair_count = K1 > 0`` cuts the rising half into ``K1`` equal stairs
    and holds the scale at the value it had at the start of each stair,
    ``scale = floor(K1 * k / F) / K1`` (values 0, 1/K1, ..., (K1-1)/K1); likewise
    ``cycle_second_stair_count = K2 > 0`` gives ``scale = 1 - floor(K2 * (k - F) / S) / K2`` on
    the falling half (values 1, 1 - 1/K2, ..., 1/K2). 0 is continuous;
    ``cycle_second_stair_count`` defaults to ``cycle_first_stair_count``.

    While ``t < C``::

        lr       = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale
        momentum = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale   (cycle_momentum)

    After the cycle, with ``d = t - C + 1`` and ``decay_step_size > 0``::

        lr       = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)
        momentum = cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size)

    ``decay_step_size = 0`` (the default) holds lr at ``cycle_min_lr`` and momentum at
    ``cycle_max_mom`` after the cycle. A positive ``decay_mom_rate`` grows momentum without bound,
    as DeepSpeed documents it; keep it 0 for Adam-family optimizers.

    Momentum is ``betas[0]`` of a param group that has ``betas`` (Adam, AdamW, Lamb) and
    ``momentum`` of one that has ``momentum`` (SGD). ``cycle_min_lr`` / ``cycle_max_lr`` are a
    number or a list with one per param group.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 cycle_min_lr: float | list[float],
                 cycle_max_lr: float | list[float],
                 decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0,
                 cycle_momentum: bool = True,
                 cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9,
                 decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = _check_float("decay_lr_rate", decay_lr_rate)
        self.first_step_size = _check_int("cycle_first_step_size", cycle_first_step_size, 1)
        self.second_step_size = (self.first_step_size if cycle_second_step_size is None else
                                 _check_int("cycle_second_step_size", cycle_second_step_size, 1))
        self.first_stair_count = _check_int("cycle_first_stair_count", cycle_first_stair_count, 0)
        self.second_stair_count = (
            self.first_stair_count if cycle_second_stair_count is None else
            _check_int("cycle_second_stair_count", cycle_second_stair_count, 0))
        self.decay_step_size = _check_int("decay_step_size", decay_step_size, 0)
        self.cycle_momentum = _check_bool("cycle_momentum", cycle_momentum)
        self.min_mom = _check_float("cycle_min_mom", cycle_min_mom)
        self.max_mom = _check_float("cycle_max_mom", cycle_max_mom)
        self.decay_mom_rate = _check_float("decay_mom_rate", decay_mom_rate)
        self.total_size = self.first_step_size + self.second_step_size
        if self.cycle_momentum:
            for index, group in enumerate(optimizer.param_groups):
                if "betas" not in group and "momentum" not in group:
                    raise ScheduleParamError(
                        "cycle_momentum",
                        f"param group {index} of {type(optimizer).__name__} has neither 'betas' "
                        "nor 'momentum'; set cycle_momentum to false")
        self._last_momentum: list[float] = []
        self._start(last_batch_iteration)

    def _scale(self) -> float:
        k = (self.last_batch_iteration + 1) % self.total_size
        f, s = self.first_step_size, self.second_step_size
        if k <= f:
            if self.first_stair_count > 0:
                return math.floor(self.first_stair_count * k / f) / self.first_stair_count
            return k / f
        j = k - f
        if self.second_stair_count > 0:
            return 1.0 - math.floor(self.second_stair_count * j / s) / self.second_stair_count
        return 1.0 - j / s

    def _in_cycle(self) -> bool:
        return self.last_batch_iteration < self.total_size

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self._in_cycle():
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_momentum(self) -> float:
        """The momentum at the current iteration (the formula above)."""
        if self._in_cycle():
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale()
        if self.decay_step_size == 0:
            return self.max_mom
        return self.max_mom * (1.0 + self.decay_mom_rate * self._decay_interval())

    def _apply(self) -> None:
        super()._apply()
        if not self.cycle_momentum:
            return
        momentum = self.get_momentum()
        for group in self.optimizer.param_groups:
            if "betas" in group:
                group["betas"] = (momentum, *tuple(group["betas"])[1:])
            else:
                group["momentum"] = momentum
        self._last_momentum = [momentum] * len(self.optimizer.param_groups)

    def get_last_momentum(self) -> list[float]:
        """The momenta last written into the optimizer (empty without cycle_momentum)."""
        return list(self._last_momentum)


class LRRangeTest(_Schedule):
    """Grow lr from ``lr_range_test_min_lr`` to find the largest lr that still trains.

    ::

        interval = (t + 1) / lr_range_test_step_size     (floored when lr_range_test_staircase)
        lr       = lr_range_test_min_lr * (1 + lr_range_test_step_rate * interval)

    ``lr_range_test_min_lr`` is a number or a list with one per param group.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 lr_range_test_min_lr: float | list[float] = 1e-3,
                 lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer)
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _check_int("lr_range_test_step_size", lr_range_test_step_size, 1)
        self.step_rate = _check_float("lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = _check_bool("lr_range_test_staircase", lr_range_test_staircase)
        self._start(last_batch_iteration)

    def get_lr(self) -> list[float]:
        i = self.last_batch_iteration + 1
        interval = i // self.step_size if self.staircase else i / self.step_size
        return [lr * (1.0 + self.step_rate * interval) for lr in self.min_lrs]


SCHEDULERS: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}

SchedulerType = Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]


def _params_model(cls: type[_Schedule]) -> type[pydantic.BaseModel]:
    """A config model of the schedule's keyword parameters, read off its signature.

    The signature is the one source of the names, defaults and types; the constructor checks the
    ranges.
    """
    fields: dict[str, Any] = {}
    signature = inspect.signature(cls.__init__, eval_str=True)
    for name, param in signature.parameters.items():
        if name in ("self", "optimizer"):
            continue
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[name] = (param.annotation, default)
    return pydantic.create_model(f"{cls.__name__}Params", __base__=ConfigSection, **fields)


_PARAM_MODELS = {name: _params_model(cls) for name, cls in SCHEDULERS.items()}


def _parse_params(scheduler_type: str, params: dict[str, Any]) -> pydantic.BaseModel:
    return parse_section(_PARAM_MODELS[scheduler_type], params, "scheduler.params")


class SchedulerConfig(ConfigSection):
    """The ``scheduler`` section: ``{"type": <one of SCHEDULERS>, "params": {...}}``.

    ``params`` are the keyword arguments of the schedule class named by ``type``; an unknown one
    is an error naming ``scheduler.params.<name>`` and the closest known name.
    """

    type: SchedulerType
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in SCHEDULERS:
            by_lower = {name.lower(): name for name in SCHEDULERS}
            hint = closest_key(value.lower(), list(by_lower))
            msg = f"unknown scheduler type {value!r}"
            if hint:
                msg += f"; did you mean {by_lower[hint]!r}?"
            raise ValueError(f"{msg} (known: {', '.join(SCHEDULERS)})")
        return value

    @field_validator("params")
    @classmethod
    def _known_params(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        scheduler_type = info.data.get("type")
        if scheduler_type is not None:
            _parse_params(scheduler_type, value)
        return value


def build_scheduler(config: SchedulerConfig | dict[str, Any],
                    optimizer: torch.optim.Optimizer) -> _Schedule:
    """The schedule that ``config`` (a :class:`SchedulerConfig` or dict) names, on ``optimizer``.

    Raises ValueError naming ``scheduler.params.<name>`` for an unknown, missing or bad param.
    """
    if isinstance(config, dict):
        config = parse_section(SchedulerConfig, config, "scheduler")
    params = _parse_params(config.type, config.params).model_dump()
    try:
        return SCHEDULERS[config.type](optimizer, **params)
    except ScheduleParamError as err:
        raise ValueError(f"config key 'scheduler.params.{err.name}': {err.detail}") from None
