"""The comms logger's figures on hand-made records: nccl-tests' bandwidths, DeepSpeed's summary
table, and the straggler analysis (records matched across ranks, never by position)."""

import random
import re
from collections import defaultdict

import pytest

from dslab.profilers.comms_analysis import (
    analyze_stragglers,
    bandwidth,
    bus_factor,
    clock_offsets,
    summarize,
    summary_rows,
)
from dslab.profilers.comms_format import format_stragglers, format_summary, human_size

# nccl-tests PERFORMANCE.md, written out per op
NCCL_TESTS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


@pytest.mark.parametrize("op", sorted(NCCL_TESTS_FACTOR))
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_bandwidth_follows_nccl_tests(op, n):
    rng = random.Random(hash((op, n)))
    nbytes = rng.randrange(1, 1 << 30)
    latency_ms = rng.uniform(0.01, 100.0)
    algbw, busbw = bandwidth(op, nbytes, latency_ms, n)
    assert algbw == pytest.approx(nbytes / (latency_ms / 1000) / 1e9, rel=1e-12)
    assert busbw == pytest.approx(algbw * NCCL_TESTS_FACTOR[op](n), rel=1e-12, abs=1e-15)
    assert bus_factor(op, n) == pytest.approx(NCCL_TESTS_FACTOR[op](n))


def test_bandwidth_undefined_without_payload_or_time():
    assert bandwidth("barrier", 0, 1.0, 4) == (None, None)
    assert bandwidth("all_gather_object", 0, 1.0, 4) == (None, None)
    assert bandwidth("all_reduce", 1024, None, 4) == (None, None)
    assert bandwidth("all_reduce", 1024, 0.0, 4) == (None, None)
    with pytest.raises(ValueError, match="group_size"):
        bus_factor("all_reduce", 0)


def test_human_size():
    assert human_size(0) == "0.00 B"
    assert human_size(1536) == "1.50 KB"
    assert human_size(2048) == "2.00 KB"
    assert human_size(int(678.86 * 2**20)) == "678.86 MB"
    assert human_size(3 * 2**30) == "3.00 GB"


def _rec(op, nbytes, latency_ms, group_size=4, **kw):
    return {"op": op, "bytes": nbytes, "latency_ms": latency_ms, "group_size": group_size, **kw}


def _split(line):
    return [cell for cell in re.split(r"\s{2,}", line) if cell]


def test_summary_is_per_call_and_laid_out_like_deepspeed():
    records = [
        _rec("all_reduce", 10**6, 1.0), _rec("all_reduce", 10**6, 3.0),
        _rec("all_reduce", 10**6, None),  # counted, not timed
        _rec("broadcast", 1536, 0.5, group_size=2),
        _rec("barrier", 0, 0.25),
    ]
    summary = summarize(records)
    ar = summary["all_reduce"][10**6]
    assert ar["count"] == 3 and ar["timed_count"] == 2
    assert ar["total_latency_ms"] == pytest.approx(4.0)
    assert ar["avg_latency_ms"] == pytest.approx(2.0)
    # mean of each call's rate (1 and 1/3 GB/s), not total bytes / total time (0.5 GB/s)
    per_call = [10**6 / (lat / 1e3) / 1e9 for lat in (1.0, 3.0)]
    assert ar["algbw_GBps"] == pytest.approx(sum(per_call) / 2)
    assert ar["algbw_gbps"] == pytest.approx(8 * sum(per_call) / 2)
    assert ar["busbw_gbps"] == pytest.approx(8 * sum(per_call) / 2 * 1.5)
    bc = summary["broadcast"][1536]
    assert bc["algbw_gbps"] == pytest.approx(8 * 1536 / 0.5e-3 / 1e9)
    assert bc["busbw_gbps"] == pytest.approx(bc["algbw_gbps"])
    assert summary["barrier"][0]["algbw_gbps"] is None

    lines = format_summary(summary).splitlines()
    assert _split(lines[0]) == ["Comm. Op", "Message Size", "Count", "Total Latency(ms)",
                                "Avg Latency(ms)", "tput_avg (Gbps)", "busbw_avg (Gbps)"]
    assert lines[1] == "all_reduce"
    assert _split(lines[2]) == ["976.56 KB", "3", "4.00", "2.00", f"{8 * sum(per_call) / 2:.2f}",
                                f"{12 * sum(per_call) / 2:.2f}"]
    assert lines[3] == "barrier"
    assert _split(lines[4]) == ["0.00 B", "1", "0.25", "0.25", "-", "-"]
    assert lines[5] == "broadcast"
    assert _split(lines[6])[:4] == ["1.50 KB", "1", "0.50", "0.50"]

    rows = summary_rows(summary)
    assert [(r["op"], r["size_bytes"]) for r in rows] == [("all_reduce", 10**6), ("barrier", 0),
                                                         ("broadcast", 1536)]


def test_summary_by_caller_splits_rows():
    records = [_rec("all_reduce", 64, 1.0, caller="a.py:1 (f)"),
               _rec("all_reduce", 64, 1.0, caller="b.py:2 (g)")]
    assert set(summarize(records, by_caller=True)) == {"all_reduce | [Caller: a.py:1 (f)]",
                                                       "all_reduce | [Caller: b.py:2 (g)]"}
    assert set(summarize(records)) == {"all_reduce"}


GROUPS = [("0,1,2,3", "all_reduce", 4096), ("0,1,2,3", "all_gather", 8192),
          ("0,1", "broadcast", 512), ("2,3", "all_reduce", 2048)]


def synthetic(slow=None, delay_ms=5.0, n=40, skew_ns=None, seed=0):
    """Per-rank records of ``n`` collectives over 4 ranks and 3 groups; ``slow`` arrives
    ``delay_ms`` late; ``skew_ns[rank]`` is added to that rank's clock. Each rank's list is
    shuffled. Returns (per_rank, truth) with truth = [(group, op, bytes, {rank: true arrival})]."""
    rng = random.Random(seed)
    skew_ns = skew_ns or {}
    per_rank, truth, seqs = defaultdict(list), [], defaultdict(int)
    for i in range(n):
        group, op, nbytes = GROUPS[i % len(GROUPS)]
        members = [int(x) for x in group.split(",")]
        seq = seqs[(group, op)]
        seqs[(group, op)] += 1
        base = 10**12 + i * 10**8
        arrivals = {r: base + int(rng.uniform(0, 0.2) * 1e6) + (int(delay_ms * 1e6) if r == slow else 0)
                    for r in members}
        start = max(arrivals.values())
        truth.append((group, op, nbytes, arrivals))
        for r in members:
            per_rank[r].append({"op": op, "group": group, "group_size": len(members), "seq": seq,
                                "bytes": nbytes, "arrival_ns": arrivals[r] + skew_ns.get(r, 0),
                                "latency_ms": 0.3 + (start - arrivals[r]) / 1e6})
    for records in per_rank.values():
        rng.shuffle(records)
    return dict(per_rank), truth


def expected_waits(truth):
    waits, last = defaultdict(list), defaultdict(int)
    for _, _, _, arrivals in truth:
        start = max(arrivals.values())
        for r, t in arrivals.items():
            waits[r].append((start - t) / 1e6)
        last[max(arrivals, key=arrivals.get)] += 1
    return waits, last


def test_straggler_named_from_shuffled_records():
    per_rank, truth = synthetic(slow=2)
    result = analyze_stragglers(per_rank)
    assert result["stragglers"] == [2]
    assert result["matched"] == 40 and result["unmatched"] == 0
    waits, last = expected_waits(truth)
    for r in range(4):
        s = result["ranks"][r]
        assert s["collectives"] == len(waits[r])
        assert s["total_wait_ms"] == pytest.approx(sum(waits[r]))
        assert s["mean_wait_ms"] == pytest.approx(sum(waits[r]) / len(waits[r]))
        assert s["max_wait_ms"] == pytest.approx(max(waits[r]))
        assert s["times_last"] == last[r]
    assert result["ranks"][2]["last_fraction"] == 1.0
    assert result["ranks"][2]["mean_caused_wait_ms"] > 4.5
    assert result["ranks"][0]["ops"]["all_reduce"]["mean_wait_ms"] > 4.5
    # DeepSpeed's view: comm latency = the fastest member's (0.3 ms); straggler = the rest
    row = result["by_op_size"]["all_reduce"][4096]
    assert row["count"] == 10
    assert row["avg_comm_latency_ms"] == pytest.approx(0.3)
    full = [w for g, o, _, a in truth if (g, o) == ("0,1,2,3", "all_reduce")
            for w in [(max(a.values()) - a[0]) / 1e6]]
    assert row["straggler_ms"][0] == pytest.approx(sum(full))
    text = format_stragglers(result, rank=0)
    assert "stragglers (last in > 50% of their collectives, others waiting >= 1 ms): 2" in text


def test_position_matching_would_fail_on_these_records():
    """The fixture defeats list-position matching: the same position holds different
    collectives on different ranks."""
    per_rank, _ = synthetic(slow=2)
    first = {r: (recs[0]["group"], recs[0]["op"], recs[0]["seq"]) for r, recs in per_rank.items()}
    assert len(set(first.values())) > 1


def test_no_straggler_when_balanced():
    per_rank, _ = synthetic(slow=None)
    result = analyze_stragglers(per_rank)
    assert result["stragglers"] == []
    assert all(s["mean_wait_ms"] < 0.2 for s in result["ranks"].values())


def test_clock_offsets_correct_skewed_clocks():
    skew = {3: 10**9}  # rank 3's clock runs 1 s ahead
    per_rank, _ = synthetic(slow=2, skew_ns=skew)
    assert analyze_stragglers(per_rank)["stragglers"] == [3]  # misread without the offsets
    stamps = {r: [5 * 10**12 + k * 10**6 + skew.get(r, 0) + (r * 7 % 3) * 1000 for k in range(5)]
              for r in range(4)}
    offsets = clock_offsets(stamps)
    assert offsets[0] == 0 and abs(offsets[3] - 10**9) < 10_000
    result = analyze_stragglers(per_rank, offsets)
    assert result["stragglers"] == [2]
    assert result["offsets_ns"][3] == offsets[3]


def test_missing_record_is_unmatched_and_duplicates_refused():
    per_rank, _ = synthetic(slow=2)
    dropped = per_rank[1].pop()
    result = analyze_stragglers(per_rank)
    assert result["unmatched"] == 1 and result["matched"] == 39
    per_rank[1].append(dropped)
    per_rank[1].append(dict(dropped))
    with pytest.raises(ValueError, match=r"per_rank\[1\]"):
        analyze_stragglers(per_rank)


def test_straggler_thresholds():
    per_rank, _ = synthetic(slow=2, delay_ms=0.5)  # last every time but only 0.5 ms late
    assert analyze_stragglers(per_rank)["stragglers"] == []
    assert analyze_stragglers(per_rank, min_wait_ms=0.2)["stragglers"] == [2]
    with pytest.raises(ValueError, match="last_fraction"):
        analyze_stragglers(per_rank, last_fraction=1.0)
