"""pytest-benchmark to ``dslab gate --pytest-benchmark``, end to end on a CPU.

A tiny benchmark file is run by pytest-benchmark in three processes, one after another (a
baseline, a rerun, and a candidate whose calls each sleep 2 ms more), each writing
``--benchmark-json`` with ``--benchmark-save-data``, as the GPU kernel benchmarks' CI job does; the gate passes the rerun and
fails the slowed candidate. The file times plain Python so that each process starts in about a
second (importing torch would take several), and each call sleeps 1 ms: identical processes on
CI's two shared cores timed a ~15 us pure-Python call with medians from 11 to 18 us, while a
sleeping call's median moves by a few percent; how the kernel benchmarks time the device inside
pytest-benchmark is tested in ``tests/benchmarks_kernels``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslab import cli

pytest.importorskip("pytest_benchmark")


pytestmark = pytest.mark.serial  # timed calls; and pytest-benchmark turns itself off under xdist

ROUNDS = 20
BENCH_FILE = f"""
import os
import time

SLEEP_S = float(os.environ.get("SLOW_MS", "0")) / 1e3


def small_op():
    sum(i * i for i in range(300))
    time.sleep(1e-3 + SLEEP_S)


def test_small_op(benchmark):
    benchmark.group = "sum of squares"
    benchmark.pedantic(small_op, rounds={ROUNDS}, iterations=5, warmup_rounds=2)
"""


def _start(tmp_path: Path, name: str, slow_ms: float = 0.0) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "SLOW_MS": str(slow_ms), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "test_tiny_bench.py", "-q", "-c", "pytest.ini", "-p", "no:cacheprovider",
               "-p", "no:dash", f"--benchmark-json={out}", "--benchmark-save-data"]
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True), out


def _finish(process: subprocess.Popen, out: Path) -> str:
    stdout, _ = process.communicate(timeout=120)
    assert process.returncode == 0 and out.is_file(), stdout
    return str(out)


def _gate(capsys, base: str, candidate: str) -> tuple[int, list[dict]]:
    # A wide threshold: the runs share a CPU whose speed wanders; the statistics themselves are
    # validated on synthetic noise in test_verdict.py.
    code = cli.main(["gate", "--pytest-benchmark", base, candidate, "--threshold", "50%", "--format", "json"])
    return code, json.loads(capsys.readouterr().out)["rows"]


def test_gate_passes_a_rerun_and_fails_a_slowed_candidate(tmp_path, capsys):
    (tmp_path / "test_tiny_bench.py").write_text(BENCH_FILE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    # One process at a time: run side by side on CI's two cores, three processes timed each other's
    # contention (a rerun once measured +90% against its base).
    base, rerun, slow = (_finish(*_start(tmp_path, name, slow_ms)) for name, slow_ms in
                         (("base", 0.0), ("rerun", 0.0), ("slow", 2.0)))
    for path in (base, rerun, slow):
        (bench,) = json.loads(Path(path).read_text())["benchmarks"]
        assert bench["fullname"] == "test_tiny_bench.py::test_small_op" and len(bench["stats"]["data"]) == ROUNDS

    code, rows = _gate(capsys, base, rerun)
    assert code == 0 and [(r["case"], r["arm"], r["verdict"]) for r in rows] == [
        ("test_tiny_bench.py::test_small_op", "sum of squares", "pass")], rows

    code, rows = _gate(capsys, base, slow)
    assert code == 1 and len(rows) == 1, rows
    assert rows[0]["verdict"] == "regression" and rows[0]["metric"] == "time" and rows[0]["ratio"] > 2, rows
    assert rows[0]["reason"].startswith("worse"), rows
