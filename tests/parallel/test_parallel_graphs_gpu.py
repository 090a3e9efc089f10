"""On 2 GPUs (nccl): the CUDA-graphed layer stack with the collectives of tensor and sequence
parallelism inside it (:mod:`dslab.models.graphs`) trains GPT-2 tiny as the eager stack does, and
the comm layer's observers see a graphed step's collectives as they see an eager step's
(parallel_graphs_worker.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel_graphs")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "parallel_graphs_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_graphed_stack_trains_as_the_eager_one(ranks, layout):
    for result in ranks:
        run = result[layout]
        assert run["stats"].get("captures") == 1 and run["stats"].get("replays", 0) >= 3, run["stats"]
        # bf16: the same kernels on the same buffers, replayed; the losses fall
        torch.testing.assert_close(torch.tensor(run["graphed_losses"]), torch.tensor(run["eager_losses"]),
                                   rtol=2e-3, atol=2e-3)
        assert run["eager_losses"][-1] < run["eager_losses"][0]
        assert run["max_param_diff"] < 5e-3


@pytest.mark.parametrize("layout, op", [("tp", "all_reduce"), ("sp", "all_to_all")])
def test_a_graphed_step_announces_the_collectives_an_eager_step_issues(ranks, layout, op):
    for result in ranks:
        run = result[layout]
        eager, graphed = run["eager_per_step"][-1], run["graphed_per_step"][-1]
        assert eager.get(op, 0) > 0
        assert graphed == eager, (graphed, eager)
