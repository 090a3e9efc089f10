"""Find the hosts, build one command per host, run them all, return the worst exit status.

Where the hosts come from, first found: ``--hostfile``; ``/job/hostfile``; this machine's GPUs
(``localhost slots=<GPU count>``); on a machine without GPUs, ``--num_gpus`` (default 1) CPU
processes on localhost, which join a gloo process group (``dslab.init_distributed`` picks gloo
without CUDA).

Children run in their own sessions, so a Ctrl-C (or SIGTERM) reaches this launcher only, which
sends SIGTERM to every child's process group (torchrun stops its workers on it), waits
``TERMINATE_GRACE_S`` and kills what is left. When one child fails, the others are stopped the
same way: their peers are gone, and they would otherwise wait in a collective until a timeout.
The exit status is the worst (highest) of the children that ended on their own, 128 + N for
one killed by signal N, and 130 after a Ctrl-C.

``--autotuning tune`` searches the script's config first (:mod:`dslab.engine.autotuning`: one run
of the script per experiment, on the same hosts and slots, through this launcher when that is more
than one process) and writes the optimal config; ``--autotuning run`` then launches the script
once with it (``autotuning.results_dir``/ds_config_optimal.json in place of its config argument).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dslab.engine.launch.commands import DEFAULT_MASTER_PORT, LaunchCommand, build_commands, is_local_host
from dslab.engine.launch.environment import env_file_values, propagated_env
from dslab.engine.launch.hostfile import DEFAULT_HOSTFILE, parse_hostfile
from dslab.engine.launch.resources import select_resources

TERMINATE_GRACE_S = 10.0
POLL_INTERVAL_S = 0.05
INTERRUPTED = 130


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def discover_hosts(hostfile: str | None = None, num_gpus: int | None = None,
                   default_hostfile: str = DEFAULT_HOSTFILE,
                   gpu_count: Callable[[], int] = _cuda_device_count) -> dict[str, int]:
    """``{host: slots}`` from the first source found (module docstring)."""
    if hostfile is not None:
        return parse_hostfile(hostfile)
    if Path(default_hostfile).is_file():
        return parse_hostfile(default_hostfile)
    gpus = gpu_count()
    if gpus > 0:
        return {"localhost": gpus}
    if num_gpus is not None and num_gpus < 1:
        raise ValueError(f"--num_gpus must be >= 1, got {num_gpus}")
    return {"localhost": num_gpus or 1}


def plan_launch(args: argparse.Namespace, cwd: str | None = None, environ=None,
                gpu_count: Callable[[], int] = _cuda_device_count,
                default_hostfile: str = DEFAULT_HOSTFILE, python: str = sys.executable) -> list[LaunchCommand]:
    """The commands ``dslab launch`` runs for parsed ``args`` (see :mod:`dslab.cli`)."""
    if not args.script:
        raise ValueError("dslab launch needs a script to run: dslab launch [options] script.py [args...]")
    cwd = os.getcwd() if cwd is None else cwd
    hosts = discover_hosts(args.hostfile, args.num_gpus, default_hostfile, gpu_count)
    resources = select_resources(hosts, args.include, args.exclude, args.num_nodes, args.num_gpus)
    return build_commands(
        resources, args.script[0], args.script[1:], master_addr=args.master_addr, master_port=args.master_port,
        rdzv_backend=args.rdzv_backend, python=python, cwd=cwd,
        remote_env=propagated_env(environ, cwd), local_env=env_file_values(cwd),
    )


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(procs: Sequence[subprocess.Popen], grace_s: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM every running child's process group; SIGKILL those still running after ``grace_s``."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def wait_all(procs: Sequence[subprocess.Popen], grace_s: float = TERMINATE_GRACE_S) -> int:
    """Wait for every child; on the first failure stop the rest. The worst status of those that
    ended on their own."""
    statuses: dict[int, int] = {}
    while len(statuses) < len(procs):
        for index, proc in enumerate(procs):
            if index not in statuses and proc.poll() is not None:
                statuses[index] = _status(proc.returncode)
        if any(statuses.values()):
            terminate(procs, grace_s)
            break
        time.sleep(POLL_INTERVAL_S)
    return max(statuses.values(), default=0)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_commands(commands: Sequence[LaunchCommand], grace_s: float = TERMINATE_GRACE_S) -> int:
    """Start every command, wait for all, return the worst exit status (module docstring)."""
    procs: list[subprocess.Popen] = []
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there
    # SIGINT too: a launcher started with SIGINT ignored (a background job of a non-interactive
    # shell, whose children inherit that) would otherwise not stop on a Ctrl-C sent to it
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if main_thread else {}
    try:
        for command in commands:
            env = {**os.environ, **dict(command.env)}
            procs.append(subprocess.Popen(list(command.argv), env=env, start_new_session=True))
        return wait_all(procs, grace_s)
    except KeyboardInterrupt:
        print("dslab launch: interrupted; stopping every host's processes", file=sys.stderr)
        terminate(procs, grace_s)
        return INTERRUPTED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def autotune_processes(args: argparse.Namespace,
                       gpu_count: Callable[[], int] = _cuda_device_count) -> tuple[int, list[str] | None]:
    """``(processes, launch options)`` an autotuning search runs each experiment with: the hosts and
    slots ``dslab launch`` would use for ``args``, and the options that make a launch use them
    again (None when it is one process on this machine, which runs without the launcher)."""
    hosts = discover_hosts(getattr(args, "hostfile", None), args.num_gpus, gpu_count=gpu_count)
    resources = select_resources(hosts, getattr(args, "include", None), getattr(args, "exclude", None),
                                 args.num_nodes, args.num_gpus)
    processes = sum(len(slots) for slots in resources.values())
    if processes == 1 and all(is_local_host(host) for host in resources):
        return 1, None
    options = []
    for name in ("hostfile", "include", "exclude", "num_nodes", "num_gpus", "master_addr", "master_port",
                 "rdzv_backend"):
        value = getattr(args, name, None)
        if value is not None:
            options += [f"--{name}", str(value)]
    return processes, options


def _launch_autotuning(args: argparse.Namespace) -> int:
    from dslab.engine.autotuning.driver import script_arguments, tune_command

    if args.dry_run:
        raise ValueError("--dry-run cannot be combined with --autotuning: the search runs the script")
    if not args.script:
        raise ValueError("dslab launch --autotuning needs a script to run: dslab launch --autotuning run [options] "
                         "script.py [args...]")
    processes, options = autotune_processes(args)
    code, result = tune_command(args.script, processes=processes, launcher_args=options)
    if args.autotuning == "tune" or code != 0:
        return code
    optimal = result.written["ds_config_optimal"].resolve()
    args.script = [args.script[0], *script_arguments(args.script[1:], optimal, result.best.config,
                                                     result.settings["arg_mappings"])]
    print(f"dslab launch: training with {optimal}", file=sys.stderr, flush=True)
    return run_commands(plan_launch(args))


def launch(args: argparse.Namespace) -> int:
    """``dslab launch``: print the commands (``--dry-run``) or run them; with ``--autotuning``,
    search the config first (module docstring)."""
    if getattr(args, "autotuning", None):
        return _launch_autotuning(args)
    commands = plan_launch(args)
    if args.dry_run:
        for command in commands:
            print(command.shell())
        return 0
    return run_commands(commands)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``dslab launch``'s options (frozen in tests/test_cli.py)."""
    parser.add_argument("--hostfile", default=None,
                        help=f"'hostname slots=N' lines (default: {DEFAULT_HOSTFILE} if it exists, "
                             "else this machine's GPUs, else CPU processes)")
    parser.add_argument("--include", default=None, help="hosts/slots to use, e.g. 'worker-0@worker-1:0,2'")
    parser.add_argument("--exclude", default=None, help="hosts/slots not to use, e.g. 'worker-1:0'")
    parser.add_argument("--num_nodes", type=int, default=None, help="use the first N hosts")
    parser.add_argument("--num_gpus", type=int, default=None,
                        help="use the first N slots of each host (CPU processes without GPUs; default 1)")
    parser.add_argument("--master_addr", default=None, help="rendezvous host (default: the first host)")
    parser.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT,
                        help=f"rendezvous port (default {DEFAULT_MASTER_PORT})")
    parser.add_argument("--rdzv_backend", choices=("static", "c10d"), default="static",
                        help="static: --node_rank per host (default); c10d: torchrun's c10d rendezvous")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="print the command of every host, one per line, and run nothing")
    parser.add_argument("--autotuning", choices=("tune", "run"), default=None,
                        help="search the script's config first (its config needs \"autotuning\": {\"enabled\": "
                             "true}): 'tune' writes the optimal config and stops, 'run' then trains with it")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="the training script and its arguments")
