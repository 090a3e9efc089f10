"""Which experiment runs next: grid search, seeded random search, and a model-based search.

Every tuner draws from the experiments the memory model kept (:class:`~.memory_model.Plan`) and
is told each outcome (:meth:`Tuner.record`). Common rules:

- ``tuner_num_trials`` caps the experiments run (the profile experiments the driver runs first
  count; the model-info run does not).
- ``tuner_early_stopping`` (N): the search ends after N experiments in a row that did not improve
  the best metric by more than :data:`IMPROVEMENT` (1%); a failed or out-of-memory experiment
  does not improve it. 0 switches this off.
- Within a ``(stage, extras)`` group, once a micro-batch size ran out of memory every larger one
  is skipped (``"larger than z1_mbs16_gas1 which ran out of memory"``).
- Metric direction: throughput and flops higher is better, latency lower.
- Dominated ZeRO stages (:func:`dominated_stages`, ``autotuning.prune_dominated_stages``) are
  held back: each waits on the experiment one stage lower with the same micro-batch, gradient
  accumulation and extras, and is released only when that one runs out of memory (or is held
  back itself and released in turn), fails, or is skipped by the out-of-memory rule. What is
  still held at the end is reported as pruned. On one data-parallel rank (``held_same_memory``)
  every stage holds the same model states, so an out-of-memory (or a skip by the out-of-memory
  rule) does not release what waits on it but prunes it, and what waits on that in turn: on an
  H200 the stages 1-3 that such releases ran all ran out of memory too (GPT-2 355M at
  micro-batch 128), in dslab's search as in DeepSpeed's. A failure still releases.

The tuners:

- ``gridsearch``: the space's order (stage, the other dimensions, micro-batch ascending, gradient
  accumulation ascending).
- ``random``: a shuffle of the space seeded with ``seed`` (the same seed, the same order).
- ``model_based`` (:class:`ModelBasedTuner`): fits a cost model to each group's results and runs
  the unexplored experiment with the best predicted metric.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

from dslab.engine.autotuning.space import Experiment

METRIC_DIRECTIONS = {"throughput": "higher", "flops": "higher", "latency": "lower"}
TUNER_TYPES = ("gridsearch", "random", "model_based")
IMPROVEMENT = 0.01
OBSERVED = ("ok", "early_stopped")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What became of one experiment the tuner handed out."""

    experiment: Experiment
    status: str  # ok | early_stopped | failed | oom
    metric: float | None = None


def dominated_stages(experiments: list[Experiment], world_size: int) -> dict[str, tuple[str, str]]:
    """The experiments a lower ZeRO stage makes pointless while it fits: ``{name: (the experiment it
    waits on, why)}``.

    A higher stage shards more of the model states over the data-parallel ranks, so it saves
    memory, and pays for that with work: stage 1 and 2 bookkeeping, stage 3's parameter gathers
    in forward and backward. With one data-parallel rank there is nothing to shard, so every stage
    above the lowest one present (for the same micro-batch, gradient accumulation and extras)
    is dominated. With more ranks, stage 1 and 2 shard the optimizer step's work (each rank updates
    its 1/N) for the same bytes on the wire as stage 0's all-reduce, so they may win and all run;
    stage 3 moves 1.5x stage 2's bytes for memory alone and waits on stage 2. Each dominated
    experiment waits on the next lower stage present, so an out-of-memory releases one stage at a
    time."""
    by_key: dict[tuple, list[Experiment]] = {}
    for e in experiments:
        by_key.setdefault((e.micro_batch_size, e.gradient_accumulation_steps, e.extras), []).append(e)
    held: dict[str, tuple[str, str]] = {}
    for group in by_key.values():
        group = sorted(group, key=lambda e: e.stage)
        for lower, higher in zip(group, group[1:]):
            if world_size == 1:
                why = (f"one data-parallel rank: ZeRO stage {higher.stage} shards nothing, so it cannot beat "
                       f"{lower.name}; it runs only if that one runs out of memory")
            elif higher.stage == 3 and lower.stage == 2:
                why = (f"stage 3 adds parameter gathers to stage 2 for memory alone; it runs only if {lower.name} "
                       f"runs out of memory")
            else:
                continue
            held[higher.name] = (lower.name, why)
    return held


class Tuner:
    """The shared bookkeeping (module docstring); subclasses choose in :meth:`_choose`."""

    def __init__(self, experiments: list[Experiment], metric: str = "throughput", num_trials: int = 50,
                 early_stopping: int = 5, held: dict[str, tuple[str, str]] | None = None,
                 held_same_memory: bool = False):
        if metric not in METRIC_DIRECTIONS:
            raise ValueError(f"autotuning.metric must be one of {', '.join(METRIC_DIRECTIONS)}, got {metric!r}")
        if num_trials < 1:
            raise ValueError(f"autotuning.tuner_num_trials must be >= 1, got {num_trials}")
        self.experiments = list(experiments)
        self.metric = metric
        self.num_trials = num_trials
        self.early_stopping = early_stopping
        self.outcomes: list[Outcome] = []
        self.skipped: dict[str, str] = {}
        self.best: Outcome | None = None
        self.since_improvement = 0
        self.stop_reason: str | None = None
        self.held = dict(held or {})
        self.held_same_memory = held_same_memory

    @property
    def higher_is_better(self) -> bool:
        return METRIC_DIRECTIONS[self.metric] == "higher"

    def better(self, value: float, than: float, margin: float = 0.0) -> bool:
        """Whether ``value`` beats ``than`` by more than the fraction ``margin`` of it."""
        if self.higher_is_better:
            return value > than + margin * abs(than)
        return value < than - margin * abs(than)

    def _done(self) -> set[str]:
        return {o.experiment.name for o in self.outcomes} | set(self.skipped)

    def remaining(self) -> list[Experiment]:
        """The experiments neither run nor skipped, in space order."""
        done = self._done()
        return [e for e in self.experiments if e.name not in done and e.name not in self.held]

    def held_back(self) -> list[tuple[Experiment, str]]:
        """The experiments still held back as dominated, with the reason, in space order."""
        done = self._done()
        return [(e, self.held[e.name][1]) for e in self.experiments if e.name in self.held and e.name not in done]

    def next(self) -> Experiment | None:
        """The experiment to run next; None when the search is over (:attr:`stop_reason` says why)."""
        if self.stop_reason is not None:
            return None
        if len(self.outcomes) >= self.num_trials:
            self.stop_reason = f"autotuning.tuner_num_trials ({self.num_trials}) experiments ran"
            return None
        if self.early_stopping > 0 and self.since_improvement >= self.early_stopping:
            self.stop_reason = (f"early stopping: {self.since_improvement} experiments in a row did not improve the "
                                f"best by more than {IMPROVEMENT:.0%} (autotuning.tuner_early_stopping)")
            return None
        candidates = self.remaining()
        if not candidates:
            self.stop_reason = "every experiment of the space ran or was skipped"
            return None
        return self._choose(candidates)

    def _choose(self, candidates: list[Experiment]) -> Experiment:
        return candidates[0]

    def record(self, outcome: Outcome) -> list[tuple[Experiment, str]]:
        """Take in an outcome; returns the experiments it makes the tuner skip, with the reason."""
        self.outcomes.append(outcome)
        value = outcome.metric
        improved = (outcome.status == "ok" and value is not None and math.isfinite(value)
                    and (self.best is None or self.better(value, self.best.metric, IMPROVEMENT)))
        if outcome.status == "ok" and value is not None and math.isfinite(value) and \
                (self.best is None or self.better(value, self.best.metric)):
            self.best = outcome
        self.since_improvement = 0 if improved else self.since_improvement + 1
        newly: list[tuple[Experiment, str]] = []
        if outcome.status == "failed":
            self._release(outcome.experiment.name)
        if outcome.status == "oom":
            ran = outcome.experiment
            newly += self._does_not_fit(ran.name)
            newly += self._skip_larger(ran, f"larger than {ran.name} which ran out of memory")
        return newly

    def _skip_larger(self, ran: Experiment, reason: str) -> list[tuple[Experiment, str]]:
        """Skip the larger micro-batches of ``ran``'s group, and what waits on each of them."""
        newly = []
        for e in self.remaining():
            if e.group == ran.group and e.micro_batch_size > ran.micro_batch_size:
                self.skipped[e.name] = reason
                newly.append((e, reason))
                newly += self._does_not_fit(e.name)
        return newly

    def over_budget(self, experiment: Experiment, reason: str) -> list[tuple[Experiment, str]]:
        """``experiment``, about to run, is estimated not to fit (the memory model learned more since
        the plan): it is skipped without counting as a trial, and what an out-of-memory of it
        would skip is skipped too. Returns everything skipped, ``experiment`` first."""
        self.skipped[experiment.name] = reason
        newly = [(experiment, reason)] + self._does_not_fit(experiment.name)
        return newly + self._skip_larger(experiment, f"larger than {experiment.name}, estimated not to fit")

    def _does_not_fit(self, name: str) -> list[tuple[Experiment, str]]:
        """``name`` ran out of memory (or was skipped as larger than one that did): release what
        waits on it, or, on one rank (``held_same_memory``), skip that and what waits on it in turn."""
        if not self.held_same_memory:
            self._release(name)
            return []
        by_name = {e.name: e for e in self.experiments}
        newly = []
        for held, (waits_on, _) in list(self.held.items()):
            if waits_on == name and held in self.held:
                del self.held[held]
                reason = (f"one data-parallel rank: the same model states as {name}, which did not fit "
                          f"(every ZeRO stage holds them whole there)")
                if held in by_name:  # else the memory model pruned it already
                    self.skipped[held] = reason
                    newly.append((by_name[held], reason))
                newly += self._does_not_fit(held)
        return newly

    def _release(self, name: str) -> None:
        """The experiments held back on ``name`` (which could not run) may run."""
        for held, (waits_on, _) in list(self.held.items()):
            if waits_on == name:
                del self.held[held]


class GridSearchTuner(Tuner):
    """The space's order."""


class RandomTuner(Tuner):
    """A seeded shuffle of the space: the same ``seed`` gives the same order."""

    def __init__(self, experiments: list[Experiment], *args, seed: int = 0, **kwargs):
        super().__init__(experiments, *args, **kwargs)
        self.order = {e.name: i for i, e in enumerate(random.Random(seed).sample(self.experiments,
                                                                                 len(self.experiments)))}

    def _choose(self, candidates: list[Experiment]) -> Experiment:
        return min(candidates, key=lambda e: self.order[e.name])


def fit_step_cost(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``(c, d)`` of ``cost = c + d * micro_batch`` over ``(micro_batch, cost)``
    points, with ``c, d >= 0``; None with fewer than two distinct micro-batch sizes."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    n = len(points)
    mean_x, mean_y = sum(xs) / n, sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    d = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    c = mean_y - d * mean_x
    if d < 0:
        return mean_y, 0.0
    if c < 0:
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x in xs)
    return c, d


class ModelBasedTuner(Tuner):
    """Runs next the unexplored experiment with the best predicted metric.

    The model: within a group (stage, extras and gradient accumulation fixed) the time of an
    optimizer step is ``c + d * micro_batch`` (a fixed cost, a per-sample cost; both >= 0), so

        throughput (and flops) = a * mbs / (b + mbs)  with  a = 1/d, b = c/d   (saturating)
        latency                = c + d * mbs                                    (linear)

    The step cost is observed as ``mbs / metric`` for throughput and flops (proportional to the
    step time at a fixed gradient accumulation and world) and as the metric for latency; ok and
    early-stopped experiments count. A group with two or more micro-batch sizes observed gets its
    own least-squares fit (:func:`fit_step_cost`); one with a single observation borrows the shape
    ``b = c/d`` (the median over the fitted groups; 0, a flat curve, when none) and scales it
    through its point. A group with nothing observed predicts +infinity, so every group is tried
    before any is exploited; within such a group the micro-batch size the model favours comes
    first (the largest for throughput and flops, the smallest for latency), the groups in space
order. Other ties go to space order.
    The model cannot see a metric that falls at large micro-batches; early stopping and the trial
    cap end the search when its predictions stop paying off.
    """

    def _group_key(self, e: Experiment) -> tuple:
        return e.stage, e.extras, e.gradient_accumulation_steps

    def _cost(self, e: Experiment, metric: float) -> float:
        return metric if self.metric == "latency" else e.micro_batch_size / metric

    def _observed(self) -> dict[tuple, list[tuple[float, float]]]:
        groups: dict[tuple, list[tuple[float, float]]] = {}
        for o in self.outcomes:
            if o.status in OBSERVED and o.metric is not None and math.isfinite(o.metric) and o.metric > 0:
                groups.setdefault(self._group_key(o.experiment), []).append(
                    (o.experiment.micro_batch_size, self._cost(o.experiment, o.metric)))
        return groups

    def predictions(self, candidates: list[Experiment]) -> dict[str, float]:
        """The predicted metric of each candidate (+inf or -inf, the direction's best, for an
        unexplored group; ties among those go to the group first in space order, then to the
        favoured micro-batch size)."""
        observed = self._observed()
        fits = {key: fit_step_cost(points) for key, points in observed.items()}
        shapes = [c / d for fit in fits.values() if fit is not None for c, d in [fit] if d > 0]
        shape = statistics.median(shapes) if shapes else 0.0
        best_unknown = math.inf if self.higher_is_better else -math.inf
        out = {}
        for e in candidates:
            key = self._group_key(e)
            if key not in observed:
                out[e.name] = best_unknown
                continue
            fit = fits[key]
            if fit is None:
                m1, cost1 = observed[key][0]
                cost = cost1 * (shape + e.micro_batch_size) / (shape + m1)
            else:
                cost = fit[0] + fit[1] * e.micro_batch_size
            if self.metric == "latency":
                out[e.name] = cost
            else:
                out[e.name] = math.inf if cost <= 0 else e.micro_batch_size / cost
        return out

    def _choose(self, candidates: list[Experiment]) -> Experiment:
        predicted = self.predictions(candidates)
        order = {e.name: i for i, e in enumerate(self.experiments)}
        unexplored = [e for e in candidates if math.isinf(predicted[e.name])]
        if unexplored:
            first = {}
            for e in self.experiments:
                first.setdefault(self._group_key(e), order[e.name])
            favoured = (lambda e: -e.micro_batch_size) if self.higher_is_better else (lambda e: e.micro_batch_size)
            return min(unexplored, key=lambda e: (first[self._group_key(e)], favoured(e), order[e.name]))
        sign = 1 if self.higher_is_better else -1
        return min(candidates, key=lambda e: (-sign * predicted[e.name], order[e.name]))


def refine_midpoint(fits: int, too_large: int) -> int | None:
    """The next micro-batch size to try between ``fits`` (the largest that ran) and ``too_large``
    (the smallest that did not fit), or None when the gap is within an eighth of ``fits`` (or
    one): a multiple of 8 near the middle where the gap is 16 or more, else the middle."""
    if too_large <= fits:
        raise ValueError(f"refine_midpoint needs fits < too_large, got {fits} and {too_large}")
    if too_large - fits <= max(1, fits // 8):
        return None
    middle = (fits + too_large) / 2
    size = int(round(middle / 8) * 8) if too_large - fits >= 16 else int(middle)
    return min(max(size, fits + 1), too_large - 1)


def make_tuner(tuner_type: str, experiments: list[Experiment], metric: str = "throughput", num_trials: int = 50,
               early_stopping: int = 5, seed: int = 0, held: dict[str, tuple[str, str]] | None = None,
               held_same_memory: bool = False) -> Tuner:
    """The tuner ``autotuning.tuner_type`` names; ``held``: :func:`dominated_stages`' map;
    ``held_same_memory``: one data-parallel rank (module docstring)."""
    common = dict(held=held, held_same_memory=held_same_memory)
    if tuner_type == "gridsearch":
        return GridSearchTuner(experiments, metric, num_trials, early_stopping, **common)
    if tuner_type == "random":
        return RandomTuner(experiments, metric, num_trials, early_stopping, seed=seed, **common)
    if tuner_type == "model_based":
        return ModelBasedTuner(experiments, metric, num_trials, early_stopping, **common)
    raise ValueError(f"autotuning.tuner_type must be one of {', '.join(TUNER_TYPES)}, got {tuner_type!r}")
