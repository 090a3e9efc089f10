"""``benchmarks/gate_detection.py``: the calibration of the injected step sleep (on simulated
devices that swallow part of a spin) and one end-to-end session on the CPU with real workers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gate_detection", REPO / "benchmarks" / "gate_detection.py")
gate_detection = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gate_detection)


def _device(step_ms: float, idle_ms: float, share: float, noise: float = 0.0, seed: int = 0):
    """A device whose step is ``step_ms``: a sleep first fills ``idle_ms`` of idle time for free,
    and only ``share`` of the rest lengthens the step; ``measure`` returns the throughput drop."""
    rng = np.random.default_rng(seed)
    calls = []

    def measure(sleep_ms: float):
        longer = share * max(0.0, sleep_ms - idle_ms)
        drop = 1.0 - step_ms / (step_ms + longer) + rng.normal(0.0, noise)
        calls.append(sleep_ms)
        return drop, f"worker {len(calls)}"
    return measure, calls


@pytest.mark.parametrize("idle_ms, share", [(0.0, 1.0), (0.3, 1.0), (0.0, 0.6), (0.25, 0.5), (1.0, 0.8)])
def test_calibration_reaches_the_target_where_a_spin_is_partly_absorbed(idle_ms, share):
    step = 31.7
    measure, calls = _device(step, idle_ms, share)
    sleep, handle, tried = gate_detection.calibrate_sleep(measure, 0.02, 0.02 * step)
    final_drop = tried[-1][1]
    assert abs(final_drop - 0.02) <= 0.002, tried
    assert handle == f"worker {len(calls)}" and sleep == calls[-1] and len(tried) == len(calls) <= 4
    if idle_ms == 0.0 and share == 1.0:
        assert len(tried) == 1  # a spin that lands whole is accepted as first computed


def test_next_sleep_steps():
    # proportional from one point, doubling when nothing was measured, bounded to [1/4, 4] x the last
    assert gate_detection.next_sleep([(1.0, 0.01)], 0.02) == pytest.approx(2.0)
    assert gate_detection.next_sleep([(1.0, 0.0)], 0.02) == pytest.approx(2.0)
    assert gate_detection.next_sleep([(1.0, 0.001)], 0.02) == pytest.approx(4.0)
    assert gate_detection.next_sleep([(1.0, 0.5)], 0.02) == pytest.approx(0.25)
    # a secant through the last two points finds the offset line's crossing
    assert gate_detection.next_sleep([(1.0, 0.01), (2.0, 0.03)], 0.02) == pytest.approx(1.5)
    # a falling pair (noise) falls back to the proportional step from the last point
    assert gate_detection.next_sleep([(1.0, 0.03), (2.0, 0.01)], 0.02) == pytest.approx(4.0)


def test_noisy_measurements_keep_the_closest_try_after_the_last_attempt():
    measure, calls = _device(31.7, 0.3, 0.7, noise=0.02, seed=5)
    sleep, handle, tried = gate_detection.calibrate_sleep(measure, 0.02, 0.6, attempts=3)
    assert len(tried) <= 3
    closest = min(range(len(tried)), key=lambda i: abs(tried[i][1] - 0.02))
    if abs(tried[-1][1] - 0.02) > 0.002:  # not accepted: the closest of the tries is kept
        assert len(tried) == 3 and sleep == tried[closest][0] and handle == f"worker {closest + 1}"


@pytest.mark.serial  # real workers, timed
def test_one_session_on_the_cpu_records_its_calibration(tmp_path):
    out = tmp_path / "detection.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/gate_detection.py", "--suite", "suites/gpt2", "--case", "124m", "--sessions", "1",
         "--repeats", "1", "--slowdown", "0.5", "--threshold", "0.3", "--inject-mode", "host", "--calibrate-pairs", "2",
         "--logs", str(tmp_path / "logs"), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    session = json.loads(out.read_text())["sessions"][0]
    calibration = session["calibration"]
    assert 1 <= len(calibration) <= 4 and all(row["sleep_ms"] > 0 for row in calibration)
    assert session["sleep_ms"] in [row["sleep_ms"] for row in calibration]
    assert len(list((tmp_path / "logs").glob("s0_slow_*.log"))) == len(calibration)
    assert "calibration: sleep" in run.stdout and len(session["aa"]) == len(session["injected"]) == 1
    (row,) = [line.split() for line in run.stdout.splitlines() if line.startswith("injected ")]
    chosen = next(r["measured_slowdown"] for r in calibration if r["sleep_ms"] == session["sleep_ms"])
    assert row[1] == "1" and row[-1] == f"{chosen:.2%}"  # runs, and the chosen sleep's calibrated slowdown
