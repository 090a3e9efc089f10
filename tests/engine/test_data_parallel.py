"""A real 2-process gloo run (torchrun) ends where one process on the full batch ends."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def run_worker(tmp_path, nproc, steps, micro, accum):
    out = tmp_path / f"result-{nproc}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, str(HERE / "dp_worker.py")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(nproc), str(HERE / "dp_worker.py")]
    proc = subprocess.run(cmd + [str(out), str(steps), str(micro), str(accum)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.world_size(2)
def test_two_gloo_ranks_match_one_process_on_full_batch(tmp_path):
    single = run_worker(tmp_path, 1, steps=4, micro=16, accum=1)
    double = run_worker(tmp_path, 2, steps=4, micro=4, accum=2)
    assert single["world"] == 1 and double["world"] == 2
    for key, value in single["params"].items():
        torch.testing.assert_close(double["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    # buckets of <= 100 elements split TinyNet's four tensors into four all-reduces per optimizer
    # step, and nothing is reduced off the accumulation boundary
    assert len(double["all_reduces"]) == 4 * 4
    total = sum(p.numel() for p in single["params"].values())
    assert sum(double["all_reduces"]) == 4 * total
    # the engine's comms logger (comms_logger.enabled) saw every gradient bucket, by size in bytes
    sizes = sorted(4 * n for n in set(double["all_reduces"]))
    assert sorted(int(s) for s in double["logged_all_reduces"]) == sizes
    assert sum(double["logged_all_reduces"].values()) == 16
