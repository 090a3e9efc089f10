"""``benchmarks/gate_gpu.sh kernels`` against a stand-in ``python3``: a ``KERNEL_SELECT`` that
selects no benchmark stops the part at its baseline run (exit 2, naming the expression) instead of
running every repeat for nothing; a selection that runs goes on to its repeats and their gates."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# pytest exits with PYTEST_RC and writes the --benchmark-json file it was given; every call is logged.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [ "$1 $2" = "-m pytest" ]; then
  for arg in "$@"; do case "$arg" in --benchmark-json=*) echo '{"benchmarks": []}' > "${arg#--benchmark-json=}" ;; esac; done
  exit "$PYTEST_RC"
fi
exit 0
"""


@pytest.fixture
def checkout(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(REPO / "benchmarks" / "gate_gpu.sh", tmp_path / "benchmarks" / "gate_gpu.sh")
    (tmp_path / "benchmarks" / "gpu_setup.sh").write_text("# the lent machine's setup: nothing here\n")
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    return tmp_path


def run_kernels(root: Path, pytest_rc: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    calls = root / "calls.log"
    env = dict(os.environ, PATH=f"{root / 'fakebin'}:{os.environ['PATH']}", CALLS=str(calls),
               PYTEST_RC=str(pytest_rc), OUT=str(root / "out"), KERNEL_SELECT="no_such_kernel", KREPEATS="2")
    done = subprocess.run(["bash", "benchmarks/gate_gpu.sh", "kernels"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=60)
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_a_selection_of_nothing_stops_at_the_baseline(checkout):
    done, calls = run_kernels(checkout, 5)  # pytest's "no tests collected"
    assert done.returncode == 2, done.stdout + done.stderr
    assert "KERNEL_SELECT='no_such_kernel' selects no kernel benchmark" in done.stderr
    pytest_calls = [c for c in calls if c.startswith("-m pytest")]
    assert len(pytest_calls) == 1 and "--kernel-pins" not in pytest_calls[0]  # the baseline run alone


def test_a_selection_that_runs_goes_on_to_the_repeats(checkout):
    done, calls = run_kernels(checkout, 0)
    pytest_calls = [c for c in calls if c.startswith("-m pytest")]
    assert len(pytest_calls) == 1 + 2 * 2, calls  # the baseline, then an A/A and a slowed run per repeat
    assert sum("--kernel-inject-slowdown" in c for c in pytest_calls) == 2
    assert sum(c.startswith("-m dslab.cli gate") for c in calls) == 4
    assert "selects no kernel benchmark" not in done.stderr
