"""The tuner side of autotuning on made-up metric surfaces: the search space read from a config,
the memory model's pruning against hand-computed ZeRO figures, each tuner type, early stopping,
the out-of-memory rule, and how a finished experiment is classified."""

from __future__ import annotations

import json
import random

import pytest

from dslab.engine.autotuning.config import AutotuningConfig
from dslab.engine.autotuning.driver import classify
from dslab.engine.autotuning.memory_model import (MemoryModel, activation_per_sample, device_memory_budget,
                                                  optimizer_state_count, parse_memory_size, plan)
from dslab.engine.autotuning.space import Experiment, build_space, choose_micro_batches, powers_of_two
from dslab.engine.autotuning.tuner import Outcome, dominated_stages, fit_step_cost, make_tuner, refine_midpoint
from dslab.engine.config import load_config

MBS = [1, 2, 4, 8, 16, 32, 64]


def _settings(**keys) -> AutotuningConfig:
    return AutotuningConfig(enabled=True, **keys)


def _space(config: dict, processes: int = 1, cuda: bool = False, **keys):
    return build_space(config, _settings(**keys), processes, cuda)


def _run(tuner, surface) -> list[Outcome]:
    """Drive ``tuner`` over ``surface(experiment) -> (status, metric)`` until it stops."""
    while (experiment := tuner.next()) is not None:
        status, metric = surface(experiment)
        tuner.record(Outcome(experiment, status, metric))
    return tuner.outcomes


def _saturating(a: dict[int, float], b: dict[int, float], max_fit: dict[int, int] | None = None):
    def surface(e: Experiment):
        if max_fit is not None and e.micro_batch_size > max_fit[e.stage]:
            return "oom", None
        return "ok", a[e.stage] * e.micro_batch_size / (b[e.stage] + e.micro_batch_size)
    return surface


def _grid_experiments():
    space = _space({"train_micro_batch_size_per_gpu": MBS})
    return space.all_experiments()


# -- space ----------------------------------------------------------------------------------------

def test_default_space_fast_and_not_fast():
    fast = _space({})
    assert fast.stages == (0, 1, 2, 3) and fast.micro_batch_auto and fast.extras == ()
    assert fast.micro_batch_sizes == tuple(powers_of_two(1, 1024)) and fast.gradient_accumulation_steps == (1,)
    slow = _space({}, fast=False)
    assert dict(slow.extras) == {"offload_optimizer": ("none", "cpu"), "activation_checkpointing": (0, 1),
                                 "kernels": ("auto", "torch")}
    assert "cuda_graphs" in dict(_space({}, cuda=True, fast=False).extras)
    groups = slow.groups()
    assert all(dict(extras)["offload_optimizer"] == "none" for stage, extras in groups if stage == 0)
    assert len(groups) == 4 * 2 * 2 * 2 - 2 * 2  # stage 0 never offloads


def test_user_lists_fixed_values_and_all():
    space = _space({"zero_optimization": {"stage": "all", "offload_optimizer": {"device": ["none", "cpu"]}},
                    "train_micro_batch_size_per_gpu": [8, 2, 4], "gradient_accumulation_steps": [1, 2],
                    "kernels": "torch", "cuda_graphs": {"enabled": [False, True]}})
    assert space.stages == (0, 1, 2, 3) and space.micro_batch_sizes == (2, 4, 8) and not space.micro_batch_auto
    assert dict(space.extras) == {"offload_optimizer": ("none", "cpu"), "cuda_graphs": (False, True)}
    fixed = _space({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4})
    assert [e.name for e in fixed.all_experiments()] == ["z2_mbs4_gas1"]


def test_space_order_is_stage_then_micro_batch_ascending():
    names = [e.name for e in _space({"zero_optimization": {"stage": [2, 0]},
                                     "train_micro_batch_size_per_gpu": [4, 1],
                                     "gradient_accumulation_steps": [2, 1]}).all_experiments()]
    assert names == ["z0_mbs1_gas1", "z0_mbs1_gas2", "z0_mbs4_gas1", "z0_mbs4_gas2",
                     "z2_mbs1_gas1", "z2_mbs1_gas2", "z2_mbs4_gas1", "z2_mbs4_gas2"]


def test_experiment_name_and_applied_config_is_a_valid_dslab_config():
    user = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": [2, 4],
            "zero_optimization": {"stage": [1, 3], "offload_optimizer": {"device": ["none", "cpu"], "pin_memory": True},
                                  "reduce_bucket_size": 1000},
            "activation_checkpointing": {"enabled": [False, True], "cpu_checkpointing": False},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}},
            "autotuning": {"enabled": True, "fast": False}}
    with pytest.raises(ValueError, match="train_batch_size"):
        _space({**user, "gradient_accumulation_steps": [1, 2]})
    space = _space(user, processes=2)
    experiment = next(e for e in space.all_experiments()
                      if e.stage == 3 and e.micro_batch_size == 4 and e.extras[0][1] == "cpu" and e.extras[1][1] == 1)
    assert experiment.name == "z3_mbs4_gas8_offcpu_ckpt1"  # 64 = 4 x 8 x 2 processes
    applied = experiment.apply(user)
    assert "autotuning" not in applied and user["autotuning"]["enabled"] is True  # the user's dict is untouched
    assert applied["train_batch_size"] == 64 and applied["train_micro_batch_size_per_gpu"] == 4
    assert applied["gradient_accumulation_steps"] == 8
    assert applied["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                            "reduce_bucket_size": 1000}
    assert applied["activation_checkpointing"] == {"cpu_checkpointing": False, "checkpoint_layers": 1}
    assert applied["optimizer"]["params"]["betas"] == [0.9, 0.99]
    parsed = load_config(applied)
    parsed.resolve_batch_size(2)
    assert parsed.zero_optimization.offload_optimizer.device == "cpu"
    fixed = Experiment(0, 1, 1).apply({"activation_checkpointing": {"enabled": True, "cpu_checkpointing": True}})
    assert fixed["activation_checkpointing"] == {"cpu_checkpointing": True, "checkpoint_layers": 1}
    free = Experiment(1, 8, 2).apply({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto"})
    assert "train_batch_size" not in free and free["train_micro_batch_size_per_gpu"] == 8


def test_batch_limits_shape_the_micro_batch_list():
    fixed = _space({"train_batch_size": 32, "train_micro_batch_size_per_gpu": [1, 2, 4, 8, 32]}, processes=2)
    assert [(e.micro_batch_size, e.gradient_accumulation_steps) for e in fixed.experiments(0, ())] == \
        [(1, 16), (2, 8), (4, 4), (8, 2)]
    assert any("[32]" in note for note in fixed.notes)
    capped = _space({"gradient_accumulation_steps": 2}, processes=2, max_train_batch_size=64,
                    min_train_micro_batch_size_per_gpu=2)
    assert capped.micro_batch_sizes == (2, 4, 8, 16)  # 16 x 2 x 2 = 64


@pytest.mark.parametrize("config, key", [
    ({"zero_optimization": {"stage": [0, 5]}}, "zero_optimization.stage"),
    ({"kernels": ["auto", "fast"]}, "kernels"),
    ({"train_micro_batch_size_per_gpu": []}, "train_micro_batch_size_per_gpu"),
    ({"train_batch_size": [8, 16]}, "train_batch_size"),
    ({"activation_checkpointing": {"enabled": [0, 1]}}, "activation_checkpointing.enabled"),
    ({"zero_optimization": {"offload_optimizer": {"device": ["gpu"]}}}, "offload_optimizer.device"),
])
def test_bad_dimensions_name_their_key(config, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _space(config)


def test_choose_micro_batches():
    assert choose_micro_batches(MBS, 3, spread=True) == [1, 8, 64]
    assert choose_micro_batches(MBS, 3, spread=False) == [1, 2, 4]
    assert choose_micro_batches(MBS, 1, spread=True) == [64]
    assert choose_micro_batches([1, 2], 3, spread=True) == [1, 2]


# -- memory model ---------------------------------------------------------------------------------

def test_parse_memory_size():
    assert parse_memory_size("40GB") == 40 * 10 ** 9 and parse_memory_size("40G") == 40 * 10 ** 9
    assert parse_memory_size("40GiB") == 40 * 2 ** 30 and parse_memory_size("512MB") == 512 * 10 ** 6
    assert parse_memory_size("4096") == 4096 and parse_memory_size("1.5 TB") == 1.5e12
    for bad in ("lots", "40 GB of it", "-3GB", "0"):
        with pytest.raises(ValueError, match="--memory-budget"):
            parse_memory_size(bad)


@pytest.mark.gpu
def test_device_budget_is_95_percent_of_the_gpu():
    import torch

    assert device_memory_budget() == int(torch.cuda.get_device_properties(0).total_memory * 0.95)


def test_model_states_follow_zero_partitioning():
    """dslab's layout, Adam: 4 + 4 bytes of parameter and gradient, 8 of optimizer states, per parameter."""
    psi = 10 ** 8
    model = MemoryModel(psi, world_size=4, budget_bytes=None)
    assert model.model_states(0) == 16 * psi
    assert model.model_states(1) == 4 * psi + 4 * psi + 8 * psi // 4
    assert model.model_states(2) == 4 * psi + (4 + 8) * psi // 4
    assert model.model_states(3) == 16 * psi // 4
    assert model.model_states(2, "cpu") == 4 * psi  # gradients and states on the CPU
    assert optimizer_state_count({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}) == 1
    assert optimizer_state_count({"optimizer": {"type": "sgd", "params": {}}}) == 0
    assert optimizer_state_count({}) == 2
    single = MemoryModel(psi, world_size=1, budget_bytes=None, optimizer_states=0)
    assert single.model_states(3) == 8 * psi


def test_activation_per_sample_from_a_profile():
    model = MemoryModel(10 ** 6, world_size=1, budget_bytes=None)
    profile = Experiment(3, 4, 1)
    per_sample, note = activation_per_sample(model, profile, {}, 16 * 10 ** 6 + 4 * 123_000)
    assert per_sample == 123_000 and note is None
    per_sample, note = activation_per_sample(model, profile, {}, 10 ** 6)
    assert per_sample == 0 and "below the estimated model states" in note


def test_plan_prunes_over_budget_and_stops_auto_list_at_largest_fitting_power_of_two():
    psi = 10 ** 8
    config = {"zero_optimization": {"stage": [0, 3]}}
    space = _space(config, processes=4)
    model = MemoryModel(psi, 4, budget_bytes=2 * 10 ** 9, activation_per_sample={0: 10 ** 8})
    result = plan(space, config, model)
    kept = {stage: [e.micro_batch_size for e in result.experiments if e.stage == stage] for stage in (0, 3)}
    # stage 0: 1.6 GB of states + 0.1 GB per sample fits 4; stage 3: 0.4 GB + 0.1 GB/sample fits 16
    assert kept == {0: [1, 2, 4], 3: [1, 4, 16]}
    assert [(e.name, reason) for e, reason in result.pruned] == [
        ("z0_mbs8_gas1", "estimated 2.4 GB > 2.0 GB budget (model states 1.6 GB + activations 0.80 GB)"),
        ("z3_mbs32_gas1", "estimated 3.6 GB > 2.0 GB budget (model states 0.40 GB + activations 3.2 GB)")]
    assert result.estimates["z3_mbs16_gas1"] == 4 * 10 ** 8 + 16 * 10 ** 8
    listed = _space({"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": [2, 8, 16]}, processes=4)
    assert [e.name for e, _ in plan(listed, {}, model).pruned] == ["z0_mbs8_gas1", "z0_mbs16_gas1"]


def test_plan_without_budget_or_activations():
    space = _space({"zero_optimization": {"stage": 1}})
    assert [e.micro_batch_size for e in plan(space, {}, None).experiments] == [1, 2, 4]
    states_only = MemoryModel(10 ** 8, 1, budget_bytes=10 ** 9)  # 1.6 GB of states alone
    result = plan(space, {}, states_only)
    assert result.experiments == [] and [e.name for e, _ in result.pruned] == ["z1_mbs1_gas1"]
    checkpointed = MemoryModel(10, 1, budget_bytes=None, activation_per_sample={0: 1000.0})
    assert checkpointed.activation_bytes(1, 4) == 4000.0  # the documented fallback factor 1.0


# -- tuners ---------------------------------------------------------------------------------------

def test_gridsearch_runs_the_space_in_order_and_finds_the_grid_best():
    experiments = _grid_experiments()
    surface = _saturating({0: 100, 1: 140, 2: 120, 3: 90}, {0: 4, 1: 8, 2: 2, 3: 1})  # 1: 124 samples/s
    tuner = make_tuner("gridsearch", experiments, num_trials=100, early_stopping=100)
    outcomes = _run(tuner, surface)
    assert [o.experiment.name for o in outcomes] == [e.name for e in experiments]
    want = max(experiments, key=lambda e: surface(e)[1])
    assert tuner.best.experiment == want and want.name == "z1_mbs64_gas1"
    assert "every experiment" in tuner.stop_reason


def test_latency_is_minimised():
    experiments = _grid_experiments()

    def latency(e):  # seconds per step: a fixed cost and a per-sample cost
        return "ok", (0.5 + 0.1 * e.stage) + 0.01 * e.micro_batch_size

    for kind in ("gridsearch", "model_based", "random"):
        tuner = make_tuner(kind, experiments, metric="latency", num_trials=100, early_stopping=100)
        _run(tuner, latency)
        assert tuner.best.experiment.name == "z0_mbs1_gas1", kind


def test_out_of_memory_skips_larger_micro_batches_of_its_group():
    experiments = _grid_experiments()
    surface = _saturating({s: 100.0 for s in range(4)}, {s: 2.0 for s in range(4)}, {0: 4, 1: 64, 2: 64, 3: 64})
    tuner = make_tuner("gridsearch", experiments, num_trials=100, early_stopping=100)
    outcomes = _run(tuner, surface)
    ran_stage0 = [(o.experiment.micro_batch_size, o.status) for o in outcomes if o.experiment.stage == 0]
    assert ran_stage0 == [(1, "ok"), (2, "ok"), (4, "ok"), (8, "oom")]
    assert tuner.skipped == {f"z0_mbs{m}_gas1": "larger than z0_mbs8_gas1 which ran out of memory" for m in (16, 32, 64)}
    assert all(o.experiment.stage != 0 or o.experiment.micro_batch_size <= 8 for o in outcomes)


def test_an_experiment_estimated_not_to_fit_is_skipped_with_its_larger_sizes_and_is_no_trial():
    tuner = make_tuner("gridsearch", _grid_experiments(), num_trials=100, early_stopping=100)
    for _ in range(3):  # z0 at 1, 2, 4
        e = tuner.next()
        tuner.record(Outcome(e, "ok", float(e.micro_batch_size)))
    e = tuner.next()
    assert e.name == "z0_mbs8_gas1"
    skipped = tuner.over_budget(e, "estimated 9 GB > 8 GB budget")
    assert [x.name for x, _ in skipped] == [f"z0_mbs{m}_gas1" for m in (8, 16, 32, 64)]
    assert skipped[0][1] == "estimated 9 GB > 8 GB budget"
    assert all(r == "larger than z0_mbs8_gas1, estimated not to fit" for _, r in skipped[1:])
    assert len(tuner.outcomes) == 3 and tuner.since_improvement == 0  # not a trial
    assert tuner.next().name == "z1_mbs1_gas1"


def test_the_memory_model_keeps_the_figure_of_the_largest_micro_batch_measured():
    model = MemoryModel(10 ** 6, world_size=1, budget_bytes=10 ** 9)
    states = 16 * 10 ** 6
    assert "was unmeasured" in model.learn(Experiment(0, 1, 1), {}, states + 15_000)
    assert model.activation_per_sample == {0: 15_000} and model.measured_at == {0: 1}
    note = model.learn(Experiment(0, 16, 1), {}, states + 16 * 100_000)
    assert model.activation_per_sample == {0: 100_000} and "100.0 MB" not in note and "0.1 MB (was 0.0 MB)" in note
    assert model.learn(Experiment(0, 8, 1), {}, states + 8 * 300_000) is None  # a smaller size teaches nothing
    assert model.activation_per_sample == {0: 100_000}
    assert model.learn(Experiment(0, 32, 1), {}, states + 32 * 102_000) is None  # within 10%: no note
    assert model.activation_per_sample == {0: 102_000} and model.measured_at == {0: 32}
    assert model.over_budget(Experiment(0, 9000, 1), {}) is None  # 0.93 GB
    assert model.over_budget(Experiment(0, 10_000, 1), {}).startswith("estimated 1.0 GB > 1.0 GB budget (model states 0.02 GB + activations 1.0 GB)")


def test_num_trials_caps_the_experiments():
    tuner = make_tuner("gridsearch", _grid_experiments(), num_trials=3, early_stopping=100)
    assert len(_run(tuner, lambda e: ("ok", float(e.micro_batch_size)))) == 3
    assert "tuner_num_trials (3)" in tuner.stop_reason


@pytest.mark.parametrize("step, runs", [(0.995, 1 + 4), (1.005, 1 + 4), (1.02, 28)])
def test_early_stopping_counts_experiments_without_a_one_percent_gain(step, runs):
    """Each experiment's metric is ``step`` times the previous one's: a loss, or a gain of at most
    1%, counts towards the 4 that stop the search; a 2% gain resets the count every time."""
    experiments = _grid_experiments()
    index = {e.name: i for i, e in enumerate(experiments)}
    tuner = make_tuner("gridsearch", experiments, num_trials=100, early_stopping=4)
    outcomes = _run(tuner, lambda e: ("ok", 100.0 * step ** index[e.name]))
    assert len(outcomes) == runs
    if runs < 28:
        assert tuner.stop_reason.startswith("early stopping: 4 experiments in a row")


def test_failures_count_towards_early_stopping_and_the_best_needs_an_ok_run():
    tuner = make_tuner("gridsearch", _grid_experiments(), num_trials=100, early_stopping=3)
    outcomes = _run(tuner, lambda e: ("failed", None))
    assert len(outcomes) == 3 and tuner.best is None
    tuner = make_tuner("gridsearch", _grid_experiments(), num_trials=100, early_stopping=100)
    _run(tuner, lambda e: ("early_stopped", 1.0) if e.micro_batch_size == 64 else ("ok", 0.5))
    assert tuner.best.metric == 0.5


def test_random_search_is_a_seeded_permutation():
    experiments = _grid_experiments()
    orders = {}
    for seed in range(5):
        tuner = make_tuner("random", experiments, num_trials=100, early_stopping=100, seed=seed)
        orders[seed] = [o.experiment.name for o in _run(tuner, lambda e: ("ok", float(e.micro_batch_size)))]
        assert sorted(orders[seed]) == sorted(e.name for e in experiments)
        assert tuner.best.experiment.micro_batch_size == 64
    again = make_tuner("random", experiments, num_trials=100, early_stopping=100, seed=3)
    assert [o.experiment.name for o in _run(again, lambda e: ("ok", 1.0))] == orders[3]
    assert len({tuple(order) for order in orders.values()}) == 5


def test_fit_step_cost_recovers_a_line_and_keeps_it_non_negative():
    c, d = fit_step_cost([(m, 2.0 + 0.5 * m) for m in (1, 4, 16)])
    assert c == pytest.approx(2.0) and d == pytest.approx(0.5)
    assert fit_step_cost([(4, 1.0), (4, 2.0)]) is None
    c, d = fit_step_cost([(1, 0.1), (2, 1.0), (4, 3.0)])  # a negative intercept is clipped to 0
    assert c == 0.0 and d == pytest.approx((0.1 + 2.0 + 12.0) / 21)
    assert fit_step_cost([(1, 3.0), (2, 2.0)]) == (2.5, 0.0)


def test_on_one_rank_an_out_of_memory_prunes_the_stages_held_on_it_in_a_chain():
    grid = [Experiment(stage, mbs, 1) for stage in range(4) for mbs in (4, 8, 16)]
    tuner = make_tuner("gridsearch", grid, held=dominated_stages(grid, world_size=1), held_same_memory=True)
    tuner.record(Outcome(grid[0], "ok", 10.0))
    skipped = tuner.record(Outcome(grid[1], "oom"))
    names = {e.name: reason for e, reason in skipped}
    # z0_mbs16 is larger than the out-of-memory one; z1-z3 at 8 and at 16 hold the same states
    assert set(names) == {"z0_mbs16_gas1"} | {f"z{s}_mbs{m}_gas1" for s in (1, 2, 3) for m in (8, 16)}
    assert names["z2_mbs8_gas1"].startswith("one data-parallel rank: the same model states as z1_mbs8_gas1")
    assert names["z1_mbs16_gas1"].startswith("one data-parallel rank: the same model states as z0_mbs16_gas1")
    assert tuner.next() is None and tuner.best.experiment.name == "z0_mbs4_gas1"
    assert {e.name for e, _ in tuner.held_back()} == {"z1_mbs4_gas1", "z2_mbs4_gas1", "z3_mbs4_gas1"}
    # a failure still releases the next stage
    tuner = make_tuner("gridsearch", grid, held=dominated_stages(grid, world_size=1), held_same_memory=True)
    tuner.record(Outcome(grid[0], "failed"))
    assert "z1_mbs4_gas1" in [e.name for e in tuner.remaining()]


def test_refine_midpoint_halves_the_gap_on_multiples_of_8_until_it_is_an_eighth():
    assert refine_midpoint(16, 128) == 72
    assert refine_midpoint(72, 128) == 96  # the middle, 100, on a multiple of 8
    assert refine_midpoint(96, 128) == 112
    assert refine_midpoint(4, 8) == 6 and refine_midpoint(6, 8) == 7
    assert refine_midpoint(6, 7) is None and refine_midpoint(1, 2) is None
    assert refine_midpoint(96, 108) is None  # 12 <= 96 / 8
    assert refine_midpoint(97, 110) == 103  # 13 > 97 // 8, below 16: the middle itself
    for fits, too_large in [(3, 1000), (8, 9), (31, 33), (1, 3)]:
        size = refine_midpoint(fits, too_large)
        assert size is None or fits < size < too_large
    with pytest.raises(ValueError, match="fits < too_large"):
        refine_midpoint(8, 8)


def _experiments_to_best(kind: str, experiments, surface) -> tuple[int, str]:
    tuner = make_tuner(kind, experiments, num_trials=1000, early_stopping=1000)
    outcomes = _run(tuner, surface)
    return [o.experiment for o in outcomes].index(tuner.best.experiment) + 1, tuner.best.experiment.name


def test_model_based_finds_the_best_in_fewer_experiments_than_the_grid():
    """On 200 seeded random saturating surfaces (throughput a*mbs/(b+mbs) per stage, some stages
    out of memory above a random size) both tuners find the true best; the model-based one needs
    at most as many experiments as there are groups plus their out-of-memory probes, the grid on
    average more than twice as many."""
    experiments = _grid_experiments()
    grid_steps, model_steps = [], []
    for seed in range(200):
        rng = random.Random(seed)
        a = {s: rng.uniform(50, 150) for s in range(4)}
        b = {s: rng.uniform(1, 32) for s in range(4)}
        max_fit = {s: rng.choice(MBS[2:] + [64, 64]) for s in range(4)}
        surface = _saturating(a, b, max_fit)
        truth = max((e for e in experiments if surface(e)[0] == "ok"), key=lambda e: surface(e)[1]).name
        grid, grid_best = _experiments_to_best("gridsearch", experiments, surface)
        model, model_best = _experiments_to_best("model_based", experiments, surface)
        assert grid_best == truth and model_best == truth, seed
        assert model <= 4 + sum(MBS.index(64) - MBS.index(m) for m in max_fit.values())
        grid_steps.append(grid)
        model_steps.append(model)
    assert sum(model_steps) * 2 < sum(grid_steps)  # measured: 5.7 against 15.2 on average
    assert sum(m < g for m, g in zip(model_steps, grid_steps)) >= 180  # measured: 195


def test_model_based_on_one_smooth_surface():
    """No memory limit: every group's best is its largest micro-batch, which the model tries
    first; the best group is stage 3, the grid's last."""
    experiments = _grid_experiments()
    surface = _saturating({0: 80, 1: 90, 2: 100, 3: 130}, {0: 2, 1: 4, 2: 8, 3: 16})  # 3: 104 samples/s
    model, name = _experiments_to_best("model_based", experiments, surface)
    grid, grid_name = _experiments_to_best("gridsearch", experiments, surface)
    assert name == grid_name == "z3_mbs64_gas1" and (model, grid) == (4, 28)


def test_model_based_exploits_the_fit_after_exploring():
    """With one group the model tries its largest micro-batch first; with one point and no fitted
    group to borrow a shape from it predicts a flat curve (space order decides); with two points of
    a saturating surface its fit is exact, and it runs the best predicted size next."""
    experiments = _space({"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": MBS}).all_experiments()
    surface = _saturating({0: 100.0}, {0: 4.0})
    tuner = make_tuner("model_based", experiments, num_trials=2, early_stopping=100)
    assert [o.experiment.micro_batch_size for o in _run(tuner, surface)] == [64, 1]
    predicted = tuner.predictions(tuner.remaining())
    for e in tuner.remaining():
        assert predicted[e.name] == pytest.approx(surface(e)[1])
    assert tuner._choose(tuner.remaining()).name == "z0_mbs32_gas1"


def test_unknown_tuner_type():
    with pytest.raises(ValueError, match="autotuning.tuner_type"):
        make_tuner("bayes", _grid_experiments())


# -- classifying a finished experiment ------------------------------------------------------------

def _exp_dir(tmp_path, stderr: str = "", metrics: dict | None = None):
    (tmp_path / "stderr.log").write_text(stderr)
    if metrics is not None:
        (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    return tmp_path


def test_classify_out_of_memory_from_stderr(tmp_path):
    text = ("Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to "
            "allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB\n")
    assert classify(_exp_dir(tmp_path, text), 1, "throughput") == (
        "oom", None, {}, "out of memory: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                         "GPU 0 has a total capacity of 79.1 GiB")
    assert classify(_exp_dir(tmp_path, "RuntimeError: [enforce fail] out of memory\n"), -9, "latency")[0] == "oom"


def test_classify_failures(tmp_path):
    status, _, _, reason = classify(_exp_dir(tmp_path, "Traceback...\nValueError: bad config key 'x'\n"), 1,
                                    "throughput")
    assert (status, reason) == ("failed", "exit status 1: ValueError: bad config key 'x'")
    status, _, _, reason = classify(_exp_dir(tmp_path, ""), 0, "throughput")
    assert status == "failed" and "fewer optimizer steps than autotuning.end_profile_step" in reason
    assert classify(_exp_dir(tmp_path, ""), None, "throughput")[3] == "timed out"
    status, _, _, reason = classify(_exp_dir(tmp_path, "", {"throughput": 3.0, "flops": None}), 0, "flops")
    assert status == "failed" and "no 'flops' value" in reason


def test_classify_metrics(tmp_path):
    metrics = {"throughput": 12.5, "latency": 0.3, "early_stopped": False, "peak_memory_bytes": 7}
    assert classify(_exp_dir(tmp_path, "out of memory warnings are not read when metrics exist",
                             metrics), 0, "throughput") == ("ok", 12.5, metrics, None)
    stopped = {**metrics, "early_stopped": True}
    assert classify(_exp_dir(tmp_path, "", stopped), 0, "latency")[:2] == ("early_stopped", 0.3)


def test_dominated_stages_hold_back_what_only_buys_memory_and_release_one_stage_per_out_of_memory():
    grid = [Experiment(stage, mbs, 1) for stage in range(4) for mbs in (4, 8)]
    one = dominated_stages(grid, world_size=1)
    assert set(one) == {f"z{s}_mbs{m}_gas1" for s in (1, 2, 3) for m in (4, 8)}
    assert one["z2_mbs8_gas1"][0] == "z1_mbs8_gas1"  # each waits on the next lower stage
    four = dominated_stages(grid, world_size=4)
    assert four == {f"z3_mbs{m}_gas1": (f"z2_mbs{m}_gas1", four[f"z3_mbs{m}_gas1"][1]) for m in (4, 8)}
    assert "parameter gathers" in four["z3_mbs4_gas1"][1]
    # only the stages present count: with stages 1 and 3 on one rank, 3 waits on 1
    assert dominated_stages([Experiment(1, 4, 1), Experiment(3, 4, 1)], 1) == {
        "z3_mbs4_gas1": ("z1_mbs4_gas1", dominated_stages([Experiment(1, 4, 1), Experiment(3, 4, 1)], 1)
                         ["z3_mbs4_gas1"][1])}

    tuner = make_tuner("gridsearch", grid, held=one)
    assert [e.name for e in tuner.remaining()] == ["z0_mbs4_gas1", "z0_mbs8_gas1"]
    tuner.record(Outcome(grid[0], "ok", 10.0))
    tuner.record(Outcome(grid[1], "oom"))
    assert [e.name for e in tuner.remaining()] == ["z1_mbs8_gas1"]  # released one stage up, at that size
    tuner.record(Outcome(Experiment(1, 8, 1), "oom"))
    assert [e.name for e in tuner.remaining()] == ["z2_mbs8_gas1"]
    assert tuner.next().name == "z2_mbs8_gas1"
    tuner.record(Outcome(Experiment(2, 8, 1), "ok", 12.0))
    assert tuner.next() is None and tuner.best.experiment.name == "z2_mbs8_gas1"
    assert {e.name for e, _ in tuner.held_back()} == {"z1_mbs4_gas1", "z2_mbs4_gas1", "z3_mbs4_gas1", "z3_mbs8_gas1"}
