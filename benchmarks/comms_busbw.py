"""The comms logger's bus bandwidth against a direct measurement, on several GPUs.

    python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/comms_busbw.py
        [--mib 1 16 256 1024] [--report reports/<suite>/<run-id>]

It also gives the measured bus-bandwidth curve the dashboard draws beside a run's collectives
(``--report``, below).

Per message size, trial and arm, 20 all_reduces of one fp32 tensor of that many MiB, back to back:

* ``direct``: ``torch.distributed.all_reduce`` with no observer, timed as a whole by two CUDA
  events around the 20 calls; per-call latency = total / 20.
* ``logged``: the same 20 calls through :func:`dslab.comm.all_reduce` with the comms logger on;
  the figure is the logger's own ``busbw_GBps`` for that size (the mean of its per-call figures,
  each from the CUDA events it records around the call).

busbw = bytes / latency * 2 (n - 1) / n (nccl-tests' definition for all_reduce), GB = 1e9 bytes.
The two arms alternate trial by trial; rank 0 prints the medians and their ratio per size last.

With ``--report RUN`` (a run's directory or its ``run.json``, best one of the same GPUs and
process count), rank 0 also writes the direct medians into that run's report as
``peaks["comms_busbw"]`` (:func:`reference_record`; the report is rewritten atomically, its other
keys unchanged). The dashboard's Comms tab draws them as the reference curve of its bus-bandwidth
plot (:func:`dashboards.comms_view.reference_busbw`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from dslab import comm
from dslab.profilers.comms import CommsLogger, CommsLoggerConfig
from dslab.profilers.comms_analysis import bus_factor
from dslab.report import read_report
from dslab.report.store import REPORT_FILE, atomic_write_text

CALLS = 20
#: the key of the record in a run report's ``peaks``
PEAKS_KEY = "comms_busbw"


def direct_busbw(x: torch.Tensor, world: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    start.record()
    for _ in range(CALLS):
        dist.all_reduce(x)
    end.record()
    end.synchronize()
    latency_s = start.elapsed_time(end) / 1e3 / CALLS
    return x.numel() * x.element_size() / latency_s * bus_factor("all_reduce", world) / 1e9


def logged_busbw(x: torch.Tensor) -> float:
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    try:
        dist.barrier()
        torch.cuda.synchronize()
        for _ in range(CALLS):
            comm.all_reduce(x)
        summary = logger.summary()
        row = summary["all_reduce"][x.numel() * x.element_size()]
        if row["timed_count"] != CALLS:
            raise RuntimeError(f"the logger timed {row['timed_count']} of {CALLS} calls")
        return row["busbw_GBps"]
    finally:
        logger.close()


def reference_record(direct: dict[int, list[float]], logged: dict[int, list[float]], world: int, gpu: str,
                     trials: int) -> dict:
    """The ``peaks["comms_busbw"]`` record of one measurement: ``{"op": "all_reduce", "dtype":
    "float32", "world_size", "gpu", "calls"`` (per trial), ``"trials", "created"`` (UTC),
    ``"source", "points": [{"size_bytes", "busbw_GBps"`` (median of the direct trials),
    ``"logged_busbw_GBps"`` (median of the logger's), ``"trials_GBps"`` (the direct trials)``}]}``,
    points by size; ``direct`` and ``logged`` map a message size in bytes to its trials' GB/s."""
    points = [{"size_bytes": size, "busbw_GBps": statistics.median(direct[size]),
               "logged_busbw_GBps": statistics.median(logged[size]) if logged.get(size) else None,
               "trials_GBps": list(direct[size])} for size in sorted(direct)]
    return {"op": "all_reduce", "dtype": "float32", "world_size": world, "gpu": gpu, "calls": CALLS,
            "trials": trials, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": "benchmarks/comms_busbw.py", "points": points}


def write_reference(run: str | Path, record: dict) -> Path:
    """``record`` into the report of run ``run`` (its directory or ``run.json``) as
    ``peaks["comms_busbw"]``, written atomically with every other key as it was; returns the
    report's path. Raises FileNotFoundError or ValueError when ``run`` holds no readable run report."""
    path = Path(run)
    path = path / REPORT_FILE if path.is_dir() else path
    read_report(path)  # a run report, readable: refuse anything else before rewriting it
    data = json.loads(path.read_text())
    peaks = data.get("peaks") if isinstance(data.get("peaks"), dict) else {}
    data["peaks"] = {**peaks, PEAKS_KEY: record}
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[1024.0],
                        help="message sizes in MiB (default 1024)")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--report", help="a run's directory: write the direct medians into its report's peaks")
    args = parser.parse_args()
    if any(m <= 0 for m in args.mib):
        raise ValueError(f"--mib sizes must be > 0, got {args.mib}")
    if args.report is not None:
        read_report(args.report)  # fail before measuring, not after
    comm.init_distributed(dist_backend="nccl")
    rank, world = comm.get_rank(), comm.get_world_size()
    torch.cuda.set_device(comm.get_local_rank())
    direct: dict[int, list[float]] = {}
    logged: dict[int, list[float]] = {}
    for mib in args.mib:
        x = torch.ones(max(1, int(mib * 2**20) // 4), device="cuda")
        size = x.numel() * x.element_size()
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        direct[size], logged[size] = [], []
        for trial in range(args.trials):
            direct[size].append(direct_busbw(x, world))
            logged[size].append(logged_busbw(x))
            if rank == 0:
                print(f"{size} bytes trial {trial}: direct {direct[size][-1]:.1f} GB/s  "
                      f"logged {logged[size][-1]:.1f} GB/s", flush=True)
        del x
    if rank == 0:
        print(f"\nall_reduce fp32 on {world} x {torch.cuda.get_device_name()}, "
              f"{CALLS} calls per trial, median of {args.trials} trials")
        print(f"{'bytes':>12} {'direct GB/s':>12} {'logged GB/s':>12} {'logged/direct':>14}")
        for size in sorted(direct):
            d, lg = statistics.median(direct[size]), statistics.median(logged[size])
            print(f"{size:>12} {d:>12.1f} {lg:>12.1f} {lg / d:>14.4f}  (within 10%: {abs(lg / d - 1) <= 0.10})")
        if args.report is not None:
            record = reference_record(direct, logged, world, torch.cuda.get_device_name(), args.trials)
            print(f"bus-bandwidth curve written into {write_reference(args.report, record)} (peaks.{PEAKS_KEY})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
