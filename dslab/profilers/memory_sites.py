"""What is allocated at a CUDA memory peak, by the code that allocated it.

``torch.cuda.memory._record_memory_history`` keeps a trace of the caching allocator's events
(``alloc``, ``free_requested``, ``free_completed``, with the Python frames of each allocation);
``torch.cuda.memory._snapshot()["device_traces"]`` hands it back. :func:`live_at_peak` replays
one device's trace and returns the blocks live at the moment their total was highest, and
:func:`by_site` sums them by allocation site: the innermost frame inside the files a caller
names (dslab's own, by default), so a peak reads as "the parameter home's fetch buffers, the
offload's gradient shards, the attention kernel's workspace" rather than as one number.

A block counts from its ``alloc`` until its ``free_completed``: a block freed while a side
stream may still use it (``record_stream``) stays counted until the allocator can reuse it,
which is what a pile-up of such blocks behind a slow copy looks like. Blocks allocated before
the recording started are not in the trace: start it before the model is built.

For a script: :func:`start_trace` before the model is built, then :func:`sites_at_peak` at the end
or where a ``torch.OutOfMemoryError`` was caught (the trace's peak is then the allocation that
failed's moment, less the block it could not get), and :func:`format_sites` for the lines to print.
"""

from __future__ import annotations

from collections.abc import Iterable


def live_at_peak(events: Iterable[dict], live_at_end: dict[int, int] | None = None) -> tuple[int, list[dict]]:
    """Replay a device trace; return the highest total of live bytes and the blocks live then:
    their ``alloc`` events in allocation order, after the blocks that were live before the trace
    began (``{"addr", "size", "before_trace": True}``, by address).

    ``live_at_end`` (address -> size, :func:`live_blocks` of the snapshot the trace came with)
    lets the blocks allocated before the recording started count: the state at the trace's
    start is found by undoing its events from the end. Without it only the trace's own
    allocations count."""
    events = list(events)
    start: dict[int, int] = {}
    if live_at_end is not None:
        start = dict(live_at_end)
        for event in reversed(events):
            action = event.get("action")
            if action == "alloc":
                start.pop(event["addr"], None)
            elif action == "free_completed":
                start[event["addr"]] = event["size"]
    # address -> index of its alloc event, or -1 for a block live since before the trace
    live = {addr: -1 for addr in start}
    total = peak = sum(start.values())
    peak_at = -1 if live else None
    for index, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = index
            total += event["size"]
            if total > peak or peak_at is None:
                peak, peak_at = total, index
        elif action == "free_completed" and event["addr"] in live:
            begun = live.pop(event["addr"])
            total -= start[event["addr"]] if begun < 0 else events[begun]["size"]
    if peak_at is None:
        return 0, []
    live = {addr: -1 for addr in start}
    for index, event in enumerate(events[:peak_at + 1]):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = index
        elif action == "free_completed":
            live.pop(event["addr"], None)
    before = [{"addr": addr, "size": start[addr], "before_trace": True}
              for addr in sorted(a for a, i in live.items() if i < 0)]
    return peak, before + [events[i] for i in sorted(i for i in live.values() if i >= 0)]


def live_blocks(snapshot: dict, device: int) -> dict[int, int]:
    """Address -> size of the blocks allocated on ``device`` in a ``torch.cuda.memory._snapshot()``
    (those freed but waiting for a stream count, as :func:`live_at_peak` counts them)."""
    blocks = {}
    for segment in snapshot.get("segments", []):
        if segment.get("device") != device:
            continue
        for block in segment.get("blocks", []):
            if block.get("state") in ("active_allocated", "active_pending_free"):
                blocks[block["address"]] = block["size"]
    return blocks


def allocation_site(event: dict, within: tuple[str, ...] = ("dslab/",)) -> str:
    """``file:line function`` of the innermost frame whose file contains one of ``within``
    (torch's own frames and the allocator's are skipped); the innermost frame when none does."""
    if event.get("before_trace"):
        return "(allocated before the trace)"
    frames = event.get("frames") or []
    for frame in frames:
        filename = frame.get("filename", "")
        if any(part in filename for part in within):
            return f"{_short(filename, within)}:{frame.get('line', 0)} {frame.get('name', '?')}"
    if frames:
        frame = frames[0]
        return f"{frame.get('filename', '?')}:{frame.get('line', 0)} {frame.get('name', '?')}"
    return "(no frames recorded)"


def by_site(blocks: Iterable[dict], within: tuple[str, ...] = ("dslab/",), top: int | None = None) -> list[dict]:
    """Live blocks summed by :func:`allocation_site`, largest first: ``site``, ``bytes``, ``blocks``."""
    sums: dict[str, list[int]] = {}
    for event in blocks:
        entry = sums.setdefault(allocation_site(event, within), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    rows = [{"site": site, "bytes": size, "blocks": count} for site, (size, count) in sums.items()]
    rows.sort(key=lambda row: (-row["bytes"], row["site"]))
    return rows if top is None else rows[:top]


def _short(filename: str, within: tuple[str, ...]) -> str:
    for part in within:
        at = filename.rfind(part)
        if at >= 0:
            return filename[at:]
    return filename


def start_trace(max_entries: int = 500_000) -> None:
    """Record the CUDA caching allocator's events with their Python frames, at most
    ``max_entries`` of them (host memory: several KB an entry)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, context="alloc", stacks="python")


def sites_at_peak(device_index: int = 0, top: int = 15, max_entries: int = 500_000,
                  within: tuple[str, ...] = ("dslab/",), snapshot: dict | None = None) -> dict:
    """Stop the recording :func:`start_trace` began and return what was live at its peak:
    ``peak_bytes``, ``blocks``, ``sites`` (:func:`by_site`'s ``top`` rows) and ``trace_full`` (the
    trace reached ``max_entries``, so its first events were dropped: the peak is the highest of
    the events kept, and blocks from before them are counted without their sites). ``snapshot``
    stands in for ``torch.cuda.memory._snapshot()``."""
    if snapshot is None:
        import torch

        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot.get("device_traces") or []
    trace = traces[device_index] if device_index < len(traces) else []
    peak, blocks = live_at_peak(trace, live_at_end=live_blocks(snapshot, device_index))
    return {"peak_bytes": peak, "blocks": len(blocks), "sites": by_site(blocks, within=within, top=top),
            "trace_full": len(trace) >= max_entries}


def format_sites(result: dict) -> list[str]:
    """Lines for :func:`sites_at_peak`'s result: the peak, then one line per site (GiB, blocks)."""
    lines = [f"live at the traced peak: {result['peak_bytes'] / 2**30:.2f} GiB in {result['blocks']} blocks"
             + (" (the trace filled its entries: the peak is the highest of its last events, and blocks from "
                "before them are counted without their sites)" if result["trace_full"] else "")]
    lines += [f"  {row['bytes'] / 2**30:8.2f} GiB {row['blocks']:6d} blocks  {row['site']}" for row in result["sites"]]
    return lines
