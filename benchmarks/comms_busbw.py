"""The comms logger's bus bandwidth against a direct measurement, on several GPUs.

    python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/comms_busbw.py
        [--mib 1 16 256 1024] [--ops all_reduce all_gather reduce_scatter] [--dtype bfloat16]
        [--report reports/<suite>/<run-id>]

It also gives the measured bus-bandwidth curve the dashboard draws beside a run's collectives
(``--report``, below).

Per op, message size, trial and arm, 20 calls on one tensor of that many MiB (all_reduce: the
buffer; all_gather: the gathered output; reduce_scatter: the input, nccl-tests' sizes, which are
also the sizes the comms logger records), back to back:

* ``direct``: the ``torch.distributed`` call with no observer, timed as a whole by two CUDA
  events around the 20 calls; per-call latency = total / 20.
* ``logged``: the same 20 calls through :mod:`dslab.comm` with the comms logger on; the figure
  is the logger's own ``busbw_GBps`` for that op and size (the mean of its per-call figures, each
  from the CUDA events it records around the call).

busbw = bytes / latency * factor, nccl-tests' factors (all_reduce 2(n - 1)/n, all_gather and
reduce_scatter (n - 1)/n), GB = 1e9 bytes. The two arms alternate trial by trial; rank 0 prints
the medians and their ratio per op and size last.

With ``--report RUN`` (a run's directory or its ``run.json``, best one of the same GPUs and
process count), rank 0 also writes the direct all_reduce medians into that run's report as
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


OPS = ("all_reduce", "all_gather", "reduce_scatter")


def buffers(op: str, size_bytes: int, dtype: torch.dtype, world: int,
            device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, input)`` of one ``op`` call of ``size_bytes`` (nccl-tests' size, rounded down to
    a multiple of the world size's elements); the same tensor twice for all_reduce."""
    per_rank = max(1, size_bytes // torch.tensor([], dtype=dtype).element_size() // world)
    whole = torch.ones(per_rank * world, dtype=dtype, device=device)
    if op == "all_reduce":
        return whole, whole
    part = torch.ones(per_rank, dtype=dtype, device=device)
    return (whole, part) if op == "all_gather" else (part, whole)


def _call(api, op: str, output: torch.Tensor, input: torch.Tensor) -> None:
    """One ``op`` call through ``api``: ``torch.distributed`` (direct) or :mod:`dslab.comm`
    (observed by the comms logger), which name these calls alike."""
    if op == "all_reduce":
        api.all_reduce(output)
    elif op == "all_gather":
        api.all_gather_into_tensor(output, input)
    else:
        api.reduce_scatter_tensor(output, input)


def size_of(op: str, output: torch.Tensor, input: torch.Tensor) -> int:
    """The call's bytes as nccl-tests and the comms logger count them."""
    tensor = input if op == "reduce_scatter" else output
    return tensor.numel() * tensor.element_size()


def direct_busbw(op: str, output: torch.Tensor, input: torch.Tensor, world: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    start.record()
    for _ in range(CALLS):
        _call(dist, op, output, input)
    end.record()
    end.synchronize()
    latency_s = start.elapsed_time(end) / 1e3 / CALLS
    return size_of(op, output, input) / latency_s * bus_factor(op, world) / 1e9


def logged_busbw(op: str, output: torch.Tensor, input: torch.Tensor) -> float:
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    try:
        dist.barrier()
        torch.cuda.synchronize()
        for _ in range(CALLS):
            _call(comm, op, output, input)
        summary = logger.summary()
        row = summary[op][size_of(op, output, input)]
        if row["timed_count"] != CALLS:
            raise RuntimeError(f"the logger timed {row['timed_count']} of {CALLS} {op} calls")
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
    parser.add_argument("--ops", nargs="+", choices=OPS, default=["all_reduce"])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--report", help="a run's directory: write the direct all_reduce medians into its report's peaks")
    args = parser.parse_args()
    if any(m <= 0 for m in args.mib):
        raise ValueError(f"--mib sizes must be > 0, got {args.mib}")
    if args.report is not None:
        read_report(args.report)  # fail before measuring, not after
        if "all_reduce" not in args.ops:
            raise ValueError("--report writes the all_reduce curve: add all_reduce to --ops")
    dtype = getattr(torch, args.dtype)
    comm.init_distributed(dist_backend="nccl")
    rank, world = comm.get_rank(), comm.get_world_size()
    torch.cuda.set_device(comm.get_local_rank())
    direct: dict[str, dict[int, list[float]]] = {op: {} for op in args.ops}
    logged: dict[str, dict[int, list[float]]] = {op: {} for op in args.ops}
    for op in args.ops:
        for mib in args.mib:
            output, input = buffers(op, int(mib * 2**20), dtype, world)
            size = size_of(op, output, input)
            for _ in range(5):
                _call(dist, op, output, input)
            torch.cuda.synchronize()
            direct[op][size], logged[op][size] = [], []
            for trial in range(args.trials):
                direct[op][size].append(direct_busbw(op, output, input, world))
                logged[op][size].append(logged_busbw(op, output, input))
                if rank == 0:
                    print(f"{op} {size} bytes trial {trial}: direct {direct[op][size][-1]:.1f} GB/s  "
                          f"logged {logged[op][size][-1]:.1f} GB/s", flush=True)
            del output, input
    if rank == 0:
        print(f"\n{args.dtype} on {world} x {torch.cuda.get_device_name()}, "
              f"{CALLS} calls per trial, median of {args.trials} trials")
        print(f"{'op':>15} {'bytes':>12} {'direct GB/s':>12} {'logged GB/s':>12} {'logged/direct':>14}")
        for op in args.ops:
            for size in sorted(direct[op]):
                d, lg = statistics.median(direct[op][size]), statistics.median(logged[op][size])
                print(f"{op:>15} {size:>12} {d:>12.1f} {lg:>12.1f} {lg / d:>14.4f}  "
                      f"(within 5%: {abs(lg / d - 1) <= 0.05})")
        if args.report is not None:
            record = reference_record(direct["all_reduce"], logged["all_reduce"], world,
                                      torch.cuda.get_device_name(), args.trials)
            record["dtype"] = args.dtype
            print(f"bus-bandwidth curve written into {write_reference(args.report, record)} (peaks.{PEAKS_KEY})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
