"""Where one arm's training step spends its host time, as a suite builds the arm (one process,
one GPU; the tiny scale on a CPU; under torchrun with a process group of one, as a suite runs
N = 1): the suite's workload, engine config and batch (``dslab.bench``), warmed up, then

- each step's host time (until ``step()`` returns) beside its device time (CUDA events), and
- a cProfile of ``--steps`` steps, by own time, with the callers of the costliest built-ins: a
  synchronisation inside the step (``.item()``, ``Event.synchronize``, a copy to the host) shows
  as a built-in that takes most of a step;
- with ``--sync-debug``, every call torch reports as synchronising (``set_sync_debug_mode``),
  with the stack that made it.

    python benchmarks/step_host_profile.py suites/zero --case 355m --arm dslab-zero3 \
        [--drop-profilers] [--warmup 5] [--steps 5] [--sync-debug]
"""

import argparse
import collections
import cProfile
import io
import pstats
import re
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from dslab import comm
from dslab.bench.arms import EngineArm
from dslab.bench.data_parallel import arm_engine_config, data_parallel_workloads
from dslab.bench.suite import load_suite

PROFILER_KEYS = ("flops_profiler", "memory_tracer", "comms_logger", "telemetry", "wall_clock_breakdown")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite")
    p.add_argument("--case", required=True)
    p.add_argument("--arm", required=True, help="a dslab arm of the suite (dslab-zero0 ... dslab-zero3)")
    p.add_argument("--drop-profilers", action="store_true", help="without the suite engine's profiler keys")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--sync-debug", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    comm.init_distributed()
    suite, _ = load_suite(args.suite)
    (workload,) = data_parallel_workloads(suite, "full" if cuda else "tiny", [args.case], [1])
    engine = dict(suite.engine)
    if args.drop_profilers:
        for key in PROFILER_KEYS:
            engine.pop(key, None)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # the profilers' text reports go to files, as in a suite run, not among this script's output
    profile_dir = Path(tempfile.mkdtemp(prefix="step_host_profile-"))
    arm = EngineArm(workload, device, suite.precision, arm_engine_config(engine, args.arm), profile_dir=profile_dir)
    for _ in range(args.warmup):
        arm.step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    hosts, walls = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        arm.step()
        hosts.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record()
            end.synchronize()
            walls.append(start.elapsed_time(end))
        else:
            walls.append(hosts[-1])
    world = f" world {comm.get_world_size()}" if comm.is_initialized() else ""
    label = f"{args.suite} {args.case} {args.arm}{' (profilers dropped)' if args.drop_profilers else ''}{world}"
    rank0 = comm.get_rank() == 0
    if rank0:
        print(f"{label}: step {statistics.median(walls):.1f} ms (device, median), host {statistics.median(hosts):.1f} ms")
        print(f"  layer stack: {arm.cuda_graph_stats()}")
    profile = cProfile.Profile()
    sync()
    profile.enable()
    for _ in range(args.steps):
        arm.step()
    profile.disable()
    sync()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).sort_stats("tottime")
    stats.print_stats(args.top)
    builtins = [(fn, row) for fn, row in stats.stats.items() if fn[0] == "~"]
    builtins.sort(key=lambda item: -item[1][2])
    for fn, _ in builtins[:3]:
        shown = "{" + fn[2][1:-1] + "}" if fn[2].startswith("<") else fn[2]  # as pstats prints it
        stats.print_callers(re.escape(shown))
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    if rank0:
        print("\n".join(lines))
    if args.sync_debug and cuda:
        seen = collections.Counter()

        def show(message, category, filename, lineno, file=None, line=None):
            seen["".join(traceback.format_stack(limit=9)[:-2])] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                arm.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if rank0:
            print(f"synchronising calls in one step: {sum(seen.values())}")
            for stack, n in seen.most_common(6):
                print(f"-- {n} x\n{stack}")
    arm.close()


if __name__ == "__main__":
    main()
