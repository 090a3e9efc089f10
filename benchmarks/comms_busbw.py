"""The comms logger's bus bandwidth against a direct measurement, on several GPUs.

    python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/comms_busbw.py [--mib 1024]

Per trial and arm, 20 all_reduces of one ``--mib`` MiB fp32 tensor, back to back:

* ``direct``: ``torch.distributed.all_reduce`` with no observer, timed as a whole by two CUDA
  events around the 20 calls; per-call latency = total / 20.
* ``logged``: the same 20 calls through :func:`dslab.comm.all_reduce` with the comms logger on;
  the figure is the logger's own ``busbw_GBps`` for that size (the mean of its per-call figures,
  each from the CUDA events it records around the call).

busbw = bytes / latency * 2 (n - 1) / n (nccl-tests' definition for all_reduce), GB = 1e9 bytes.
The two arms alternate trial by trial; rank 0 prints the medians and their ratio last.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from dslab import comm
from dslab.profilers.comms import CommsLogger, CommsLoggerConfig
from dslab.profilers.comms_analysis import bus_factor

CALLS = 20


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="message size in MiB (default 1024)")
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args()
    comm.init_distributed(dist_backend="nccl")
    rank, world = comm.get_rank(), comm.get_world_size()
    torch.cuda.set_device(comm.get_local_rank())
    x = torch.ones(args.mib * 2**20 // 4, device="cuda")
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    direct, logged = [], []
    for trial in range(args.trials):
        direct.append(direct_busbw(x, world))
        logged.append(logged_busbw(x))
        if rank == 0:
            print(f"trial {trial}: direct {direct[-1]:.1f} GB/s  logged {logged[-1]:.1f} GB/s", flush=True)
    if rank == 0:
        d, lg = statistics.median(direct), statistics.median(logged)
        print(f"\nall_reduce {args.mib} MiB fp32 on {world} x {torch.cuda.get_device_name()}, "
              f"{CALLS} calls per trial, median of {args.trials} trials")
        print(f"{'arm':<8} {'busbw GB/s':>11}")
        print(f"{'direct':<8} {d:>11.1f}")
        print(f"{'logged':<8} {lg:>11.1f}")
        print(f"logged/direct {lg / d:.4f}  (within 10%: {abs(lg / d - 1) <= 0.10})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
