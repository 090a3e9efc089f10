"""The ``dslab`` command line: subcommands through main() and a real subprocess, exit codes, and
the frozen list of what users type."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dslab
from dslab import cli, kernels
from dslab.kernels import dispatch

REPO = Path(__file__).resolve().parent.parent

# The CLI is an interface (STYLE.md #12): every subcommand and every option a user can type is
# listed here, so that adding, renaming or removing one is a deliberate change to this table.
# A new subcommand adds one entry: "name": {"--option", ...} (without -h/--help).
EXPECTED_TOP_LEVEL_OPTIONS = {"--version"}
# A subcommand with actions of its own (dslab report list/show) maps to {action: options}.
EXPECTED_COMMANDS = {
    "bench": {"--scale", "--arms", "--cases", "--trials", "--steps", "--warmup", "--out", "--nprocs",
              "--zero-stage", "--verbose", "--pin-kernels"},
    "report": {
        "list": {"--suite", "--reports"},
        "show": {"--reports", "--json"},
        "plot": {"--reports", "--out"},
        "export": {"--reports", "--format", "--out"},
    },
    "dashboard": {"--reports", "--host", "--port"},
    "trace": {"--reports", "--force"},
    "gate": {"--suite", "--reports", "--baseline", "--candidate", "--metric", "--arm", "--threshold",
             "--alpha", "--run-noise", "--strict", "--format", "--update-baseline", "--pytest-benchmark",
             "--ab", "--case", "--scale", "--baseline-tree", "--max-trials", "--min-trials", "--out",
             "--candidate-env", "--no-pin-kernels"},
    "env": {"--json"},
    "launch": {"--hostfile", "--include", "--exclude", "--num_nodes", "--num_gpus", "--master_addr",
               "--master_port", "--rdzv_backend", "--dry-run", "--autotuning"},
    "autotune": {"--num_gpus", "--num_nodes", "--memory-budget", "--reports", "--tuner-type"},
    "zero-to-fp32": {"--tag"},
    "nvme-tune": {"--path", "--size", "--trials", "--device", "--sweep-config", "--no-fio", "--out"},
}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {
        option
        for action in parser._actions
        for option in action.option_strings
        if not isinstance(action, argparse._HelpAction)
    }


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (subparsers,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(subparsers.choices)


def _interface(parser: argparse.ArgumentParser):
    """A subcommand's options, or {action: options} when it has actions of its own."""
    if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        return {name: _interface(sub) for name, sub in _subcommands(parser).items()}
    return _options(parser)


def test_frozen_commands_and_options():
    parser = cli.build_parser()
    assert _options(parser) == EXPECTED_TOP_LEVEL_OPTIONS
    found = {name: _interface(subparser) for name, subparser in _subcommands(parser).items()}
    assert found == EXPECTED_COMMANDS
    assert [command.name for command in cli.COMMANDS] == list(found)
    assert all(command.help for command in cli.COMMANDS)


def test_frozen_bench_arms():
    """The arms ``--arms`` and a suite's ``arms`` accept are typed by users too (STYLE.md #12)."""
    from dslab.bench.suite import ARMS

    assert ARMS == ("dslab", "torch", "torch-compile", "torch-compile-ro", "hf", "sdpa", "liger")


def test_env_text(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dslab environment\n")
    lines = out.splitlines()
    for op in kernels.OPS:
        assert any(line.split() == [op, kernels.planned_backend()] for line in lines), op


def test_env_json(capsys):
    assert cli.main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kernels"] == {op: kernels.planned_backend() for op in kernels.OPS}
    assert report["dslab"]["version"] == dslab.__version__
    assert {"python", "torch", "cuda", "nvml"} <= set(report)


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dslab {dslab.__version__}"


@pytest.mark.parametrize("argv", [[], ["nonsense"], ["env", "--bogus"]])
def test_usage_errors_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "usage: dslab" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    assert "env" in capsys.readouterr().out


@pytest.mark.parametrize("error", [ValueError("bad value for 'x'"), FileNotFoundError("no such suite: s")])
def test_expected_errors_exit_1_without_traceback(error, monkeypatch, capsys):
    def fail(args):
        raise error

    failing = cli.Command("fail", "always fails", lambda parser: None, fail)
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, failing))
    assert cli.main(["fail"]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"dslab: error: {error}\n"
    assert "Traceback" not in captured.err


def test_unexpected_errors_propagate(monkeypatch):
    def fail(args):
        raise RuntimeError("a bug")

    failing = cli.Command("fail", "always fails", lambda parser: None, fail)
    monkeypatch.setattr(cli, "COMMANDS", (failing,))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["fail"])


def test_env_with_bad_kernel_backend(monkeypatch, capsys):
    monkeypatch.setattr(dispatch, "_override", None)
    monkeypatch.setenv(dispatch.ENV_VAR, "fastest")
    assert cli.main(["env"]) == 1
    assert capsys.readouterr().err.startswith("dslab: error: DSLAB_KERNELS='fastest' is not a kernel backend")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != dispatch.ENV_VAR}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_env_in_a_subprocess():
    done = _run([sys.executable, "-m", "dslab.cli", "env"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("dslab environment\n")
    for op in kernels.OPS:
        assert any(line.split()[:1] == [op] for line in done.stdout.splitlines()), op


def test_console_script_version():
    script = Path(sys.executable).parent / "dslab"
    if not script.exists():
        pytest.skip("the dslab console script is not installed next to this interpreter")
    done = _run([str(script), "--version"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"dslab {dslab.__version__}"


def test_dashboard_commands_name_the_missing_extra(monkeypatch, capsys, tmp_path):
    """Without the dashboard extra installed, the commands that need it say which extra to add."""
    import builtins

    real_import = builtins.__import__

    def no_dash(name, *args, **kwargs):
        if name.startswith(("dashboards", "dash", "perfetto")):
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dash)
    assert cli.main(["dashboard", "--reports", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "dashboards" in err and "'dashboard' extra" in err
