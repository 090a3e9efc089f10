"""``dslab bench SUITE``: run a suite's arms side by side and write a run report.

The runner orchestrates; each kind of suite implements :mod:`dslab.bench.protocol` in a module
of its own (:mod:`dslab.bench.training`, :mod:`dslab.bench.inference`), and neither calls back
here. For each case every arm is built once, then trials run interleaved: trial 0 of every arm,
then trial 1 with the arm order rotated, and so on, so slow drifts of the machine (clocks,
temperature, neighbours) fall on all arms alike. Each arm's first trial starts with the suite's
warm-up steps (compilation, autotuning); later trials settle for a step or two (the kind's) before
they are timed. The warm-up runs on through the one-off steps of the dslab engine's profilers
(the flops profiler's counted, module-timed and busy-time steps, the memory tracer's breakdown:
eager, under hooks) when those come later, so that no timed step is one of them; every arm of the
case then warms up as long, and all train the same steps (a case that keeps one arm at a time
extends each engine arm's warm-up and that of every arm after it).

A run that cannot start (no suite at the path, an invalid suite file, a scale, arm, case or count
it does not have) raises :class:`~dslab.bench.common.RunNotStarted` before anything is measured or
written. Once started, the report is rewritten atomically after every round of trials; an arm that
fails is recorded with its error and the others go on, and the finished run is ``partial`` (a
skipped arm does not count; :meth:`dslab.report.RunReport.finished_status`), else ``complete``;
Ctrl-C or an error of the runner itself leaves the report marked incomplete. An arm that runs
out of GPU memory (``torch.OutOfMemoryError`` while it is built, warms up or runs a trial) is
recorded with status ``oom`` and an error whose first line says where and repeats the first line
of PyTorch's message (:func:`dslab.bench.common.error_text`); any trials it finished are kept. The
runner then drops the arm, collects garbage and empties the CUDA cache, and goes on with the next
arm and case. Any other exception is recorded as ``failed`` with its traceback's last frames.

Started on several processes (torchrun or ``dslab launch``, ``WORLD_SIZE`` > 1), every rank calls
:func:`run_suite`; only rank 0 prints and writes the report (the training kind says how the ranks
step together and how their measurements combine).

Progress lines (one per arm and trial) go to standard error, the summary table and the report's
path to standard output, so ``dslab bench SUITE > summary.txt`` keeps the table.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

import torch

from dslab import comm
from dslab.bench.common import (
    RUN_ID_ENV, ArmSkipped, Progress, RunNotStarted, TrialFailed, World, current_device, datasheet_bf16, error_text,
    failure_status, free_memory,
)
from dslab.bench.data_parallel import DataParallelSuite
from dslab.bench.inference import InferenceSuite
from dslab.bench.kernel_pins import merge_part_pins, pins_note, record_pins, replay_pins
from dslab.bench.launcher import run_launches
from dslab.bench.long_context import LongContextSuite
from dslab.bench.measure import measure_peaks
from dslab.bench.model_parallel import ModelParallelSuite
from dslab.bench.protocol import CaseRun, Counts, RunContext, SuiteKind
from dslab.bench.suite import load_suite
from dslab.bench.trace_step import write_run_trace
from dslab.bench.training import TrainingSuite
from dslab.engine.profiling import ProfilerHooks
from dslab.report import Result, RunReport, Trial, new_run_id
from dslab.report.environment import collect_environment
from dslab.report.store import utc_now
from dslab.report.scaling import best_peer_ratios, scaling_table
from dslab.report.summary import describe, results_table

# Each suite.json "kind" and the class that runs it.
KINDS = {"training": TrainingSuite, "inference": InferenceSuite, "data_parallel": DataParallelSuite,
         "model_parallel": ModelParallelSuite, "long_context": LongContextSuite}


def suite_kind(suite, suite_file: Path, zero_stage: int | None = None, verbose: bool = False,
               nprocs: list[int] | None = None) -> SuiteKind:
    """The :class:`~dslab.bench.protocol.SuiteKind` that runs ``suite`` (its ``kind``, training by
    default), with the command's options checked for it."""
    kind = getattr(suite, "kind", None) or "training"
    if kind not in KINDS:
        raise ValueError(f"suite {suite.name}: unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    if getattr(KINDS[kind], "launches_processes", False):
        return KINDS[kind](suite, suite_file, zero_stage=zero_stage, verbose=verbose, nprocs=nprocs)
    if nprocs:
        raise ValueError(f"--nprocs: suite {suite.name} ({kind}) runs in the processes it is started in; "
                         f"only a data-parallel suite starts processes of its own, as does a model-parallel one "
                         f"(start this one under torchrun or dslab launch)")
    return KINDS[kind](suite, suite_file, zero_stage=zero_stage, verbose=verbose)


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
    nprocs: list[int] | None = None,
    summary: TextIO | None = None,
    pin_kernels: str | Path | None = None,
) -> tuple[RunReport, Path]:
    """Run the suite at ``suite_path``; returns the report and the path of its run.json.

    Progress lines go to ``stream`` (standard error by default), the summary table and the
    report's path to ``summary`` (standard output by default, or ``stream`` when only that is
    given); rank 0 only. A run that cannot start raises
    :class:`~dslab.bench.common.RunNotStarted` naming the problem (module docstring).
    ``scale`` defaults to ``full`` on a CUDA device and ``tiny`` elsewhere; ``trials``, ``steps``
    and ``warmup_steps`` override the scale's. The training kind also takes ``zero_stage`` (it
    overrides the suite engine's ``zero_optimization.stage``) and ``verbose`` (the profilers' text
    reports printed as well as written); an inference suite refuses ``zero_stage``.

    A data- or model-parallel suite started outside torchrun launches its processes itself, one
    torchrun per process count (``nprocs``, else the suite's; :mod:`dslab.bench.launcher`), and
    merges what they measured into this run's report; the summary adds the scaling table.

    ``pin_kernels`` names a file of kernel choices (a baseline, a run.json) replayed before any arm
    is built; every run records its own after the trials (:mod:`dslab.bench.kernel_pins`)."""
    try:
        suite, suite_file = load_suite(suite_path)
        kind = suite_kind(suite, suite_file, zero_stage, verbose, nprocs)
        launching = getattr(kind, "launches_processes", False) and not os.environ.get("WORLD_SIZE")
        world = World() if launching else kind.join_world()
        device = current_device() if not launching else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        progress = Progress(stream or sys.stderr, enabled=world.rank == 0)
        if scale is None:
            scale = "full" if device.type == "cuda" else "tiny"
            if device.type != "cuda":
                progress.line(f"no CUDA GPU: running suite {suite.name} at the 'tiny' scale on the CPU")
        if scale not in suite.scales:
            raise ValueError(f"suite {suite.name} has no scale {scale!r}; it has {', '.join(suite.scales)}")
        counts = _counts(suite.scales[scale], trials, steps, warmup_steps)
        plan = kind.plan(scale, arms, cases, counts, world, device)
        pins = replay_pins(pin_kernels) if pin_kernels else None
    except (ValueError, FileNotFoundError) as err:
        raise RunNotStarted(str(err)) from err
    summary_lines = Progress(summary or stream or sys.stdout, enabled=world.rank == 0)

    run_id = os.environ.get(RUN_ID_ENV) or new_run_id()
    if world.size > 1:  # one run, one id: rank 0's
        run_id = comm.all_gather_object(run_id)[0]
    report = RunReport(run_id=run_id, suite=suite.name, created=utc_now())
    report.environment = collect_environment()
    report.config = plan.config
    report.data = plan.data
    for note in plan.notes + ([pins_note(pins)] if pins else []):
        progress.line(note)
        report.notes.append(note)
    context = RunContext(report, device, world, progress, out, counts, plan.arms)
    path = context.write()
    ranks = f" x {world.size} ranks" if world.size > 1 else ""
    progress.line(f"run {report.run_id}: {len(plan.cases)} case(s) x {len(plan.arms)} arm(s) x {counts.trials} "
                  f"trial(s) of {counts.steps} {plan.step_noun} on {device}{ranks} -> {path.parent}")
    try:
        if launching:
            _launch(report, plan, suite_file, scale, counts, out, verbose, context, progress, pin_kernels)
            merge_part_pins(report)
        else:
            report.peaks = measure_peaks(device)
            datasheet = datasheet_bf16(report.environment)
            if datasheet:
                report.peaks["datasheet_bf16_tflops"] = datasheet
            for case in plan.cases:
                case_run = kind.open_case(case, context)
                if case_run is not None:
                    run_case(case_run, context)
            record_pins(report, world, pins)
        _ratios(report)
        report.status = report.finished_status()
    except KeyboardInterrupt:
        report.status = "incomplete"
        report.notes.append("interrupted (Ctrl-C) before the run finished")
        _ratios(report)
        raise
    except BaseException:
        report.status = "incomplete"
        report.notes.append("the runner stopped on an error before the run finished")
        raise
    finally:
        report.finished = utc_now()
        path = context.write()
        write_run_trace(context, path)
        progress.line("")
        if world.part:  # one launch of a multi-process run: the launcher prints the run's summary
            progress.line(f"part {world.part} of run {report.run_id}: {path}")
        else:
            scaling = scaling_table(report)
            summary_lines.line(describe(report) + "\n" + results_table(report) + (f"\n{scaling}" if scaling else ""))
            summary_lines.line(f"report: {path}")
    return report, path


def _ratios(report: RunReport) -> None:
    """dslab's ratios: over every other arm of a case, or for a data- or model-parallel run over
    the peers that shard or split the model the same way
    (:func:`dslab.report.scaling.best_peer_ratios`)."""
    if report.config.get("kind") in ("data_parallel", "model_parallel", "long_context"):
        report.ratios, report.best_plain = best_peer_ratios(report), {}
    else:
        report.compute_ratios("dslab", "samples_per_s")


def _launch(report: RunReport, plan, suite_file: Path, scale: str, counts: Counts, out, verbose: bool,
            context: RunContext, progress: Progress, pin_kernels: str | Path | None = None) -> None:
    """A data- or model-parallel run's launches, one per process count (:mod:`dslab.bench.launcher`)."""
    nprocs = list(plan.config["nprocs"])
    cases_by_n = {n: [c["name"] for c in plan.config["cases"] if c["nprocs"] == n] for n in nprocs}
    bases = list(dict.fromkeys(c["base_case"] for c in plan.config["cases"]))
    options = ["--scale", scale, "--arms", ",".join(plan.arms), "--cases", ",".join(bases),
               "--trials", str(counts.trials), "--steps", str(counts.steps), "--warmup", str(counts.warmup_steps),
               "--out", str(out), *(["--verbose"] if verbose else []),
               *(["--pin-kernels", str(Path(pin_kernels).resolve())] if pin_kernels else [])]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    run_launches(report, suite_file, nprocs, cases_by_n, plan.arms, options, context.run_path, gpus, progress,
                 context.write, trials=counts.trials)


def _counts(scale_config, trials: int | None, steps: int | None, warmup_steps: int | None) -> Counts:
    counts = Counts(trials=trials or scale_config.trials, steps=steps or scale_config.steps,
                    warmup_steps=scale_config.warmup_steps if warmup_steps is None else warmup_steps)
    for name, value in (("--trials", counts.trials), ("--steps", counts.steps)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if counts.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {counts.warmup_steps}")
    return counts


def run_case(case: CaseRun, context: RunContext) -> None:
    """Build every arm of ``case``, run its trials interleaved, then let the case record what it
    measured and close the arms (module docstring). A case that keeps one arm at a time
    (``one_arm_at_a_time``: a data- or model-parallel case) builds, times, records and closes each arm in
    turn instead."""
    if getattr(case, "one_arm_at_a_time", False):
        # an engine arm's warm-up runs through its profiled steps (_trial); the arms after it
        # warm up as long, so that they train the same steps
        first_warmup = context.counts.warmup_steps
        for name in context.arms:
            arm = _build(case, name, context)
            context.write()
            if arm is None:
                continue
            first_warmup = max(first_warmup, profiled_steps_left(arm))
            built = {name: arm}
            case.before_trials()
            for t in range(context.counts.trials):
                if not _trial(case, name, built, t, first_warmup if t == 0 else
                              min(context.counts.warmup_steps, case.settle_steps), context):
                    break
                context.write()
            case.finish(built)
            for arm in built.values():
                arm.close()
            built.clear()
            free_memory(context.device)
            context.write()
        case.close()
        return
    built = {}
    for name in context.arms:
        arm = _build(case, name, context)
        if arm is not None:
            built[name] = arm
    context.write()

    # every arm warms up as long, so that all train the same steps: through the one-off profiled
    # steps of the dslab engines when those come later than the suite's warm-up
    first_warmup = max([context.counts.warmup_steps, *(profiled_steps_left(arm) for arm in built.values())])
    case.before_trials()
    warmed: set[str] = set()
    for t in range(context.counts.trials):
        live = [n for n in context.arms if n in built]
        if not live:
            break
        shift = t % len(live)
        for name in live[shift:] + live[:shift]:
            # The full warm-up (compilation, autotuning, allocator growth) once per arm; later
            # trials only settle for a step or two after the other arms ran.
            warmup = first_warmup if name not in warmed else min(context.counts.warmup_steps, case.settle_steps)
            if _trial(case, name, built, t, warmup, context):
                warmed.add(name)
        context.write()
    case.finish(built)
    for arm in built.values():
        arm.close()
    built.clear()
    free_memory(context.device)
    case.close()


def _build(case: CaseRun, name: str, context: RunContext):
    """Arm ``name`` of ``case``, or None when it was skipped or failed (recorded in the report)."""
    report, progress = context.report, context.progress
    tag = f"[{report.suite} {case.name}]"
    result = Result(case=case.name, arm=name)
    report.results.append(result)
    try:
        return case.build_arm(name)
    except ArmSkipped as err:
        result.status, result.error = "skipped", str(err)
        progress.line(f"{tag} {name}: skipped ({err})")
    except Exception as err:
        result.error = error_text(err, "building the arm")
        result.status = failure_status(result.error)
        progress.line(f"{tag} {name}: {result.status} while building: {result.error.splitlines()[0]}")
    # outside the except blocks: their tracebacks no longer hold the arm's tensors
    free_memory(context.device)
    return None


def profiled_steps_left(arm) -> int:
    """Steps until the profilers of ``arm``'s dslab engine (none: 0) have run their one-off
    profiled steps (the flops profiler's counted and timed steps, the memory tracer's breakdown),
    which run eagerly under hooks: a trial warms up through them, so that no timed step is one."""
    hooks = getattr(getattr(arm, "engine", None), "profilers", None)
    if not isinstance(hooks, ProfilerHooks):
        return 0
    return hooks.one_off_steps_left(arm.engine.global_steps)


def _trial(case: CaseRun, name: str, built: dict, t: int, warmup: int, context: RunContext) -> bool:
    """Trial ``t`` of arm ``name`` (its warm-up extended through its engine's one-off profiled
    steps: :func:`profiled_steps_left`); on failure the arm is recorded, closed and dropped from
    ``built``. Returns whether the trial ran."""
    report, progress, counts = context.report, context.progress, context.counts
    tag = f"[{report.suite} {case.name}]"
    result = report.result(case.name, name)
    left = profiled_steps_left(built[name])
    if left > warmup:  # run_case passes the longer warm-up already; kept for any other caller
        warmup = left
    if t == 0 and warmup > counts.warmup_steps:
        progress.line(f"{tag} {name}: {warmup} warm-up step(s), through the dslab engine's one-off profiled steps")
    error = None
    try:
        step_times, metrics = case.run_trial(name, built[name], warmup, counts.steps, t)
    except TrialFailed as err:
        error = str(err)
    except Exception as err:
        error = error_text(err, f"trial {t + 1}")
    if error is not None:
        result.status, result.error = failure_status(error), error
        progress.line(f"{tag} trial {t + 1}/{counts.trials} {name}: {result.status}: {error.splitlines()[0]}")
        try:
            built.pop(name).close()
        except Exception as err:  # an arm that broke mid-step may not close cleanly; drop it anyway
            progress.line(f"{tag} {name}: closing it failed: {error_text(err).splitlines()[0]}")
        free_memory(context.device)
        return False
    result.trials.append(Trial(trial=t, step_times_ms=step_times, metrics=metrics))
    result.summarize()
    progress.line(f"{tag} trial {t + 1}/{counts.trials} {case.trial_line(name, metrics)}")
    return True
