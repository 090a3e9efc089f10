"""Text for the comms logger: DeepSpeed's ``log_summary`` table, the straggler tables and the
``verbose`` line. Formatting only; the figures come from :mod:`dslab.profilers.comms_analysis`."""

from __future__ import annotations

from typing import Mapping

_UNITS = ("B", "KB", "MB", "GB", "TB")
_WIDTH = 22


def human_size(nbytes: int) -> str:
    """``nbytes`` in B/KB/MB/GB/TB of 1024^k bytes, two decimals (DeepSpeed's convention):
    ``1536 -> '1.50 KB'``."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0 (got {nbytes})")
    value, unit = float(nbytes), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{value:.2f} {_UNITS[unit]}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _line(cells) -> str:
    """Cells left-aligned in columns of ``_WIDTH``, always at least two spaces apart."""
    return "".join(f"{c!s:<{_WIDTH - 2}}  " for c in cells).rstrip()


SUMMARY_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                   "tput_avg (Gbps)", "busbw_avg (Gbps)")


def format_summary(summary: Mapping[str, Mapping[int, Mapping]]) -> str:
    """DeepSpeed's ``log_summary`` table: a header, then per op a line with its name and one
    line per message size (count, total and mean latency in ms, mean per-call algbw and busbw in
    Gbps). ``-`` marks a figure that is not defined (untimed calls, ops without payload)."""
    lines = [_line(SUMMARY_COLUMNS)]
    for label, sizes in summary.items():
        lines.append(label)
        for size, s in sizes.items():
            lines.append(_line(("", human_size(size), s["count"], _num(s["total_latency_ms"]),
                                _num(s["avg_latency_ms"]), _num(s["algbw_gbps"]),
                                _num(s["busbw_gbps"]))))
    return "\n".join(lines)


STRAGGLER_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total comm lat(ms)",
                     "Total straggler(ms)", "Avg comm lat(ms)", "Avg straggler(ms)")
WAIT_COLUMNS = ("Rank", "Collectives", "Times last", "Last (%)", "Mean wait(ms)",
                "Total wait(ms)", "Others wait(ms)")


def format_stragglers(analysis: Mapping, rank: int) -> str:
    """Two tables from :func:`~dslab.profilers.comms_analysis.analyze_stragglers`: DeepSpeed's
    straggler view for ``rank`` (comm latency = the fastest member's, straggler = ``rank``'s
    latency beyond it), then every rank's wait at the collectives and how often it came last
    ("Others wait" = the others' mean wait when it was last), and the ranks named stragglers."""
    lines = [_line(STRAGGLER_COLUMNS)]
    for op, sizes in analysis["by_op_size"].items():
        lines.append(op)
        for size, row in sizes.items():
            mine = row["straggler_ms"].get(rank, 0.0)
            lines.append(_line(("", human_size(size), row["count"],
                                _num(row["total_comm_latency_ms"]), _num(mine),
                                _num(row["avg_comm_latency_ms"]), _num(mine / row["count"]))))
    lines.append("")
    lines.append(_line(WAIT_COLUMNS))
    for r, s in analysis["ranks"].items():
        lines.append(_line((r, s["collectives"], s["times_last"], f"{100 * s['last_fraction']:.1f}",
                            _num(s["mean_wait_ms"]), _num(s["total_wait_ms"]),
                            _num(s["mean_caused_wait_ms"]))))
    c = analysis["criteria"]
    named = ", ".join(str(r) for r in analysis["stragglers"]) or "none"
    lines.append(f"stragglers (last in > {100 * c['last_fraction']:.0f}% of their collectives, "
                 f"others waiting >= {c['min_wait_ms']:g} ms): {named}; "
                 f"{analysis['matched']} collectives matched, {analysis['unmatched']} unmatched")
    return "\n".join(lines)


def format_call(rank: int, label: str, nbytes: int, latency_ms: float | None,
                algbw_gbs: float | None, busbw_gbs: float | None) -> str:
    """The ``verbose`` line of one call (DeepSpeed's layout; bandwidths in Gbps)."""
    return (f"rank={rank} | comm op: {label} | time (ms): {_num(latency_ms)} | "
            f"msg size: {human_size(nbytes)} | "
            f"algbw (Gbps): {_num(None if algbw_gbs is None else algbw_gbs * 8)} | "
            f"busbw (Gbps): {_num(None if busbw_gbs is None else busbw_gbs * 8)}")
