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
"""

from __future__ import annotations

from collections.abc import Iterable


def live_at_peak(events: Iterable[dict]) -> tuple[int, list[dict]]:
    """Replay a device trace; return the highest total of live bytes and the ``alloc`` events
    of the blocks live then, in allocation order."""
    events = list(events)
    live: dict[int, int] = {}  # address -> index of its alloc event
    total = peak = 0
    peak_at = -1
    for index, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = index
            total += event["size"]
            if total > peak:
                peak, peak_at = total, index
        elif action == "free_completed":
            start = live.pop(event["addr"], None)
            if start is not None:
                total -= events[start]["size"]
    if peak_at < 0:
        return 0, []
    live.clear()
    for index, event in enumerate(events[:peak_at + 1]):
        if event.get("action") == "alloc":
            live[event["addr"]] = index
        elif event.get("action") == "free_completed":
            live.pop(event["addr"], None)
    return peak, [events[i] for i in sorted(live.values())]


def allocation_site(event: dict, within: tuple[str, ...] = ("dslab/",)) -> str:
    """``file:line function`` of the innermost frame whose file contains one of ``within``
    (torch's own frames and the allocator's are skipped); the innermost frame when none does."""
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
