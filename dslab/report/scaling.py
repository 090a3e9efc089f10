"""Scaling figures of a multi-process run (``suites/zero``, ``suites/parallel``): each arm's
throughput against the number of processes, its scaling efficiency, its peak memory per GPU, and
dslab's arms against the peers that shard or split the model the same way.

A data-parallel suite names each case after its model case and process count: ``355m-n4`` is
case ``355m`` on 4 processes, each stepping the case's micro-batch. Its entry in
``config.cases`` says so (``base_case``, ``nprocs``); a report without them is read from the
name's ``-n<N>`` suffix.

- ``tokens_per_s`` (``samples_per_s`` where a case has no tokens) is global: every rank's
  micro-batch per (slowest rank's) step.
- The weak-scaling efficiency at N processes is ``tokens/s(N) / (N x tokens/s(1))`` for the same
  arm and model case, when the run measured that arm on one process; 1.0 is perfect scaling.
- Peak memory per GPU is the largest rank's (``peak_memory_bytes``, the CUDA allocator's peak
  over a trial plus the arm's graph pools; on a CPU the largest ``peak_rss_bytes_rank<r>``).

Sharding peers (:data:`SHARDING_PEERS`): stage 0 replicates everything like DDP; stages 1 and 2
shard what DeepSpeed's same stages shard; stage 3 shards the parameters too, like FSDP2 (with or
without compiled blocks) and DeepSpeed's stage 3. A report whose config names its own ``peers``
(``{dslab arm: [peer arms]}``: a model-parallel run pairs the arms of one layout, ``dslab-pp4``
with ``torch-pp4`` and ``deepspeed-pp4``) is read with those instead (:func:`report_peers`). Each
dslab arm is compared with each of its peers in the same case (a ratio of throughput, and of peak
memory) and with the fastest of them.

A model-parallel run (``config.kind`` ``model_parallel``) steps the case's global batch on every
process count, so its efficiency ``tokens/s(N) / (N x tokens/s(1))`` is a strong-scaling one; the
summary says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dslab.report.schema import RunReport

# dslab's data-parallel arms and the peers that shard model states the same way.
SHARDING_PEERS: dict[str, tuple[str, ...]] = {
    "dslab-zero0": ("ddp", "deepspeed-zero0"),
    "dslab-zero1": ("deepspeed-zero1",),
    "dslab-zero2": ("deepspeed-zero2",),
    "dslab-zero3": ("fsdp2", "fsdp2-compile", "deepspeed-zero3"),
    "dslab-zero3-offload": ("deepspeed-zero3-offload",),
}
_SUFFIX = re.compile(r"^(?P<base>.+)-n(?P<n>[1-9][0-9]*)$")


def case_name(base: str, nprocs: int) -> str:
    """The name of model case ``base`` on ``nprocs`` processes."""
    return f"{base}-n{nprocs}"


def case_processes(report: RunReport) -> dict[str, tuple[str, int]]:
    """``{case: (model case, processes)}`` for every case of the report that has a process count
    (from ``config.cases``, else the name's ``-n<N>`` suffix)."""
    out: dict[str, tuple[str, int]] = {}
    entries = report.config.get("cases") if isinstance(report.config, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("nprocs"), int) and isinstance(entry.get("name"), str):
            out[entry["name"]] = (str(entry.get("base_case") or entry["name"]), entry["nprocs"])
    for case in report.cases():
        if case not in out:
            match = _SUFFIX.match(case)
            if match:
                out[case] = (match["base"], int(match["n"]))
    return out


def _peak_bytes(metrics: dict) -> float | None:
    peak = metrics.get("peak_memory_bytes")
    if isinstance(peak, (int, float)):
        return float(peak)
    rss = [v for k, v in metrics.items() if k.startswith("peak_rss_bytes_rank") and isinstance(v, (int, float))]
    return float(max(rss)) if rss else None


@dataclass(frozen=True)
class ScalingPoint:
    """One arm on one model case at one process count."""

    base_case: str
    arm: str
    nprocs: int
    case: str
    status: str
    tokens_per_s: float | None
    efficiency: float | None
    peak_memory_bytes: float | None


def _throughput(metrics: dict) -> float | None:
    value = metrics.get("tokens_per_s", metrics.get("samples_per_s"))
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def scaling_points(report: RunReport) -> list[ScalingPoint]:
    """Every (model case, arm, process count) the report measured, in the report's order."""
    processes = case_processes(report)
    single: dict[tuple[str, str], float] = {}
    for result in report.results:
        if result.case in processes and processes[result.case][1] == 1 and result.status == "ok":
            value = _throughput(result.metrics)
            if value is not None:
                single[(processes[result.case][0], result.arm)] = value
    points = []
    for result in report.results:
        if result.case not in processes:
            continue
        base, n = processes[result.case]
        value = _throughput(result.metrics) if result.status == "ok" else None
        one = single.get((base, result.arm))
        efficiency = value / (n * one) if value is not None and one else None
        points.append(ScalingPoint(base, result.arm, n, result.case, result.status, value, efficiency,
                                   _peak_bytes(result.metrics) if result.status == "ok" else None))
    return points


@dataclass(frozen=True)
class PeerComparison:
    """A dslab arm against one peer in one case: throughput over the peer's, and peak memory over
    the peer's (below 1: dslab needs less)."""

    case: str
    arm: str
    peer: str
    speedup: float
    memory_ratio: float | None


def report_peers(report: RunReport) -> dict[str, tuple[str, ...]]:
    """The peers each dslab arm of ``report`` is compared with: the report config's ``peers``
    where it names them, else :data:`SHARDING_PEERS`."""
    configured = report.config.get("peers") if isinstance(report.config, dict) else None
    if isinstance(configured, dict):
        return {str(arm): tuple(str(p) for p in peers) for arm, peers in configured.items()
                if isinstance(peers, list)}
    return SHARDING_PEERS


def peer_comparisons(report: RunReport) -> list[PeerComparison]:
    """Each dslab arm against each of its peers (:func:`report_peers`) that ran ``ok`` in the
    same case."""
    by_key = {(p.case, p.arm): p for p in scaling_points(report)}
    peers = report_peers(report)
    out = []
    for (case, arm), mine in by_key.items():
        if arm not in peers or mine.tokens_per_s is None:
            continue
        for peer in peers[arm]:
            theirs = by_key.get((case, peer))
            if theirs is None or theirs.tokens_per_s is None:
                continue
            memory = (mine.peak_memory_bytes / theirs.peak_memory_bytes
                      if mine.peak_memory_bytes and theirs.peak_memory_bytes else None)
            out.append(PeerComparison(case, arm, peer, mine.tokens_per_s / theirs.tokens_per_s, memory))
    return out


def best_peer_ratios(report: RunReport) -> dict[str, dict[str, float]]:
    """``{case: {"<arm>/<peer>": speedup, ..., "<arm>/best_peer": speedup over the fastest}}``,
    the entries :meth:`RunReport.ratios` keeps for a data-parallel run."""
    ratios: dict[str, dict[str, float]] = {}
    fastest: dict[tuple[str, str], float] = {}
    for c in peer_comparisons(report):
        ratios.setdefault(c.case, {})[f"{c.arm}/{c.peer}"] = c.speedup
        key = (c.case, c.arm)
        fastest[key] = min(fastest.get(key, c.speedup), c.speedup)
    for (case, arm), speedup in fastest.items():
        ratios[case][f"{arm}/best_peer"] = speedup
    return ratios


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def scaling_table(report: RunReport) -> str:
    """The terminal's scaling summary: per model case, one row per arm with tokens/s, efficiency
    and peak GiB per GPU at each process count, then dslab's arms against their peers."""
    points = scaling_points(report)
    if not points:
        return ""
    counts = sorted({p.nprocs for p in points})
    kind = report.config.get("kind") if isinstance(report.config, dict) else None
    if kind == "model_parallel":
        lines = ["strong scaling (the case's global batch on every process count): tokens/s, efficiency = "
                 "tokens/s(N) / (N x tokens/s(1)), peak GiB per GPU"]
    elif kind == "long_context":
        lines = ["one sequence split over the processes: tokens/s (all ranks), efficiency = tokens/s(N) / "
                 "(N x tokens/s(1)) where one process ran the case, peak GiB per GPU"]
    else:
        lines = ["weak scaling: tokens/s (all ranks), efficiency = tokens/s(N) / (N x tokens/s(1)), "
                 "peak GiB per GPU"]
    by_key = {(p.base_case, p.arm, p.nprocs): p for p in points}
    for base in dict.fromkeys(p.base_case for p in points):
        arms = list(dict.fromkeys(p.arm for p in points if p.base_case == base))
        header = ["arm", *(f"N={n} {col}" for n in counts for col in ("tok/s", "eff", "GiB"))]
        rows = []
        for arm in arms:
            row = [arm]
            for n in counts:
                p = by_key.get((base, arm, n))
                if p is None:
                    row += ["", "", ""]
                elif p.status != "ok":
                    row += [p.status, "", ""]
                else:
                    row += [_fmt(p.tokens_per_s, ",.0f"), _fmt(p.efficiency, ".2f"),
                            _fmt(None if p.peak_memory_bytes is None else p.peak_memory_bytes / 2**30, ".2f")]
            rows.append(row)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines.append(f"{base}:")
        lines.append("  " + "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    comparisons = peer_comparisons(report)
    if comparisons:
        way = "split the model" if kind == "model_parallel" else "shard"
        lines.append(f"dslab against the peers that {way} the same way (throughput x, peak memory x):")
        for c in comparisons:
            memory = "" if c.memory_ratio is None else f", memory {c.memory_ratio:.2f}x"
            lines.append(f"  {c.case}: {c.arm} {c.speedup:.2f}x {c.peer}{memory}")
    return "\n".join(lines)
