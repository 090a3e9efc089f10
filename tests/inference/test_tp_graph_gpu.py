"""On two GPUs (torchrun, NCCL): the tensor-parallel per-token step captured in a CUDA graph, its
all_reduces inside the graph, gives the eager step's greedy tokens (fp32), and the comms logger
counts the step's all_reduces once per replay, untimed, and not at capture (tp_graph_worker.py).

Per generation of N tokens the logger counts 2 all_reduces per layer for the prompt (eager) and
for each step; the first graphed generation also runs the step eagerly WARMUP_RUNS times before
it captures.

    python3 -m pytest -q -m gpu tests/inference/test_tp_graph_gpu.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

HERE = Path(__file__).parent
NEW_TOKENS = 8  # tp_graph_worker.py's
# NVLink multicast (NVLS) off: NCCL's NVLS buffers and torch's symmetric memory need fabric
# resources a shared machine may not grant
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tp2-graphs")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning", **NO_MULTICAST)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "tp_graph_worker.py"), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def _check_calls(run: dict, layers: int, eager_steps: int, label: str) -> None:
    """``run``'s logged collectives: 2 all_reduces per layer for the prompt, for each of
    ``eager_steps`` eager runs of the step and for each replay; replays untimed, the rest timed;
    per-(group, op) seqs 0, 1, ... in order."""
    calls, replays = run["calls"], run["added"].get("replays", 0)
    assert {c["op"] for c in calls} == {"all_reduce"}, label
    assert len(calls) == 2 * layers * (1 + eager_steps + replays), label
    assert [c["seq"] for c in calls] == list(range(len(calls))), label
    replayed = [c for c in calls if c["graph_replay"]]
    assert len(replayed) == 2 * layers * replays, label
    assert not any(c["timed"] for c in replayed), label
    assert all(c["timed"] for c in calls if not c["graph_replay"]), label


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices: one per tensor-parallel rank over NCCL")
def test_tp2_step_in_cuda_graphs_equals_eager_and_logs_each_replay(two_ranks):
    for result in two_ranks:
        label = f"rank {result['rank']}"
        layers, first, second, eager = result["layers"], result["first"], result["second"], result["eager"]
        assert result["tp_size"] == 2, label
        assert not any("runs eagerly" in note for note in result["notes"]), (label, result["notes"])
        assert first["tokens"] == eager["tokens"] == second["tokens"], label
        assert first["added"] == {"captures": 1, "replays": NEW_TOKENS - 1}, label
        assert second["added"] == {"captures": 0, "replays": NEW_TOKENS - 1}, label
        assert result["stats"]["captures"] >= 1 and result["stats"]["replays"] >= 1, label
        assert result["eager_stats"] == {"eager (graphs off)": NEW_TOKENS - 1}, label
        _check_calls(eager, layers, eager_steps=NEW_TOKENS - 1, label=f"{label}, eager")
        _check_calls(first, layers, eager_steps=result["warmup_runs"], label=f"{label}, first graphed")
        _check_calls(second, layers, eager_steps=0, label=f"{label}, second graphed")
    # every rank replays the same graph: the same collectives under the same seqs
    for run in ("first", "second"):
        assert ([(c["seq"], c["bytes"], c["graph_replay"]) for c in two_ranks[0][run]["calls"]]
                == [(c["seq"], c["bytes"], c["graph_replay"]) for c in two_ranks[1][run]["calls"]]), run
    assert two_ranks[0]["first"]["tokens"] == two_ranks[1]["first"]["tokens"]
