"""``python -m dslab.bench.ab_worker``: one arm of one case of a suite, built once and timed one
trial at a time on request; the worker that ``dslab gate --ab`` (:mod:`dslab.gate.ab`) starts in
each source tree it compares.

    python -m dslab.bench.ab_worker --suite DIR --case C --arm A [--scale S] [--warmup-steps N] [--steps N]
                                    [--pin-kernels FILE]

The case is run through the bench runner's own machinery (:mod:`dslab.bench.protocol`): the
suite's kind plans it (:func:`dslab.bench.runner.suite_kind`), opens the case, builds the arm,
and every trial is the kind's ``run_trial``, so a trial here is what a trial of ``dslab bench`` is.
The suite's scale gives the steps and warm-up unless overridden; the scale defaults as for
``dslab bench`` (``full`` on a CUDA GPU, ``tiny`` elsewhere). Only suites that run in one process
(training, inference) can be served; a data- or model-parallel suite is refused.

Protocol: one JSON object a line on standard output. Everything else the run prints goes to
standard error (standard output is moved there before anything is imported that might print).

- after building the arm and its warm-up (the scale's warm-up steps, then one timed step, discarded):
  ``{"ready": true, ...}`` with the suite, case, arm, scale, device, counts, ``dslab_path`` (the
  package this process imported, so the caller can check which tree ran), the run's
  environment and config, ``inject_step_sleep_ms`` / ``injection_applies``, ``kernel_choices``
  (:func:`dslab.kernels.pinning.record_kernel_choices` after the warm-up: what this process chose)
  and ``pinned`` (the replay's summary and the keys autotuned anyway, when ``--pin-kernels`` FILE
  was replayed before the arm was built; None otherwise);
- for each line ``trial`` on standard input: the trial, with the kind's settle steps (as the
  runner runs an arm's later trials) and the timed steps, then
  ``{"trial": k, "metrics": {...}, "step_times_ms": [...]}`` (k from 0);
- ``quit`` or the end of standard input: the arm is closed and the worker exits 0;
- any error: ``{"error": "..."}`` and exit status 2.

``DSLAB_INJECT_STEP_SLEEP_MS`` is honoured as by ``dslab bench``: the training kind's ``dslab``
arm sleeps that long in every step (:mod:`dslab.bench.arms`); no other arm or kind does, which
the ready line's ``injection_applies`` says.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

PROTOCOL_VERSION = 1
EXIT_ERROR = 2


class WorkerRefused(ValueError):
    """The worker cannot serve what it was asked for (the message says why)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a protocol error line, not argparse's usage text and exit
        raise WorkerRefused(f"ab_worker: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m dslab.bench.ab_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--suite", required=True, help="the suite's folder (or its suite.json)")
    parser.add_argument("--case", required=True, help="the case to run")
    parser.add_argument("--arm", required=True, help="the arm to run")
    parser.add_argument("--scale", default=None, help="the suite's scale (default: full on a CUDA GPU, else tiny)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="warm-up steps (default: the scale's)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps a trial (default: the scale's)")
    parser.add_argument("--pin-kernels", default=None, metavar="FILE",
                        help="replay the kernel choices of FILE before building (dslab bench --pin-kernels)")
    return parser


def _protocol_stream() -> TextIO:
    """Standard output for the protocol alone: the real stdout is duplicated for it, and file
    descriptor 1 then points at standard error, so stray prints cannot corrupt the JSON lines."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return protocol


def _send(stream: TextIO, message: dict) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


class ArmSession:
    """One arm of one case, built and warmed up, ready to run trials (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, scratch: Path):
        import dslab
        from dslab.bench.arms import inject_sleep_mode, inject_sleep_ms
        from dslab.bench.common import ArmSkipped, Progress, current_device
        from dslab.bench.kernel_pins import pins_note, replay_pins
        from dslab.kernels.pinning import pinning_misses, record_kernel_choices
        from dslab.bench.measure import measure_peaks
        from dslab.bench.protocol import Counts, RunContext
        from dslab.bench.runner import suite_kind
        from dslab.bench.suite import load_suite
        from dslab.bench.training import TrainingSuite
        from dslab.report import RunReport, new_run_id
        from dslab.report.environment import collect_environment
        from dslab.report.store import utc_now

        suite, suite_file = load_suite(args.suite)
        kind = suite_kind(suite, suite_file)
        if getattr(kind, "launches_processes", False):
            raise WorkerRefused(f"suite {suite.name} ({getattr(suite, 'kind', '?')}) starts processes of its own; "
                                f"the A/B worker runs suites that run in one process (training, inference)")
        world = kind.join_world()
        if world.size > 1:
            raise WorkerRefused("the A/B worker runs in one process; unset WORLD_SIZE")
        device = current_device()
        scale = args.scale or ("full" if device.type == "cuda" else "tiny")
        if scale not in suite.scales:
            raise WorkerRefused(f"suite {suite.name} has no scale {scale!r}; it has {', '.join(suite.scales)}")
        scale_config = suite.scales[scale]
        counts = Counts(trials=1, steps=args.steps or scale_config.steps,
                        warmup_steps=scale_config.warmup_steps if args.warmup_steps is None else args.warmup_steps)
        if counts.steps < 1 or counts.warmup_steps < 0:
            raise WorkerRefused(f"--steps must be >= 1 and --warmup-steps >= 0, got {counts.steps} and "
                                f"{counts.warmup_steps}")
        plan = kind.plan(scale, [args.arm], [args.case], counts, world, device)
        if args.arm not in plan.arms or len(plan.cases) != 1:
            raise WorkerRefused(f"suite {suite.name} at scale {scale} has no case {args.case!r} with arm {args.arm!r}")

        replay = replay_pins(args.pin_kernels) if args.pin_kernels else None
        report = RunReport(run_id=new_run_id(), suite=suite.name, created=utc_now())
        report.environment, report.config, report.data = collect_environment(), plan.config, plan.data
        report.peaks = measure_peaks(device)
        context = RunContext(report, device, world, Progress(sys.stderr), scratch, counts, [args.arm])
        self.arm_name, self.counts = args.arm, counts
        self.case = kind.open_case(plan.cases[0], context)
        if self.case is None:
            errors = [r.error for r in report.results if r.error] or report.notes
            raise WorkerRefused(f"case {args.case} cannot run: {'; '.join(errors) or 'the kind gave no reason'}")
        try:
            self.arm = self.case.build_arm(args.arm)
        except ArmSkipped as err:
            raise WorkerRefused(f"arm {args.arm} is skipped here: {err}") from None
        self.case.before_trials()
        self.settle_steps = min(counts.warmup_steps, self.case.settle_steps)
        started = time.perf_counter()
        self.case.run_trial(args.arm, self.arm, counts.warmup_steps, 1, 0)  # the warm-up, not reported
        applies = isinstance(kind, TrainingSuite) and args.arm == "dslab"
        self.ready = {
            "ready": True, "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "suite": suite.name,
            "suite_file": str(suite_file), "case": args.case, "arm": args.arm, "scale": scale, "device": str(device),
            "steps": counts.steps, "warmup_steps": counts.warmup_steps, "settle_steps": self.settle_steps,
            "warmup_s": time.perf_counter() - started, "dslab_path": str(Path(dslab.__file__).resolve().parent),
            "inject_step_sleep_ms": inject_sleep_ms(), "inject_step_sleep_mode": inject_sleep_mode(),
            "injection_applies": applies,
            "environment": report.environment, "config": plan.config,
            "notes": list(report.notes) + ([pins_note(replay)] if replay else []),
            "kernel_choices": record_kernel_choices(),
            "pinned": None if replay is None else {**replay, "misses": pinning_misses()},
        }
        self.trials = 0

    def trial(self) -> dict:
        step_times, metrics = self.case.run_trial(self.arm_name, self.arm, self.settle_steps, self.counts.steps,
                                                  self.trials + 1)
        message = {"trial": self.trials, "metrics": metrics, "step_times_ms": list(step_times)}
        self.trials += 1
        return message

    def close(self) -> None:
        try:
            self.case.finish({self.arm_name: self.arm})
        finally:
            self.arm.close()
            self.case.close()


def serve(args: argparse.Namespace, protocol: TextIO, commands: TextIO) -> int:
    """Build the arm, say ready, and answer ``trial`` lines until ``quit`` or the end of input."""
    from dslab.bench.common import error_text

    with tempfile.TemporaryDirectory(prefix="dslab-ab-worker-") as scratch:
        try:
            session = ArmSession(args, Path(scratch))
        except (WorkerRefused, ValueError, FileNotFoundError) as err:
            _send(protocol, {"error": str(err)})
            return EXIT_ERROR
        except Exception as err:
            _send(protocol, {"error": error_text(err, "building the arm")})
            return EXIT_ERROR
        _send(protocol, session.ready)
        for line in commands:
            command = line.strip()
            if command == "quit":
                break
            if command != "trial":
                _send(protocol, {"error": f"unknown command {command!r}: send 'trial' or 'quit'"})
                return EXIT_ERROR
            try:
                _send(protocol, session.trial())
            except Exception as err:
                _send(protocol, {"error": error_text(err, f"trial {session.trials + 1}")})
                return EXIT_ERROR
        try:
            session.close()
        except Exception as err:  # the trials were answered already; say so and leave
            print(f"ab_worker: closing the arm failed: {error_text(err)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    protocol = _protocol_stream()
    try:
        args = _parser().parse_args(argv)
    except WorkerRefused as err:
        _send(protocol, {"error": str(err)})
        return EXIT_ERROR
    return serve(args, protocol, sys.stdin)


if __name__ == "__main__":
    sys.exit(main())
