"""Where a ZeRO step's time goes: device busy time, host time, and the host's Python hot spots.

Run under torchrun, one process per GPU::

    torchrun --standalone --nproc_per_node 4 benchmarks/zero_step_profile.py --stage 3 [--cuda-graphs]
        [--granularity N] [--preset gpt2_355m] [--micro-batch 8] [--seq 1024] [--steps 5]

Builds the preset (dslab kernels) in the engine with bf16 autocast, AdamW and clipping at 1.0,
ZeRO at ``--stage``; warms up; then on rank 0 prints, over ``--steps`` steps:

- ``step``: wall time per step (the device synchronised at the end of every step);
- ``host``: the time ``forward + backward + step`` take to return on the host, before the final
  synchronisation: when it is close to ``step`` the host is the bottleneck;
- ``device busy``: the union of the intervals in which any kernel ran, from a
  ``torch.profiler`` trace of the same steps, over the wall time: 1 - idle fraction;
- ``comm``: the time NCCL kernels ran, and how much of it overlapped compute kernels;
- the host's top Python functions by own time (``cProfile`` over the same number of steps), which
  names the host work a step does beyond launching kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

import dslab
from dslab import comm
from dslab.models import gpt2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--granularity", type=int, default=None)
    p.add_argument("--reuse", type=int, default=None)
    p.add_argument("--preset", default="gpt2_355m")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--variants", default="none",
                   help="comma-separated profiler sets, each timed in its own engine: none, all (every "
                        "profiler of suites/zero's engine section) or one of " + ", ".join(PROFILER_KEYS)
                        + "; with more than one, each prints its step and host time and no trace is taken")
    return p.parse_args(argv)


PROFILER_KEYS = ("wall_clock_breakdown", "flops_profiler", "memory_tracer", "comms_logger", "telemetry")


def profiler_config(variant: str) -> dict:
    """The engine keys of one ``--variants`` entry, as suites/zero configures them."""
    if variant == "none":
        return {}
    engine = json.loads((Path(__file__).resolve().parents[1] / "suites" / "zero" / "suite.json").read_text())["engine"]
    names = PROFILER_KEYS if variant == "all" else (variant,)
    unknown = [n for n in names if n not in PROFILER_KEYS]
    if unknown:
        raise SystemExit(f"--variants: unknown profiler {unknown[0]!r} (none, all, {', '.join(PROFILER_KEYS)})")
    return {n: engine[n] for n in names if n in engine}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def main(argv=None) -> None:
    args = parse_args(argv)
    comm.init_distributed()
    device = torch.device("cuda", torch.cuda.current_device())
    rank = comm.get_rank()
    variants = args.variants.split(",")
    for variant in variants:
        profile_variant(args, device, rank, variant, detailed=len(variants) == 1)


def profile_variant(args, device, rank: int, variant: str, detailed: bool) -> None:
    torch.manual_seed(1234)
    with torch.device(device):
        model = gpt2.GPT2LMHeadModel(getattr(gpt2, args.preset)(vocab_pad_multiple=64), kernels="dslab")
    zero = {"stage": args.stage}
    if args.granularity:
        zero["stage3_module_granularity_threshold"] = args.granularity
    if args.reuse is not None:
        zero["stage3_max_reuse_distance"] = args.reuse
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
              "zero_optimization": zero, "cuda_graphs": {"enabled": args.cuda_graphs},
              **profiler_config(variant)}
    engine, _, _, _ = dslab.initialize(model=model, config=config, dist_init_required=False)
    ids = torch.randint(0, 50257, (args.micro_batch, args.seq), device=device,
                        generator=torch.Generator(device).manual_seed(rank))

    def step():
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        hosts.append(t1 - t0)
        walls.append(t2 - t0)
    if not detailed:
        walls.sort()
        hosts.sort()
        if rank == 0:
            print(f"stage {args.stage} graphs {args.cuda_graphs} world {comm.get_world_size()} profilers {variant}: "
                  f"step {1e3 * walls[len(walls) // 2]:.1f} ms (median), host {1e3 * hosts[len(hosts) // 2]:.1f} ms",
                  flush=True)
        engine.destroy()
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        traced_wall = time.perf_counter() - t0
    kernels, nccl = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            interval = (e.time_range.start, e.time_range.end)
            (nccl if "nccl" in e.name.lower() else kernels).append(interval)
    busy = _union(kernels + nccl) / 1e6
    compute = _union(kernels) / 1e6
    comm_time = _union(nccl) / 1e6
    overlapped = compute + comm_time - busy
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    pr.disable()
    if rank == 0:
        walls.sort()
        hosts.sort()
        n = args.steps
        print(f"stage {args.stage} graphs {args.cuda_graphs} granularity {args.granularity} world "
              f"{comm.get_world_size()} {args.preset} mb {args.micro_batch}x{args.seq}")
        print(f"  step {1e3 * walls[n // 2]:.1f} ms (median), host {1e3 * hosts[n // 2]:.1f} ms; traced: wall "
              f"{1e3 * traced_wall / n:.1f} ms/step, device busy {busy / traced_wall:.1%}, compute kernels "
              f"{1e3 * compute / n:.1f} ms/step, nccl {1e3 * comm_time / n:.1f} ms/step "
              f"({overlapped / comm_time if comm_time else 0:.0%} of it beside compute)")
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(args.top)
        lines = [line for line in out.getvalue().splitlines() if line.strip()]
        print("\n".join(lines[:args.top + 8]))
    engine.destroy()


if __name__ == "__main__":
    main()
