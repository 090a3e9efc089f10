"""benchmarks/zero_scaling.sh end to end on CPU (gloo, gpt2_tiny, 1 and 2 processes): the rows
each arm writes, model states beside the estimate, and the weak-scaling table, so the multi-GPU
run cannot break unnoticed between lent sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.world_size(2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero-scaling")
    env = dict(os.environ, ZERO_SCALING_NPROCS="1 2", ZERO_SCALING_OUT=str(out),
               PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = ["bash", str(REPO / "benchmarks" / "zero_scaling.sh"), "--tiny", "--stages", "0,2,3,2o",
           "--granularity", "20000", "--reuse", "0", "--warmup", "2", "--steps", "1", "--trials", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, {n: json.loads((out / f"world{n}.json").read_text()) for n in (1, 2)}


LABELS = ["0", "2", "3", "3/r0", "3/g2e+04/r0", "3/g2e+04", "2+off"]


def test_every_arm_writes_a_row_per_world_size(run):
    _, worlds = run
    for n, data in worlds.items():
        assert data["world_size"] == n and data["tiny"] is True
        assert [row["label"] for row in data["rows"]] == LABELS
        for row in data["rows"]:
            assert len(row["trials_ms"]) == 2 and row["step_time_ms"] > 0
            assert row["tokens_per_s"] == pytest.approx(2 * 64 * n / (row["step_time_ms"] / 1e3))


def test_model_states_sit_beside_the_estimate(run):
    _, worlds = run
    for n, data in worlds.items():
        for row in data["rows"]:
            assert 0.9 <= row["ratio"] <= 1.1, (n, row["label"], row["ratio"])
            if row["offload"]:
                assert row["cpu_measured"] == pytest.approx(row["cpu_estimate"], rel=0.1)
            else:
                assert row["cpu_measured"] is None


def test_the_weak_scaling_table_lists_every_arm(run):
    stdout, _ = run
    table = stdout[stdout.index("weak scaling"):]
    assert "N=1 tok/s" in table and "N=2 tok/s" in table
    for label in LABELS:
        assert any(line.split()[0] == label for line in table.splitlines()[3:] if line.strip()), label


def test_one_warm_up_step_is_refused():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "zero_scaling.py"), "--tiny",
                           "--warmup", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--warmup must be >= 2" in proc.stderr
