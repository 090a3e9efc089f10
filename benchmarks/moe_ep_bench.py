"""Expert parallelism on several GPUs: the MoE layer at the anchor shape per GPU (16,384 tokens,
hidden 1024, FFN 4096, 8 experts, bf16 parameters, dropless), forward + backward, with the experts
sharded over all GPUs (ep_size = world) against every GPU holding all 8 experts (ep_size 1, the
data-parallel layout), in one run.

    torchrun --standalone --nproc_per_node 2 benchmarks/moe_ep_bench.py [--reps 20] [--warmup 5]

A step is ``out, l_aux, _ = layer(x)`` and the backward of ``(out, l_aux)`` from a fixed upstream
gradient, on every rank at once; its time is the slowest rank's (CUDA events around the step,
maxed over ranks), median of ``--reps`` after ``--warmup``. ep_size > 1 runs eagerly (its exchange
sizes are data-dependent, which a CUDA graph cannot hold): the ep_size 1 row is eager too, so the
two rows differ by the exchanges and the halved expert work per GPU only. The all_to_all rows come
from dslab's comms logger over the timed steps: calls, bytes per call and bus bandwidth
((n - 1) / n of the bytes over the latency, NCCL's convention).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn

from dslab import comm
from dslab.moe import MoE
from dslab.profilers.comms import CommsLogger, CommsLoggerConfig

TOKENS, HIDDEN, FFN, EXPERTS = 16384, 1024, 4096, 8


def build(k: int, ep_size: int) -> MoE:
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(approximate="tanh"), nn.Linear(FFN, HIDDEN))
    return MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=k, drop_tokens=False).cuda().bfloat16()


def time_steps(layer, x, dy, warmup: int, reps: int) -> tuple[list[float], dict]:
    """The slowest rank's step times and the comms logger's all_to_all summary of the timed steps
    (the logger starts after the warm-up, which holds NCCL's communicator set-up)."""
    one = torch.ones((), device="cuda")

    def step():
        out, l_aux, _ = layer(x)
        torch.autograd.backward([out, l_aux], [dy, one])
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    logger = CommsLogger(CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=["all_to_all"]))
    times = []
    try:
        for _ in range(reps):
            comm.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            slowest = torch.tensor([start.elapsed_time(end)], device="cuda")
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times.append(slowest.item())
        summary = logger.summary().get("all_to_all", {})
    finally:
        logger.close()
    return times, summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    comm.init_distributed(dist_backend="nccl")
    rank, world = comm.get_rank(), comm.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = []
    for k in (1, 2):
        for ep_size in (1, world):
            layer = build(k, ep_size)
            times, summary = time_steps(layer, x, dy, args.warmup, args.reps)
            calls = sum(s["count"] for s in summary.values())
            moved = sum(size * s["count"] for size, s in summary.items())
            latency = sum(s["total_latency_ms"] for s in summary.values())
            busbw = moved * (world - 1) / world / (latency * 1e-3) / 1e9 if latency else 0.0
            ms = statistics.median(times)
            rows.append((k, ep_size, ms, TOKENS / ms * 1e3, calls / max(1, args.reps),
                         moved / max(1, calls), busbw, latency / max(1, calls)))
            del layer
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}; per GPU {TOKENS} tokens, "
              f"hidden {HIDDEN}, FFN {FFN}, {EXPERTS} experts, bf16, dropless")
        print(f"{'k':>2} {'ep_size':>7} {'step ms':>8} {'tokens/s/GPU':>13} {'a2a/step':>8} {'MB/call':>8} "
              f"{'a2a ms/call':>11} {'busbw GB/s':>10}")
        for k, ep, ms, tps, per_step, size, bw, lat in rows:
            print(f"{k:>2} {ep:>7} {ms:>8.3f} {tps:>13.0f} {per_step:>8.1f} {size / 1e6:>8.2f} {lat:>11.3f} {bw:>10.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
