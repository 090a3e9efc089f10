"""Bandwidth and straggler analysis of collective records: pure functions over saved data.

A *record* is one collective as one rank saw it, a plain dict as
:class:`dslab.profilers.comms.CommsLogger` saves it:

===============  ==========================================================================
``op``           ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ...
``group``        the group's global ranks, comma-separated (``"0,1,2"``)
``group_size``   number of ranks in the group
``seq``          index of this call among this rank's calls of ``op`` on ``group`` (from 0)
``bytes``        message size in bytes, by nccl-tests' convention (see :data:`DEFINITIONS`)
``arrival_ns``   when this rank reached the collective, wall clock in ns (on CUDA: when the
                 issuing stream reached it, converted to wall clock)
``latency_ms``   this rank's latency of this one call, or None when it was not timed
``caller``       ``"file:line (function)"`` of the caller, only with ``debug``
``bucket``       the gradient bucket (or ZeRO unit) the call reduces, only on such calls
===============  ==========================================================================

Collectives on one process group run in the same order on every member, so the n-th call of an
op on a group is the same collective on every rank: records are matched across ranks by
``(group, op, seq)``, never by their position in a list (a rank that logged a different set of
ops, or whose list was cut or reordered, would shift every later position).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Iterable, Mapping, Sequence

DEFINITIONS = (
    "Per call: algbw = bytes / latency; busbw = algbw * factor, nccl-tests' definitions "
    "(PERFORMANCE.md): all_reduce 2(n-1)/n; all_gather (bytes = the gathered output), "
    "reduce_scatter (bytes = the input), all_to_all (bytes = the input) (n-1)/n; broadcast and "
    "reduce 1; n = group size. GB/s = 1e9 bytes/s; the Gbps columns are 8 x GB/s (DeepSpeed's "
    "units). Message sizes print in KB/MB/GB of 1024^k bytes. Averages (latency, tput_avg, "
    "busbw_avg) are means over calls of each call's own figures; nothing accumulates across calls. "
    "Latency: CUDA events on the issuing stream (start before the op is issued, or the end of "
    "the group's previous collective when the op queued behind it on NCCL's stream; end once the "
    "op has completed), host clock for CPU (gloo) ops. Straggler wait: collectives matched across "
    "ranks by (group, op, per-group sequence number); the last rank to arrive defines the start; "
    "each rank's wait = last arrival - its own arrival."
)

#: a point-to-point transfer is one event seen from two ranks: the sender's n-th "send" to a
#: receiver and the receiver's n-th "recv" from that sender (the same ``group``, "sender,receiver")
#: are matched as one "send/recv"
P2P_MATCH = {"send": "send/recv", "recv": "send/recv"}

#: ops that move no payload (their bandwidth is not defined)
NO_PAYLOAD_OPS = frozenset({"barrier", "all_gather_object"})


def bus_factor(op: str, group_size: int) -> float | None:
    """nccl-tests' bus-bandwidth factor of ``op`` on ``group_size`` ranks.

    busbw = algbw * factor is the per-link traffic an optimal ring moves, comparable to the
    hardware's link bandwidth whatever the op: all_reduce sends and receives 2(n-1)/n of the buffer
    per rank; all_gather, reduce_scatter and all_to_all (n-1)/n; broadcast, reduce, send and recv
    1 (a transfer's bytes cross one link). None for
    ops without payload or unknown ops.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (got {group_size})")
    n = group_size
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv"):
        return 1.0
    return None


def bandwidth(op: str, nbytes: int, latency_ms: float | None,
              group_size: int) -> tuple[float | None, float | None]:
    """``(algbw, busbw)`` of one call in GB/s (1e9 bytes/s); None where not defined
    (untimed, zero latency, no payload)."""
    if latency_ms is None or latency_ms <= 0 or nbytes <= 0 or op in NO_PAYLOAD_OPS:
        return None, None
    algbw = nbytes / (latency_ms * 1e-3) / 1e9
    factor = bus_factor(op, group_size)
    return algbw, (algbw * factor if factor is not None else None)


def op_label(record: Mapping, by_caller: bool = False) -> str:
    """The summary's row label: the op, with the caller appended under ``debug``
    (DeepSpeed's ``op | [Caller Func: ...]``)."""
    if by_caller and record.get("caller"):
        return f"{record['op']} | [Caller: {record['caller']}]"
    return record["op"]


class SizeStats:
    """Running figures of one (op, message size) row; every figure is per call."""

    __slots__ = ("count", "timed", "total_ms", "min_ms", "max_ms", "algbw_sum", "busbw_sum",
                 "bw_count")

    def __init__(self):
        self.count = 0
        self.timed = 0
        self.total_ms = 0.0
        self.min_ms = float("inf")
        self.max_ms = 0.0
        self.algbw_sum = 0.0
        self.busbw_sum = 0.0
        self.bw_count = 0

    def add(self, latency_ms: float | None, algbw: float | None, busbw: float | None) -> None:
        self.count += 1
        if latency_ms is None:
            return
        self.timed += 1
        self.total_ms += latency_ms
        self.min_ms = min(self.min_ms, latency_ms)
        self.max_ms = max(self.max_ms, latency_ms)
        if algbw is not None:
            self.algbw_sum += algbw
            self.busbw_sum += busbw if busbw is not None else 0.0
            self.bw_count += 1

    def as_dict(self) -> dict:
        """count (all calls), timed_count, latencies in ms over timed calls, and the mean of each
        call's bandwidth in GB/s (``*_GBps``) and in DeepSpeed's Gbps (``*_gbps`` = 8 x GB/s)."""
        algbw = self.algbw_sum / self.bw_count if self.bw_count else None
        busbw = self.busbw_sum / self.bw_count if self.bw_count else None
        return {
            "count": self.count,
            "timed_count": self.timed,
            "total_latency_ms": self.total_ms,
            "avg_latency_ms": self.total_ms / self.timed if self.timed else None,
            "min_latency_ms": self.min_ms if self.timed else None,
            "max_latency_ms": self.max_ms if self.timed else None,
            "algbw_GBps": algbw,
            "busbw_GBps": busbw,
            "algbw_gbps": algbw * 8 if algbw is not None else None,
            "busbw_gbps": busbw * 8 if busbw is not None else None,
        }


class Summary:
    """Per (label, message size) running figures, fed one call at a time."""

    def __init__(self):
        self._rows: dict[str, dict[int, SizeStats]] = defaultdict(dict)

    def add(self, label: str, op: str, nbytes: int, group_size: int,
            latency_ms: float | None) -> None:
        stats = self._rows[label].get(nbytes)
        if stats is None:
            stats = self._rows[label][nbytes] = SizeStats()
        stats.add(latency_ms, *bandwidth(op, nbytes, latency_ms, group_size))

    def as_dict(self) -> dict[str, dict[int, dict]]:
        """``{label: {size_bytes: SizeStats.as_dict()}}``, labels and sizes sorted."""
        return {label: {size: self._rows[label][size].as_dict() for size in sorted(self._rows[label])}
                for label in sorted(self._rows)}


def summarize(records: Iterable[Mapping], by_caller: bool = False) -> dict[str, dict[int, dict]]:
    """The summary table's figures of ``records`` (one rank's): ``{label: {size_bytes: {...}}}``."""
    summary = Summary()
    for r in records:
        summary.add(op_label(r, by_caller), r["op"], r["bytes"], r["group_size"], r.get("latency_ms"))
    return summary.as_dict()


def summary_rows(summary: Mapping[str, Mapping[int, Mapping]]) -> list[dict]:
    """The summary flattened to one dict per (op, size) row, for the run report."""
    return [{"op": label, "size_bytes": size, **stats}
            for label, sizes in summary.items() for size, stats in sizes.items()]


def clock_offsets(stamps: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """Each rank's wall-clock offset to the lowest rank, in ns, from barrier exit stamps.

    ``stamps[rank][i]`` is the rank's ``time.time_ns()`` right after the i-th of a few barriers;
    the ranks leave a barrier together to within its release skew (tens of microseconds on one
    host), so ``offset[rank] = median_i(stamps[rank][i] - stamps[ref][i])`` and
    ``arrival - offset`` puts an arrival on the reference rank's clock.
    """
    if not stamps:
        return {}
    ref = min(stamps)
    rounds = len(stamps[ref])
    for rank, s in stamps.items():
        if len(s) != rounds:
            raise ValueError(f"stamps[{rank}] has {len(s)} rounds, rank {ref} has {rounds}")
    if rounds == 0:
        return {rank: 0 for rank in stamps}
    return {rank: int(statistics.median(a - b for a, b in zip(s, stamps[ref])))
            for rank, s in stamps.items()}


def _wait_stats() -> dict:
    return {"collectives": 0, "times_last": 0, "total_wait_ms": 0.0, "max_wait_ms": 0.0}


def _finish_wait_stats(s: dict) -> dict:
    n = s["collectives"]
    s["last_fraction"] = s["times_last"] / n if n else 0.0
    s["mean_wait_ms"] = s["total_wait_ms"] / n if n else 0.0
    return s


def analyze_stragglers(per_rank: Mapping[int, Sequence[Mapping]],
                       offsets_ns: Mapping[int, int] | None = None, *,
                       last_fraction: float = 0.5, min_wait_ms: float = 1.0) -> dict:
    """Who made whom wait, from every rank's records.

    Args:
        per_rank: ``{rank: [record, ...]}`` (see the module docstring), in any order.
        offsets_ns: each rank's clock offset (:func:`clock_offsets`); missing ranks count as 0
            (one host, one clock).
        last_fraction: a rank is named a straggler when it is the last to arrive in more than
            this fraction of the collectives it took part in ...
        min_wait_ms: ... and, in those collectives, the other ranks waited for it at least this
            long on average.

    For each collective (``group, op, seq``) reported by every member of its group, the last
    arrival defines its start; rank r's wait is ``last arrival - arrival_r`` (ms, on the reference
    clock). Collectives of one rank, or missing on some member, are not analysed (``unmatched``
    counts the latter).

    Returns ``{"stragglers": [rank, ...] (most caused wait first), "ranks": {rank: {collectives,
    times_last, last_fraction, total_wait_ms, mean_wait_ms, max_wait_ms, caused_wait_ms,
    mean_caused_wait_ms, ops: {op: {collectives, times_last, last_fraction, total_wait_ms,
    mean_wait_ms, max_wait_ms}}}}, "by_op_size": {op: {bytes: {count, total_comm_latency_ms,
    avg_comm_latency_ms, straggler_ms: {rank: total}}}}, "matched", "unmatched", "criteria",
    "offsets_ns"}``. ``caused_wait_ms`` sums, over the collectives where the rank was last, the
    others' mean wait. ``by_op_size`` is DeepSpeed's straggler view: comm latency = the smallest
    latency of the members (the last arriver's, which did not wait), a rank's straggler time =
    its latency - that.
    """
    if not 0.0 <= last_fraction < 1.0:
        raise ValueError(f"last_fraction must be in [0, 1) (got {last_fraction})")
    if min_wait_ms < 0:
        raise ValueError(f"min_wait_ms must be >= 0 (got {min_wait_ms})")
    offsets = dict(offsets_ns or {})
    collectives: dict[tuple, dict[int, Mapping]] = defaultdict(dict)
    for rank, records in per_rank.items():
        for r in records:
            key = (r["group"], P2P_MATCH.get(r["op"], r["op"]), r["seq"])
            if rank in collectives[key]:
                raise ValueError(f"per_rank[{rank}] holds collective {key} twice")
            collectives[key][rank] = r

    ranks_stats = {rank: {**_wait_stats(), "caused_wait_ms": 0.0, "ops": {}} for rank in per_rank}
    by_op_size: dict[str, dict[int, dict]] = defaultdict(dict)
    matched = unmatched = 0
    for (group, op, _), members in sorted(collectives.items()):
        expected = {int(x) for x in group.split(",")} if group else set(members)
        if len(expected) < 2:
            continue
        if set(members) != expected:
            unmatched += 1
            continue
        matched += 1
        arrival = {rank: rec["arrival_ns"] - offsets.get(rank, 0) for rank, rec in members.items()}
        start = max(arrival.values())
        last = min(rank for rank, t in arrival.items() if t == start)
        waits = {rank: (start - t) / 1e6 for rank, t in arrival.items()}
        for rank, wait in waits.items():
            for s in (ranks_stats[rank], ranks_stats[rank]["ops"].setdefault(op, _wait_stats())):
                s["collectives"] += 1
                s["total_wait_ms"] += wait
                s["max_wait_ms"] = max(s["max_wait_ms"], wait)
                s["times_last"] += rank == last
        others = [w for rank, w in waits.items() if rank != last]
        ranks_stats[last]["caused_wait_ms"] += sum(others) / len(others)

        latencies = {rank: rec.get("latency_ms") for rank, rec in members.items()}
        if all(v is not None for v in latencies.values()):
            nbytes = members[last]["bytes"]
            row = by_op_size[op].setdefault(nbytes, {"count": 0, "total_comm_latency_ms": 0.0,
                                                      "straggler_ms": defaultdict(float)})
            fastest = min(latencies.values())
            row["count"] += 1
            row["total_comm_latency_ms"] += fastest
            for rank, lat in latencies.items():
                row["straggler_ms"][rank] += lat - fastest

    for s in ranks_stats.values():
        _finish_wait_stats(s)
        s["mean_caused_wait_ms"] = s["caused_wait_ms"] / s["times_last"] if s["times_last"] else 0.0
        for o in s["ops"].values():
            _finish_wait_stats(o)
    for sizes in by_op_size.values():
        for row in sizes.values():
            row["avg_comm_latency_ms"] = row["total_comm_latency_ms"] / row["count"]
            row["straggler_ms"] = dict(sorted(row["straggler_ms"].items()))
    named = [rank for rank, s in ranks_stats.items()
             if s["collectives"] and s["last_fraction"] > last_fraction
             and s["mean_caused_wait_ms"] >= min_wait_ms]
    named.sort(key=lambda rank: -ranks_stats[rank]["caused_wait_ms"])
    return {
        "stragglers": named,
        "ranks": dict(sorted(ranks_stats.items())),
        "by_op_size": {op: dict(sorted(sizes.items())) for op, sizes in sorted(by_op_size.items())},
        "matched": matched,
        "unmatched": unmatched,
        "criteria": {"last_fraction": last_fraction, "min_wait_ms": min_wait_ms},
        "offsets_ns": {rank: offsets.get(rank, 0) for rank in sorted(per_rank)},
    }
