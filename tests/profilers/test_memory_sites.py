"""dslab.profilers.memory_sites: the blocks live at a trace's peak, summed by allocation site,
checked against a brute-force count on random traces."""

import random

import pytest

from dslab.profilers import memory_sites

SITES = [
    [{"filename": "/x/torch/nn/functional.py", "line": 10, "name": "linear"},
     {"filename": "/repo/dslab/engine/zero/param_offload.py", "line": 120, "name": "fetch"}],
    [{"filename": "/repo/dslab/engine/zero/offload.py", "line": 77, "name": "receive"}],
    [{"filename": "/repo/benchmarks/size_ladder.py", "line": 5, "name": "main"}],
]


def _trace(seed, n=400):
    """Random allocations and frees; some frees requested long before they complete."""
    rng = random.Random(seed)
    events, live, pending, sizes, reusable, next_addr = [], [], [], {}, [], 4096
    for _ in range(n):
        roll = rng.random()
        if roll < 0.5 or not live:
            size = rng.choice([512, 2**20, 3 * 2**20, 2**25])
            if reusable and rng.random() < 0.4:  # the allocator hands out a freed address again
                addr = reusable.pop(rng.randrange(len(reusable)))
            else:
                addr, next_addr = next_addr, next_addr + size
            events.append({"action": "alloc", "addr": addr, "size": size, "frames": rng.choice(SITES)})
            live.append(addr)
            sizes[addr] = size
        elif roll < 0.8:  # the allocator's free events carry the block's size too
            addr = live.pop(rng.randrange(len(live)))
            events.append({"action": "free_requested", "addr": addr, "size": sizes[addr]})
            if rng.random() < 0.5:
                events.append({"action": "free_completed", "addr": addr, "size": sizes[addr]})
                reusable.append(addr)
            else:
                pending.append(addr)
        elif pending:
            addr = pending.pop(0)
            events.append({"action": "free_completed", "addr": addr, "size": sizes[addr]})
            reusable.append(addr)
        else:
            events.append({"action": "segment_alloc", "addr": 0, "size": 2**30})
    return events


def _brute_force(events):
    best, best_live = 0, []
    for cut in range(len(events)):
        live = {}  # address -> (index of its alloc, the event)
        for index, event in enumerate(events[:cut + 1]):
            if event["action"] == "alloc":
                live[event["addr"]] = (index, event)
            elif event["action"] == "free_completed":
                live.pop(event["addr"], None)
        total = sum(e["size"] for _, e in live.values())
        if total > best:
            best, best_live = total, [e for _, e in sorted(live.values(), key=lambda pair: pair[0])]
    return best, best_live


@pytest.mark.parametrize("seed", range(5))
def test_the_peak_and_its_blocks_are_the_brute_force_count(seed):
    events = _trace(seed)
    peak, blocks = memory_sites.live_at_peak(events)
    want, want_blocks = _brute_force(events)
    assert peak == want > 0
    assert [b["addr"] for b in blocks] == [b["addr"] for b in want_blocks]
    rows = memory_sites.by_site(blocks)
    assert sum(r["bytes"] for r in rows) == peak and sum(r["blocks"] for r in rows) == len(blocks)
    assert [r["bytes"] for r in rows] == sorted((r["bytes"] for r in rows), reverse=True)


def test_a_block_counts_until_its_free_completes():
    frames = SITES[1]
    events = [{"action": "alloc", "addr": 1, "size": 100, "frames": frames},
              {"action": "free_requested", "addr": 1},  # a side stream still uses it
              {"action": "alloc", "addr": 2, "size": 60, "frames": frames},
              {"action": "free_completed", "addr": 1},
              {"action": "alloc", "addr": 3, "size": 90, "frames": frames}]
    peak, blocks = memory_sites.live_at_peak(events)
    assert peak == 160 and [b["addr"] for b in blocks] == [1, 2]


def test_sites_name_the_innermost_frame_in_the_named_tree():
    event = {"frames": SITES[0]}
    assert memory_sites.allocation_site(event) == "dslab/engine/zero/param_offload.py:120 fetch"
    assert memory_sites.allocation_site({"frames": SITES[2]}) == "/repo/benchmarks/size_ladder.py:5 main"
    assert memory_sites.allocation_site({"frames": SITES[2]}, within=("dslab/", "benchmarks/")) == \
        "benchmarks/size_ladder.py:5 main"
    assert memory_sites.allocation_site({}) == "(no frames recorded)"
    assert memory_sites.live_at_peak([]) == (0, [])


@pytest.mark.gpu
def test_a_real_trace_names_the_line_that_holds_the_peak():
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=10_000, context="alloc", stacks="python")
    try:
        held = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB, live at the peak
        passing = torch.empty(16 * 2**20, dtype=torch.uint8, device="cuda")
        del passing
        extra = torch.empty(32 * 2**20, dtype=torch.uint8, device="cuda")  # the peak: 96 MiB
        del extra
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks = memory_sites.live_at_peak(trace)
    assert peak >= 96 * 2**20
    rows = memory_sites.by_site(blocks, within=("tests/profilers/",))
    here = [r for r in rows if r["site"].startswith("tests/profilers/test_memory_sites.py")]
    assert sum(r["bytes"] for r in here) == 96 * 2**20 and len(here) == 2
    del held


def _live_after(events):
    """Address -> (size, index of its alloc) after ``events``."""
    live = {}
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], index)
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return live


@pytest.mark.parametrize("seed", range(5))
def test_blocks_from_before_the_trace_count_through_the_end_state(seed):
    """A trace that starts mid-run (the recording began late) with the snapshot's live blocks at
    its end: the peak and the blocks then are the full history's, the older blocks named as such."""
    full = _trace(100 + seed, n=600)
    cut = len(full) // 3
    trace, end = full[cut:], {addr: size for addr, (size, _) in _live_after(full).items()}
    best, best_live = -1, None
    for stop in range(cut - 1, len(full)):
        live = _live_after(full[:stop + 1])
        total = sum(size for size, _ in live.values())
        if total > best:
            best, best_live = total, live
    peak, blocks = memory_sites.live_at_peak(trace, live_at_end=end)
    assert peak == best and {b["addr"] for b in blocks} == set(best_live)
    before = [b for b in blocks if b.get("before_trace")]
    assert {b["addr"] for b in before} == {addr for addr, (_, index) in best_live.items() if index < cut}
    assert all(memory_sites.allocation_site(b) == "(allocated before the trace)" for b in before)
    assert sum(r["bytes"] for r in memory_sites.by_site(blocks)) == peak


def test_live_blocks_reads_a_snapshots_segments():
    snapshot = {"segments": [
        {"device": 0, "blocks": [{"address": 10, "size": 512, "state": "active_allocated"},
                                 {"address": 522, "size": 1024, "state": "inactive"},
                                 {"address": 1546, "size": 2048, "state": "active_pending_free"}]},
        {"device": 1, "blocks": [{"address": 99, "size": 512, "state": "active_allocated"}]}]}
    assert memory_sites.live_blocks(snapshot, 0) == {10: 512, 1546: 2048}
    assert memory_sites.live_blocks(snapshot, 1) == {99: 512}


def test_sites_at_peak_and_its_lines_from_a_snapshot():
    """The script-facing pair: a snapshot's trace (one block from before it, still live at the end)
    summed by site at its peak, and the lines printed for it."""
    frames = [{"filename": "/repo/dslab/models/graphs.py", "line": 180, "name": "capture"}]
    trace = [{"action": "alloc", "addr": 100, "size": 3 * 2**30, "frames": frames},
             {"action": "alloc", "addr": 200, "size": 2**30, "frames": SITES[1]},
             {"action": "free_requested", "addr": 200, "size": 2**30},
             {"action": "free_completed", "addr": 200, "size": 2**30}]
    snapshot = {"device_traces": [trace],
                "segments": [{"device": 0, "blocks": [{"address": 100, "size": 3 * 2**30, "state": "active_allocated"},
                                                      {"address": 50, "size": 2**29, "state": "active_allocated"}]}]}
    result = memory_sites.sites_at_peak(0, top=5, max_entries=4, snapshot=snapshot)
    assert result["peak_bytes"] == 4 * 2**30 + 2**29 and result["blocks"] == 3 and result["trace_full"]
    assert [(row["site"], row["bytes"]) for row in result["sites"]] == [
        ("dslab/models/graphs.py:180 capture", 3 * 2**30), ("dslab/engine/zero/offload.py:77 receive", 2**30),
        ("(allocated before the trace)", 2**29)]
    lines = memory_sites.format_sites(result)
    assert lines[0].startswith("live at the traced peak: 4.50 GiB in 3 blocks (the trace filled its entries")
    assert lines[1].split() == ["3.00", "GiB", "1", "blocks", "dslab/models/graphs.py:180", "capture"]
    assert memory_sites.sites_at_peak(1, snapshot=snapshot) == {"peak_bytes": 0, "blocks": 0, "sites": [],
                                                                 "trace_full": False}
