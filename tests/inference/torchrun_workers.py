"""Runs a test worker script under ``torch.distributed.run`` on CPU (gloo) and reads back what each
rank pickled to ``<out_dir>/rank<r>.pkl``: the tensor-parallel tests' launcher."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path


def run_workers(worker: Path, out_dir: Path, nprocs: int = 2, timeout: float = 300) -> list[dict]:
    """``worker`` on ``nprocs`` processes with ``out_dir`` as its argument; each rank's results,
    in rank order. Fails the test with the processes' stderr when they fail."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs),
           str(worker), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = []
    for rank in range(nprocs):
        with open(out_dir / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results
