"""The Comms tab's tables and figures: the reporting rank's per-op summary, who arrived late to
each collective and whom it kept waiting, bus bandwidth against message size, one step's
collectives on the reporting rank, and how much of the profiled step's gradient communication
backward hid (the comms record's ``overlap``, :mod:`dslab.profilers.comms_overlap`).

Pure functions over one case's ``comms_calls``, ``comms_ops`` and ``stragglers`` frames
(:mod:`dslab.report.frames`) and the run's ``peaks``, plus the plotly figures drawn from them.

Matching. Collectives are matched across ranks by ``(group, op, seq)``, a send and its receive as
one ``send/recv``, as the comms analysis does (:mod:`dslab.profilers.comms_analysis`); arrivals
are put on the reference rank's clock (``arrival_ns - clock_offset_ns``).

Lateness. A rank's lateness in a collective is its arrival minus the first arrival: the late rank
is the one with the largest lateness, and its lateness is the wait it imposed on the first rank
(the comms analysis' *wait* is the mirror image, last arrival minus one's own). The heatmap's
colour range ends at the largest per-collective spread (last minus first arrival) within Tukey's
upper fence of all spreads (Q3 + 1.5 x IQR), and never below ``floor_ms`` (the analysis' default
``min_wait_ms``, 1 ms), so one warm-up collective that kept everyone waiting a second does not
wash out the steady state; cells beyond it are drawn at full colour, their true value in the hover.

Bus bandwidth per collective. nccl-tests' ``busbw = bytes / latency x factor`` (:func:`bus_factor`,
the same table as :func:`dslab.profilers.comms_analysis.bus_factor`), with the latency of the member
that waited least: when every member of the group recorded the call, that is the last arriver's,
which did not wait, so the figure is the transfer alone. The reference curve is the direct
``all_reduce`` measurement ``benchmarks/comms_busbw.py --report RUN`` writes into the run's
``peaks["comms_busbw"]``: ``{"op", "world_size", "gpu", "dtype", "calls", "trials", "created",
"points": [{"size_bytes", "busbw_GBps"}]}``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import TYPE_CHECKING

import pandas as pd

from dashboards.figure_base import empty_figure, laid_out, plotly_go
from dashboards.views import _dict, _list, _number
from dslab.report import RunReport, frames

if TYPE_CHECKING:
    import plotly.graph_objects as go

MARGIN = {"l": 90, "r": 20, "t": 60, "b": 50}
LATE_COLOUR, OTHER_COLOUR = "#d62728", "#9ca3af"
P2P_MATCH = {"send": "send/recv", "recv": "send/recv"}
NO_PAYLOAD_OPS = frozenset({"barrier", "all_gather_object"})
# Above this many collectives the bandwidth plot draws one marker per op and message size (the
# median, whiskers to the min and max) instead of one per collective: a thousand overlapping
# markers read no better than their spread per size, and cost Plotly a few hundred ms to draw.
BANDWIDTH_POINTS_MAX = 300
REFERENCE_KEY = "comms_busbw"

OP_COLUMNS = [
    ("op", "op"), ("size_bytes", "message bytes"), ("count", "calls"), ("timed_count", "timed calls"),
    ("avg_latency_ms", "mean latency (ms)"), ("min_latency_ms", "min latency (ms)"),
    ("max_latency_ms", "max latency (ms)"), ("algbw_GBps", "algbw GB/s"), ("busbw_GBps", "busbw GB/s"),
]
STRAGGLER_COLUMNS = [
    ("rank", "rank"), ("late", "named straggler"), ("collectives", "collectives"), ("times_last", "times last"),
    ("caused_wait_ms", "caused wait (ms)"), ("mean_caused_wait_ms", "caused wait per time last (ms)"),
    ("mean_lateness_ms", "mean lateness (ms)"), ("median_lateness_ms", "median lateness (ms)"),
    ("total_wait_ms", "own wait (ms)"),
]
STEP_COLUMNS = [
    ("step", "step"), ("calls", "collectives"), ("mib", "MiB moved"), ("issue_span_ms", "first to last issue (ms)"),
    ("busy_ms", "comm busy (ms)"), ("span_ms", "first issue to last completion (ms)"),
    ("tail_ms", "after the last issue (ms)"),
]
STRAGGLER_NOTE = (
    "Lateness: a rank's arrival at a collective minus the first rank's (clocks aligned), so the late rank "
    "is the dark row. Caused wait: summed over the collectives where the rank arrived last, the other "
    "ranks' mean wait for it. Times last: how often it arrived last. A rank is named a straggler when it "
    "is last in more than half its collectives and the others waited for it at least 1 ms on average "
    "(the comms analysis' criteria). Crosses mark the last arrival of each collective."
)
BANDWIDTH_NOTE = (
    "One point per collective: busbw = bytes / latency x the op's bus factor (nccl-tests: all_reduce "
    "2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, send/recv 1), the latency "
    "the smallest of the group's members (the last arriver's, which did not wait). GB/s = 1e9 bytes/s. "
    f"A case of more than {BANDWIDTH_POINTS_MAX} collectives is drawn as one point per op and message size: "
    "the median busbw of its collectives, whiskers to the slowest and the fastest, their count in the hover."
)
STEP_NOTE = (
    "These per-call records carry no timestamps of the step's forward, backward and optimizer "
    "phases (the gradient overlap above has them, where the report records it), so each gradient "
    "bucket's collective is shown by its issue order within the "
    "step, on the reporting rank's clock from the step's first collective (on CUDA: when the issuing "
    "stream reached it). The engine issues the last buckets when backward ends and waits for them "
    "before the optimizer step, so the time after the last issue is communication backward did not hide."
)


def _go():
    return plotly_go()


def _layout(fig: go.Figure, title: str, **kwargs) -> go.Figure:
    return laid_out(fig, title, MARGIN, **kwargs)


def _empty(title: str, message: str) -> go.Figure:
    return empty_figure(title, message, MARGIN)


def size_label(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB or GiB (1024-based), 3 significant digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def bus_factor(op: str, group_size: int) -> float | None:
    """nccl-tests' bus-bandwidth factor of ``op`` on ``group_size`` ranks (None for ops without
    one); the dashboard's copy of :func:`dslab.profilers.comms_analysis.bus_factor`, which it may
    not import, held equal to it by a test."""
    n = group_size
    if n < 1:
        return None
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv", "send/recv"):
        return 1.0
    return None


# -- tables -----------------------------------------------------------------------------------


def comms_op_rows(ops: pd.DataFrame) -> list[dict]:
    """The comms logger's per (op, message size) summary rows of the reporting rank, from one
    case's ``comms_ops`` frame, keyed as :data:`OP_COLUMNS`."""
    return [{"op": r["op"] or "?", **{key: r[key] for key, _ in OP_COLUMNS[1:]}} for r in frames.records(ops)]


def _timed(calls: pd.DataFrame) -> list[dict]:
    """The calls of a ``comms_calls`` frame that name their op and payload, as plain rows."""
    return frames.records(calls[calls["op"].notna() & calls["bytes"].notna() & calls["rank"].notna()])


def _members(group: str, present) -> set[int]:
    return {int(x) for x in group.split(",") if x.strip().isdigit()} or set(present)


def _collectives(calls: pd.DataFrame) -> dict[tuple, dict[int, dict]]:
    """``{(group, op, seq): {rank: call}}`` of a ``comms_calls`` frame, a send and its receive
    keyed as one ``send/recv``."""
    out: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in _timed(calls):
        out[(r["group"] or "", P2P_MATCH.get(r["op"], r["op"]), r["seq"])][r["rank"]] = r
    return out


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered`` by linear interpolation (numpy's default)."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def colour_max(spreads: list[float], floor_ms: float = 1.0) -> float:
    """The top of the lateness colour scale: the largest of ``spreads`` (per collective, last
    minus first arrival, ms) within Tukey's upper fence Q3 + 1.5 x IQR, at least ``floor_ms``."""
    if not spreads:
        return floor_ms
    ordered = sorted(spreads)
    q1, q3 = _quantile(ordered, 0.25), _quantile(ordered, 0.75)
    fence = q3 + 1.5 * (q3 - q1)
    return max(floor_ms, max(s for s in ordered if s <= fence))


def straggler_matrix(calls: pd.DataFrame, stragglers: pd.DataFrame, limit: int = 120,
                     floor_ms: float = 1.0) -> dict:
    """Ranks x collectives of one case, from its ``comms_calls`` and ``stragglers`` frames.

    Returns ``{"ranks", "labels"`` (``"all_reduce #3"``), ``"lateness_ms"[rank][col]`` (arrival
    minus the first arrival), ``"wait_ms"[rank][col]`` (last arrival minus the rank's own), ``"last"``
    (the rank that arrived last, per collective), ``"spread_ms"`` (per collective), ``"colour_max_ms"``
    (:func:`colour_max` of the spreads), ``"clipped"`` (collectives whose spread is beyond it),
    ``"stragglers"`` (the ranks the comms analysis named)``}``; None where a rank is not in the
    group. Only collectives every member of their group (two or more ranks) recorded are kept, the
    last ``limit`` by time."""
    columns = []
    for (group, op, seq), members in _collectives(calls).items():
        arrivals = {rank: c["arrival_ns"] - (c["clock_offset_ns"] or 0)
                    for rank, c in members.items() if c["arrival_ns"] is not None}
        expected = _members(group, arrivals)
        if len(expected) < 2 or set(arrivals) != expected:
            continue
        first, last = min(arrivals.values()), max(arrivals.values())
        late = min(rank for rank, t in arrivals.items() if t == last)
        columns.append((first, f"{op} #{seq}", arrivals, late))
    columns.sort(key=lambda c: c[0])
    columns = columns[-limit:]
    ranks = sorted(int(r) for r in calls["rank"].dropna().unique())
    named = stragglers[stragglers["straggler"].fillna(False).astype(bool)]["rank"].dropna()
    spreads = [(max(c[2].values()) - c[0]) / 1e6 for c in columns]
    top = colour_max(spreads, floor_ms)

    def cells(value):
        return [[value(c, rank) if rank in c[2] else None for c in columns] for rank in ranks]

    return {"ranks": ranks, "labels": [c[1] for c in columns],
            "lateness_ms": cells(lambda c, rank: (c[2][rank] - c[0]) / 1e6),
            "wait_ms": cells(lambda c, rank: (max(c[2].values()) - c[2][rank]) / 1e6),
            "last": [c[3] for c in columns], "spread_ms": spreads, "colour_max_ms": top,
            "clipped": sum(s > top for s in spreads), "stragglers": sorted(int(r) for r in named)}


def straggler_rows(stragglers: pd.DataFrame, matrix: dict) -> list[dict]:
    """Per rank of one case's ``stragglers`` frame (the comms analysis), keyed as
    :data:`STRAGGLER_COLUMNS`: ``late`` ("yes" for a named straggler), times last, caused wait
    (total and per time last), own wait, and the mean and median lateness over the collectives of
    ``matrix`` (:func:`straggler_matrix`) it took part in. The named stragglers first, then by
    caused wait, largest first."""
    lateness = {rank: [v for v in row if v is not None] for rank, row in zip(matrix["ranks"], matrix["lateness_ms"])}
    rows = []
    for s in frames.records(stragglers):
        if s["rank"] is None:
            continue
        mine = lateness.get(s["rank"], [])
        rows.append({"rank": s["rank"], "late": "yes" if s["straggler"] else "no",
                     "collectives": s["collectives"], "times_last": s["times_last"],
                     "caused_wait_ms": s["caused_wait_ms"] or 0.0, "mean_caused_wait_ms": s["mean_caused_wait_ms"],
                     "mean_lateness_ms": statistics.fmean(mine) if mine else None,
                     "median_lateness_ms": statistics.median(mine) if mine else None,
                     "total_wait_ms": s["total_wait_ms"]})
    rows.sort(key=lambda r: (r["late"] != "yes", -r["caused_wait_ms"], r["rank"]))
    return rows


def bandwidth_points(calls: pd.DataFrame) -> list[dict]:
    """One point per collective with a payload and a latency in one case's ``comms_calls`` frame:
    ``{"op", "bytes", "group_size", "seq", "step", "latency_ms", "algbw_GBps", "busbw_GBps",
    "rank"`` (whose latency it is: the member that waited least)``, "members"`` (ranks that recorded
    it)``}``. Collectives on one rank, and ops without a bus factor, have no bus bandwidth and are
    left out."""
    points = []
    for (_, op, seq), members in _collectives(calls).items():
        timed = {rank: c for rank, c in members.items()
                 if c["latency_ms"] and c["latency_ms"] > 0 and c["bytes"] > 0 and c["op"] not in NO_PAYLOAD_OPS}
        if not timed:
            continue
        rank = min(timed, key=lambda r: (timed[r]["latency_ms"], r))
        call = timed[rank]
        factor = bus_factor(op, call["group_size"] or len(members))
        if not factor:
            continue
        algbw = call["bytes"] / (call["latency_ms"] * 1e-3) / 1e9
        points.append({"op": op, "bytes": call["bytes"], "group_size": call["group_size"], "seq": seq,
                       "step": call["step"], "latency_ms": call["latency_ms"], "algbw_GBps": algbw,
                       "busbw_GBps": algbw * factor, "rank": rank, "members": len(members)})
    points.sort(key=lambda p: (p["op"], p["bytes"], p["seq"]))
    return points


def bandwidth_by_size(points: list[dict]) -> list[dict]:
    """:func:`bandwidth_points` summarised per op and message size, in that order: ``{"op",
    "bytes", "count", "busbw_GBps"`` (the median), ``"busbw_min_GBps", "busbw_max_GBps",
    "latency_ms"`` (the median), ``"group_sizes"`` (sorted)``}``."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for p in points:
        groups[(p["op"], p["bytes"])].append(p)
    out = []
    for (op, size), mine in sorted(groups.items()):
        busbw = [p["busbw_GBps"] for p in mine]
        out.append({"op": op, "bytes": size, "count": len(mine), "busbw_GBps": statistics.median(busbw),
                    "busbw_min_GBps": min(busbw), "busbw_max_GBps": max(busbw),
                    "latency_ms": statistics.median(p["latency_ms"] for p in mine),
                    "group_sizes": sorted({p["group_size"] for p in mine if p["group_size"] is not None})})
    return out


def reference_busbw(report: RunReport) -> dict | None:
    """The measured bus-bandwidth curve in the run's ``peaks["comms_busbw"]`` (module docstring),
    points sorted by size; None without one. Raises ValueError naming the key when it is
    malformed."""
    peaks = report.peaks if isinstance(report.peaks, dict) else {}
    if peaks.get(REFERENCE_KEY) is None:
        return None
    record = _dict(peaks[REFERENCE_KEY], f"peaks.{REFERENCE_KEY}")
    points = []
    for i, p in enumerate(_list(record.get("points"), f"peaks.{REFERENCE_KEY}.points")):
        p = _dict(p, f"peaks.{REFERENCE_KEY}.points[{i}]")
        size, busbw = _number(p.get("size_bytes")), _number(p.get("busbw_GBps"))
        if size is None or busbw is None or size <= 0 or busbw <= 0:
            raise ValueError(f"peaks.{REFERENCE_KEY}.points[{i}] needs a positive size_bytes and busbw_GBps")
        points.append({"size_bytes": size, "busbw_GBps": busbw})
    label = f"measured {record.get('op', 'all_reduce')} busbw"
    if record.get("world_size") or record.get("gpu"):
        label += f" ({record.get('world_size', '?')} x {record.get('gpu', 'GPU')})"
    return {"label": label, "op": record.get("op", "all_reduce"), "world_size": record.get("world_size"),
            "points": sorted(points, key=lambda p: p["size_bytes"])}


# -- one step of the reporting rank -----------------------------------------------------------


def _busy(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def step_calls(calls: pd.DataFrame, rank: int) -> dict[int, list[dict]]:
    """``{step: [call]}`` of ``rank``'s timed collectives in a ``comms_calls`` frame, on groups of
    two or more ranks, in issue order; each call ``{"index"`` (its order in the step), ``"op"``,
    ``"bytes"``, ``"start_ms"`` (from the step's first issue), ``"end_ms"``, ``"latency_ms"}``."""
    mine = [c for c in _timed(calls) if c["rank"] == rank and c["step"] is not None and c["arrival_ns"] is not None
            and c["latency_ms"] is not None and (c["group_size"] or 0) >= 2]
    by_step: dict[int, list[dict]] = defaultdict(list)
    for c in mine:
        by_step[c["step"]].append(c)
    out = {}
    for step, group in sorted(by_step.items()):
        group.sort(key=lambda c: c["arrival_ns"])
        t0 = group[0]["arrival_ns"]
        out[step] = [{"index": i, "op": c["op"], "bytes": c["bytes"], "start_ms": (c["arrival_ns"] - t0) / 1e6,
                      "end_ms": (c["arrival_ns"] - t0) / 1e6 + c["latency_ms"], "latency_ms": c["latency_ms"]}
                     for i, c in enumerate(group)]
    return out


def step_rows(steps: dict[int, list[dict]]) -> list[dict]:
    """Per step of :func:`step_calls`, keyed as :data:`STEP_COLUMNS`: collectives, MiB moved, the
    span of their issues, the time some collective ran (the union of their intervals), first issue
    to last completion, and the time from the last issue to the last completion."""
    rows = []
    for step, group in steps.items():
        last_issue, last_end = group[-1]["start_ms"], max(c["end_ms"] for c in group)
        rows.append({"step": step, "calls": len(group), "mib": sum(c["bytes"] for c in group) / 2**20,
                     "issue_span_ms": last_issue, "busy_ms": _busy([(c["start_ms"], c["end_ms"]) for c in group]),
                     "span_ms": last_end, "tail_ms": last_end - last_issue})
    return rows


def typical_step(rows: list[dict]) -> int | None:
    """The step drawn: among the steps with the most common number of collectives, the one whose
    first-issue-to-last-completion span is the median (the later of two)."""
    if not rows:
        return None
    counts = [r["calls"] for r in rows]
    modal = max(set(counts), key=lambda n: (counts.count(n), n))
    same = sorted((r for r in rows if r["calls"] == modal), key=lambda r: (r["span_ms"], r["step"]))
    return same[len(same) // 2]["step"]


# -- figures ----------------------------------------------------------------------------------


def caused_wait_bar(rows: list[dict], case: str) -> go.Figure:
    """Each rank's caused wait (ms), named stragglers in red, times last on the bar."""
    go = _go()
    if not rows:
        return _empty(f"{case}: caused wait", "no straggler analysis")
    ordered = sorted(rows, key=lambda r: r["rank"])
    fig = go.Figure(go.Bar(
        x=[f"rank {r['rank']}" for r in ordered], y=[r["caused_wait_ms"] for r in ordered],
        marker_color=[LATE_COLOUR if r["late"] == "yes" else OTHER_COLOUR for r in ordered],
        text=[f"last {r['times_last']}x" for r in ordered], textposition="outside",
        hovertemplate="%{x}<br>caused %{y:.3f} ms of wait<br>%{text}<extra></extra>"))
    fig.update_yaxes(title="caused wait (ms)")
    return _layout(fig, f"{case}: wait each rank caused by arriving last (red: named straggler)", height=320)


def step_timeline(steps: dict[int, list[dict]], step: int | None, rank: int, case: str,
                  phases_ms: dict[str, float] | None = None) -> go.Figure:
    """The collectives of ``step`` on ``rank`` (:func:`step_calls`) as bars from issue to
    completion, one row per collective in issue order, coloured by op; the wall-clock medians of
    the step's phases (``phases_ms``), which have no timestamps, in the title."""
    go = _go()
    group = steps.get(step) if step is not None else None
    if not group:
        return _empty(f"{case}: one step's collectives", "no timed collectives on groups of two or more ranks")
    fig = go.Figure()
    labels = [f"{c['index']:>3} {c['op']} {size_label(c['bytes'])}" for c in group]
    for op in dict.fromkeys(c["op"] for c in group):
        mine = [(label, c) for label, c in zip(labels, group) if c["op"] == op]
        fig.add_trace(go.Bar(
            y=[label for label, _ in mine], x=[c["latency_ms"] for _, c in mine],
            base=[c["start_ms"] for _, c in mine], orientation="h", name=op,
            customdata=[[c["start_ms"], c["end_ms"], c["bytes"]] for _, c in mine],
            hovertemplate="%{y}<br>issued at %{customdata[0]:.3f} ms<br>done at %{customdata[1]:.3f} ms"
                          "<br>%{x:.3f} ms, %{customdata[2]} bytes<extra></extra>"))
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=labels, title="collective (issue order)")
    fig.update_xaxes(title=f"ms since the step's first collective (rank {rank}'s clock)")
    title = f"{case}: step {step} on rank {rank}, one bar per collective"
    if phases_ms:
        shown = ", ".join(f"{name} {ms:.3g} ms" for name, ms in phases_ms.items())
        title += f"<br><sup>median phase times (wall clock, no timestamps): {shown}</sup>"
    return _layout(fig, title, barmode="overlay", height=160 + 22 * len(group), legend={"title": {"text": "op"}})


# -- gradient overlap of the profiled step ----------------------------------------------------

OVERLAPPED_COLOUR, EXPOSED_COLOUR = "#2ca02c", "#d62728"
PHASE_COLOURS = {"forward": "#9ecae1", "backward": "#3182bd", "gradient wait": "#fdae6b", "optimizer": "#756bb1"}
#: the compute row's bars: (name, from mark, to mark)
PHASE_SPANS = (("forward", "forward_begin", "backward_begin"), ("backward", "backward_begin", "backward_end"),
               ("gradient wait", "backward_end", "optimizer_begin"), ("optimizer", "optimizer_begin", "step_end"))
OVERLAP_COLUMNS = [
    ("bucket", "bucket"), ("op", "op"), ("mb", "MB (10^6 bytes)"), ("issue_ms", "issued (ms, host)"),
    ("start_ms", "start (ms)"), ("end_ms", "end (ms)"), ("overlapped_ms", "overlapped with backward (ms)"),
    ("exposed_ms", "exposed after backward (ms)"),
]
OVERLAP_NOTE = (
    "Times in ms since the step's forward began, on the shown rank's clock. Overlapped: the part of a "
    "bucket's collective inside backward (autograd's backward, before the engine waits for the "
    "reductions); exposed: the rest, which the optimizer step waited for (the 'gradient wait' bar). "
    "Start and end are CUDA events on a GPU (from the issuing stream reaching the op to its "
    "completion) and the host clock on gloo (from the issue to the completion of the work handle), "
    "so a bucket queued behind another counts its queueing. The summary's totals are over the union "
    "of the buckets' spans."
)


def overlap_ranks(data) -> dict[int, dict]:
    """``{rank: overlap}`` of a comms record (``profilers["comms"][case]``; empty when it has no
    ``overlap``), each checked to have ``buckets``, ``phases_ms`` and ``totals``. Raises ValueError
    on a malformed one."""
    raw = data.get("overlap") if isinstance(data, dict) else None
    if raw is None:
        return {}
    per_rank = _dict(_dict(raw, "comms.overlap").get("per_rank"), "comms.overlap.per_rank")
    out = {}
    for key, overlap in per_rank.items():
        where = f"comms.overlap.per_rank.{key}"
        if not str(key).lstrip("-").isdigit():
            raise ValueError(f"{where}: the rank is not an integer")
        _dict(overlap, where)
        _list(overlap.get("buckets"), f"{where}.buckets")
        _dict(overlap.get("phases_ms"), f"{where}.phases_ms")
        _dict(overlap.get("totals"), f"{where}.totals")
        out[int(key)] = overlap
    return dict(sorted(out.items()))


def overlap_rank(ranks: dict[int, dict], preferred) -> int | None:
    """The rank shown: ``preferred`` (the reporting rank) when it has an overlap, else the lowest."""
    if not ranks:
        return None
    return preferred if preferred in ranks else min(ranks)


def overlap_rows(overlap: dict) -> list[dict]:
    """One row per bucket in issue order, keyed as :data:`OVERLAP_COLUMNS` (bytes in MB)."""
    buckets = sorted((_dict(b, "comms.overlap bucket") for b in overlap["buckets"]),
                     key=lambda b: (_number(b.get("issue_ms")) is None, _number(b.get("issue_ms")) or 0.0))
    rows = []
    for b in buckets:
        nbytes = _number(b.get("bytes"))
        rows.append({"bucket": b.get("bucket"), "op": b.get("op"), "mb": None if nbytes is None else nbytes / 1e6,
                     **{key: _number(b.get(key)) for key, _ in OVERLAP_COLUMNS[3:]}})
    return rows


def overlap_summary(overlap: dict, rank: int) -> str:
    """The one-line verdict: how much gradient communication backward hid and how much was exposed."""
    totals = overlap["totals"]
    comm_ms, hidden, exposed = (_number(totals.get(k)) for k in ("comm_ms", "overlapped_ms", "exposed_ms"))
    if comm_ms is None or hidden is None or exposed is None:
        raise ValueError("comms.overlap totals need comm_ms, overlapped_ms and exposed_ms")
    backward = _number(totals.get("backward_ms"))
    during = f" ({backward:.3g} ms)" if backward is not None else ""
    step = overlap.get("step")
    where = f"rank {rank}" + (f", step {step}" if step is not None else "")
    return (f"{where}: {hidden:.3g} of {comm_ms:.3g} ms of gradient communication hidden behind backward"
            f"{during}; {exposed:.3g} ms exposed.")


def _segments(start: float, end: float, window: tuple[float, float]) -> list[tuple[float, float, bool]]:
    """``[(from, to, overlapped)]``: the parts of ``[start, end]`` inside and outside ``window``."""
    cuts = sorted({start, end, *(t for t in window if start < t < end)})
    return [(a, b, window[0] <= a and b <= window[1]) for a, b in zip(cuts, cuts[1:]) if b > a]


def overlap_timeline(overlap: dict, rank: int, case: str) -> go.Figure:
    """The profiled step on ``rank``: one row of compute phases (forward, backward, the wait for
    the gradients, optimizer) and one row per bucket in issue order, its collective drawn from
    start to end, green where it ran inside backward and red where it was exposed."""
    go = _go()
    phases = {k: v for k, v in overlap["phases_ms"].items() if _number(v) is not None}
    if "backward_begin" not in phases or "backward_end" not in phases:
        return _empty(f"{case}: gradient overlap", "no backward marks on this rank")
    window = (phases["backward_begin"], phases["backward_end"])
    rows = overlap_rows(overlap)
    compute = "compute"
    labels = [compute] + [f"bucket {r['bucket']} {r['op']}" for r in rows]
    fig = go.Figure()
    for name, lo, hi in PHASE_SPANS:
        if lo in phases and hi in phases and phases[hi] > phases[lo]:
            fig.add_trace(go.Bar(y=[compute], x=[phases[hi] - phases[lo]], base=[phases[lo]], orientation="h",
                                 name=name, marker_color=PHASE_COLOURS[name], legendgroup="phases",
                                 hovertemplate=f"{name}<br>%{{base:.3f}} to %{{customdata:.3f}} ms<extra></extra>",
                                 customdata=[phases[hi]]))
    pieces = {True: ([], [], [], []), False: ([], [], [], [])}
    for label, row in zip(labels[1:], rows):
        if row["start_ms"] is None or row["end_ms"] is None:
            continue
        for a, b, inside in _segments(row["start_ms"], row["end_ms"], window):
            ys, xs, bases, data = pieces[inside]
            ys.append(label)
            xs.append(b - a)
            bases.append(a)
            data.append([row["start_ms"], row["end_ms"], row["mb"] or 0.0])
    for inside, (ys, xs, bases, data) in pieces.items():
        name = "overlapped with backward" if inside else "exposed"
        fig.add_trace(go.Bar(y=ys, x=xs, base=bases, orientation="h", name=name, customdata=data,
                             marker_color=OVERLAPPED_COLOUR if inside else EXPOSED_COLOUR,
                             hovertemplate="%{y}<br>" + name + ": %{x:.3f} ms<br>collective %{customdata[0]:.3f}"
                                           " to %{customdata[1]:.3f} ms, %{customdata[2]:.3g} MB<extra></extra>"))
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=labels, title=None)
    clock = "CUDA events" if overlap.get("clock") == "cuda_events" else "host clock"
    fig.update_xaxes(title=f"ms since forward began (rank {rank}, {clock})")
    step = overlap.get("step")
    title = f"{case}: gradient buckets against backward, step {step} on rank {rank}"
    return _layout(fig, title, barmode="overlay", height=170 + 24 * len(labels))
