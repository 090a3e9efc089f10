"""The search: run the user's script once per experiment and keep the best config.

:func:`tune` reads the config the script is given (``--deepspeed_config X``,
``--deepspeed_config=X``, ``--dslab_config X`` or ``--deepspeed X.json``), which must have
``"autotuning": {"enabled": true}``, builds the space (:mod:`.space`), and then:

1. holds back the dominated ZeRO stages (:func:`.tuner.dominated_stages`, unless
   ``autotuning.prune_dominated_stages`` is false);
2. with a memory budget (:mod:`.memory_model`), runs the **profile** experiment(s): the smallest
   micro-batch at the highest ZeRO stage not held back (the highest whose config dslab accepts),
   once per activation-checkpointing setting; their ``metrics.json`` give the model's parameter
   count and, from the measured peaks, the activation bytes per sample. These are ordinary
   experiments of the space and count towards the trials. (No separate model-info launch: every
   experiment reports the parameter count. DeepSpeed's ``model_info_only`` experiments are still
   understood by the engine, :mod:`.experiment`.) Without a budget nothing is profiled and the
   parameter count comes from the first experiment that reports it;
3. prunes what the memory model says does not fit, records as failed (without running them) the
   experiments whose config dslab's engine refuses (:func:`config_error`, e.g. ZeRO stage 3 with
   ``compile``), and hands the rest to the tuner (:mod:`.tuner`), running what it asks for until
   it stops;
4. with ``"auto"`` micro-batch sizes (``autotuning.refine_micro_batch``), refines the best
   group's micro-batch between the largest size that ran and the smallest that did not fit
   (:meth:`Autotuner._refine`);
5. writes the outputs (:mod:`.outputs`).

Each experiment lives in ``exps_dir/<name>/``: ``ds_config.json`` (its full config) and
``exp.json`` (the protocol of :mod:`.experiment`) written atomically before the launch,
``stdout.log``/``stderr.log``, and the engine's ``metrics.json``. The script runs with the same
Python, ``DSLAB_AUTOTUNING_EXPERIMENT=<exp_dir>`` set, its config argument pointing at the
experiment's ``ds_config.json`` and the ``autotuning.arg_mappings`` options set to the
experiment's values; with more than one process through ``python -m dslab.cli launch``. An
experiment that leaves no ``metrics.json`` is ``oom`` when its ``stderr.log`` says "out of memory"
and ``failed`` otherwise (the reason: the last line of its error). With ``autotuning.overwrite``
false an experiment folder whose ``metrics.json`` exists for the same config is reused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dslab.config_base import parse_section
from dslab.engine.autotuning.config import AutotuningConfig
from dslab.engine.autotuning.experiment import ENV_VAR, EXPERIMENT_FILE, METRICS_FILE
from dslab.engine.autotuning.memory_model import (MemoryModel, activation_per_sample, device_memory_budget,
                                                  optimizer_state_count, plan)
from dslab.engine.autotuning.outputs import AutotuneResult, ExperimentRecord, format_metric, write_outputs
from dslab.engine.autotuning.space import Experiment, build_space, checkpoint_layers
from dslab.engine.autotuning.tuner import (IMPROVEMENT, OBSERVED, Outcome, Tuner, dominated_stages, make_tuner,
                                          refine_midpoint)
from dslab.report.store import atomic_write_text

CONFIG_FLAGS = ("--deepspeed_config", "--dslab_config")
CONFIG_FILE = "ds_config.json"
_OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)
TERMINATE_GRACE_S = 10.0


def find_config_argument(args: Sequence[str]) -> tuple[int, bool] | None:
    """Where the config path is in ``args``: ``(index, joined)``, the path at ``args[index + 1]``
    or, ``joined``, after the ``=`` of ``args[index]``. ``--deepspeed_config``/``--dslab_config``
    first; then ``--deepspeed X`` with X a ``.json`` path (``--deepspeed`` alone is a switch)."""
    for flags in (CONFIG_FLAGS, ("--deepspeed",)):
        for i, arg in enumerate(args):
            for flag in flags:
                if arg.startswith(flag + "="):
                    return i, True
                if arg == flag and i + 1 < len(args):
                    value = args[i + 1]
                    if flag != "--deepspeed" or (not value.startswith("-") and value.endswith(".json")):
                        return i, False
    return None


def config_path(args: Sequence[str]) -> str:
    """The config path the script is given; a ValueError when it is given none."""
    found = find_config_argument(args)
    if found is None:
        raise ValueError("dslab autotune: the script's arguments name no config: pass it as "
                         "--deepspeed_config FILE (or --deepspeed_config=FILE, --dslab_config FILE, --deepspeed FILE.json)")
    index, joined = found
    return args[index].split("=", 1)[1] if joined else args[index + 1]


def _set_option(args: list[str], option: str, value: str) -> list[str]:
    for i, arg in enumerate(args):
        if arg.startswith(option + "="):
            return args[:i] + [f"{option}={value}"] + args[i + 1:]
        if arg == option and i + 1 < len(args):
            return args[:i + 1] + [value] + args[i + 2:]
    return args + [option, value]


def _dotted(config: dict, key: str):
    value = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"autotuning.arg_mappings: config key '{key}' is not in the experiment's config")
        value = value[part]
    return value


def script_arguments(args: Sequence[str], config_file: str | Path, config: dict,
                     arg_mappings: dict[str, str]) -> list[str]:
    """``args`` with the config argument pointing at ``config_file`` and each option of
    ``arg_mappings`` (config key -> option) set to ``config``'s value of that key."""
    index, joined = find_config_argument(args)
    out = list(args)
    if joined:
        out[index] = f"{out[index].split('=', 1)[0]}={config_file}"
    else:
        out[index + 1] = str(config_file)
    for key, option in arg_mappings.items():
        value = _dotted(config, key)
        out = _set_option(out, option, json.dumps(value) if isinstance(value, (bool, dict, list)) else str(value))
    return out


def command_line(script: str, args: Sequence[str], launcher_args: Sequence[str] | None,
                 python: str = sys.executable) -> list[str]:
    """The script with ``args`` under ``python``; through ``dslab launch`` with ``launcher_args``
    (None: one process, no launcher)."""
    if launcher_args is None:
        return [python, script, *args]
    return [python, "-m", "dslab.cli", "launch", *launcher_args, script, *args]


def classify(exp_dir: Path, returncode: int | None, metric: str) -> tuple[str, float | None, dict, str | None]:
    """``(status, metric value, metrics.json, reason)`` of a finished experiment (module docstring);
    ``returncode`` None means it timed out."""
    metrics_path = exp_dir / METRICS_FILE
    if metrics_path.is_file():
        try:
            metrics = json.loads(metrics_path.read_text())
        except json.JSONDecodeError as err:
            return "failed", None, {}, f"{metrics_path} is not valid JSON: {err}"
        if not isinstance(metrics, dict):
            return "failed", None, {}, f"{metrics_path} does not hold a JSON object"
        value = metrics.get(metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            why = " (the run counted no flops)" if metric == "flops" else ""
            return "failed", None, metrics, f"{METRICS_FILE} has no '{metric}' value{why}"
        status = "early_stopped" if metrics.get("early_stopped") else "ok"
        reason = None if not returncode else f"exit status {returncode} after writing {METRICS_FILE}"
        return status, float(value), metrics, reason
    stderr = exp_dir / "stderr.log"
    text = stderr.read_text(errors="replace") if stderr.is_file() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    oom = [line for line in lines if _OOM.search(line)]
    if oom:
        return "oom", None, {}, f"out of memory: {oom[-1][:300]}"
    if returncode is None:
        return "failed", None, {}, "timed out"
    last = lines[-1][:300] if lines else "no output on stderr"
    if returncode == 0:
        return "failed", None, {}, (f"exited 0 without writing {METRICS_FILE}: the script ran fewer optimizer steps "
                                    f"than autotuning.end_profile_step, or builds no engine with dslab.initialize "
                                    f"({last})")
    return "failed", None, {}, f"exit status {returncode}: {last}"


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, TERMINATE_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclasses.dataclass
class Launch:
    """How experiments start: the script, its arguments, the launcher's (None: one process)."""

    script: str
    args: list[str]
    launcher_args: list[str] | None = None
    python: str = sys.executable
    cwd: str | None = None
    timeout_s: float | None = None
    env: dict[str, str] | None = None

    def run(self, exp_dir: Path, args: list[str]) -> tuple[int | None, float]:
        """Run one experiment in ``exp_dir``; ``(exit status or None on a timeout, seconds)``."""
        env = {**os.environ, **(self.env or {}), ENV_VAR: str(exp_dir.resolve())}
        start = time.perf_counter()
        with open(exp_dir / "stdout.log", "w") as out, open(exp_dir / "stderr.log", "w") as err:
            proc = subprocess.Popen(command_line(self.script, args, self.launcher_args, self.python), stdout=out,
                                    stderr=err, env=env, cwd=self.cwd, start_new_session=True)
            try:
                returncode = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _stop(proc)
                returncode = None
            except BaseException:
                _stop(proc)
                raise
        return returncode, time.perf_counter() - start


def read_settings(config: dict, source: str) -> AutotuningConfig:
    """The config's ``autotuning`` section; a ValueError naming the key unless it is enabled."""
    section = config.get("autotuning")
    if not isinstance(section, dict) or section.get("enabled") is not True:
        raise ValueError(f"{source} does not switch autotuning on: add \"autotuning\": {{\"enabled\": true}} "
                         "(config key 'autotuning.enabled')")
    return parse_section(AutotuningConfig, section, "autotuning")


def _read_user_config(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"config file {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a JSON object")
    return data


def _profile_experiments(candidates: list[Experiment]) -> list[Experiment]:
    """The smallest micro-batch at the highest stage among ``candidates`` (in space order), and the
    same at each other activation-checkpointing setting among them (module docstring)."""
    top = max(e.stage for e in candidates)
    first = next(e for e in candidates if e.stage == top)
    base = min((e for e in candidates if e.stage == top and e.extras == first.extras),
               key=lambda e: (e.micro_batch_size, e.gradient_accumulation_steps))
    out = [base]
    names = {e.name for e in candidates}
    seen = {base.extra("activation_checkpointing")}
    for e in candidates:
        layers = e.extra("activation_checkpointing")
        if layers in seen:
            continue
        seen.add(layers)
        extras = tuple((k, layers if k == "activation_checkpointing" else v) for k, v in base.extras)
        variant = dataclasses.replace(base, extras=extras)
        if variant.name in names:
            out.append(variant)
    return out


def config_error(config: dict) -> str | None:
    """Why dslab's engine refuses ``config`` (:func:`dslab.engine.config.load_config`), or None."""
    from dslab.engine.config import load_config

    try:
        load_config(config)
    except ValueError as err:
        return str(err)
    return None


class Autotuner:
    """One search (module docstring). ``progress`` gets one line per experiment."""

    def __init__(self, launch: Launch, *, processes: int = 1, memory_budget: int | None = None,
                 tuner_type: str | None = None, seed: int = 0, progress: Callable[[str], None] | None = None,
                 cuda_available: bool | None = None):
        self.launch = launch
        self.processes = processes
        path = Path(launch.cwd or ".") / config_path(launch.args)
        self.config = _read_user_config(path)
        self.settings = read_settings(self.config, f"config file {path}")
        if tuner_type is not None:
            self.settings = self.settings.model_copy(update={"tuner_type": tuner_type})
        self.seed = seed
        self.progress = progress or (lambda line: print(f"[autotune] {line}", file=sys.stderr, flush=True))
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        self.cuda_available = cuda_available
        self.memory_budget = memory_budget
        base = Path(launch.cwd or ".")
        self.exps_dir = base / self.settings.exps_dir
        self.results_dir = base / self.settings.results_dir
        self.records: list[ExperimentRecord] = []
        self.notes: list[str] = []
        self.space = build_space(self.config, self.settings, processes, cuda_available)
        self._model: MemoryModel | None = None  # set once the profiles ran; every later run teaches it

    def _exp_json(self, name: str, best: float | None, model_info_only: bool = False) -> dict:
        s = self.settings
        return {"name": name, "metric": s.metric, "start_profile_step": s.start_profile_step,
                "end_profile_step": s.end_profile_step, "best_metric": best,
                "early_stop": best is not None and not model_info_only, "model_info_only": model_info_only}

    def _run(self, name: str, config: dict, best: float | None, model_info_only: bool = False):
        """Run (or reuse) one experiment; ``(status, metric, metrics, reason, seconds)``."""
        exp_dir = self.exps_dir / name
        exp_dir.mkdir(parents=True, exist_ok=True)
        config_file = exp_dir / CONFIG_FILE
        metrics_file = exp_dir / METRICS_FILE
        metric = "num_params" if model_info_only else self.settings.metric
        if not self.settings.overwrite and metrics_file.is_file() and config_file.is_file():
            try:
                same = json.loads(config_file.read_text()) == config
            except json.JSONDecodeError:
                same = False
            if same:
                status, value, metrics, _ = classify(exp_dir, 0, metric)
                return status, value, metrics, "reused an earlier run's metrics (autotuning.overwrite is false)", 0.0
        for stale in (metrics_file, exp_dir / "stdout.log", exp_dir / "stderr.log"):
            stale.unlink(missing_ok=True)
        atomic_write_text(config_file, json.dumps(config, indent=2) + "\n")
        atomic_write_text(exp_dir / EXPERIMENT_FILE, json.dumps(self._exp_json(name, best, model_info_only)) + "\n")
        args = script_arguments(self.launch.args, config_file.resolve(), config, self.settings.arg_mappings)
        returncode, seconds = self.launch.run(exp_dir, args)
        status, value, metrics, reason = classify(exp_dir, returncode, metric)
        return status, value, metrics, reason, seconds

    def _record(self, experiment: Experiment, status: str, **fields) -> ExperimentRecord:
        record = ExperimentRecord(experiment, status, len(self.records) + 1, experiment.apply(self.config), **fields)
        self.records.append(record)
        shown = f", {format_metric(self.settings.metric, record.metric)}" if record.metric is not None else ""
        why = f" ({record.reason})" if record.reason else ""
        took = f", {record.wall_time_s:.1f} s" if status != "pruned" else ""
        self.progress(f"#{record.order} {record.name}: {status}{shown}{took}{why}")
        return record

    def _experiment(self, experiment: Experiment, best: float | None, estimate: int | None = None) -> ExperimentRecord:
        config = experiment.apply(self.config)
        status, value, metrics, reason, seconds = self._run(experiment.name, config, best)
        record = self._record(experiment, status, metric=value, metrics=metrics, reason=reason,
                              estimated_memory_bytes=estimate, wall_time_s=seconds)
        peak = metrics.get("peak_memory_bytes") if isinstance(metrics, dict) else None
        if self._model is not None and status in OBSERVED and isinstance(peak, int):
            note = self._model.learn(experiment, self.config, peak)
            if note:
                self.notes.append(note)
                self.progress(note)
        return record

    def _over_budget_now(self, experiment: Experiment, estimates: dict[str, int]) -> str | None:
        """Why ``experiment`` is now estimated not to fit, by a memory model that has learned from
        the experiments run since the plan (:meth:`MemoryModel.learn`); None when it fits."""
        if self._model is None:
            return None
        reason = self._model.over_budget(experiment, self.config)
        if reason is not None:
            estimates[experiment.name] = self._model.estimate(experiment, self.config)
            reason += "; re-estimated from the experiments that ran"
        return reason

    def _memory_model(self, profiles: list[Experiment]) -> tuple[MemoryModel | None, list[ExperimentRecord]]:
        """Run the profile experiments (with a memory budget) and build the memory model from their
        parameter count and measured peaks; without a budget nothing runs and there is no model."""
        budget = self.memory_budget if self.memory_budget is not None else device_memory_budget()
        if budget is None:
            self.notes.append("no memory budget (no CUDA device and no --memory-budget): nothing was pruned by the "
                              "memory model; micro-batch sizes grow from the smallest, and a group stops at its first "
                              "out-of-memory")
            return None, []
        ran = [self._experiment(experiment, None) for experiment in profiles]
        counted = next((r for r in ran if isinstance(r.metrics.get("num_params"), int)), None)
        if counted is None:
            first = ran[0]
            raise ValueError(f"no profile experiment of {self.launch.script} reported the model's size "
                             f"({first.name}: {first.reason or first.status}); its output is in "
                             f"{self.exps_dir / first.name}/stderr.log")
        num_params = counted.metrics["num_params"]
        world = counted.metrics.get("world_size")
        if world is not None and world != self.processes:
            self.notes.append(f"the profile run reported world size {world}, not the {self.processes} process(es) "
                              "asked for")
        self.notes.append(f"{num_params} parameters per model replica (from the profile run {counted.name})")
        model = MemoryModel(num_params, self.space.world_size, budget, optimizer_state_count(self.config))
        for record in ran:
            peak = record.metrics.get("peak_memory_bytes")
            if record.status not in ("ok", "early_stopped") or not isinstance(peak, int):
                why = record.reason or "it reported no peak memory (no CUDA device)"
                self.notes.append(f"profile {record.name} measured no activation memory: {why}")
                continue
            per_sample, note = activation_per_sample(model, record.experiment, self.config, peak)
            layers = checkpoint_layers(record.config)
            if record.experiment.micro_batch_size >= model.measured_at.get(layers, 0):
                model.activation_per_sample[layers] = per_sample
                model.measured_at[layers] = record.experiment.micro_batch_size
            if note:
                self.notes.append(note)
        if model.knows_activations:
            measured = ", ".join(f"{per / 1e6:.1f} MB (checkpointing {layers})"
                                 for layers, per in sorted(model.activation_per_sample.items()))
            self.notes.append(f"activation memory per sample, measured: {measured}")
        else:
            self.notes.append("activation memory was not measured: experiments were pruned by their model states only")
        return model, ran

    def search(self) -> AutotuneResult:
        """Run the whole search (module docstring) and return its result; writes nothing but the
        experiment folders (:func:`tune` writes the outputs)."""
        start = time.perf_counter()
        candidates = self.space.all_experiments()
        refused = {e.name: error for e in candidates if (error := config_error(e.apply(self.config))) is not None}
        valid = [e for e in candidates if e.name not in refused]
        if not valid:
            name, error = next(iter(refused.items()))
            raise ValueError(f"dslab refuses the config of every experiment, e.g. {name}: {error}")
        s = self.settings
        held = dominated_stages(valid, self.space.world_size) if s.prune_dominated_stages else {}
        profiles = _profile_experiments([e for e in valid if e.name not in held] or valid)
        model, profiled = self._memory_model(profiles)
        self._model = model
        planned = plan(self.space, self.config, model)
        ran_names = {r.name for r in profiled}
        for record in profiled:
            record.estimated_memory_bytes = planned.estimates.get(record.name)
        for experiment, reason in planned.pruned:
            if experiment.name not in ran_names:
                self._record(experiment, "pruned", reason=reason,
                             estimated_memory_bytes=planned.estimates.get(experiment.name))
        for experiment in planned.experiments:
            if experiment.name in refused:
                self._record(experiment, "failed", reason=f"dslab refuses its config: {refused[experiment.name]}",
                             estimated_memory_bytes=planned.estimates.get(experiment.name))
        tuner = make_tuner(s.tuner_type, [e for e in planned.experiments if e.name not in refused], s.metric,
                           s.tuner_num_trials, s.tuner_early_stopping, self.seed, held,
                           held_same_memory=self.space.world_size == 1)
        for record in profiled:
            self._skip(tuner.record(Outcome(record.experiment, record.status, record.metric)), planned.estimates)
        over_budget = {e.name for e, _ in planned.pruned}
        while (experiment := tuner.next()) is not None:
            if (reason := self._over_budget_now(experiment, planned.estimates)) is not None:
                over_budget.add(experiment.name)
                self._skip(tuner.over_budget(experiment, reason), planned.estimates)
                continue
            best = tuner.best.metric if tuner.best is not None else None
            record = self._experiment(experiment, best, planned.estimates.get(experiment.name))
            self._skip(tuner.record(Outcome(experiment, record.status, record.metric)), planned.estimates)
        if self.space.micro_batch_auto and s.refine_micro_batch and s.metric != "latency":
            self._refine(tuner, model, over_budget, planned.estimates)
        self._skip(tuner.held_back(), planned.estimates)
        num_params = model.num_params if model is not None else next(
            (r.metrics["num_params"] for r in self.records if isinstance(r.metrics.get("num_params"), int)), None)
        left = len(tuner.remaining())
        stop = tuner.stop_reason + (f"; {left} experiment(s) of the space not run" if left else "")
        best = next((r for r in self.records if tuner.best is not None and r.name == tuner.best.experiment.name), None)
        self.notes.extend(self.space.notes)
        result = AutotuneResult(
            metric=s.metric, tuner_type=s.tuner_type, user_config=self.config, settings=s.model_dump(mode="json"),
            script=self.launch.script, script_args=list(self.launch.args), processes=self.processes,
            records=self.records, best=best, memory_budget_bytes=model.budget_bytes if model is not None else None,
            num_params=num_params,
            wall_time_s=time.perf_counter() - start, stop_reason=stop, notes=self.notes,
            results_dir=self.results_dir, exps_dir=self.exps_dir)
        if best is not None:
            optimal = (self.results_dir / "ds_config_optimal.json").resolve()
            args = script_arguments(self.launch.args, optimal, best.config, s.arg_mappings)
            result.optimal_command = command_line(self.launch.script, args, self.launch.launcher_args,
                                                  self.launch.python)
        return result

    def _refine(self, tuner: Tuner, model: MemoryModel | None, over_budget: set[str],
                estimates: dict[str, int]) -> None:
        """Search the best group's micro-batch between the largest size that ran (the best one)
        and the smallest larger one that did not fit (out of memory, or pruned as over budget), at
        :func:`refine_midpoint`'s sizes: a size that runs and improves the best by more than
        :data:`~.tuner.IMPROVEMENT` raises the lower end (one that improves it less ends the
        refinement there), an out-of-memory or over-budget size lowers the upper end; anything
        else ends it, as does ``tuner_num_trials``."""
        if tuner.best is None or tuner.best.experiment.train_batch_size is not None:
            return
        best = tuner.best.experiment
        same = [r for r in self.records if r.experiment.group == best.group
                and r.experiment.gradient_accumulation_steps == best.gradient_accumulation_steps]
        if max(r.experiment.micro_batch_size for r in same if r.status in OBSERVED) != best.micro_batch_size:
            return  # a larger size ran and was slower: throughput is not rising with the micro-batch
        too_large = [r.experiment.micro_batch_size for r in same
                     if r.experiment.micro_batch_size > best.micro_batch_size
                     and (r.status == "oom" or r.name in over_budget)]
        if not too_large:
            return
        fits, upper = best.micro_batch_size, min(too_large)
        tried = []
        while (size := refine_midpoint(fits, upper)) is not None:
            if len(tuner.outcomes) >= tuner.num_trials:
                tried.append(f"stopped at autotuning.tuner_num_trials ({tuner.num_trials})")
                break
            gas = best.gradient_accumulation_steps
            if not self.space._batch_ok(size * gas * self.space.world_size):
                tried.append(f"{size}: outside the batch limits")
                break
            experiment = dataclasses.replace(best, micro_batch_size=size)
            estimate = model.estimate(experiment, self.config) if model is not None else None
            reason = model.over_budget(experiment, self.config) if model is not None else None
            if reason is not None:
                self._record(experiment, "pruned", reason=reason, estimated_memory_bytes=estimate)
                tried.append(f"{size}: over budget")
                upper = size
                continue
            before = tuner.best.metric
            record = self._experiment(experiment, before, estimate)
            tuner.record(Outcome(experiment, record.status, record.metric))
            tried.append(f"{size}: {record.status}")
            if record.status == "oom":
                upper = size
            elif record.status == "ok" and record.metric is not None and tuner.better(record.metric, before):
                fits = size
                if not tuner.better(record.metric, before, IMPROVEMENT):
                    break
            else:
                break
        self.notes.append(f"micro-batch refined in z{best.stage}'s group from {best.micro_batch_size} (ran) towards "
                          f"{min(too_large)} (did not fit): {', '.join(tried) or 'no size between them'}")

    def _skip(self, skipped: list[tuple[Experiment, str]], estimates: dict[str, int]) -> None:
        for experiment, reason in skipped:
            self._record(experiment, "pruned", reason=reason, estimated_memory_bytes=estimates.get(experiment.name))


def tune(script: str, script_args: Sequence[str], *, processes: int = 1, launcher_args: Sequence[str] | None = None,
         memory_budget: int | None = None, tuner_type: str | None = None, reports: str | Path | None = "reports",
         python: str = sys.executable, cwd: str | None = None, timeout_s: float | None = None,
         progress: Callable[[str], None] | None = None, seed: int = 0) -> AutotuneResult:
    """Search the config of ``script script_args`` and write the outputs (module docstring).

    ``processes`` > 1 needs ``launcher_args`` (``dslab launch``'s options). ``memory_budget``:
    bytes per GPU (default: 95% of the device's). ``tuner_type`` overrides
    ``autotuning.tuner_type``. ``reports``: the reports root (None: no run report)."""
    if processes > 1 and launcher_args is None:
        raise ValueError(f"{processes} processes need dslab launch's options (launcher_args), e.g. ['--num_gpus', "
                         f"'{processes}']")
    launch = Launch(script, list(script_args), None if launcher_args is None else list(launcher_args), python, cwd,
                    timeout_s)
    tuner = Autotuner(launch, processes=processes, memory_budget=memory_budget, tuner_type=tuner_type, seed=seed,
                      progress=progress)
    result = tuner.search()
    write_outputs(result, reports)
    return result


def tune_command(script_argv: Sequence[str], *, processes: int = 1, launcher_args: Sequence[str] | None = None,
                 memory_budget: str | None = None, tuner_type: str | None = None,
                 reports: str | None = "reports") -> tuple[int, AutotuneResult]:
    """``dslab autotune`` / ``dslab launch --autotuning``: :func:`tune` the script of
    ``script_argv`` (``[script, args...]``), print the summary and the files written; the exit
    code is 0 with a best experiment and 1 when none ran to the end."""
    from dslab.engine.autotuning.memory_model import parse_memory_size
    from dslab.engine.autotuning.outputs import summary_text

    if not script_argv:
        raise ValueError("dslab autotune needs a script: dslab autotune [options] script.py [script args...] "
                         "--deepspeed_config ds_config.json")
    budget = parse_memory_size(memory_budget) if memory_budget is not None else None
    result = tune(script_argv[0], script_argv[1:], processes=processes, launcher_args=launcher_args,
                  memory_budget=budget, tuner_type=tuner_type, reports=reports)
    print(summary_text(result), end="")
    for what, path in result.written.items():
        print(f"{what}: {path}")
    if result.best is None:
        print(f"dslab autotune: no experiment ran to the end; each one's error is in {result.exps_dir}/<name>/"
              "stderr.log and in the summary", file=sys.stderr)
        return 1, result
    return 0, result
