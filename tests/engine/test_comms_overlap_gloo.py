"""A real 2-process gloo run (torchrun) of ZeRO stages 0 and 2 with the comms logger on and small
buckets: every rank's records name each gradient bucket once, with its bytes, and place it against
the step's phase marks (overlap_worker.py)."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PHASES = ("forward_begin", "backward_begin", "backward_end", "optimizer_begin", "step_end")

pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap") / "rank0.pkl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "overlap_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage, op", [(0, "all_reduce"), (2, "reduce_scatter")])
def test_every_bucket_once_per_rank_with_its_bytes(run, stage, op):
    result = run[stage]
    overlap = result["records"]["overlap"]
    assert set(overlap["per_rank"]) == {"0", "1"}
    expected = result["bucket_bytes"]
    assert len(expected) >= 3  # the bucket size cuts the gradients
    for rank, record in overlap["per_rank"].items():
        assert record["clock"] == "host"
        assert record["step"] == 2  # the last step (0-based) ran the optimizer
        buckets = record["buckets"]
        assert sorted(b["bucket"] for b in buckets) == list(range(len(expected))), rank
        assert {b["op"] for b in buckets} == {op}
        assert {b["bucket"]: b["bytes"] for b in buckets} == dict(enumerate(expected))
        assert record["totals"]["bytes"] == sum(expected)
        assert record["totals"]["buckets"] == len(expected)
    if stage == 0:
        assert sum(expected) == result["param_bytes"]
    else:  # each unit's flat buffer is padded to a multiple of the world size
        assert result["param_bytes"] <= sum(expected) < result["param_bytes"] + 2 * 4 * len(expected)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", [0, 2])
def test_phases_ordered_and_buckets_inside_backward(run, stage):
    for rank, record in run[stage]["records"]["overlap"]["per_rank"].items():
        for key in ("phases_ms", "host_phases_ms"):
            marks = [record[key][p] for p in PHASES]
            assert marks == sorted(marks) and marks[0] == 0.0, (rank, key, marks)
        begin, end = record["host_phases_ms"]["backward_begin"], record["host_phases_ms"]["backward_end"]
        for b in record["buckets"]:
            # every parameter gets a gradient, so every bucket is issued from backward's hooks
            assert begin <= b["issue_ms"] <= end, (rank, b)
            assert b["issue_ms"] <= b["start_ms"] <= b["end_ms"]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", [0, 2])
def test_overlapped_plus_exposed_is_each_collectives_time(run, stage):
    for record in run[stage]["records"]["overlap"]["per_rank"].values():
        phases = record["phases_ms"]
        for b in record["buckets"]:
            assert b["comm_ms"] == pytest.approx(b["end_ms"] - b["start_ms"])
            assert b["overlapped_ms"] + b["exposed_ms"] == pytest.approx(b["comm_ms"])
            inside = max(0.0, min(b["end_ms"], phases["backward_end"]) - max(b["start_ms"], phases["backward_begin"]))
            assert b["overlapped_ms"] == pytest.approx(inside)
        totals = record["totals"]
        assert totals["overlapped_ms"] + totals["exposed_ms"] == pytest.approx(totals["comm_ms"])
        assert totals["backward_ms"] == pytest.approx(phases["backward_end"] - phases["backward_begin"])
        assert totals["comm_ms"] <= sum(b["comm_ms"] for b in record["buckets"]) + 1e-9
        assert totals["comm_ms"] >= max(b["comm_ms"] for b in record["buckets"])
