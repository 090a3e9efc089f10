"""The engine side of one autotuning experiment: time the profiled steps, write ``metrics.json``,
exit.

The tuner (:mod:`dslab.engine.autotuning.driver`) runs the user's training script with the
environment variable ``DSLAB_AUTOTUNING_EXPERIMENT=<exp_dir>``; ``<exp_dir>/exp.json`` says what
to measure (:class:`ExperimentSpec`). :func:`dslab.initialize` then calls :func:`attach_from_env`,
which attaches an :class:`ExperimentRecorder` to the engine, and the engine calls
:meth:`ExperimentRecorder.on_optimizer_step_end` after each optimizer step. Without the variable
neither costs more than a dictionary lookup at initialize and an attribute test per step.

What one experiment measures (steps are optimizer steps counted from ``initialize``, 1-based, so
a checkpoint loaded afterwards does not shift them):

- ``model_info_only``: the model's parameter counts, written right after ``initialize``.
- With the ``flops`` metric, step ``start_profile_step - 1`` is **counted**: every op of it under
  dslab's flops profiler (:class:`dslab.profilers.flops.FlopsProfiler`, the flops of the ops that
  ran, forward, backward and optimizer). The counting costs the host a Python call per op, so it
  stays outside the timed steps. When the engine's own ``flops_profiler`` section counts a whole
  optimizer step (``gradient_accumulation_steps`` 1) before the window ends, its figure is used
  instead. With the ``throughput`` and ``latency`` metrics nothing is counted, because a counted
  step costs more than host time: the profiler counts through a dispatch mode, under which a
  CUDA-graphed layer stack runs eagerly. After the stack's graphs are captured (step 1), that
  eager step's activations sit beside the graphs' memory pool, a peak no training run has, which
  the experiment's measured peak (and an out-of-memory) would carry: on one H200, GPT-2 355M at
  micro-batch 96 ran out of memory in an experiment, where plain training peaks at 76 GiB.
  Counting step 1, before the capture, once made the capture at step 2 fail on the GPU
  (``cudaErrorStreamCaptureInvalidated``); the graphed stacks now capture against stand-ins for
  the parameters (:func:`dslab.models.graphs.stand_ins`), and an H200 test trains through it.
- Steps ``start_profile_step`` .. ``end_profile_step`` are **timed**: the device is synchronised
  once before the first and once after the last (the window's length on the host clock); the
  steps between are told apart by CUDA events (no synchronisation; the host clock on a CPU,
  where work is synchronous). With early stopping on, the events are read after each step from
  the second on, which waits for that step's work.
- **Early stop**: with ``early_stop`` and a ``best_metric``, once two steps are timed, an
  experiment whose fastest step is worse than ``best_metric`` by more than
  :data:`~dslab.engine.autotuning.config.EARLY_STOP_MARGIN` ends there.

With several processes every rank times its own steps and the ranks agree on the slowest
(an all-reduce of the times, so every rank takes the same early-stop decision); rank 0 writes
``metrics.json`` atomically and every rank raises ``SystemExit(0)``. A process that fails or runs
out of memory writes nothing: the tuner reads a missing ``metrics.json`` as a failed experiment.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Literal

import pydantic
import torch
from pydantic import Field

from dslab import comm
from dslab.config_base import ConfigSection, parse_section
from dslab.engine.autotuning.config import EARLY_STOP_MARGIN
from dslab.profilers import peaks
from dslab.profilers.flops import FlopsProfiler, whole_numel
from dslab.report.store import atomic_write_text

ENV_VAR = "DSLAB_AUTOTUNING_EXPERIMENT"
EXPERIMENT_FILE = "exp.json"
METRICS_FILE = "metrics.json"

Metric = Literal["throughput", "latency", "flops"]


class ExperimentSpec(ConfigSection):
    """``<exp_dir>/exp.json``, written by the tuner. ``best_metric``: the best value of ``metric``
    so far, in its own unit (samples/s, seconds per step, FLOP/s per GPU); None before any."""

    name: str
    metric: Metric
    start_profile_step: int = Field(ge=1)
    end_profile_step: int
    best_metric: float | None = None
    early_stop: bool = False
    model_info_only: bool = False

    @pydantic.model_validator(mode="after")
    def _window(self) -> ExperimentSpec:
        if self.end_profile_step <= self.start_profile_step:
            raise ValueError(
                f"config key 'end_profile_step' ({self.end_profile_step}) must be greater than "
                f"'start_profile_step' ({self.start_profile_step})")
        return self


def read_experiment(exp_dir: Path) -> ExperimentSpec:
    """The experiment ``exp_dir/exp.json`` describes; a ValueError naming the file and the key
    when it is missing or wrong."""
    path = Path(exp_dir) / EXPERIMENT_FILE
    if not path.is_file():
        raise ValueError(f"{ENV_VAR}={exp_dir}: the experiment file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"experiment file {path} is not valid JSON: {err}") from None
    try:
        return parse_section(ExperimentSpec, data)
    except ValueError as err:
        raise ValueError(f"experiment file {path}: {err}") from None


def attach_from_env(engine) -> ExperimentRecorder | None:
    """With ``DSLAB_AUTOTUNING_EXPERIMENT`` set, attach a recorder to ``engine`` (as
    ``engine.autotuning_experiment``) and start it; a ``model_info_only`` experiment exits here.
    None when the variable is unset or empty."""
    exp_dir = os.environ.get(ENV_VAR)
    if not exp_dir:
        return None
    recorder = ExperimentRecorder(engine, Path(exp_dir), read_experiment(Path(exp_dir)))
    engine.autotuning_experiment = recorder
    recorder.start()
    return recorder


def model_info(module: torch.nn.Module) -> dict:
    """``{"num_params", "trainable_params"}`` of ``module`` on this rank, each parameter once and
    whole (``ds_numel`` where ZeRO stage 3 or ``dslab.zero.Init`` left a parameter a shard or empty:
    :func:`dslab.profilers.flops.whole_numel`)."""
    params = list(module.parameters())
    return {"num_params": sum(whole_numel(p) for p in params),
            "trainable_params": sum(whole_numel(p) for p in params if p.requires_grad)}


def metric_value(metric: str, step_s: float, samples_per_step: int, flops_per_step: int | None) -> float | None:
    """``metric`` for steps of ``step_s`` seconds: samples/s, seconds per step, or FLOP/s (None
    when the flops are not known)."""
    if metric == "latency":
        return step_s
    if metric == "throughput":
        return samples_per_step / step_s
    return None if flops_per_step is None else flops_per_step / step_s


def worse_beyond_margin(metric: str, value: float, best: float, margin: float = EARLY_STOP_MARGIN) -> bool:
    """Whether ``value`` is worse than ``best`` by more than ``margin`` (a fraction of ``best``):
    lower for throughput and flops, higher for latency."""
    if metric == "latency":
        return value > best * (1.0 + margin)
    return value < best * (1.0 - margin)


class ExperimentRecorder:
    """Measures one experiment on ``engine`` as ``spec`` asks (module docstring)."""

    def __init__(self, engine, exp_dir: Path, spec: ExperimentSpec):
        self.engine = engine
        self.exp_dir = Path(exp_dir)
        self.spec = spec
        self.device: torch.device = engine.device
        self.cuda = self.device.type == "cuda"
        self.steps_done = 0
        self.micro_batch_size = engine.train_micro_batch_size_per_gpu()
        self.gradient_accumulation_steps = engine.gradient_accumulation_steps()
        self.samples_per_step = self.micro_batch_size * self.gradient_accumulation_steps * engine.dp_world_size
        self.flops_per_step: int | None = None
        self.tflops_source: str | None = None
        self._counter: FlopsProfiler | None = None
        self._count_step: int | None = None
        self._engine_flops = None
        self._window_begin: float | None = None
        self._marks: list = []
        self._choose_flops_source()

    def _choose_flops_source(self) -> None:
        """The engine's flops profiler when it counts a whole optimizer step before the window
        ends, else, with the flops metric, the recorder's own count of step
        ``start_profile_step - 1`` (none when that is step 0)."""
        profiler = self.engine.profilers.find("flops")
        if profiler is not None and self.gradient_accumulation_steps == 1:
            # its profile_step is the engine's 0-based global step
            counted = profiler.config.profile_step - self.engine.global_steps + 1
            if 1 <= counted <= self.spec.end_profile_step:
                self._engine_flops = profiler
                return
        if self.spec.metric == "flops" and self.spec.start_profile_step >= 2:
            self._count_step = self.spec.start_profile_step - 1

    # -- the engine's calls ---------------------------------------------------------------------

    def start(self) -> None:
        """Right after ``initialize``: the model info (and exit) or what begins at step 0."""
        if self.spec.model_info_only:
            info = model_info(self.engine.module)
            self._write({**info, "world_size": self.engine.world_size, "model_info_only": True})
            raise SystemExit(0)
        self._at_step_end(0)

    def on_optimizer_step_end(self) -> None:
        """After each optimizer step (``engine.step()`` on the accumulation boundary,
        ``train_batch()``); exits at the end of the window or on an early stop."""
        self.steps_done += 1
        self._at_step_end(self.steps_done)

    # -- the window -----------------------------------------------------------------------------

    def _at_step_end(self, step: int) -> None:
        spec = self.spec
        if self._count_step is not None:
            if step == self._count_step - 1:
                self._start_counting()
            elif step == self._count_step:
                self._stop_counting()
        if step == spec.start_profile_step - 1:
            self._synchronize()
            self._window_begin = time.perf_counter()
            self._marks = [self._mark(self._window_begin)]
        elif spec.start_profile_step <= step <= spec.end_profile_step:
            self._marks.append(self._mark())
            profiled = step - spec.start_profile_step + 1
            if step == spec.end_profile_step:
                self._finish(early_stopped=False)
            elif spec.early_stop and spec.best_metric is not None and profiled >= 2 and self._beyond_best():
                self._finish(early_stopped=True)

    def _mark(self, host_time: float | None = None):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter() if host_time is None else host_time

    def _synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _step_times_s(self) -> list[float]:
        """This rank's time of each profiled step so far (waits for the last step's work on CUDA)."""
        if self.cuda:
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) * 1e-3 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]

    def _agreed(self, values: list[float]) -> list[float]:
        """The maximum of each value over all ranks (the slowest rank's time), on every rank."""
        if comm.get_world_size() == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        comm.all_reduce(tensor, op=comm.ReduceOp.MAX)
        return tensor.tolist()

    def _beyond_best(self) -> bool:
        fastest = min(self._agreed(self._step_times_s()))
        value = metric_value(self.spec.metric, fastest, self.samples_per_step, self.flops_per_step)
        return value is not None and worse_beyond_margin(self.spec.metric, value, self.spec.best_metric)

    # -- flops ----------------------------------------------------------------------------------

    def _start_counting(self) -> None:
        self._counter = FlopsProfiler(self.engine.module)
        self._counter.start_profile()

    def _stop_counting(self) -> None:
        counter, self._counter = self._counter, None
        if counter is None:
            return
        counter.stop_profile()
        counter.end_profile()
        self.flops_per_step = int(counter.get_total_flops())
        self.tflops_source = (f"dslab flops profiler: the matmul-like flops of every op of optimizer step "
                              f"{self._count_step} (forward, backward, optimizer), counted on this rank "
                              "before the profiled steps")

    def _flops_from_engine(self) -> None:
        records = self._engine_flops.records()
        if records.get("profiled"):
            self.flops_per_step = int(records["total_flops"])
            self.tflops_source = (f"the engine's flops_profiler section: every op of global step "
                                  f"{records.get('profile_step')} (0-based), counted")

    # -- results --------------------------------------------------------------------------------

    def _finish(self, early_stopped: bool) -> None:
        """Agree on the times over the ranks, write ``metrics.json`` (rank 0), exit (every rank)."""
        if self.cuda:
            self._synchronize()
            window_s = time.perf_counter() - self._window_begin
        else:  # the host marks are the window's ends
            window_s = self._marks[-1] - self._marks[0]
        step_times = self._step_times_s()
        peak = peaks.peak_allocated(self.device) if self.cuda else -1  # the whole run's, across tracer resets
        agreed = self._agreed([float(peak), window_s, *step_times])
        peak, window_s, step_times = int(agreed[0]), agreed[1], agreed[2:]
        if self._engine_flops is not None:
            self._flops_from_engine()
        profiled = len(step_times)
        latency = window_s / profiled
        metrics = {
            "throughput": self.samples_per_step * profiled / window_s,
            "latency": latency,
            "flops": None if self.flops_per_step is None else self.flops_per_step / latency,
            "step_times_s": step_times,
            "profiled_steps": profiled,
            "early_stopped": early_stopped,
            "peak_memory_bytes": peak if peak >= 0 else None,
            "num_params": model_info(self.engine.module)["num_params"],
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "world_size": self.engine.world_size,
            "samples_per_step": self.samples_per_step,
            "tflops_source": self.tflops_source,
        }
        self._write(metrics)
        if self.engine.rank == 0:
            stopped = "stopped early: worse than the best so far" if early_stopped else "done"
            print(f"autotuning experiment {self.spec.name}: {profiled} profiled step(s), "
                  f"{self.spec.metric} {metrics[self.spec.metric]}; {stopped}; exiting", flush=True)
        raise SystemExit(0)

    def _write(self, metrics: dict) -> None:
        if comm.get_rank() == 0:
            atomic_write_text(self.exp_dir / METRICS_FILE, json.dumps(metrics, indent=1) + "\n")
