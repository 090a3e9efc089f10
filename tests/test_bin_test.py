"""``bin/test``'s two passes, run against a stand-in for the venv's python: the last line gives
both passes' totals, and the exit status is the first pass's failure, else the second's."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Prints what pytest prints at the end of each pass and exits with the pass's status.
FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in
  *"serial and not gpu"*) echo "serial threads: ${OMP_NUM_THREADS:-unset}"; echo "tests/test_timing.py ...";
                          echo "${SERIAL_TOTALS}"; exit "${SERIAL_RC}" ;;
  *) echo "main threads: ${OMP_NUM_THREADS:-unset}"; echo "main args: $*"; echo "bringing up nodes...";
     echo "=========== ${MAIN_TOTALS} ==========="; exit "${MAIN_RC}" ;;
esac
"""


@pytest.fixture
def checkout(tmp_path):
    """A copy of bin/test in a root whose bootstrap does nothing and whose venv python is the stand-in."""
    (tmp_path / "bin").mkdir()
    shutil.copy(REPO / "bin" / "test", tmp_path / "bin" / "test")
    (tmp_path / "bin" / "bootstrap").write_text("#!/usr/bin/env bash\nexit 0\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text(FAKE_PYTHON)
    for script in ("bin/test", "bin/bootstrap", ".venv/bin/python"):
        (tmp_path / script).chmod(0o755)
    return tmp_path


def run_bin_test(root: Path, main_rc: int, serial_rc: int, serial_totals: str = "19 passed in 2.31s", **extra):
    env = dict(os.environ, MAIN_RC=str(main_rc), SERIAL_RC=str(serial_rc), SERIAL_TOTALS=serial_totals,
               MAIN_TOTALS="1234 passed, 5 skipped, 2 warnings in 301.20s (0:05:01)", **extra)
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra)
    return subprocess.run([str(root / "bin" / "test"), "-q"], env=env, capture_output=True, text=True, timeout=60)


def test_the_last_line_gives_both_passes_totals(checkout):
    done = run_bin_test(checkout, 0, 0)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == ("bin/test: main pass: 1234 passed, 5 skipped, 2 warnings in 301.20s "
                                            "(0:05:01); serial pass: 19 passed in 2.31s")
    assert "bringing up nodes..." in done.stdout and "tests/test_timing.py ..." in done.stdout  # passed through


@pytest.mark.parametrize("main_rc, serial_rc, expected", [(1, 0, 1), (0, 1, 1), (2, 1, 2), (5, 0, 0), (5, 5, 5)])
def test_the_exit_status_is_either_pass_failing(checkout, main_rc, serial_rc, expected):
    done = run_bin_test(checkout, main_rc, serial_rc)
    assert done.returncode == expected
    assert done.stdout.splitlines()[-1].startswith("bin/test: main pass: 1234 passed")


def test_a_pass_without_totals_says_how_pytest_exited(checkout):
    done = run_bin_test(checkout, 0, 4, serial_totals="ERROR: usage: pytest [options]")
    assert done.returncode == 4
    assert done.stdout.splitlines()[-1].endswith("; serial pass: no totals (pytest exited 4)")


@pytest.mark.parametrize("extra, main, serial", [
    ({}, "1", "unset"),  # the workers' one thread each; the serial pass keeps torch's default
    ({"OMP_NUM_THREADS": "3"}, "3", "3"),  # a setting of the caller's is kept
    ({"DSLAB_TEST_WORKERS": "1"}, "unset", "unset"),  # one worker has the cores to itself
])
def test_the_main_pass_workers_run_one_intra_op_thread_each(checkout, extra, main, serial):
    done = run_bin_test(checkout, 0, 0, **extra)
    assert done.returncode == 0, done.stderr
    assert f"main threads: {main}" in done.stdout and f"serial threads: {serial}" in done.stdout


def test_the_main_pass_keeps_a_modules_tests_on_one_worker(checkout):
    """``--dist loadscope``: a module-scoped fixture that starts gloo processes runs once, not on both workers."""
    done = run_bin_test(checkout, 0, 0)
    (args,) = [line for line in done.stdout.splitlines() if line.startswith("main args: ")]
    assert "-n 2 --dist loadscope" in args and "-m not gpu and not serial -q" in args
