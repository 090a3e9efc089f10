"""Expert parallelism on real gloo process groups (torchrun, 2 and 4 ranks): an ep_size 2 or 4
layer with 8 experts gives each rank what an ep_size 1 layer holding all experts gives on that
rank's tokens (output, l_aux, exp_counts, input and gate gradients), its expert gradients are the
sums over the expert-parallel group, and the engine's rule (sum over the expert-data-parallel
group, divide by the world) gives the world-mean gradient. The comms observer sees the all_to_all
calls: equal splits for capacity, counts then split sizes for dropless (moe_layer_ep_worker.py)."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from moe_layer_ep_worker import EXPERTS, H, TOKENS  # noqa: E402


def _launch(nproc, out_dir, backend="gloo"):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning", MOE_EP_BACKEND=backend)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE / "moe_layer_ep_worker.py"), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = []
    for rank in range(nproc):
        with open(out_dir / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(2, tmp_path_factory.mktemp("moe-ep2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(4, tmp_path_factory.mktemp("moe-ep4"))


def _check_equal_to_ep1(results, device_type="cpu"):
    for rank, cases in enumerate(results):
        for result in cases:
            label = f"rank {rank}, {result['case']}"
            assert result["counts_equal"] and result["on_device"] == device_type, label
            bad = {name: err for name, err in result["errors"].items() if err > 2e-5 * result["scale"]}
            assert not bad, f"{label}: {bad}"
            assert len(result["errors"]) > 4, label  # the expert gradients were compared


def _check_calls(results):
    for rank, cases in enumerate(results):
        for result in cases:
            case, calls = result["case"], result["calls"]
            label = f"rank {rank}, {case}"
            assert all(c["group_size"] == case["ep_size"] for c in calls), label
            if case["drop_tokens"]:
                # dispatch and combine forward, their two gradient exchanges backward: equal splits
                assert len(calls) == 4 and not any("input_split_sizes" in c for c in calls), label
                assert len({c["numel"] for c in calls}) == 1 and calls[0]["numel"] % (EXPERTS * H) == 0, label
            else:
                counts, *rows = calls
                assert counts["numel"] == EXPERTS and counts["dtype"] == "torch.int64", label
                assert len(rows) == 4 and all(len(c["input_split_sizes"]) == case["ep_size"] for c in rows), label
                dispatch = rows[0]
                assert sum(dispatch["input_split_sizes"]) == result["kept_rows"] == TOKENS * case["k"], label
                assert dispatch["numel"] == result["kept_rows"] * H, label
                combine = rows[1]
                assert combine["input_split_sizes"] == dispatch["output_split_sizes"], label
                assert combine["output_split_sizes"] == dispatch["input_split_sizes"], label


@pytest.mark.world_size(2)
def test_ep2_equals_ep1(two_ranks):
    _check_equal_to_ep1(two_ranks)


@pytest.mark.world_size(2)
def test_ep2_all_to_all_calls(two_ranks):
    _check_calls(two_ranks)


@pytest.mark.world_size(4)
def test_ep4_and_ep2_of_four_ranks_equal_ep1(four_ranks):
    _check_equal_to_ep1(four_ranks)


@pytest.mark.world_size(4)
def test_ep4_all_to_all_calls(four_ranks):
    _check_calls(four_ranks)
