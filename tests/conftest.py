"""Test-wide set-up.

On a machine without CUDA, Triton kernels run under its interpreter: TRITON_INTERPRET must be set
before triton is first imported, so it is set here, before any test module loads.

Also without CUDA, Inductor's C++ kernels are generated scalar (``TORCHINDUCTOR_VEC_ISA_OK=0``,
read when ``torch._inductor.config`` is first imported, which no test module does at import
time). The tests that compile (the plain arms ``torch-compile`` and ``torch-compile-ro`` of the
suites' tiny scales, the models under ``torch.compile``) check what compiled code computes, not
its speed, and g++ takes about half as long without the vector headers: on a 2-core machine with
an empty Inductor cache, the tiny Evoformer's forward and backward compile in 62 s instead of 101.
Set in the environment, it reaches the tests' subprocesses too.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def torchrun():
    """``torchrun(worker, *args, nprocs=2, timeout=300)``: run the script ``worker`` on ``nprocs``
    local processes (gloo on a CPU, one thread each) with ``args``; fails the test with the tail of
    its standard error unless every process exits 0. Returns the finished process."""
    import subprocess
    import sys

    def run(worker, *args, nprocs: int = 2, timeout: int = 300):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs),
               str(worker), *map(str, args)]
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    return run
