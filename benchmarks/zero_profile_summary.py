"""Where a data-parallel step's time and memory went, per case and arm, from a run report of
``suites/zero`` (or any suite whose arms record the comms logger's gradient overlap):

    python3 benchmarks/zero_profile_summary.py reports/zero/<run-id>[/run.json[.gz]] [--cases 355m-n2] [--ops]

Per row: the step's median time and the host's time per step; the step's phases (device clock:
forward, backward, the wait between backward's end and the optimizer, the optimizer) from rank
0's gradient-overlap record of the profiled step, or where there is none (one process) the
wall-clock breakdown's medians (its "step" phase is the optimizer's);
the gradient buckets' communication (union of their spans; the part inside backward, the part
after it), and memory (peak allocated per GPU, what CUDA graph pools hold, model states,
activations at the forward's end). With ``--ops``, also each collective's mean latency and bus
bandwidth as the comms logger recorded them in the run. Tables on stdout, nothing written.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

GIB = 2**30


def rows(report: dict, cases: set[str] | None = None) -> list[dict]:
    """One dict per (case, arm) result of ``report`` (a run report's JSON), in report order."""
    comms = report.get("profilers", {}).get("comms", {})
    memory = report.get("profilers", {}).get("memory", {})
    out = []
    for result in report.get("results", []):
        case, arm = result["case"], result["arm"]
        if cases and case not in cases:
            continue
        metrics = result.get("metrics") or {}
        key = f"{case} {arm}"
        row = {"case": case, "arm": arm, "status": result.get("status"),
               "tokens_per_s": metrics.get("tokens_per_s"), "step_ms": metrics.get("step_time_ms"),
               "host_step_ms": metrics.get("host_step_ms"),
               "peak_gib": (metrics.get("peak_memory_bytes") or 0) / GIB,
               "graph_pool_gib": (metrics.get("graph_pool_bytes") or 0) / GIB}
        # the wall-clock breakdown's medians over every step (device clock), where no overlap record is
        wall = ((report.get("profilers", {}).get("wall_clock", {}).get(key) or {}).get("phases") or {})
        for phase, column in (("forward", "forward_ms"), ("backward", "backward_ms"), ("step", "optimizer_ms")):
            if wall.get(phase):
                row[column] = wall[phase]["median_ms"]
        overlap = (comms.get(key) or {}).get("overlap") or {}
        rank0 = (overlap.get("per_rank") or {}).get("0")
        if rank0:
            phases = rank0["phases_ms"]
            row.update(forward_ms=phases["backward_begin"] - phases["forward_begin"],
                       backward_ms=phases["backward_end"] - phases["backward_begin"],
                       wait_ms=phases["optimizer_begin"] - phases["backward_end"],
                       optimizer_ms=phases["step_end"] - phases["optimizer_begin"])
            totals = rank0.get("totals") or {}
            row.update(buckets=totals.get("buckets"), comm_ms=totals.get("comm_ms"),
                       overlapped_ms=totals.get("overlapped_ms"), exposed_ms=totals.get("exposed_ms"))
        mem = memory.get(key) or {}
        states = mem.get("model_states") or {}
        row.update(model_states_gib=(states.get("total") or 0) / GIB,
                   activations_gib=(mem.get("activation_bytes") or 0) / GIB)
        out.append(row)
    return out


def _fmt(value, digits=1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


COLUMNS = (("case", "case", 0), ("arm", "arm", 0), ("tokens_per_s", "tok/s", 0), ("step_ms", "step", 1),
           ("host_step_ms", "host", 1), ("forward_ms", "fwd", 1), ("backward_ms", "bwd", 1),
           ("wait_ms", "wait", 2), ("optimizer_ms", "opt", 1), ("comm_ms", "comm", 2),
           ("overlapped_ms", "in bwd", 2), ("exposed_ms", "after", 2), ("peak_gib", "peak GiB", 2),
           ("graph_pool_gib", "pools", 2), ("model_states_gib", "states", 2), ("activations_gib", "acts", 2))


def table(report_rows: list[dict]) -> str:
    header = [title for _, title, _ in COLUMNS]
    body = [[_fmt(row.get(key), digits) for key, _, digits in COLUMNS] for row in report_rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in [header, *body]]
    return "\n".join(lines)


def op_rows(report: dict, cases: set[str] | None = None) -> list[dict]:
    """The comms logger's per-(op, size) summary of rank 0, per (case, arm): the latency and bus
    bandwidth the run's records give each collective, to hold against ``benchmarks/comms_busbw.py``."""
    out = []
    for key, section in (report.get("profilers", {}).get("comms") or {}).items():
        case, _, arm = key.partition(" ")
        if cases and case not in cases:
            continue
        for row in section.get("ops") or []:
            if row.get("busbw_GBps"):
                out.append({"case": case, "arm": arm, "op": row["op"], "MiB": row["size_bytes"] / 2**20,
                            "calls": row["count"], "avg ms": row["avg_latency_ms"],
                            "min ms": row["min_latency_ms"], "busbw GB/s": row["busbw_GBps"]})
    return out


def plain_table(report_rows: list[dict]) -> str:
    if not report_rows:
        return "(none)"
    header = list(report_rows[0])
    body = [[_fmt(row[k], 2 if isinstance(row[k], float) else 0) for k in header] for row in report_rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [header, *body])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run's directory or its run.json")
    parser.add_argument("--cases", help="comma-separated cases (default: all)")
    parser.add_argument("--ops", action="store_true", help="also the comms logger's per-op latency and busbw")
    args = parser.parse_args()
    path = Path(args.run)
    path = path / "run.json" if path.is_dir() else path
    if not path.is_file():
        raise SystemExit(f"no run report at {path}")
    report = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
    print("ms per step (device clock, rank 0's profiled step; host: the host's time per step), GiB per GPU")
    cases = set(args.cases.split(",")) if args.cases else None
    print(table(rows(report, cases)))
    if args.ops:
        print("\nthe comms logger's collectives (rank 0; mean per-call figures over the run's steps)")
        print(plain_table(op_rows(report, cases)))


if __name__ == "__main__":
    main()
