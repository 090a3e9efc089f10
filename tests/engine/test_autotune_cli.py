"""``dslab autotune`` and ``dslab launch --autotuning`` end to end: the driver over a stand-in
training script whose metrics are known functions of its config (``autotune_fake_script.py``),
then over ``examples/train_tiny.py`` with dslab's engine recording the experiments."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import pytest

from dslab import cli
from dslab.engine.autotuning.driver import command_line, config_path, find_config_argument, script_arguments
from dslab.engine.launch.runner import autotune_processes
from dslab.report import list_runs, read_report

HERE = Path(__file__).resolve().parent
FAKE = str(HERE / "autotune_fake_script.py")
TRAIN_TINY = str(HERE.parents[1] / "examples" / "train_tiny.py")
sys.path.insert(0, str(HERE))
from autotune_fake_script import peak_bytes, throughput  # noqa: E402

SURFACE = {"num_params": 1_000_000, "activation_bytes_per_sample": 100_000_000, "device_bytes": 700_000_000,
           "a": {"0": 100.0, "1": 130.0, "2": 160.0, "3": 90.0}, "b": 4.0, "fail_stages": [2]}


def _setup(tmp_path, monkeypatch, autotuning: dict | None = None, config: dict | None = None, **surface):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "surface.json").write_text(json.dumps({**SURFACE, "calls": str(tmp_path / "calls.txt"), **surface}))
    user = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            **(config or {}),
            "autotuning": {"enabled": True, "num_tuning_micro_batch_sizes": 4, "tuner_early_stopping": 100,
                           # the fake's throughput depends on the stage on one process, which a real
                           # engine's does not: every stage runs unless a test turns pruning back on
                           "prune_dominated_stages": False,
                           # the tests of the powers-of-two search; the refinement has its own
                           "refine_micro_batch": False, **(autotuning or {})}}
    (tmp_path / "cfg.json").write_text(json.dumps(user))
    return user


def _calls(tmp_path) -> list[str]:
    path = tmp_path / "calls.txt"
    return path.read_text().split() if path.is_file() else []


def _autotune(*options: str, args=("--deepspeed_config", "cfg.json"), reports: str = "reports") -> int:
    return cli.main(["autotune", "--reports", reports, *options, FAKE, *args, "--surface", "surface.json"])


def _report(tmp_path, reports: str = "reports"):
    """The one run under ``reports`` (run ids within one second do not sort by time)."""
    (run,) = list_runs(tmp_path / reports, "autotune")
    return read_report(run)


def test_fake_script_end_to_end(tmp_path, monkeypatch, capsys):
    user = _setup(tmp_path, monkeypatch)
    assert _autotune("--memory-budget", "1GB") == 0
    out = capsys.readouterr()
    # 16 MB of model states + 100 MB per sample: the memory model lets 1..8 through a 1 GB budget,
    # the fake device (700 MB) runs out of memory at 8, stage 2 crashes
    stage_best = {s: throughput(SURFACE, {"zero_optimization": {"stage": s}, "train_micro_batch_size_per_gpu": 4,
                                          "gradient_accumulation_steps": 1}) for s in (0, 1, 3)}
    best = f"z{max(stage_best, key=stage_best.get)}_mbs4_gas1"
    assert best == "z1_mbs4_gas1"
    exps, results = tmp_path / "autotuning_exps", tmp_path / "autotuning_results"
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal == json.loads((exps / best / "ds_config.json").read_text())
    assert optimal == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                       "optimizer": user["optimizer"], "zero_optimization": {"stage": 1}}
    command = shlex.split((results / "cmd_optimal.txt").read_text())
    assert command == [sys.executable, FAKE, "--deepspeed_config", str((results / "ds_config_optimal.json").resolve()),
                       "--surface", "surface.json"]
    assert _calls(tmp_path)[:1] == ["z3_mbs1_gas1"]  # the profile at stage 3 first (it counts the parameters too)

    report = _report(tmp_path)
    assert report.suite == "autotune" and report.status == "partial"
    by_case = {r.case: r for r in report.results}
    section = report.profilers["autotuning"]
    assert section["best"] == best and section["best_metric"] == pytest.approx(stage_best[1])
    assert section["memory_budget_bytes"] == 10 ** 9 and section["model"] == {"num_params": 1_000_000}
    statuses = {e["name"]: e["status"] for e in section["experiments"]}
    for stage in range(4):
        assert statuses[f"z{stage}_mbs16_gas1"] == "pruned"
        assert by_case[f"z{stage}_mbs16_gas1"].status == "skipped"
        assert by_case[f"z{stage}_mbs16_gas1"].error.startswith("estimated 1.6 GB > 1.0 GB budget")
    for stage in (0, 1, 3):
        assert statuses[f"z{stage}_mbs8_gas1"] == "oom" and by_case[f"z{stage}_mbs8_gas1"].status == "oom"
        assert "CUDA out of memory" in by_case[f"z{stage}_mbs8_gas1"].error
    assert {statuses[f"z2_mbs{m}_gas1"] for m in (1, 2, 4, 8)} == {"failed"}
    assert "ValueError: stage 2 is broken in this fake" in by_case["z2_mbs4_gas1"].error
    ok = by_case[best]
    assert ok.status == "ok" and ok.metrics["samples_per_s"] == pytest.approx(stage_best[1])
    assert ok.metrics["peak_memory_gb"] == pytest.approx(peak_bytes(SURFACE, optimal) / 1e9)
    experiment = next(e for e in section["experiments"] if e["name"] == best)
    assert experiment["config"] == {"zero_stage": 1, "micro_batch_size": 4, "gradient_accumulation_steps": 1}
    assert experiment["estimated_memory_bytes"] == 16 * 1_000_000 + 4 * 100_000_000  # the measured activations
    assert [e["order"] for e in section["experiments"]] == list(range(1, len(section["experiments"]) + 1))

    summary = (results / "summary.txt").read_text()
    assert f"best: {best} (" in summary and "pruned" in summary and "oom" in summary
    lines = {line.split()[1]: line for line in summary.splitlines() if line[:1].isdigit()}
    assert set(lines) == {e["name"] for e in section["experiments"]}
    assert f"{best} *" in summary and "[autotune] #1 z3_mbs1_gas1: ok" in out.err
    assert "ds_config_optimal:" in out.out


REFINE = {"refine_micro_batch": True, "tuner_type": "model_based", "num_tuning_micro_batch_sizes": 3}


def _statuses(tmp_path) -> dict[str, tuple[str, str | None]]:
    section = _report(tmp_path).profilers["autotuning"]
    return {e["name"]: (e["status"], e["reason"]) for e in section["experiments"]}


def test_auto_micro_batch_is_refined_between_the_best_and_the_out_of_memory_above_it(tmp_path, monkeypatch):
    """The fake device holds 49 samples (5 GB; 100 MB each): the powers of two run 1, 8 and 64 (the
    budget lets 1..64 through), 64 runs out of memory, 8 is best. The refinement then runs 32 and
    48 (each better by more than 1%), 56 and 52 (out of memory), and stops with 48 and 52 an
    eighth of 48 apart. Without ``refine_micro_batch`` the search ends at 8."""
    surface = {"b": 4.0, "fail_stages": [], "device_bytes": 5 * 10 ** 9}
    _setup(tmp_path, monkeypatch, REFINE,
           {"zero_optimization": {"stage": 0}}, **surface)
    assert _autotune("--memory-budget", "10GB") == 0
    calls = _calls(tmp_path)
    assert calls[-4:] == ["z0_mbs32_gas1", "z0_mbs48_gas1", "z0_mbs56_gas1", "z0_mbs52_gas1"]
    assert sorted(calls[:-4]) == ["z0_mbs1_gas1", "z0_mbs64_gas1", "z0_mbs8_gas1"]
    statuses = _statuses(tmp_path)
    assert statuses["z0_mbs64_gas1"][0] == "oom" and statuses["z0_mbs56_gas1"][0] == "oom"
    assert statuses["z0_mbs48_gas1"][0] == "ok" and _report(tmp_path).profilers["autotuning"]["best"] == "z0_mbs48_gas1"
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == 48
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert ("micro-batch refined in z0's group from 8 (ran) towards 64 (did not fit): 32: ok, 48: ok, 56: oom, "
            "52: oom") in summary

    off = tmp_path / "off"
    off.mkdir()
    _setup(off, monkeypatch, {**REFINE, "refine_micro_batch": False},
           {"zero_optimization": {"stage": 0}}, **surface)
    assert _autotune("--memory-budget", "10GB") == 0
    assert sorted(_calls(off)) == ["z0_mbs1_gas1", "z0_mbs64_gas1", "z0_mbs8_gas1"]
    assert _report(off).profilers["autotuning"]["best"] == "z0_mbs8_gas1"


def test_refinement_stops_where_the_throughput_has_saturated(tmp_path, monkeypatch):
    """With b = 0.05 the fake's throughput is within 0.5% of its ceiling from 8 samples on: 32 is
    better than 8, by less than 1%, so the refinement keeps it and stops there."""
    _setup(tmp_path, monkeypatch, REFINE,
           {"zero_optimization": {"stage": 0}}, b=0.05, fail_stages=[], device_bytes=5 * 10 ** 9)
    assert _autotune("--memory-budget", "10GB") == 0
    assert _calls(tmp_path)[-1] == "z0_mbs32_gas1" and "z0_mbs48_gas1" not in _calls(tmp_path)
    assert _report(tmp_path).profilers["autotuning"]["best"] == "z0_mbs32_gas1"


def test_refinement_prunes_sizes_over_the_budget_without_running_them(tmp_path, monkeypatch):
    """A 5 GB budget and a 10 GB device: the memory model stops the powers of two at 32 (64 is over
    budget); the refinement runs 48 and prunes 56 and 52 on the estimate (16 MB + 100 MB a sample)."""
    _setup(tmp_path, monkeypatch, REFINE,
           {"zero_optimization": {"stage": 0}}, b=4.0, fail_stages=[], device_bytes=10 ** 10)
    assert _autotune("--memory-budget", "5GB") == 0
    calls = _calls(tmp_path)
    assert calls[-1] == "z0_mbs48_gas1" and not {"z0_mbs56_gas1", "z0_mbs52_gas1", "z0_mbs64_gas1"} & set(calls)
    statuses = _statuses(tmp_path)
    for name in ("z0_mbs56_gas1", "z0_mbs52_gas1"):
        assert statuses[name][0] == "pruned" and statuses[name][1].startswith("estimated 5.")
    assert _report(tmp_path).profilers["autotuning"]["best"] == "z0_mbs48_gas1"


def test_the_memory_model_learns_from_each_run_and_prunes_what_it_then_rules_out(tmp_path, monkeypatch):
    """A one-sample peak far under the slope (15 MB where every later sample takes 100 MB, as GPT-2
    355M with CUDA graphs measured on an H200): the plan from the profile lets large micro-batches
    through, but once a larger size has run the model holds 100 MB a sample, and the sizes it then
    rules out on the 5 GB device are pruned unlaunched instead of running out of memory."""
    _setup(tmp_path, monkeypatch, REFINE, {"zero_optimization": {"stage": 0}},
           b=4.0, fail_stages=[], device_bytes=5 * 10 ** 9, first_sample_bytes=15_000_000)
    assert _autotune("--memory-budget", "5GB") == 0
    calls = _calls(tmp_path)
    statuses = _statuses(tmp_path)
    ran = [int(name.split("_mbs")[1].split("_")[0]) for name in calls]
    assert ran[0] == 1 and max(ran) <= 49  # 49 samples fit the device: nothing ran out of memory
    assert not [name for name, (status, _) in statuses.items() if status == "oom"]
    relearned = [(name, reason) for name, (status, reason) in statuses.items()
                 if status == "pruned" and reason and reason.endswith("re-estimated from the experiments that ran")]
    assert relearned, statuses  # pruned by what the runs taught, not by the profile's plan
    for name, reason in relearned:
        assert int(name.split("_mbs")[1].split("_")[0]) > 49 and reason.startswith("estimated ")
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert "re-measured at z0_mbs" in summary and "100.0 MB (was 15.0 MB)" in summary
    best = _report(tmp_path).profilers["autotuning"]["best"]
    assert 32 <= int(best.split("_mbs")[1].split("_")[0]) <= 49


def test_dominated_stages_wait_and_an_out_of_memory_prunes_them_on_one_process(tmp_path, monkeypatch):
    """By default (``prune_dominated_stages``), on one process only stage 0 runs where it fits; the
    higher stages are pruned as dominated. Where stage 0 runs out of memory, the higher stages at
    that micro-batch are pruned too (one rank: every stage holds the same model states), not run.
    No separate model-info launch: the profile (at stage 0, the highest stage not held back)
    reports the parameter count."""
    _setup(tmp_path, monkeypatch, {"prune_dominated_stages": True, "tuner_type": "model_based"},
           {"train_micro_batch_size_per_gpu": [2, 4, 8]}, fail_stages=[])
    assert _autotune("--memory-budget", "2GB") == 0
    calls = _calls(tmp_path)
    assert calls[0] == "z0_mbs2_gas1"
    assert sorted(calls) == ["z0_mbs2_gas1", "z0_mbs4_gas1", "z0_mbs8_gas1"]
    section = _report(tmp_path).profilers["autotuning"]
    statuses = _statuses(tmp_path)
    assert section["best"] == "z0_mbs4_gas1" and section["model"] == {"num_params": 1_000_000}
    assert statuses["z0_mbs8_gas1"][0] == "oom"
    for stage in (1, 2, 3):
        status, reason = statuses[f"z{stage}_mbs8_gas1"]
        assert status == "pruned" and reason.startswith(
            f"one data-parallel rank: the same model states as z{stage - 1}_mbs8_gas1, which did not fit")
        for mbs in (2, 4):
            status, reason = statuses[f"z{stage}_mbs{mbs}_gas1"]
            assert status == "pruned" and reason.startswith(f"one data-parallel rank: ZeRO stage {stage} shards")


def test_on_one_process_a_failed_stage_still_releases_the_next(tmp_path, monkeypatch):
    """A crash says nothing about the next stage's memory: stage 0 fails, so stage 1 runs (no
    memory budget: a profile that crashes would end the search)."""
    _setup(tmp_path, monkeypatch, {"prune_dominated_stages": True, "tuner_type": "gridsearch"},
           {"train_micro_batch_size_per_gpu": [2, 4], "zero_optimization": {"stage": [0, 1]}}, fail_stages=[0])
    assert _autotune() == 0
    assert set(_calls(tmp_path)) == {"z0_mbs2_gas1", "z0_mbs4_gas1", "z1_mbs2_gas1", "z1_mbs4_gas1"}
    assert _report(tmp_path).profilers["autotuning"]["best"] == "z1_mbs4_gas1"


def test_model_based_and_random_find_the_same_best(tmp_path, monkeypatch):
    _setup(tmp_path, monkeypatch, fail_stages=[])
    for kind in ("model_based", "random"):
        assert _autotune("--memory-budget", "1GB", "--tuner-type", kind, reports=kind) == 0
        report = _report(tmp_path, kind)
        assert report.profilers["autotuning"]["tuner_type"] == kind
        assert report.profilers["autotuning"]["best"] == "z2_mbs4_gas1"


def test_without_budget_on_cpu_nothing_is_pruned_and_sizes_grow_from_the_smallest(tmp_path, monkeypatch):
    _setup(tmp_path, monkeypatch, {"num_tuning_micro_batch_sizes": 3}, {"zero_optimization": {"stage": 1}})
    assert _autotune() == 0
    assert _calls(tmp_path) == ["z1_mbs1_gas1", "z1_mbs2_gas1", "z1_mbs4_gas1"]
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert "no memory budget" in summary and "memory budget per GPU: none" in summary


def test_refused_configs_fail_without_running_and_the_profile_takes_the_highest_accepted_stage(tmp_path,
                                                                                                 monkeypatch):
    _setup(tmp_path, monkeypatch, config={"zero_optimization": {"stage": [2, 3]}, "compile": {"enabled": True},
                                          "train_micro_batch_size_per_gpu": [1, 2]}, fail_stages=[])
    assert _autotune("--memory-budget", "1GB") == 0
    assert _calls(tmp_path) == ["z2_mbs1_gas1", "z2_mbs2_gas1"]
    experiments = {e["name"]: e for e in _report(tmp_path).profilers["autotuning"]["experiments"]}
    for name in ("z3_mbs1_gas1", "z3_mbs2_gas1"):
        assert experiments[name]["status"] == "failed"
        assert experiments[name]["reason"].startswith("dslab refuses its config: config key 'compile.enabled'")


def test_each_checkpointing_setting_gets_its_own_profile(tmp_path, monkeypatch):
    """Checkpointing halves the fake's activations: 50 MB per sample fit 16 samples in 1 GB where
    100 MB fit 8."""
    _setup(tmp_path, monkeypatch, {"num_tuning_micro_batch_sizes": 8},
           {"zero_optimization": {"stage": 3}, "activation_checkpointing": {"enabled": [False, True]}},
           checkpoint_factor=0.5, device_bytes=10 ** 10)
    assert _autotune("--memory-budget", "1GB") == 0
    assert _calls(tmp_path)[:2] == ["z3_mbs1_gas1_ckpt0", "z3_mbs1_gas1_ckpt1"]
    section = _report(tmp_path).profilers["autotuning"]
    pruned = sorted(e["name"] for e in section["experiments"] if e["status"] == "pruned")
    assert pruned == ["z3_mbs16_gas1_ckpt0", "z3_mbs32_gas1_ckpt1"]
    assert section["best"] == "z3_mbs16_gas1_ckpt1"
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert "100.0 MB (checkpointing 0), 50.0 MB (checkpointing 1)" in summary


def test_overwrite_false_reuses_finished_experiments(tmp_path, monkeypatch):
    _setup(tmp_path, monkeypatch, {"overwrite": False}, {"zero_optimization": {"stage": [0, 1]},
                                                         "train_micro_batch_size_per_gpu": [1, 2]})
    assert _autotune() == 0
    first = _calls(tmp_path)
    assert first == ["z0_mbs1_gas1", "z0_mbs2_gas1", "z1_mbs1_gas1", "z1_mbs2_gas1"]
    assert _autotune(reports="again") == 0
    assert _calls(tmp_path) == first  # nothing ran again
    report = _report(tmp_path, "again")
    assert all("reused" in e["reason"] for e in report.profilers["autotuning"]["experiments"])
    _setup(tmp_path, monkeypatch, {"overwrite": False}, {"zero_optimization": {"stage": [0, 1]},
                                                         "train_micro_batch_size_per_gpu": [1, 2], "kernels": "torch"})
    assert _autotune() == 0
    assert _calls(tmp_path) == first * 2  # a changed config runs again


def test_arg_mappings_set_the_scripts_options(tmp_path, monkeypatch):
    _setup(tmp_path, monkeypatch, {"arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"}},
           {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": [1, 2, 4]})
    assert _autotune(args=("--deepspeed_config=cfg.json", "--batch", "999")) == 0
    command = shlex.split((tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text())
    assert command[2:] == [f"--deepspeed_config={(tmp_path / 'autotuning_results/ds_config_optimal.json').resolve()}",
                           "--batch", "4", "--surface", "surface.json"]


def test_refusals(tmp_path, monkeypatch, capsys):
    _setup(tmp_path, monkeypatch)
    (tmp_path / "off.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    assert _autotune(args=("--deepspeed_config", "off.json")) == 1
    assert "'autotuning.enabled'" in capsys.readouterr().err
    assert _autotune(args=()) == 1
    assert "--deepspeed_config FILE" in capsys.readouterr().err
    assert cli.main(["autotune"]) == 1
    assert "needs a script" in capsys.readouterr().err
    (tmp_path / "broken.py").write_text("raise SystemExit('no model here')\n")
    assert cli.main(["autotune", "broken.py", "--deepspeed_config", "cfg.json"]) == 1
    err = capsys.readouterr().err
    assert "#1 z0_mbs1_gas1: failed" in err and "(exit status 1: no model here)" in err
    assert "no experiment ran to the end" in err
    assert cli.main(["launch", "--autotuning", "tune", "--dry-run", FAKE]) == 1


def test_config_argument_forms():
    assert find_config_argument(["--deepspeed", "--deepspeed_config", "a.json"]) == (1, False)
    assert find_config_argument(["--x", "--deepspeed_config=a.json"]) == (1, True)
    assert find_config_argument(["--dslab_config", "a.json"]) == (0, False)
    assert find_config_argument(["--deepspeed", "cfg/a.json"]) == (0, False)
    assert find_config_argument(["--deepspeed", "data.txt"]) is None
    assert config_path(["--deepspeed", "--deepspeed_config=a.json"]) == "a.json"
    args = script_arguments(["--deepspeed", "--deepspeed_config", "a.json", "--bs=3"], "/e/ds.json",
                            {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}},
                            {"train_micro_batch_size_per_gpu": "--bs", "zero_optimization.stage": "--stage"})
    assert args == ["--deepspeed", "--deepspeed_config", "/e/ds.json", "--bs=8", "--stage", "2"]
    with pytest.raises(ValueError, match="arg_mappings: config key 'fp16.enabled'"):
        script_arguments(["--deepspeed_config", "a"], "b", {}, {"fp16.enabled": "--fp16"})


def test_several_processes_go_through_dslab_launch():
    assert command_line("t.py", ["--x"], None, "py") == ["py", "t.py", "--x"]
    assert command_line("t.py", ["--x"], ["--num_gpus", "2"], "py") == \
        ["py", "-m", "dslab.cli", "launch", "--num_gpus", "2", "t.py", "--x"]
    args = argparse.Namespace(num_gpus=2, num_nodes=None)
    assert autotune_processes(args, gpu_count=lambda: 4) == (2, ["--num_gpus", "2"])
    assert autotune_processes(argparse.Namespace(num_gpus=1, num_nodes=None), gpu_count=lambda: 4) == (1, None)


@pytest.mark.slow
def test_launch_autotuning_run_trains_with_the_optimal_config(tmp_path, monkeypatch, capfd):
    _setup(tmp_path, monkeypatch, config={"zero_optimization": {"stage": [0, 3]},
                                          "train_micro_batch_size_per_gpu": [1, 4]})
    assert cli.main(["launch", "--autotuning", "run", FAKE, "--deepspeed_config", "cfg.json",
                     "--surface", "surface.json"]) == 0
    optimal = (tmp_path / "autotuning_results" / "ds_config_optimal.json").resolve()
    assert f"trained with {optimal}: micro-batch 4, stage 0" in capfd.readouterr().out


@pytest.mark.slow
def test_train_tiny_with_the_engine_recording(tmp_path, monkeypatch, capsys):
    """examples/train_tiny.py with the engine's ExperimentRecorder writing the metrics: on one
    process stage 0 runs at micro-batch 1 and 2 and stage 1 is pruned as dominated; with
    pruning off, the trial cap stops after three experiments."""
    monkeypatch.chdir(tmp_path)
    config = {"train_micro_batch_size_per_gpu": [1, 2], "zero_optimization": {"stage": [0, 1]},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2, "tuner_num_trials": 3}}
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    assert cli.main(["autotune", "--reports", "reports", TRAIN_TINY, "--steps", "20",
                     "--deepspeed_config", "cfg.json"]) == 0
    section = _report(tmp_path).profilers["autotuning"]
    statuses = {e["name"]: e["status"] for e in section["experiments"]}
    assert statuses == {"z0_mbs1_gas1": statuses["z0_mbs1_gas1"], "z0_mbs2_gas1": statuses["z0_mbs2_gas1"],
                        "z1_mbs1_gas1": "pruned", "z1_mbs2_gas1": "pruned"}
    assert {statuses["z0_mbs1_gas1"], statuses["z0_mbs2_gas1"]} <= {"ok", "early_stopped"}
    assert section["model"]["num_params"] == 536_320  # TinyTransformer's
    best = section["best"]
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal == json.loads((tmp_path / "autotuning_exps" / best / "ds_config.json").read_text())
    metrics = json.loads((tmp_path / "autotuning_exps" / best / "metrics.json").read_text())
    assert metrics["profiled_steps"] == 2 and metrics["throughput"] == pytest.approx(section["best_metric"])

    config["autotuning"]["prune_dominated_stages"] = False
    config["autotuning"]["results_dir"] = "grid_results"
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    assert cli.main(["autotune", "--reports", "grid", TRAIN_TINY, "--steps", "20",
                     "--deepspeed_config", "cfg.json"]) == 0
    section = _report(tmp_path, "grid").profilers["autotuning"]
    assert [e["name"] for e in section["experiments"]] == ["z0_mbs1_gas1", "z0_mbs2_gas1", "z1_mbs1_gas1"]
    assert all(e["status"] in ("ok", "early_stopped") for e in section["experiments"])
    assert "tuner_num_trials (3)" in (tmp_path / "grid_results" / "summary.txt").read_text()
