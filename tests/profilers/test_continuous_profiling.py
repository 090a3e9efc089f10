"""Continuous profiling (``flops_profiler.every_n_steps``): the key's checks, an engine on CPU taking
its profiles at the documented steps with no hook left on the others and no change to the losses,
the series' compact records and its bound over a long run, the report frame of the series, and
the overhead benchmark at a tiny size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dslab
from dslab.models import GPT2LMHeadModel, gpt2_tiny
from dslab.profilers import flops_continuous
from dslab.profilers.flops_continuous import ContinuousProfiles, compact_modules
from dslab.report import frames, report_from_dict

ROOT = Path(__file__).resolve().parents[2]
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 10**9}


def _hooked(model: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _train(flops_profiler: dict | None, steps: int, observe=None):
    """Losses of ``steps`` steps of GPT-2 tiny (no dropout) from seed 0, and the flops records;
    ``observe(step, model)`` runs after each forward."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="torch")
    config = dict(BASE, **({"flops_profiler": flops_profiler} if flops_profiler else {}))
    engine, *_ = dslab.initialize(model=model, config=config)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(steps):
        loss = engine(input_ids=ids, labels=ids)
        if observe is not None:
            observe(step, model)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
        assert not _hooked(model), f"hooks left on the model after step {step}"
    records = engine.profiler_records().get("flops")
    engine.destroy()
    return losses, records


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "3"])
def test_every_n_steps_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=r"flops_profiler\.every_n_steps' must be a positive int"):
        dslab.initialize(model=torch.nn.Linear(4, 4),
                         config=dict(BASE, flops_profiler={"enabled": True, "every_n_steps": value}))


def test_every_n_steps_needs_device_time():
    with pytest.raises(ValueError, match=r"flops_profiler\.every_n_steps.*flops_profiler\.device_time"):
        dslab.initialize(model=torch.nn.Linear(4, 4), config=dict(
            BASE, flops_profiler={"enabled": True, "every_n_steps": 3, "device_time": False}))


@pytest.mark.parametrize("timer", ["events", "kernels"])
def test_engine_profiles_every_n_steps_after_the_first_timed_step(monkeypatch, timer):
    """profile_step 1, every_n_steps 3, steps 0..9: step 1 counted, steps 2, 5 and 8 timed (2 is
    the first profile, by kernels, then every 3 by the configured timer), step 3 under the profiler
    without hooks; every other step runs with no hook, no dispatch mode and no profiler. The
    attribution of profiles 5 and 8 is done at the begin of steps 6 and 9 (no budget)."""
    monkeypatch.setattr(flops_continuous, "WORK_PER_STEP_MS", 1e6)
    seen = {}

    def observe(step, model):
        seen[step] = (_hooked(model), torch._C._autograd._profiler_enabled(), torch._C._len_torch_dispatch_stack())

    _, records = _train({"enabled": True, "profile_step": 1, "every_n_steps": 3, "module_depth": 2,
                         "top_modules": 2, "continuous_timer": timer}, 10, observe)
    assert {s for s, (hooks, _, _) in seen.items() if hooks} == {1, 2, 5, 8}
    assert {s for s, (_, profiler, _) in seen.items() if profiler} == ({2, 3, 5, 8} if timer == "kernels" else {2, 3})
    assert {s for s, (_, _, modes) in seen.items() if modes} == {1}
    series = records["continuous"]
    assert (series["every_n_steps"], series["interval_steps"], series["taken"]) == (3, 3, 3)
    profiles = series["profiles"]
    assert [p["step"] for p in profiles] == [2, 5, 8]
    assert [p["timer"] for p in profiles] == ["kernels", timer, timer]
    assert all(p["host_lead"] is None for p in profiles)  # a CPU: no device to lead
    # the first profile's device times are the single profile's
    root = next(m for m in records["modules"] if m["name"] == "")
    assert profiles[0]["forward_ms"] == root["forward_device_ms"] == profiles[0]["modules"][0]["forward_ms"]
    for p in profiles:
        assert p["forward_ms"] > 0 and p["backward_ms"] > 0 and p["span_ms"] > 0
        assert (p["busy_ms"] > 0) if p["timer"] == "kernels" else p["busy_ms"] is None
        # the events' root spans the forward, backward and optimizer inside the step's span
        assert p["forward_ms"] + p["backward_ms"] + p["optimizer_ms"] <= p["span_ms"]
        names = [m["name"] for m in p["modules"]]
        assert names[0] == "" and "layers" in names
        for depth in (1, 2):
            kept = [m for m in p["modules"] if m["depth"] == depth]
            assert len(kept) == 2 and all(m["forward_ms"] > 0 for m in kept)
        assert max(m["depth"] for m in p["modules"]) == 2
        layers = next(m for m in p["modules"] if m["name"] == "layers")
        assert 0 < layers["forward_ms"] <= p["forward_ms"] and 0 < layers["backward_ms"] <= p["backward_ms"]
    # windows: after 2, step 3 ran under the profiler and 5 is the next profile (one step, 4 -> 5);
    # after 5, step 6 carried its attribution (7 -> 8); after 8, the run ends before 9 -> 10
    assert [p["window_steps"] for p in profiles] == [1, 1, 0]
    for p in profiles[:2]:
        assert p["step_ms"] > 0
        assert p["achieved_tflops"] == pytest.approx(records["total_flops"] / (p["step_ms"] * 1e-3) / 1e12)
    assert profiles[2]["step_ms"] is None and profiles[2]["achieved_tflops"] is None
    # the steady state leaves the profiled steps out: 4->5, 6->7 and 7->8 (5->6 and 8->9 start at one)
    assert records["steady_state"]["steps"] == 3
    json.dumps(records)


def test_continuous_profiling_does_not_change_the_losses():
    plain, _ = _train(None, 7)
    single, _ = _train({"enabled": True, "profile_step": 1}, 7)
    continuous, records = _train({"enabled": True, "profile_step": 1, "every_n_steps": 2}, 7)
    assert [p["step"] for p in records["continuous"]["profiles"]] == [2, 4, 6]
    for a, b, c in zip(plain, single, continuous):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_every_step_profiled(capsys):
    """every_n_steps 1: each step from profile_step + 1 on is a profile, none has an unprofiled
    step to time, and the text profile is still written."""
    _, records = _train({"enabled": True, "profile_step": 0, "every_n_steps": 1}, 4)
    assert capsys.readouterr().out.count("Profile Summary at step 0") == 1
    profiles = records["continuous"]["profiles"]
    assert [p["step"] for p in profiles] == [1, 2, 3]
    assert all(p["step_ms"] is None and p["window_steps"] == 0 for p in profiles)
    assert "steady_busy_ms" not in records["device_time"] and "steady_state" not in records


def _timed(scale: float) -> dict:
    return {"modules": {"": {"forward_ms": 3 * scale, "backward_ms": 6 * scale},
                        "layers.0": {"forward_ms": 1 * scale, "backward_ms": 2 * scale},
                        "layers.1": {"forward_ms": 2 * scale, "backward_ms": 4 * scale},
                        "layers.1.mlp": {"forward_ms": 1.5 * scale, "backward_ms": 3 * scale}},
            "optimizer_ms": 0.5, "busy_ms": 9.5 * scale, "span_ms": 10 * scale}


def test_compact_modules_sums_containers_and_keeps_the_top_of_each_depth():
    names = ["", "layers", "layers.0", "layers.1", "layers.1.mlp"]
    kept = compact_modules(_timed(1.0), names, module_depth=2, top_modules=1)
    assert [(m["name"], m["depth"]) for m in kept] == [("", 0), ("layers", 1), ("layers.1", 2)]
    assert kept[1]["forward_ms"] == 3.0 and kept[1]["backward_ms"] == 6.0  # the ModuleList: its layers' sum
    every_depth = compact_modules(_timed(1.0), names, module_depth=-1, top_modules=5)
    assert [m["name"] for m in every_depth] == ["", "layers", "layers.1", "layers.0", "layers.1.mlp"]


def test_a_long_run_keeps_a_bounded_evenly_spaced_series(monkeypatch):
    """With room for 4 profiles (+1), the fifth halves the series and doubles the interval: the
    kept profiles stay evenly spaced from the first to the latest."""
    monkeypatch.setattr(flops_continuous, "MAX_PROFILES", 4)
    series = ContinuousProfiles(every_n_steps=2, first_step=1, names=["", "layers", "layers.0", "layers.1",
                                                                      "layers.1.mlp"],
                                module_depth=1, top_modules=1, cuda=False)
    counted = {"total_flops": 10**12, "peaks": {"measured_tflops": 100.0, "datasheet_tflops": None}}
    for step in range(60):
        profiled = step == series.next_step
        series.on_step_begin(step, clean=not profiled)
        if profiled:
            series.add(step, _timed(1.0 + step), counted)
    records = series.records(counted)
    steps = [p["step"] for p in records["profiles"]]
    assert steps == [1, 17, 33, 49]
    assert records["interval_steps"] == 16 and records["taken"] == 10 and series.next_step == 65
    # the first window ends at the next profile (step 3); the later ones after WINDOW_STEPS steps
    assert [p["window_steps"] for p in records["profiles"]] == [1, 4, 4, 4]
    assert all(p["step_ms"] > 0 for p in records["profiles"])
    mfu = records["profiles"][0]["mfu"]
    assert mfu["datasheet"] is None
    assert mfu["measured"] == pytest.approx(records["profiles"][0]["achieved_tflops"] / 100.0)


def test_attribution_advances_step_by_step_and_records_finish_it(monkeypatch):
    """The pending attribution advances by about WORK_PER_STEP_MS at each step's begin, not on
    the profiled step, and records() finishes it; the steps that carry it are not in the window;
    an error it raises is the profile's."""
    monkeypatch.setattr(flops_continuous, "WORK_PER_STEP_MS", 0.0)  # one piece per step
    series = ContinuousProfiles(every_n_steps=10, first_step=1, names=["", "layers", "layers.0"], module_depth=-1,
                                top_modules=2, cuda=False)
    counted = {"total_flops": 10**12, "peaks": {}}
    pieces = []

    def work(n):
        for i in range(n):
            pieces.append(i)
            yield
        return _timed(1.0)

    series.add_later(1, work(5), counted)
    assert pieces == [] and "modules" not in series.profiles[0] and series.next_step == 11
    for step in (2, 3):
        series.on_step_begin(step, clean=True)
    assert pieces == [0, 1] and "modules" not in series.profiles[0]
    records = series.records(counted)
    assert pieces == [0, 1, 2, 3, 4] and records["profiles"][0]["window_steps"] == 0  # 2 and 3 carried work
    assert [m["name"] for m in records["profiles"][0]["modules"]] == ["", "layers", "layers.1", "layers.0",
                                                                       "layers.1.mlp"]

    def broken():
        yield
        raise ZeroDivisionError("division by zero")

    for step in range(4, 12):
        series.on_step_begin(step, clean=step != 11)
    series.add_later(11, broken(), counted)
    records = series.records(counted)
    assert records["profiles"][0]["window_steps"] == 4  # 4 -> 5 .. 7 -> 8, once the work was done
    assert records["profiles"][1]["error"] == "ZeroDivisionError: division by zero"


def test_a_failed_attribution_is_recorded_and_training_goes_on(monkeypatch):
    from dslab.profilers import device_time, event_time

    def broken(*args, **kwargs):
        raise ValueError("no activity records")

    monkeypatch.setattr(device_time, "attribute", broken)
    losses, records = _train({"enabled": True, "profile_step": 1, "every_n_steps": 3, "continuous_timer": "kernels"}, 7)
    profiles = records["continuous"]["profiles"]
    assert [(p["step"], p["error"]) for p in profiles] == [(2, "ValueError: no activity records"),
                                                            (5, "ValueError: no activity records")]
    assert all("modules" not in p for p in profiles) and profiles[0]["window_steps"] == 1
    assert len(losses) == 7

    monkeypatch.setattr(event_time.EventModuleTimer, "figures", broken)
    losses, records = _train({"enabled": True, "profile_step": 1, "every_n_steps": 3}, 7)
    profiles = records["continuous"]["profiles"]
    assert [(p["step"], p.get("error")) for p in profiles] == [(2, "ValueError: no activity records"),
                                                                (5, "ValueError: no activity records")]
    assert len(losses) == 7


def test_the_frame_returns_the_series(monkeypatch):
    monkeypatch.setattr(flops_continuous, "WORK_PER_STEP_MS", 1e6)  # each attribution in one step
    _, records = _train({"enabled": True, "profile_step": 1, "every_n_steps": 3, "module_depth": 1,
                         "top_modules": 2}, 10)
    report = report_from_dict({"run_id": "20261210T100000Z-cont00", "suite": "gpt2",
                               "profilers": {"flops": {"124m": records}}})
    series = frames.flops_series(report, strict=True)
    assert list(series.columns) == list(frames.COLUMNS["flops_series"])
    profiles = records["continuous"]["profiles"]
    assert len(series) == sum(len(p["modules"]) for p in profiles)
    model = series[series["name"].isna()]
    assert list(model["step"]) == [2, 5, 8] and list(model["depth"]) == [0, 0, 0]
    assert list(model["forward_ms"]) == [p["forward_ms"] for p in profiles]
    assert model["step_ms"].notna().tolist() == [True, True, False]
    layers = series[series["name"] == "layers"]
    assert list(layers["step"]) == [2, 5, 8] and (layers["forward_ms"] > 0).all()
    assert frames.flops_series(report, case="other").empty
    broken = report_from_dict({"run_id": "20261210T100000Z-cont01", "suite": "gpt2", "profilers": {
        "flops": {"124m": {"continuous": {"profiles": [{"step": 4, "error": "RuntimeError: x"}, 3]}}}}})
    assert frames.records(frames.flops_series(broken))[0]["error"] == "RuntimeError: x"
    with pytest.raises(ValueError, match=r"flops\.continuous\.profiles\[1\] should be an object"):
        frames.flops_series(broken, strict=True)


def test_benchmark_runs_on_a_tiny_size(tmp_path):
    out = tmp_path / "continuous.json"
    run = subprocess.run([sys.executable, "benchmarks/continuous_profiling.py", "--size", "tiny", "--every", "2",
                          "--steps", "2", "--trials", "2", "--warmup", "4", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["arm", "steps/s"])
    assert lines[header + 1].startswith("profilers off") and lines[header + 2].startswith("profilers on")
    assert any(line.startswith("overhead: ") for line in lines)
    assert any(line.startswith("profiled step: ") for line in lines)
    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"profilers off", "profilers on"}
    for arm in result["arms"].values():
        assert arm["steps_per_s"] > 0 and len(arm["trial_steps_per_s"]) == 2
    assert result["overhead_pct"] == pytest.approx(100 * (1 - result["arms"]["profilers on"]["steps_per_s"]
                                                          / result["arms"]["profilers off"]["steps_per_s"]))
    assert result["every_n_steps"] == 2 and result["size"] == "tiny"
    assert {"comms", "flops", "memory", "telemetry"} <= set(result["profilers_on"])
    assert result["profiled_steps_timed"] == 2 and result["profiled_over_plain"] > 0
    assert [p["step"] for p in result["continuous"]["profiles"]] == [3, 5, 7]  # warm-up 0..3, trials 4..7
    assert result["arms"]["profilers on"]["config"]["flops_profiler"]["every_n_steps"] == 2
    assert result["timer"] == "events"
    assert [p["timer"] for p in result["continuous"]["profiles"]] == ["kernels", "events", "events"]
    agree = result["against_first"]
    assert agree["later_profiles"] == 2 and [r["step"] for r in agree["profiles"]] == [5, 7]
    assert agree["model_forward"] > 0 and agree["model_backward"] > 0 and agree["host_led"] == 0
    assert any(line.startswith("later profiles (events) against the first") for line in lines)
