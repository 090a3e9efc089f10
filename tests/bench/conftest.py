"""Fixtures that several modules of tests/bench read.

``zero_tiny_run``: ``dslab bench suites/zero`` at its tiny scale, started as a user starts it (a
plain process that launches one torchrun per process count, here 1 and 2 gloo processes), every
tiny arm, one trial of 1 warm-up + 2 steps. It runs once per test session (shared_launch.py, also
across pytest-xdist's workers): test_zero_suite.py checks its report, test_bench_trace.py the
Perfetto trace of its two-process launch. The command's exit status and output are kept, not
judged here, so each test fails on what it checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared_launch import shared_directory

REPO = Path(__file__).resolve().parents[2]
ZERO_TINY_OPTIONS = ["--trials", "1", "--steps", "2", "--warmup", "1"]


@dataclass
class LaunchedRun:
    """A finished ``dslab bench`` command: its exit status, its output, and its ``--out``."""

    returncode: int
    stdout: str
    stderr: str
    out: Path


def _bench_zero_tiny(out: Path) -> None:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "dslab.cli", "bench", str(REPO / "suites" / "zero"), *ZERO_TINY_OPTIONS,
           "--out", str(out / "reports")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    (out / "stdout.txt").write_text(proc.stdout)
    (out / "stderr.txt").write_text(proc.stderr)
    (out / "returncode.txt").write_text(str(proc.returncode))


@pytest.fixture(scope="session")
def zero_tiny_run(tmp_path_factory) -> LaunchedRun:
    out = shared_directory(tmp_path_factory, "bench-zero-tiny", _bench_zero_tiny)
    return LaunchedRun(int((out / "returncode.txt").read_text()), (out / "stdout.txt").read_text(),
                       (out / "stderr.txt").read_text(), out / "reports")
