"""The five learning-rate schedules against their closed forms, written out here independently."""

import io
import math

import pytest
import torch

from dslab.config_base import parse_section
from dslab.engine.schedulers import (
    LRRangeTest,
    OneCycle,
    SchedulerConfig,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def make_optimizer(kind="adamw", lrs=(0.1,)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "adamw":
        return torch.optim.AdamW(groups)
    if kind == "sgd":
        return torch.optim.SGD(groups, momentum=0.5)
    return torch.optim.Adagrad(groups)


def lrs_of(optimizer):
    return [group["lr"] for group in optimizer.param_groups]


def run(schedule, optimizer, steps):
    """The optimizer's lrs after each of ``steps`` steps, keyed by last_batch_iteration."""
    seen = {}
    for _ in range(steps):
        schedule.step()
        assert schedule.get_last_lr() == lrs_of(optimizer)
        seen[schedule.last_batch_iteration] = lrs_of(optimizer)
    return seen


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr_follows_formula_per_group(warmup_type):
    opt = make_optimizer(lrs=(0.5, 0.5))
    lo, hi, n = [0.01, 0.02], [0.1, 0.3], 37
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n,
                     warmup_type=warmup_type)
    assert lrs_of(opt) == pytest.approx(lo, rel=0, abs=0)
    for t, got in run(sched, opt, 60).items():
        if t < n:
            g = math.log(t + 1) / math.log(n) if warmup_type == "log" else t / n
        else:
            g = 1.0
        assert got == pytest.approx([lo[0] + (hi[0] - lo[0]) * g, lo[1] + (hi[1] - lo[1]) * g],
                                    rel=1e-12)


@pytest.mark.parametrize("n", [0, 1])
def test_warmup_num_steps_raised_to_two(n):
    opt = make_optimizer()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=n,
                     warmup_type="log")
    got = run(sched, opt, 4)
    assert got[0] == [0.0]
    assert got[1] == [1.0] and got[3] == [1.0]


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr_follows_formula(warmup_type):
    opt = make_optimizer()
    lo, hi, n, total = 0.001, 0.05, 13, 90
    sched = WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=lo, warmup_max_lr=hi,
                          warmup_num_steps=n, warmup_type=warmup_type)
    assert lrs_of(opt) == [lo]
    for t, (got,) in run(sched, opt, 120).items():
        if t < n:
            g = math.log(t + 1) / math.log(n) if warmup_type == "log" else t / n
        else:
            g = max(0.0, (total - t) / (total - n))
        assert got == pytest.approx(lo + (hi - lo) * g, rel=1e-12, abs=1e-15)
    assert sched.get_last_lr() == [lo]


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr_follows_formula(warmup_type):
    base = [0.2, 0.05]
    opt = make_optimizer(lrs=base)
    min_ratio, n, total, cos_min = 0.1, 11, 71, 0.02
    sched = WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=min_ratio,
                           warmup_num_steps=n, cos_min_ratio=cos_min, warmup_type=warmup_type)
    assert lrs_of(opt) == pytest.approx([b * min_ratio for b in base], rel=1e-15)
    for t, got in run(sched, opt, 100).items():
        if t < n:
            w = math.log(t + 1) / math.log(n) if warmup_type == "log" else t / n
            ratio = min_ratio + (1 - min_ratio) * w
        elif t - n + 1 <= total - n:
            s = t - n + 1
            ratio = cos_min + (1 - cos_min) * (1 + math.cos(math.pi * s / (total - n))) / 2
        else:
            ratio = cos_min  # held after total_num_steps
        assert got == pytest.approx([b * ratio for b in base], rel=1e-12)


def one_cycle_reference(t, lo, hi, first, second, min_mom, max_mom, decay_lr_rate=0.0,
                        decay_mom_rate=0.0, decay_step_size=0):
    """The brief's closed form of OneCycle, in floating point."""
    total = first + second
    if t < total:
        step_ratio = first / total
        i = t + 1
        cycle = math.floor(1 + i / total)
        x = 1 + i / total - cycle
        scale = x / step_ratio if x <= step_ratio else (x - 1) / (step_ratio - 1)
        return lo + (hi - lo) * scale, max_mom - (max_mom - min_mom) * scale
    if decay_step_size == 0:
        return lo, max_mom
    d = t - total + 1
    return (lo / (1 + decay_lr_rate * d / decay_step_size),
            max_mom * (1 + decay_mom_rate * d / decay_step_size))


@pytest.mark.parametrize("first,second,decay_step_size", [(20, None, 0), (17, 9, 5), (3, 30, 1)])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_one_cycle_lr_and_momentum(first, second, decay_step_size, kind):
    opt = make_optimizer(kind)
    lo, hi = 0.001, 0.01
    sched = OneCycle(opt, cycle_min_lr=lo, cycle_max_lr=hi, decay_lr_rate=0.3,
                     cycle_first_step_size=first, cycle_second_step_size=second,
                     decay_step_size=decay_step_size, cycle_min_mom=0.85, cycle_max_mom=0.95,
                     decay_mom_rate=0.01)

    def momentum():
        group = opt.param_groups[0]
        return group["betas"][0] if kind == "adamw" else group["momentum"]

    assert lrs_of(opt) == [lo] and momentum() == pytest.approx(0.95)
    if kind == "adamw":
        assert opt.param_groups[0]["betas"][1] == 0.999
    sec = first if second is None else second
    for _ in range(first + sec + 25):
        sched.step()
        t = sched.last_batch_iteration
        want_lr, want_mom = one_cycle_reference(t, lo, hi, first, sec, 0.85, 0.95, 0.3, 0.01,
                                                decay_step_size)
        assert lrs_of(opt)[0] == pytest.approx(want_lr, rel=1e-12)
        assert momentum() == pytest.approx(want_mom, rel=1e-12)
    assert sched.get_last_momentum() == [momentum()]


def test_one_cycle_stairs():
    # first half 10 steps in 5 stairs of 2, second half 6 steps in 3 stairs of 2
    opt = make_optimizer()
    sched = OneCycle(opt, cycle_min_lr=1.0, cycle_max_lr=2.0, cycle_first_step_size=10,
                     cycle_second_step_size=6, cycle_first_stair_count=5,
                     cycle_second_stair_count=3, cycle_momentum=False)
    for t, (got,) in run(sched, opt, 20).items():
        k = t + 1
        if k <= 10:
            scale = (k // 2) * 0.2
        elif k < 16:
            scale = 1 - ((k - 10) // 2) / 3
        else:
            scale = 0.0
        assert got == pytest.approx(1.0 + scale, rel=1e-12), t
    assert "betas" in opt.param_groups[0] and opt.param_groups[0]["betas"][0] == 0.9


def test_one_cycle_second_stairs_default_to_first():
    opt = make_optimizer()
    sched = OneCycle(opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4,
                     cycle_first_stair_count=2)
    got = [lr for (lr,) in run(sched, opt, 8).values()]
    assert got == pytest.approx([0.0, 0.5, 0.5, 1.0, 1.0, 0.5, 0.5, 0.0])


def test_one_cycle_needs_momentum_key():
    with pytest.raises(ValueError, match="cycle_momentum"):
        OneCycle(make_optimizer("adagrad"), cycle_min_lr=0.1, cycle_max_lr=1.0)
    OneCycle(make_optimizer("adagrad"), cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_momentum=False)


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = make_optimizer(lrs=(1.0, 1.0))
    sched = LRRangeTest(opt, lr_range_test_min_lr=[1e-4, 2e-4], lr_range_test_step_size=7,
                        lr_range_test_step_rate=3.5, lr_range_test_staircase=staircase)
    assert lrs_of(opt) == [1e-4, 2e-4]
    for t, got in run(sched, opt, 50).items():
        interval = math.floor((t + 1) / 7) if staircase else (t + 1) / 7
        assert got == pytest.approx([m * (1 + 3.5 * interval) for m in (1e-4, 2e-4)], rel=1e-12)


def test_step_with_explicit_iteration():
    opt = make_optimizer()
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.5, lr_range_test_step_size=10)
    sched.step(29)
    assert sched.last_batch_iteration == 29 and lrs_of(opt) == pytest.approx([0.5 * 4])
    assert sched.get_lr() == sched.get_last_lr()
    sched.step()
    assert sched.last_batch_iteration == 30


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 9}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 9, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 9, "warmup_min_ratio": 0.1}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 6,
                  "cycle_second_step_size": 4, "decay_step_size": 3, "decay_lr_rate": 0.5,
                  "cycle_first_stair_count": 2}),
    ("LRRangeTest", {"lr_range_test_step_size": 4, "lr_range_test_staircase": True}),
]


@pytest.mark.parametrize("name,params", SCHEDULES)
def test_state_dict_round_trip_continues_identically(name, params):
    config = SchedulerConfig(type=name, params=params)
    opt_a = make_optimizer(lrs=(0.3, 0.7))
    sched_a = build_scheduler(config, opt_a)
    for _ in range(11):
        sched_a.step()
    buffer = io.BytesIO()
    torch.save(sched_a.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    # a fresh optimizer built with other lrs, which then drift: the state alone must restore it
    opt_b = make_optimizer(lrs=(0.9, 0.1))
    sched_b = build_scheduler(config, opt_b)
    for group in opt_b.param_groups:
        group["lr"] = 123.0
    sched_b.load_state_dict(state)
    assert lrs_of(opt_b) == lrs_of(opt_a)
    assert sched_b.get_last_lr() == sched_a.get_last_lr()
    for _ in range(30):
        sched_a.step()
        sched_b.step()
        assert lrs_of(opt_b) == lrs_of(opt_a)
        assert [g["betas"] for g in opt_b.param_groups] == [g["betas"] for g in opt_a.param_groups]


def test_config_unknown_param_names_closest():
    with pytest.raises(ValueError) as err:
        parse_section(SchedulerConfig, {"type": "WarmupLR", "params": {"warmup_max": 0.1}},
                      "scheduler")
    assert "scheduler.params.warmup_max'" in str(err.value)
    assert "did you mean 'scheduler.params.warmup_max_lr'" in str(err.value)
    with pytest.raises(ValueError, match="scheduler.params.cycle_frist_step_size.*"
                                         "scheduler.params.cycle_first_step_size"):
        build_scheduler({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1,
                                                        "cycle_frist_step_size": 3}},
                        make_optimizer())


@pytest.mark.parametrize("name", ["WarmupDecayLR", "WarmupCosineLR"])
def test_config_missing_total_num_steps(name):
    with pytest.raises(ValueError, match=r"scheduler\.params\.total_num_steps.*required"):
        parse_section(SchedulerConfig, {"type": name, "params": {"warmup_num_steps": 5}},
                      "scheduler")


def test_config_unknown_type_names_closest():
    with pytest.raises(ValueError, match="scheduler.type.*did you mean 'WarmupCosineLR'"):
        parse_section(SchedulerConfig, {"type": "WarmupCosine"}, "scheduler")
    with pytest.raises(ValueError, match="did you mean 'OneCycle'"):
        parse_section(SchedulerConfig, {"type": "onecycle"}, "scheduler")


@pytest.mark.parametrize("name,params,key", [
    ("WarmupDecayLR", {"total_num_steps": 5, "warmup_num_steps": 10}, "total_num_steps"),
    ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 10}, "total_num_steps"),
    ("WarmupLR", {"warmup_type": "cosine"}, "warmup_type"),
    ("WarmupLR", {"warmup_num_steps": -3}, "warmup_num_steps"),
    ("WarmupLR", {"warmup_min_lr": [0.1, 0.2, 0.3]}, "warmup_min_lr"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 0},
     "cycle_first_step_size"),
    ("LRRangeTest", {"lr_range_test_step_size": 0}, "lr_range_test_step_size"),
])
def test_build_rejects_bad_values_naming_the_key(name, params, key):
    with pytest.raises(ValueError, match=rf"scheduler\.params\.{key}"):
        build_scheduler({"type": name, "params": params}, make_optimizer(lrs=(0.1, 0.2)))


def test_direct_construction_rejects_bad_values():
    with pytest.raises(ValueError, match="total_num_steps"):
        WarmupDecayLR(make_optimizer(), total_num_steps=3, warmup_num_steps=4)
    with pytest.raises(ValueError, match="optimizer"):
        WarmupLR(object())
