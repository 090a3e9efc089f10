"""The ``autotuning`` config section and the engine side of an autotuning experiment
(``DSLAB_AUTOTUNING_EXPERIMENT``): in-process engines for what is checked against a reference,
and ``examples/train_tiny.py`` in subprocesses (one process, and two under torchrun on gloo) for
the protocol end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import dslab
from dslab.config_base import known_keys
from dslab.engine.autotuning import experiment
from dslab.engine.autotuning.config import AutotuningConfig
from dslab.engine.config import UNSUPPORTED_DEEPSPEED_KEYS, DslabConfig, load_config
from dslab.profilers.flops_causal import causal_aware_formulas

REPO = Path(__file__).resolve().parents[2]
TRAIN_TINY = REPO / "examples" / "train_tiny.py"
MICRO_BATCH, GAS = 4, 2
TRAIN_CONFIG = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GAS,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 1000}
METRICS_KEYS = {"throughput", "latency", "flops", "step_times_s", "profiled_steps", "early_stopped",
                "peak_memory_bytes", "num_params", "micro_batch_size", "gradient_accumulation_steps",
                "world_size", "samples_per_step", "tflops_source"}


def _train_tiny():
    spec = importlib.util.spec_from_file_location("train_tiny_example", TRAIN_TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TinyTransformer = _train_tiny().TinyTransformer


def _experiment_dir(tmp_path: Path, **spec) -> Path:
    exp = {"name": "exp_z0_mbs4", "metric": "throughput", "start_profile_step": 2, "end_profile_step": 4,
           "best_metric": None, "early_stop": False, "model_info_only": False, **spec}
    (tmp_path / "exp.json").write_text(json.dumps(exp))
    (tmp_path / "ds_config.json").write_text(json.dumps(TRAIN_CONFIG))
    return tmp_path


def _metrics(exp_dir: Path) -> dict:
    return json.loads((exp_dir / "metrics.json").read_text())


def _batch(micro_batch: int, g: torch.Generator) -> torch.Tensor:
    """train_tiny's tokens: each sequence counts up from a random start."""
    start = torch.randint(0, 512, (micro_batch, 1), generator=g)
    return (start + torch.arange(65)) % 512


def _train_until_exit(engine, max_steps: int, pause_s: float = 0.0) -> int:
    """Run train_tiny's loop until the experiment exits; returns the optimizer steps taken."""
    g = torch.Generator().manual_seed(0)
    with pytest.raises(SystemExit) as exit_info:
        for _ in range(max_steps * engine.gradient_accumulation_steps()):
            engine.backward(engine(_batch(engine.train_micro_batch_size_per_gpu(), g).to(engine.device)))
            engine.step()
            if pause_s and engine.is_gradient_accumulation_boundary():
                time.sleep(pause_s)  # once per optimizer step, after its first micro-step
    assert exit_info.value.code == 0
    return engine.global_steps


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the subprocesses run (OMP_NUM_THREADS=1): the machine's cores are
    shared, and more threads than cores only slow each step down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _engine(config: dict | None = None):
    torch.manual_seed(0)
    engine, *_ = dslab.initialize(model=TinyTransformer(), config=config or TRAIN_CONFIG)
    return engine


# -- the config section ----------------------------------------------------------------------------

def test_frozen_autotuning_keys_and_deepspeed_defaults():
    """What users type (STYLE.md #12): DeepSpeed's keys, with DeepSpeed's defaults
    (deepspeed/autotuning/constants.py), and the section is no longer refused."""
    assert "autotuning" not in UNSUPPORTED_DEEPSPEED_KEYS
    assert "autotuning" in known_keys(DslabConfig)
    assert AutotuningConfig().model_dump() == {
        "enabled": False, "fast": True, "metric": "throughput", "start_profile_step": 3,
        "end_profile_step": 5, "max_train_batch_size": None, "min_train_batch_size": 1, "mp_size": 1,
        "num_tuning_micro_batch_sizes": 3, "min_train_micro_batch_size_per_gpu": 1,
        "max_train_micro_batch_size_per_gpu": 1024, "tuner_type": "gridsearch", "tuner_early_stopping": 5,
        "tuner_num_trials": 50, "results_dir": "autotuning_results", "exps_dir": "autotuning_exps",
        "overwrite": True, "arg_mappings": {}, "prune_dominated_stages": True,
            "refine_micro_batch": True}


def test_deepspeed_example_sections_parse():
    # the tutorial's section (its arg_mappings key with the trailing space included)
    tutorial = {"enabled": True, "arg_mappings": {
        "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
        "gradient_accumulation_steps ": "--gradient_accumulation_steps"}}
    cfg = load_config({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}, "autotuning": tutorial})
    assert cfg.autotuning.enabled and cfg.autotuning.arg_mappings == tutorial["arg_mappings"]
    assert cfg.autotuning.tuner_type == "gridsearch" and cfg.autotuning.start_profile_step == 3
    full = {"enabled": True, "fast": False, "metric": "latency", "start_profile_step": 5, "end_profile_step": 15,
            "max_train_batch_size": 512, "min_train_batch_size": 8, "mp_size": 1, "num_tuning_micro_batch_sizes": 4,
            "min_train_micro_batch_size_per_gpu": 2, "max_train_micro_batch_size_per_gpu": 64,
            "tuner_type": "model_based", "tuner_early_stopping": 3, "tuner_num_trials": 20,
            "results_dir": "out/results", "exps_dir": "out/exps", "overwrite": False, "arg_mappings": None}
    section = load_config({"train_batch_size": 8, "autotuning": full}).autotuning
    assert section.model_dump() == {**full, "arg_mappings": {}, "prune_dominated_stages": True,
                                    "refine_micro_batch": True}


@pytest.mark.parametrize("section, message", [
    ({"end_profile_step": 3}, r"autotuning.end_profile_step \(3\) must be greater than autotuning.start_profile_step \(3\)"),
    ({"start_profile_step": 0}, r"'autotuning.start_profile_step'.*greater than or equal to 1"),
    ({"metric": "speed"}, r"'autotuning.metric'.*'throughput', 'latency' or 'flops'"),
    ({"tuner_type": "bayes"}, r"'autotuning.tuner_type'"),
    ({"num_tuning_micro_batch_sizes": 0}, r"'autotuning.num_tuning_micro_batch_sizes'"),
    ({"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 4},
     r"autotuning.max_train_micro_batch_size_per_gpu \(4\) must be at least "
     r"autotuning.min_train_micro_batch_size_per_gpu \(8\)"),
    ({"max_train_batch_size": 4, "min_train_batch_size": 8}, r"autotuning.max_train_batch_size \(4\)"),
    ({"metric": "flops", "start_profile_step": 1, "end_profile_step": 3}, r"autotuning.start_profile_step \(1\)"),
    ({"results_dir": ""}, r"'autotuning.results_dir'"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": 4}}, r"'autotuning.arg_mappings.train_micro_batch_size_per_gpu'"),
    ({"metric_pth": "x"}, r"unknown config key 'autotuning.metric_pth'; did you mean 'autotuning.metric'"),
])
def test_bad_values_name_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        load_config({"train_batch_size": 8, "autotuning": section})


def test_bad_experiment_file_names_file_and_key(tmp_path, monkeypatch):
    exp_dir = _experiment_dir(tmp_path, end_profile_step=2)
    with pytest.raises(ValueError, match=r"exp.json: config key 'end_profile_step' \(2\) must be greater than 'start_profile_step' \(2\)"):
        experiment.read_experiment(exp_dir)
    (exp_dir / "exp.json").write_text(json.dumps({"name": "e", "metric": "throughput", "start_profile_step": 2,
                                                   "end_profile_step": 3, "best_metrc": 1.0}))
    with pytest.raises(ValueError, match=r"exp.json: unknown config key 'best_metrc'; did you mean 'best_metric'"):
        experiment.read_experiment(exp_dir)
    monkeypatch.setenv(experiment.ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"missing/exp.json does not exist"):
        _engine()


def test_no_recorder_without_the_variable(monkeypatch):
    monkeypatch.delenv(experiment.ENV_VAR, raising=False)
    engine = _engine({**TRAIN_CONFIG, "autotuning": {"enabled": True}})
    assert engine.autotuning_experiment is None
    g = torch.Generator().manual_seed(0)
    for _ in range(2 * GAS):
        engine.backward(engine(_batch(engine.train_micro_batch_size_per_gpu(), g)))
        engine.step()
    assert engine.global_steps == 2


# -- the experiment, in process ---------------------------------------------------------------------

def test_model_info_only_counts_parameters(tmp_path, monkeypatch):
    exp_dir = _experiment_dir(tmp_path, model_info_only=True)
    monkeypatch.setenv(experiment.ENV_VAR, str(exp_dir))
    torch.manual_seed(0)
    model = TinyTransformer()
    for p in model.embed.parameters():
        p.requires_grad_(False)
    total = sum(p.numel() for p in TinyTransformer().parameters())
    with pytest.raises(SystemExit) as exit_info:
        dslab.initialize(model=model, config=TRAIN_CONFIG)
    assert exit_info.value.code == 0
    assert _metrics(exp_dir) == {"num_params": total, "trainable_params": total - 512 * 128,
                                 "world_size": 1, "model_info_only": True}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_window_counts_whole_parameters_at_every_stage(tmp_path, monkeypatch, stage):
    """A stage 3 unit is released (its parameters empty) when the window ends: the experiment
    still reports the whole model, which the memory model sizes every stage's model states by."""
    exp_dir = _experiment_dir(tmp_path, start_profile_step=1, end_profile_step=2)
    monkeypatch.setenv(experiment.ENV_VAR, str(exp_dir))
    engine = _engine(dict(TRAIN_CONFIG, zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0}))
    _train_until_exit(engine, max_steps=5)
    if stage == 3:
        assert sum(p.numel() for p in engine.module.parameters()) < 1000  # released between uses
    assert _metrics(exp_dir)["num_params"] == sum(p.numel() for p in TinyTransformer().parameters())


def test_window_times_steps_and_counts_flops(tmp_path, monkeypatch):
    """Profiled steps 2..4: each step's time holds the host pause between steps; throughput and
    latency are the window's; with the flops metric the flops are one optimizer step's, as torch's
    counter counts them."""
    exp_dir = _experiment_dir(tmp_path, metric="flops", start_profile_step=2, end_profile_step=4)
    monkeypatch.setenv(experiment.ENV_VAR, str(exp_dir))
    pause = 0.03
    assert _train_until_exit(_engine(), max_steps=10, pause_s=pause) == 4
    m = _metrics(exp_dir)
    assert set(m) == METRICS_KEYS
    assert m["profiled_steps"] == 3 and len(m["step_times_s"]) == 3 and not m["early_stopped"]
    assert all(t >= pause for t in m["step_times_s"])
    window = sum(m["step_times_s"])
    assert m["latency"] == pytest.approx(window / 3, rel=1e-9)
    assert m["samples_per_step"] == MICRO_BATCH * GAS
    assert m["throughput"] == pytest.approx(MICRO_BATCH * GAS * 3 / window, rel=1e-9)
    assert (m["micro_batch_size"], m["gradient_accumulation_steps"], m["world_size"]) == (MICRO_BATCH, GAS, 1)
    assert m["peak_memory_bytes"] is None  # CPU
    assert m["num_params"] == sum(p.numel() for p in TinyTransformer().parameters())
    # reference: torch's counter (dslab's causal convention) over GAS forward + backward passes
    model, g = TinyTransformer(), torch.Generator().manual_seed(0)
    with FlopCounterMode(display=False, custom_mapping=causal_aware_formulas()) as counter:
        for _ in range(GAS):
            model(_batch(MICRO_BATCH, g)).backward()
    reference = counter.get_total_flops()
    assert reference > 0
    assert m["flops"] * m["latency"] == pytest.approx(reference, rel=1e-9)
    assert "optimizer step 1" in m["tflops_source"]


@pytest.mark.parametrize("metric, counted_steps", [("flops", [3]), ("throughput", []), ("latency", [])])
def test_only_the_flops_metric_counts_a_step_and_it_is_the_one_before_the_window(tmp_path, monkeypatch, metric,
                                                                                 counted_steps):
    """A counted step runs a CUDA-graphed stack eagerly beside its graphs' pool (module
    docstring), so only the flops metric, which needs the count, pays for it: step 4 with the
    window at 5..6, the same count as any step's."""
    exp_dir = _experiment_dir(tmp_path, metric=metric, start_profile_step=5, end_profile_step=6)
    monkeypatch.setenv(experiment.ENV_VAR, str(exp_dir))
    counted = []
    real_start = experiment.ExperimentRecorder._start_counting

    def start(self):
        counted.append(self.steps_done)
        real_start(self)

    monkeypatch.setattr(experiment.ExperimentRecorder, "_start_counting", start)
    assert _train_until_exit(_engine(), max_steps=10) == 6
    m = _metrics(exp_dir)
    assert counted == counted_steps
    assert m["throughput"] > 0 and m["latency"] > 0
    if not counted_steps:
        assert m["flops"] is None and m["tflops_source"] is None
        return
    assert "optimizer step 4 " in m["tflops_source"]
    model, g = TinyTransformer(), torch.Generator().manual_seed(0)
    with FlopCounterMode(display=False, custom_mapping=causal_aware_formulas()) as counter:
        for _ in range(GAS):
            model(_batch(MICRO_BATCH, g)).backward()
    assert m["flops"] * m["latency"] == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_engine_flops_profiler_count_is_used(tmp_path, monkeypatch):
    """With one micro-step per optimizer step, the engine's flops_profiler count (step 0) is the step's."""
    exp_dir = _experiment_dir(tmp_path, start_profile_step=2, end_profile_step=3)
    monkeypatch.setenv(experiment.ENV_VAR, str(exp_dir))
    config = {**TRAIN_CONFIG, "gradient_accumulation_steps": 1,
              "flops_profiler": {"enabled": True, "profile_step": 0, "device_time": False,
                                 "output_file": str(tmp_path / "flops.txt")}}
    assert _train_until_exit(_engine(config), max_steps=10) == 3
    m = _metrics(exp_dir)
    model = TinyTransformer()
    with FlopCounterMode(display=False, custom_mapping=causal_aware_formulas()) as counter:
        model(_batch(MICRO_BATCH, torch.Generator().manual_seed(0))).backward()
    assert m["flops"] * m["latency"] == pytest.approx(counter.get_total_flops(), rel=1e-9)
    assert m["tflops_source"].startswith("the engine's flops_profiler")


@pytest.mark.parametrize("metric, best, stops", [
    ("throughput", 1e15, True),   # unbeatable: no step reaches 95% of it
    ("latency", 1e-9, True),
    ("throughput", 1e-9, False),  # beaten by every step: runs the whole window
])
def test_early_stop(tmp_path, monkeypatch, metric, best, stops):
    exp_dir = _experiment_dir(tmp_path, metric=metric, start_profile_step=2, end_profile_step=4,
                              best_metric=best, early_stop=True)
    monkeypatch.setenv(experiment.ENV_VAR, str(exp_dir))
    steps = _train_until_exit(_engine({**TRAIN_CONFIG, "train_micro_batch_size_per_gpu": 1,
                                       "gradient_accumulation_steps": 1}), max_steps=10)
    m = _metrics(exp_dir)
    assert m["early_stopped"] is stops
    assert m["profiled_steps"] == (2 if stops else 3) == len(m["step_times_s"])
    assert steps == (3 if stops else 4)


def test_early_stop_margin():
    assert experiment.worse_beyond_margin("throughput", 94.9, 100.0)
    assert not experiment.worse_beyond_margin("throughput", 95.1, 100.0)
    assert experiment.worse_beyond_margin("flops", 9.4e12, 1e13)
    assert experiment.worse_beyond_margin("latency", 1.051, 1.0)
    assert not experiment.worse_beyond_margin("latency", 1.049, 1.0)


@pytest.mark.gpu
def test_cuda_window_reads_events_and_peak_memory(tmp_path, monkeypatch):
    """On a GPU the steps are told apart by CUDA events inside the synchronised window, and the
    peak is the allocator's."""
    exp_dir = _experiment_dir(tmp_path)
    monkeypatch.setenv(experiment.ENV_VAR, str(exp_dir))
    torch.cuda.reset_peak_memory_stats()
    engine = _engine()
    assert engine.device.type == "cuda"
    assert _train_until_exit(engine, max_steps=10) == 4
    m = _metrics(exp_dir)
    assert 0 < m["peak_memory_bytes"] <= torch.cuda.max_memory_allocated()
    window = m["latency"] * 3
    assert len(m["step_times_s"]) == 3 and sum(m["step_times_s"]) <= window + 1e-3
    assert m["flops"] > 0


# -- the protocol end to end: examples/train_tiny.py -------------------------------------------------

def _run_train_tiny(exp_dir: Path, nprocs: int = 1, steps: int = 20) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)] if nprocs > 1 else []
    cmd = [sys.executable, *launcher, str(TRAIN_TINY), "--steps", str(steps),
           "--deepspeed_config", str(exp_dir / "ds_config.json")]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{experiment.ENV_VAR: str(exp_dir)})
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def test_train_tiny_experiment_stops_after_window(tmp_path):
    exp_dir = _experiment_dir(tmp_path, metric="flops")
    proc = _run_train_tiny(exp_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = _metrics(exp_dir)
    assert set(m) == METRICS_KEYS
    assert m["profiled_steps"] == 4 - 2 + 1 == len(m["step_times_s"])
    assert not m["early_stopped"] and m["world_size"] == 1 and m["samples_per_step"] == MICRO_BATCH * GAS
    assert m["throughput"] > 0 and m["flops"] > 0 and m["tflops_source"]
    # stopped at step 4 of 20: neither the step-10 line nor the closing summary was printed
    assert "autotuning experiment exp_z0_mbs4: 3 profiled step(s)" in proc.stdout
    assert "step   10" not in proc.stdout and "20 steps" not in proc.stdout


@pytest.mark.world_size(2)
def test_train_tiny_experiment_two_ranks(tmp_path):
    exp_dir = _experiment_dir(tmp_path)
    proc = _run_train_tiny(exp_dir, nprocs=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in exp_dir.iterdir()) == ["ds_config.json", "exp.json", "metrics.json"]
    m = _metrics(exp_dir)
    assert m["world_size"] == 2 and m["profiled_steps"] == 3
    assert m["samples_per_step"] == MICRO_BATCH * GAS * 2
    window = m["latency"] * 3
    assert m["throughput"] == pytest.approx(MICRO_BATCH * GAS * 2 * 3 / window, rel=1e-9)
    # each step's time is the slowest rank's; the window is the slowest rank's whole window
    assert max(m["step_times_s"]) <= window * (1 + 1e-9) <= sum(m["step_times_s"]) * (1 + 1e-9)
    assert proc.stdout.count("autotuning experiment") == 1 and "20 steps" not in proc.stdout
