"""``dslab bench SUITE``: run a suite's arms side by side and write a run report.

For each case, every arm is built once (same seed, same synthetic batch), then trials run
interleaved: trial 0 of every arm, then trial 1 with the arm order rotated, and so on, so slow
drifts of the machine (clocks, temperature, neighbours) fall on all arms alike. Each arm's first
trial starts with the suite's warm-up steps (compilation, autotuning); later trials settle for
two steps before they are timed. For a mixture-of-experts case the dslab arm's routing after its
last step goes into ``profilers["moe"][case]`` and every arm gets ``expert_tflops``
(:mod:`dslab.bench.moe_report`). The report is rewritten atomically after every trial; an arm
that fails is recorded with its error and the others go on; Ctrl-C leaves the report marked
incomplete.

An arm that runs out of GPU memory (``torch.OutOfMemoryError`` while it is built, warms up or runs
a trial) is recorded with status ``oom`` and an error whose first line says where and repeats the
first line of PyTorch's message; any trials it finished are kept. The runner then drops the arm,
collects garbage and empties the CUDA cache, and goes on with the next arm and case. Any other
exception is recorded as ``failed`` with its traceback's last frames, as before.

The flops a step performs (``config.flops_per_step``, what TFLOP/s and MFU divide) are counted
once per case from the aten ops of a forward and backward of the ``torch`` kernel set's model
(:func:`dslab.bench.measure.count_step_flops`); when that runs out of GPU memory they are counted
again on fake tensors (shapes, no memory). A family with a flops formula of its own
(the Evoformer) has its forward's figure in its case's entry of ``config.cases`` as
``formula_forward_flops``, beside the count.

Started on several processes (torchrun or ``dslab launch``, ``WORLD_SIZE`` > 1), the runner
joins the process group and every rank builds the ``dslab`` arm and steps it in lockstep: the
engine runs data parallelism or ZeRO as the suite's engine config says
(``zero_optimization.stage``, which ``zero_stage`` overrides). The plain arms are single-process
loops and are recorded as skipped. After each trial the ranks' measurements are gathered
(:func:`dslab.comm.all_gather_object`): the trial's step time is the slowest rank's median (its
step times are the ones kept), throughput is global (``samples_per_s`` = micro-batch × world
size / step time, likewise ``tokens_per_s``), ``model_tflops`` and MFU stay per GPU (one rank's
flops over the step time), and each rank's peak memory is kept as ``peak_memory_bytes_rank<r>``
(the CUDA allocator's peak over the trial plus what the arm's CUDA-graph pools hold beyond it,
see :func:`dslab.bench.measure.run_trial`; ``peak_memory_bytes`` is the largest) or, on a CPU,
``peak_rss_bytes_rank<r>`` (the process's largest resident set so far, from ``getrusage``). The
memory tracer's model states of every rank go into its records as ``model_states_per_rank``.
Only rank 0 prints and writes the report; each rank's profiler files go to
``profiles/<case>/rank<r>``. Every rank trains on the same synthetic batch.

The terminal gets the progress lines (one per arm and trial) and the summary table. The text
reports the dslab arm's profilers would print in a training script (the flops profile, the comms
logger's verbose lines) go to files of the run's directory instead, ``profiles/<case>/`` (per rank as
above): ``flops_profile.txt`` and ``comms_calls.txt``. The profiler's record names its file as
``text_file``, relative to the run's directory, and one progress line per file says where it is.
With ``verbose`` the text is printed as well (to standard output, as the engine prints it).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import statistics
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from dslab import comm
from dslab.bench.arms import PRECISION_DTYPES, ArmSkipped, build_arm, describe_injected_sleep, inject_sleep_ms
from dslab.bench.measure import count_step_flops, measure_peaks, run_trial, trial_metrics
from dslab.bench.moe_report import expert_tflops, moe_record, stats_to_host
from dslab.bench.suite import SuiteConfig, load_suite, select_arms
from dslab.bench.workloads import Workload, workloads_for
from dslab.profilers.flops_step import steady_state
from dslab.report import Result, RunReport, Trial, new_run_id, run_dir, write_report
from dslab.report.environment import collect_environment
from dslab.report.store import REPORT_FILE, utc_now
from dslab.report.summary import describe, results_table


SETTLE_STEPS = 2
# The progress line's name of each profiler section's text report.
TEXT_REPORTS = {"flops": "flops profile", "comms": "comms log"}
OOM_STATUS = "oom"
OOM_PREFIX = "out of memory"


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _error_text(err: BaseException, where: str | None = None) -> str:
    """An arm's error for the report: out of memory, ``"out of memory (<where>): <torch's first
    line>"``; else the exception and the last frames of its traceback."""
    if isinstance(err, torch.OutOfMemoryError):
        lines = str(err).splitlines()
        return f"{OOM_PREFIX}{f' ({where})' if where else ''}: {lines[0] if lines else 'torch.OutOfMemoryError'}"
    last = traceback.format_exception(err)[-3:]
    return f"{type(err).__name__}: {err}\n{''.join(last)}"


def _failure_status(error: str) -> str:
    """``oom`` for an error :func:`_error_text` made of an out-of-memory error (on any rank:
    :func:`gather_trial` prefixes ``rank <r>: ``), else ``failed``."""
    first = error.split(": ", 1)[1] if error.startswith("rank ") and ": " in error else error
    return OOM_STATUS if first.startswith(OOM_PREFIX) else "failed"


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _datasheet_bf16(environment: dict) -> float | None:
    gpus = (environment.get("cuda") or {}).get("gpus") or []
    spec = gpus[0].get("spec") if gpus else None
    return spec.get("bf16_tflops") if spec else None


class Progress:
    def __init__(self, stream: TextIO, enabled: bool = True):
        self.stream = stream
        self.enabled = enabled

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)


@dataclass(frozen=True)
class World:
    """This process's rank and the number of processes running the suite together."""

    rank: int = 0
    size: int = 1

    def write(self, report: RunReport, out) -> Path:
        """Write the report on rank 0; every rank gets the path of run.json."""
        if self.rank == 0:
            return write_report(report, out)
        return run_dir(out, report.suite, report.run_id) / REPORT_FILE


def join_world() -> World:
    """Join the process group torchrun / ``dslab launch`` describe when ``WORLD_SIZE`` > 1."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        requested = int(raw)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={raw!r} is not a number of processes") from None
    if requested > 1:
        comm.init_distributed()
    return World(comm.get_rank(), comm.get_world_size())


def engine_config(engine: dict, zero_stage: int | None) -> dict:
    """The suite's engine config, with ``zero_optimization.stage`` set to ``zero_stage`` if given."""
    config = copy.deepcopy(engine)
    if zero_stage is not None:
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        config["zero_optimization"] = {**(config.get("zero_optimization") or {}), "stage": zero_stage}
    return config


def _peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def gather_trial(measured: dict | None, error: str | None, world: World) -> tuple[dict | None, str | None]:
    """Every rank's trial as one: the slowest rank's step times, the largest peak, each rank's
    peak memory (``per_rank_memory``), or the first rank's error."""
    if world.size == 1:
        return measured, error
    mine = {"measured": measured, "error": error, "rss": _peak_rss_bytes()}
    outcomes = comm.all_gather_object(mine)
    for rank, outcome in enumerate(outcomes):
        if outcome["error"] is not None:
            return None, f"rank {rank}: {outcome['error']}"
    medians = [statistics.median(o["measured"]["step_times_ms"]) for o in outcomes]
    slowest = outcomes[medians.index(max(medians))]["measured"]
    peaks = [o["measured"]["peak_memory_bytes"] for o in outcomes]
    if all(p is not None for p in peaks):
        per_rank = {f"peak_memory_bytes_rank{r}": float(p) for r, p in enumerate(peaks)}
        peak = max(peaks)
    else:
        per_rank = {f"peak_rss_bytes_rank{r}": float(o["rss"]) for r, o in enumerate(outcomes)
                    if o["rss"] is not None}
        peak = None
    combined = {**slowest, "peak_memory_bytes": peak, "final_loss": outcomes[0]["measured"]["final_loss"],
                "per_rank_memory": per_rank}
    return combined, None


def _count_flops(workload: Workload, suite: SuiteConfig, device: torch.device) -> tuple[int, str | None]:
    """The flops of one step counted on ``device`` or, when that runs out of memory, again on fake
    tensors of ``device`` (shapes and dtypes only, no memory: the same ops, so the same count), with a
    note saying so in the second case."""
    try:
        return _count_flops_on(workload, suite, device), None
    except torch.OutOfMemoryError as err:
        reason = _error_text(err).splitlines()[0]
    _free(device)
    note = f"flops counted on fake tensors (shapes only): counting on {device} ran {reason}"
    return _count_flops_on(workload, suite, device, fake=True), note


def _count_flops_on(workload: Workload, suite: SuiteConfig, device: torch.device, fake: bool = False) -> int:
    # FakeTensorMode is what torch.compile traces with: tensors that carry a device, shape and
    # dtype but no storage, so autocast and every op's flop formula see what a real run sees.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = workload.build_model(kernels="torch", device=device)
        try:
            return count_step_flops(model, workload.loss_fn(), workload.make_batch(device),
                                    PRECISION_DTYPES[suite.precision], device)
        finally:
            del model
            _free(device)


def _case_entry(workload: Workload) -> dict:
    """A case's entry in ``config.cases``: its settings, preset and family, and the model's own
    forward flops figure where the family has one."""
    entry = {**workload.case.model_dump(), "preset": workload.preset, "family": workload.family}
    formula = workload.formula_forward_flops()
    if formula is not None:
        entry["formula_forward_flops"] = formula
    return entry


def run_suite(
    suite_path: str | Path,
    scale: str | None = None,
    arms: list[str] | None = None,
    cases: list[str] | None = None,
    trials: int | None = None,
    steps: int | None = None,
    warmup_steps: int | None = None,
    out: str | Path = "reports",
    stream: TextIO | None = None,
    zero_stage: int | None = None,
    verbose: bool = False,
) -> tuple[RunReport, Path]:
    """Run the suite at ``suite_path``; returns the report and the path of its run.json.

    Progress and the summary table go to ``stream`` (standard error by default; rank 0 only).
    The profilers' text reports go to files of the run's directory, and to standard output too with
    ``verbose`` (module docstring).
    ``zero_stage`` overrides the suite engine's ``zero_optimization.stage``. Under torchrun
    (``WORLD_SIZE`` > 1) every rank must call it (module docstring). An inference suite
    (``"kind": "inference"``) runs :func:`dslab.bench.inference.run_inference_suite` instead."""
    suite, suite_file = load_suite(suite_path)
    if getattr(suite, "kind", None) == "inference":  # generation, not training: dslab.bench.inference
        from dslab.bench.inference import run_inference_suite

        return run_inference_suite(suite, suite_file, scale, arms, cases, trials, steps, warmup_steps, out, stream,
                                   zero_stage)
    engine = engine_config(suite.engine, zero_stage)
    world = join_world()
    device = _device()
    progress = Progress(stream or sys.stderr, enabled=world.rank == 0)
    if scale is None:
        scale = "full" if device.type == "cuda" else "tiny"
        if device.type != "cuda":
            progress.line(f"no CUDA GPU: running suite {suite.name} at the 'tiny' scale on the CPU")
    workloads = workloads_for(suite, scale, cases)
    sc = suite.scales[scale]
    arm_names = select_arms(suite, arms, scale)
    n_trials = trials or sc.trials
    n_steps = steps or sc.steps
    n_warmup = sc.warmup_steps if warmup_steps is None else warmup_steps
    for name, value in (("--trials", n_trials), ("--steps", n_steps)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    sleep_ms = inject_sleep_ms()
    slowdown = describe_injected_sleep(world.size)  # None unless DSLAB_INJECT_STEP_SLEEP_MS is set
    if slowdown:
        progress.line(slowdown)

    run_id = new_run_id()
    if world.size > 1:  # one run, one id: rank 0's
        run_id = comm.all_gather_object(run_id)[0]
    report = RunReport(run_id=run_id, suite=suite.name, created=utc_now())
    report.environment = collect_environment()
    report.config = {
        "suite_file": str(suite_file),
        "scale": scale,
        "arms": arm_names,
        "trials": n_trials,
        "steps": n_steps,
        "warmup_steps": n_warmup,
        "precision": suite.precision,
        "family": suite.family,
        "cases": [_case_entry(w) for w in workloads],
        "model_options": suite.model_options,
        "engine": engine,
        "zero_stage": int((engine.get("zero_optimization") or {}).get("stage", 0)),
        "world_size": world.size,
        "device": str(device),
        "seed": suite.seed,
        "inject_step_sleep_ms": sleep_ms,
    }
    report.data = {"kind": "synthetic", "description": workloads[0].data_description}
    if slowdown:
        report.notes.append(slowdown)
    path = world.write(report, out)
    ranks = f" x {world.size} ranks" if world.size > 1 else ""
    progress.line(f"run {report.run_id}: {len(workloads)} case(s) x {len(arm_names)} arm(s) x {n_trials} trial(s) "
                  f"of {n_steps} steps on {device}{ranks} -> {path.parent}")
    try:
        report.peaks = measure_peaks(device)
        datasheet = _datasheet_bf16(report.environment)
        if datasheet:
            report.peaks["datasheet_bf16_tflops"] = datasheet
        for workload in workloads:
            _run_case(report, suite, engine, workload, arm_names, device, n_trials, n_steps, n_warmup,
                      datasheet, out, progress, world, verbose)
        report.compute_ratios("dslab", "samples_per_s")
        report.status = "complete"
    except KeyboardInterrupt:
        report.status = "incomplete"
        report.notes.append("interrupted (Ctrl-C) before the run finished")
        report.compute_ratios("dslab", "samples_per_s")
        raise
    except BaseException:
        report.status = "incomplete"
        report.notes.append("the runner stopped on an error before the run finished")
        raise
    finally:
        report.finished = utc_now()
        path = world.write(report, out)
        progress.line("")
        progress.line(describe(report) + "\n" + results_table(report))
        progress.line(f"report: {path}")
    return report, path


def _text_files_in_run(records: dict[str, dict], run_path: Path) -> list[tuple[str, Path]]:
    """The text report files the profilers' ``records`` name (``text_file``), as ``(section, path)``;
    each record's ``text_file`` becomes relative to the run's directory (a file outside it, such as
    a ``flops_profiler.output_file`` the suite names, stays as given)."""
    files = []
    for section, record in records.items():
        named = record.get("text_file") if isinstance(record, dict) else None
        if not named:
            continue
        files.append((section, Path(named)))
        try:
            record["text_file"] = Path(named).resolve().relative_to(run_path.resolve()).as_posix()
        except ValueError:
            pass
    return files


def _steady_state_from_trials(report: RunReport, case: str) -> None:
    """The flops profile's whole-model figure at the dslab arm's timed steps (every trial's),
    in place of the engine's own few steps: the run's steady state is what the benchmark timed."""
    record = (report.profilers.get("flops") or {}).get(case)
    result = report.result(case, "dslab")
    if not isinstance(record, dict) or not record.get("profiled") or result is None or not result.trials:
        return
    times = [t for trial in result.trials for t in trial.step_times_ms]
    record["steady_state"] = steady_state(
        record, times, f"the benchmark: median of the dslab arm's {len(times)} timed steps over "
                       f"{len(result.trials)} trial(s)")


def _record_moe(report: RunReport, workload: Workload, dslab_arm, arm_names: list[str], progress: Progress,
                suite_name: str) -> None:
    """``profilers["moe"][case]`` from the dslab arm's routing after its last step (read to the
    host once), and every arm's ``expert_tflops`` (:mod:`dslab.bench.moe_report`)."""
    case = workload.case.name
    plain = [a for a in arm_names if a != "dslab"]
    record = None
    if dslab_arm is not None:
        try:
            stats = dslab_arm.moe_stats()
            if stats:
                comms = (report.profilers.get("comms") or {}).get(case)
                record = moe_record(workload, stats_to_host(stats), plain, comms)
        except Exception as err:  # the routing is informative; the timings stand without it
            report.notes.append(f"{case}: MoE routing could not be read: {_error_text(err).splitlines()[0]}")
    if record is not None:
        if report.profilers.get("moe") is None:
            report.profilers["moe"] = {}
        report.profilers["moe"][case] = record
        flops = record["expert_flops_per_step"]
        loads = ", ".join(f"layer {layer['layer']} max/mean {layer['max_over_mean']:.2f}" for layer in record["layers"]
                          if layer["max_over_mean"] is not None)
        progress.line(f"[{suite_name} {case}] dslab routing after its last step: {loads}; "
                      f"dropped {record['dropped_fraction']:.1%} of {record['assignments']} assignments")
    else:
        flops = {arm: workload.expert_flops_per_step(hf=arm == "hf") for arm in arm_names}
    for arm in arm_names:
        result = report.result(case, arm)
        if result is None or not result.trials:
            continue
        for trial in result.trials:
            value = expert_tflops(flops.get(arm), trial.metrics.get("step_time_ms"))
            if value is not None:
                trial.metrics["expert_tflops"] = value
        result.summarize()


def _needs_parking(workload: Workload, n_arms: int, device: torch.device) -> bool:
    """True when every arm's resident state (fp32 weights and AdamW moments, 12 bytes per
    parameter; gradients are freed between steps) would take more than three quarters of the GPU,
    leaving too little for one arm's activations: then idle arms wait in host memory between
    their trials."""
    if device.type != "cuda" or n_arms < 2:
        return False
    with torch.device("meta"):
        params = sum(p.numel() for p in workload.build_model(kernels="torch").parameters())
    total = torch.cuda.get_device_properties(device).total_memory
    return params * 12 * n_arms > 0.75 * total


def _run_case(report: RunReport, suite: SuiteConfig, engine: dict, workload: Workload, arm_names: list[str],
              device: torch.device, n_trials: int, n_steps: int, n_warmup: int,
              datasheet: float | None, out, progress: Progress, world: World, verbose: bool = False) -> None:
    case = workload.case.name
    run_path = run_dir(out, report.suite, report.run_id)
    samples, tokens = workload.samples_and_tokens()
    samples, tokens = samples * world.size, tokens * world.size  # every rank steps a micro-batch
    flops = None
    if world.rank == 0:  # only rank 0's report is written
        try:
            flops, note = _count_flops(workload, suite, device)
            if note:
                report.notes.append(f"{case}: {note}")
        except Exception as err:  # counting is informative; the timings still stand without it
            report.notes.append(f"{case}: flop count failed: {_error_text(err).splitlines()[0]}")
        _free(device)  # again outside the except block, whose traceback held the count's tensors
    if flops:
        report.config.setdefault("flops_per_step", {})[case] = flops

    parking = _needs_parking(workload, len(arm_names) if world.size == 1 else 1, device)
    if parking:
        report.notes.append(f"{case}: the arms do not all fit on the GPU at once; each waits in host memory "
                            f"between its trials (moved back and settled before it is timed)")
        progress.line(f"[{suite.name} {case}] arms are parked in host memory between trials")
    built = {}
    for name in arm_names:
        result = Result(case=case, arm=name)
        report.results.append(result)
        try:
            profile_dir = run_path / "profiles" / case
            if world.size > 1:
                profile_dir = profile_dir / f"rank{world.rank}"
            built[name] = build_arm(name, workload, device, suite.precision, engine,
                                    **({"profile_dir": profile_dir, "echo_profile_text": verbose,
                                        "measured_peak_tflops": report.peaks.get("bf16_matmul_tflops")}
                                       if name == "dslab" else {"world_size": world.size}))
            if parking:
                built[name].park()
        except ArmSkipped as err:
            result.status, result.error = "skipped", str(err)
            progress.line(f"[{suite.name} {case}] {name}: skipped ({err})")
        except Exception as err:
            result.error = _error_text(err, "building the arm")
            result.status = _failure_status(result.error)
            progress.line(f"[{suite.name} {case}] {name}: {result.status} while building: "
                          f"{result.error.splitlines()[0]}")
        if result.status not in ("ok", "skipped"):
            built.pop(name, None)  # an arm that failed after its build (parking) is dropped too
            _free(device)  # outside the except block: its traceback no longer holds the arm's tensors
    world.write(report, out)

    warmed: set[str] = set()
    graph_pools_of: dict[str, set] = {name: set() for name in arm_names}  # see measure.run_trial
    for t in range(n_trials):
        live = [n for n in arm_names if n in built]
        if not live:
            break
        shift = t % len(live)
        for name in live[shift:] + live[:shift]:
            result = report.result(case, name)
            try:
                # The full warm-up (compilation, autotuning, allocator growth) once per arm; later
                # trials only settle for a couple of steps after the other arms ran.
                warmup = n_warmup if name not in warmed else min(n_warmup, SETTLE_STEPS)
                if parking:
                    built[name].unpark()
                measured, error = run_trial(built[name].step, device, warmup, n_steps,
                                            pools=graph_pools_of[name]), None
                warmed.add(name)
                if parking:
                    built[name].park()
            except Exception as err:
                measured, error = None, _error_text(err, f"trial {t + 1}")
            measured, error = gather_trial(measured, error, world)
            if error is not None:
                result.status, result.error = _failure_status(error), error
                progress.line(f"[{suite.name} {case}] trial {t + 1}/{n_trials} {name}: {result.status}: "
                              f"{result.error.splitlines()[0]}")
                try:
                    built.pop(name).close()
                except Exception as err:  # an arm that broke mid-step may not close cleanly; drop it anyway
                    progress.line(f"[{suite.name} {case}] {name}: closing it failed: "
                                  f"{_error_text(err).splitlines()[0]}")
                _free(device)
                continue
            metrics = trial_metrics(measured, samples, tokens, flops, report.peaks, datasheet)
            metrics.update(measured.get("per_rank_memory") or {})
            result.trials.append(Trial(trial=t, step_times_ms=measured["step_times_ms"], metrics=metrics))
            result.summarize()
            progress.line(f"[{suite.name} {case}] trial {t + 1}/{n_trials} {name:<13} "
                          f"{metrics['samples_per_s']:>10.1f} samples/s  {metrics['step_time_ms']:>9.2f} ms/step")
        world.write(report, out)
    text_files: list[tuple[str, Path]] = []
    if "dslab" in built:
        try:
            records = built["dslab"].records()
            text_files = _text_files_in_run(records, run_path)
            if world.size > 1 and records.get("memory") is not None:
                per_rank = comm.all_gather_object(records["memory"].get("model_states"))
                records["memory"] = {**records["memory"], "model_states_per_rank": per_rank}
            for section, data in records.items():
                if report.profilers.get(section) is None:
                    report.profilers[section] = {}
                report.profilers[section][case] = data
            _steady_state_from_trials(report, case)
        except Exception as err:  # a profiler's failure must not lose the measured trials
            report.notes.append(f"{case}: profiler records failed: {_error_text(err).splitlines()[0]}")
        graph_stats = built["dslab"].cuda_graph_stats()
        if graph_stats:
            counts = ", ".join(f"{k} {v}" for k, v in sorted(graph_stats.items()))
            report.notes.append(f"{case}: dslab arm CUDA graphs of the layer stack: {counts}")
    if workload.is_moe:
        _record_moe(report, workload, built.get("dslab"), arm_names, progress, suite.name)
    for arm in built.values():
        arm.close()  # the flops profile is written at the latest here
    built.clear()
    _free(device)
    for section, file in text_files:
        progress.line(f"[{suite.name} {case}] {TEXT_REPORTS.get(section, section)} text: {file}")
