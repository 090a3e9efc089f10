"""A real 3-process gloo run (torchrun) with a straggler: the comms logger names it, counts each
collective, and reports latencies per call."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from comms_worker import ALL_GATHERS, ALL_REDUCES, BROADCASTS, SLEEP_S  # noqa: E402

SLEEP_MS = SLEEP_S * 1e3


# The module's tests share one run whose straggler is a rank's sleep against the others' waits.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("comms") / "rank0.pkl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
           str(HERE / "comms_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, "rb") as f:
        result = pickle.load(f)
    result["stdout"] = proc.stdout
    return result


@pytest.mark.world_size(3)
def test_straggler_is_named(run):
    summary = run["summary"]
    assert run["world"] == 3 and run["all_reduce_result"] == 3.0 ** ALL_REDUCES
    assert summary["stragglers"] == [1]
    ranks = summary["straggler"]["ranks"]
    assert ranks[1]["times_last"] >= ALL_REDUCES + ALL_GATHERS
    assert ranks[1]["ops"]["all_reduce"]["last_fraction"] == 1.0
    for waiting in (0, 2):
        assert ranks[waiting]["ops"]["all_reduce"]["mean_wait_ms"] > 0.7 * SLEEP_MS
        assert ranks[waiting]["ops"]["all_gather"]["mean_wait_ms"] > 0.7 * SLEEP_MS
    assert ranks[1]["ops"]["all_reduce"]["mean_wait_ms"] < 0.2 * SLEEP_MS
    assert summary["straggler"]["matched"] == ALL_REDUCES + ALL_GATHERS + BROADCASTS
    assert summary["straggler"]["unmatched"] == 0
    assert "stragglers (last in > 50%" in run["stdout"] and "): 1;" in run["stdout"]


@pytest.mark.world_size(3)
def test_counts_sizes_and_per_call_latency(run):
    summary = run["summary"]
    ops = {k: v for k, v in summary.items() if k not in ("stragglers", "straggler")}
    # the logger's own barriers and gathers are not logged
    assert {op: {size: s["count"] for size, s in sizes.items()} for op, sizes in ops.items()} == {
        "all_reduce": {4000: ALL_REDUCES}, "all_gather": {3 * 256 * 4: ALL_GATHERS},
        "broadcast": {1536: BROADCASTS}}
    rank0 = run["records"]["per_rank"]["0"]
    latencies = [r["latency_ms"] for r in rank0 if r["op"] == "all_reduce"]
    assert len(latencies) == ALL_REDUCES
    # rank 0 waits ~SLEEP_MS for rank 1 at every call; an accumulating logger would report
    # k * SLEEP_MS for the k-th call
    assert all(0.7 * SLEEP_MS < lat < 3 * SLEEP_MS for lat in latencies), latencies
    ar = summary["all_reduce"][4000]
    assert ar["total_latency_ms"] == pytest.approx(sum(latencies))
    assert ar["avg_latency_ms"] == pytest.approx(sum(latencies) / ALL_REDUCES)
    per_call_gbps = [8 * 4000 / (lat / 1e3) / 1e9 for lat in latencies]
    assert ar["algbw_gbps"] == pytest.approx(sum(per_call_gbps) / ALL_REDUCES)
    assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"] * 2 * 2 / 3)
    gathers = [r["latency_ms"] for r in rank0 if r["op"] == "all_gather"]
    assert all(0.7 * SLEEP_MS < lat < 3 * SLEEP_MS for lat in gathers), gathers  # async, timed
    assert summary["broadcast"][1536]["avg_latency_ms"] < SLEEP_MS


@pytest.mark.world_size(3)
def test_records_for_the_report(run):
    records = run["records"]
    assert records["stragglers"] == [1]
    assert set(records["per_rank"]) == {"0", "1", "2"}
    for recs in records["per_rank"].values():
        assert [r["seq"] for r in recs if r["op"] == "all_reduce"] == list(range(ALL_REDUCES))
        assert all(r["group"] == "0,1,2" and r["group_size"] == 3 for r in recs)
    assert set(records["clock_offsets_ns"]) == {"0", "1", "2"}
    assert all(abs(o) < 50e6 for o in records["clock_offsets_ns"].values())  # one host
    assert records["straggler"]["ranks"]["1"]["last_fraction"] > 0.5
