"""The ``dslab`` command: parses, then calls into dslab.

Each subcommand is one :class:`Command` in :data:`COMMANDS`: its name, a one-line help, a function
that adds its arguments and a thin function that runs it. The run functions import their modules
when called, so ``dslab --help`` and ``dslab --version`` do not import torch. Adding a subcommand
is writing those two functions and one entry in :data:`COMMANDS` (and extending the frozen list of
commands in ``tests/test_cli.py``).

Exit codes: 0 success, 1 an expected error (bad input: ``ValueError``, ``FileNotFoundError``),
printed as ``dslab: error: <message>`` without a traceback; 2 a usage error (argparse's). Two
commands say more:

- ``dslab bench``: 0 when the run finished and every arm of every case ran or was skipped (an arm
  that cannot run here, e.g. ``deepspeed`` not installed; the report says why); 3 when it finished
  but some arm failed or ran out of memory (the report's status is ``partial``; the summary gives
  each one's error); 2 when the run could not start: the suite path names no suite (the message
  lists the suites found), the suite file is invalid, or the scale, arms, cases or counts asked for
  are refused, before anything is measured or a report is written; 1 when the runner itself
  stopped on an expected error after the run started (the report is left ``incomplete``). Under
  torchrun only rank 0 speaks for the run, and the processes ``dslab bench`` launches for a data-
  or model-parallel suite exit 0 for a partial part (the launching process judges the whole run).
- ``dslab gate``: 0 pass, 1 regression, 2 cannot judge.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Callable

from dslab import __version__

EXPECTED_ERRORS = (ValueError, FileNotFoundError)
EXIT_BENCH_NOT_STARTED = 2
EXIT_BENCH_PARTIAL = 3


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: ``run(args)`` returns the exit code."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _env_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the environment as JSON")


def _run_env(args: argparse.Namespace) -> int:
    from dslab import kernels
    from dslab.report.environment import collect_environment, format_environment

    environment = collect_environment()
    planned = {op: kernels.planned_backend() for op in kernels.OPS}
    if args.json:
        print(json.dumps({**environment, "kernels": planned}, indent=2))
    else:
        print(format_environment(environment, planned), end="")
    return 0


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", help="suite directory (e.g. suites/bert_large) or its suite.json")
    parser.add_argument("--scale", choices=("full", "tiny"), default=None,
                        help="'full' on a GPU (default there), 'tiny' on a CPU (default without a GPU)")
    parser.add_argument("--arms", default=None,
                        help="comma-separated arms (dslab, torch, torch-compile, torch-compile-ro, hf, sdpa, liger); "
                             "default: the suite's")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all of the scale's)")
    parser.add_argument("--trials", type=int, default=None, help="trials per arm (default: the suite's)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per trial (default: the suite's)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per trial (default: the suite's)")
    parser.add_argument("--out", default="reports", help="reports root (default: reports/)")
    parser.add_argument("--nprocs", default=None,
                        help="a data-parallel, model-parallel or long-context suite's process counts, comma-separated (e.g. 1,2,4; "
                             "default: the suite's, else 1, 2, 4, ... up to the GPUs here)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage of the dslab arm's engine (overrides the suite's "
                             "zero_optimization.stage); start under torchrun / dslab launch to shard")
    parser.add_argument("--verbose", action="store_true",
                        help="also print the profilers' text reports (the flops profile, ...) to the terminal; "
                             "they are always written to the run's directory (profiles/<case>/)")
    parser.add_argument("--pin-kernels", dest="pin_kernels", default=None, metavar="FILE",
                        help="replay the kernel choices recorded in FILE (kernel-choices JSON, a baseline, or a "
                             "run's run.json) before any arm is built: Triton autotune configs and cuDNN/cuBLAS "
                             "flags (cudnn.benchmark off); refused when FILE was recorded on another device or "
                             "torch/Triton/CUDA/cuDNN version. Every run records its choices in its report")


def _run_bench(args: argparse.Namespace) -> int:
    from dslab.bench.common import PART_ENV, RunNotStarted
    from dslab.bench.runner import run_suite

    if threading.current_thread() is threading.main_thread():
        # Ctrl-C (and `timeout -s INT`) ends the run keeping what it measured, also when the process
        # started with SIGINT ignored, as a background job of a non-interactive shell does
        signal.signal(signal.SIGINT, signal.default_int_handler)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    cases = [c.strip() for c in args.cases.split(",") if c.strip()] if args.cases else None
    try:
        nprocs = None
        if args.nprocs:
            from dslab.bench.data_parallel_suite import parse_nprocs

            try:
                nprocs = parse_nprocs(args.nprocs)
            except ValueError as err:
                raise RunNotStarted(str(err)) from err
        report, _ = run_suite(args.suite, scale=args.scale, arms=arms, cases=cases, trials=args.trials,
                              steps=args.steps, warmup_steps=args.warmup, out=args.out, zero_stage=args.zero_stage,
                              verbose=args.verbose, nprocs=nprocs, pin_kernels=args.pin_kernels)
    except RunNotStarted as err:
        print(f"dslab: error: {err}", file=sys.stderr)
        return EXIT_BENCH_NOT_STARTED
    # Under torchrun rank 0 speaks for all; a launched part leaves the verdict to its launcher.
    if os.environ.get("RANK", "0") != "0" or os.environ.get(PART_ENV):
        return 0
    failed = report.failed_results()
    if failed:
        print(f"dslab: run {report.run_id} is partial: {len(failed)} arm(s) failed: "
              f"{', '.join(f'{r.case}/{r.arm} ({r.status})' for r in failed)}; the summary and the report "
              f"give each error", file=sys.stderr)
        return EXIT_BENCH_PARTIAL
    return 0


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="report_action", metavar="<action>", required=True)
    listing = actions.add_parser("list", help="list runs, newest last")
    listing.add_argument("--suite", default=None, help="only this suite's runs")
    listing.add_argument("--reports", default="reports", help="reports root (default: reports/)")
    show = actions.add_parser("show", help="print one run's environment and results")
    show.add_argument("run", help="run id (or a prefix), suite/run_id, or a run directory")
    show.add_argument("--reports", default="reports", help="reports root (default: reports/)")
    show.add_argument("--json", action="store_true", help="print the report as JSON")
    plot = actions.add_parser("plot", help="write PNG figures of a run's main views (for CI artifacts)")
    plot.add_argument("run", help="run id (or a prefix), suite/run_id, or a run directory")
    plot.add_argument("--reports", default="reports", help="reports root (default: reports/)")
    plot.add_argument("--out", default=None, help="output folder (default: <run directory>/plots)")
    export = actions.add_parser("export", help="write a run's tables (runs, trials, results, profiler records) "
                                               "as CSV, Parquet or JSON files")
    export.add_argument("run", help="run id (or a prefix), suite/run_id, or a run directory")
    export.add_argument("--reports", default="reports", help="reports root (default: reports/)")
    export.add_argument("--format", default="csv", help="csv (default), parquet (needs pyarrow) or json")
    export.add_argument("--out", default=None, help="output folder (default: <run directory>/export)")


def _report_frames():
    """:mod:`dslab.report.frames`, which every ``dslab report`` action reads reports through; a
    ValueError saying what to install where pandas is missing (an environment made before dslab
    depended on it)."""
    try:
        from dslab.report import frames
    except ImportError as err:
        raise ValueError(f"{err.name or err} is not installed: dslab report needs pandas, a dependency of "
                         "dslab (pip install pandas, or run bin/bootstrap)") from None
    return frames


def _run_report_export(args: argparse.Namespace) -> int:
    frames = _report_frames()
    from dslab.report import find_run, read_report

    frames.check_format(args.format)
    run = find_run(args.reports, args.run)
    for path in frames.export(read_report(run), args.out or run / "export", args.format):
        print(path)
    return 0


def _run_report_plot(args: argparse.Namespace) -> int:
    from dslab.report import find_run, read_report

    run = find_run(args.reports, args.run)
    _report_frames()
    try:
        from dashboards.plots import write_plots

        written, warnings = write_plots(read_report(run), args.out or run / "plots")
    except ImportError as err:
        raise _missing_extra(err, "dashboard") from None
    for warning in warnings:
        print(f"dslab: warning: {warning}", file=sys.stderr)
    for path in written:
        print(path)
    return 0


def _run_report(args: argparse.Namespace) -> int:
    from dslab.report import find_run, list_runs, read_report

    if args.report_action == "plot":
        return _run_report_plot(args)
    if args.report_action == "export":
        return _run_report_export(args)
    if args.report_action == "list":
        runs = list_runs(args.reports, args.suite)
        if not runs:
            print(f"no runs under {args.reports}" + (f" for suite {args.suite}" if args.suite else ""))
            return 0
        _report_frames()  # the table reads each report through its frames
        from dslab.report.summary import runs_table

        print(runs_table(runs), end="")
        return 0
    report = read_report(find_run(args.reports, args.run))
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        _report_frames()  # the summary reads the report through its frames
        from dslab.report.summary import describe, results_table

        print(describe(report))
        print(results_table(report), end="")
    return 0


def _gate_arguments(parser: argparse.ArgumentParser) -> None:
    from dslab.gate.command import add_arguments

    add_arguments(parser)


def _run_gate(args: argparse.Namespace) -> int:
    # The gate reports its own problems and exits 2 ("cannot judge"), never 1 ("regression").
    from dslab.gate.command import run

    return run(args)


def _dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reports", default="reports", help="reports root (default: reports/)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8050, help="port (default: 8050)")


def _missing_extra(err: ImportError, extra: str) -> ValueError:
    return ValueError(f"{err.name or err} is not installed: the dashboard, traces and plots need "
                      f"dslab's '{extra}' extra (pip install -e '.[{extra}]', or run bin/dslab)")


def _run_dashboard(args: argparse.Namespace) -> int:
    try:
        from dashboards.app import run
    except ImportError as err:
        raise _missing_extra(err, "dashboard") from None

    run(args.reports, host=args.host, port=args.port)
    return 0


def _trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run id (or a prefix), suite/run_id, or a run directory")
    parser.add_argument("--reports", default="reports", help="reports root (default: reports/)")
    parser.add_argument("--force", action="store_true", help="rewrite the trace if it exists")


def _run_trace(args: argparse.Namespace) -> int:
    from dslab.profilers.trace import write_trace
    from dslab.report import find_run

    run = find_run(args.reports, args.run)
    try:
        print(write_trace(run, force=args.force))
    except ImportError as err:
        raise _missing_extra(err, "dashboard") from None
    return 0


def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    from dslab.engine.launch.runner import add_arguments

    add_arguments(parser)


def _run_launch(args: argparse.Namespace) -> int:
    # The exit code is the worst of the launched processes'.
    from dslab.engine.launch.runner import launch

    return launch(args)


def _autotune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num_gpus", type=int, default=None,
                        help="processes per host for each experiment (default 1; more run through dslab launch)")
    parser.add_argument("--num_nodes", type=int, default=None, help="hosts of the hostfile for each experiment")
    parser.add_argument("--memory-budget", dest="memory_budget", default=None,
                        help="memory per GPU the memory model prunes against, e.g. 40GB (default: 95%% of the "
                             "GPU's; on a CPU nothing is pruned without it)")
    parser.add_argument("--reports", default="reports", help="reports root (default: reports/)")
    parser.add_argument("--tuner-type", dest="tuner_type", choices=("gridsearch", "random", "model_based"),
                        default=None, help="overrides autotuning.tuner_type")
    parser.add_argument("script", nargs=argparse.REMAINDER,
                        help="the training script and its arguments, its config among them (--deepspeed_config "
                             "FILE, whose \"autotuning\": {\"enabled\": true}); dslab autotune's options go before it")


def _run_autotune(args: argparse.Namespace) -> int:
    from dslab.engine.autotuning.driver import tune_command
    from dslab.engine.launch.runner import autotune_processes

    processes, options = 1, None
    if args.num_gpus is not None or args.num_nodes is not None:
        processes, options = autotune_processes(args)
    code, _ = tune_command(args.script, processes=processes, launcher_args=options,
                           memory_budget=args.memory_budget, tuner_type=args.tuner_type, reports=args.reports)
    return code


def _zero_to_fp32_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir",
                        help="a save directory (its 'latest', or --tag, picks the checkpoint) or "
                             "one checkpoint's own directory")
    parser.add_argument("out", help="file to write the full fp32 state dict to (torch.save)")
    parser.add_argument("--tag", default=None, help="checkpoint tag inside CHECKPOINT_DIR")


def _run_zero_to_fp32(args: argparse.Namespace) -> int:
    from dslab.engine.checkpoint_io import CheckpointError
    from dslab.engine.zero.consolidate import zero_to_fp32

    try:
        path = zero_to_fp32(args.checkpoint_dir, args.out, tag=args.tag)
    except CheckpointError as error:
        print(f"dslab: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


def _nvme_tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True,
                        help="directory on the storage to tune (a test file is written there and removed)")
    parser.add_argument("--size", default="1G", help="test file size, e.g. 1G, 256M (default: 1G)")
    parser.add_argument("--trials", type=int, default=3, help="trials per finalist configuration (default: 3)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="tensors to read into and write from: pinned CPU memory or a CUDA device")
    parser.add_argument("--sweep-config", default=None,
                        help="JSON file of lists to sweep: block_size, queue_depth, intra_op_parallelism, "
                             "single_submit, overlap_events (default: dslab's space)")
    parser.add_argument("--no-fio", action="store_true", help="skip fio's job on the same file")
    parser.add_argument("--out", default="reports", help="reports root (default: reports/)")


def _run_nvme_tune(args: argparse.Namespace) -> int:
    from dslab.io.tune import (format_result, load_sweep_config, parse_size, stderr_progress, tune,
                               write_tune_report)

    space = load_sweep_config(args.sweep_config) if args.sweep_config else None
    result = tune(args.path, parse_size(args.size), trials=args.trials, device=args.device, space=space,
                  use_fio=not args.no_fio, progress=stderr_progress())
    print(format_result(result), end="")
    print(f"report: {write_tune_report(result, args.out, space)}")
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(
        "bench",
        "run a benchmark suite's arms side by side and write a run report",
        _bench_arguments,
        _run_bench,
    ),
    Command(
        "report",
        "list run reports, show one, plot one to PNG files, or export its tables to CSV/Parquet/JSON",
        _report_arguments,
        _run_report,
    ),
    Command(
        "dashboard",
        "serve the Dash dashboard over the run reports (http://127.0.0.1:8050/ by default)",
        _dashboard_arguments,
        _run_dashboard,
    ),
    Command(
        "trace",
        "write a run's Perfetto trace (trace.pftrace, for ui.perfetto.dev) if missing and print its path",
        _trace_arguments,
        _run_trace,
    ),
    Command(
        "gate",
        "judge a run against a baseline: exit 0 pass, 1 regression, 2 cannot judge",
        _gate_arguments,
        _run_gate,
    ),
    Command(
        "env",
        "print versions, GPUs with their datasheet peaks, NVML and the kernel backends (for bug reports)",
        _env_arguments,
        _run_env,
    ),
    Command(
        "launch",
        "start a training script on every host of a hostfile (one torchrun per host), or on this machine",
        _launch_arguments,
        _run_launch,
    ),
    Command(
        "autotune",
        "search a training script's engine config (ZeRO stage, micro-batch, ...) for the fastest that fits",
        _autotune_arguments,
        _run_autotune,
    ),
    Command(
        "zero-to-fp32",
        "consolidate a ZeRO checkpoint's shards into one full fp32 state dict (no GPU needed)",
        _zero_to_fp32_arguments,
        _run_zero_to_fp32,
    ),
    Command(
        "nvme-tune",
        "sweep async I/O handle settings on a directory's storage, beside fio, and print the best aio config",
        _nvme_tune_arguments,
        _run_nvme_tune,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="dslab", description="dslab: a profiling-first performance lab for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"dslab {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for command in COMMANDS:
        subparser = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(subparser)
        subparser.set_defaults(_handler=command.run)
    return parser


def _exit_code(code: int | str | None) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 2


def main(argv: list[str] | None = None) -> int:
    """Run ``dslab`` with ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help and --version exit 0, usage errors 2
        return _exit_code(exit_.code)
    try:
        return args._handler(args)
    except EXPECTED_ERRORS as error:
        print(f"dslab: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
