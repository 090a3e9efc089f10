"""The ``dslab`` command: parses, then calls into dslab.

Each subcommand is one :class:`Command` in :data:`COMMANDS`: its name, a one-line help, a function
that adds its arguments and a thin function that runs it. The run functions import their modules
when called, so ``dslab --help`` and ``dslab --version`` do not import torch. Adding a subcommand
is writing those two functions and one entry in :data:`COMMANDS` (and extending the frozen list of
commands in ``tests/test_cli.py``).

Exit codes: 0 success, 1 an expected error (bad input: ``ValueError``, ``FileNotFoundError``),
printed as ``dslab: error: <message>`` without a traceback; 2 a usage error (argparse's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable

from dslab import __version__

EXPECTED_ERRORS = (ValueError, FileNotFoundError)


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


COMMANDS: tuple[Command, ...] = (
    Command(
        "env",
        "print versions, GPUs with their datasheet peaks, NVML and the kernel backends (for bug reports)",
        _env_arguments,
        _run_env,
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
        subparser.set_defaults(run=command.run)
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
        return args.run(args)
    except EXPECTED_ERRORS as error:
        print(f"dslab: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
