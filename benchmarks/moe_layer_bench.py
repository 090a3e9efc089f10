"""The MoE layer alone at the anchor shape (16,384 tokens, hidden 1024, FFN 4096, 8 experts, bf16
autocast over fp32 parameters, dropless), forward + backward, dslab's layer against the naive
per-expert loop (:class:`dslab.models.moe_naive.NaiveMoE`, same weights), in one process.

    python3 benchmarks/moe_layer_bench.py [--reps 20] [--warmup 5] [--profile]

A step is ``out, l_aux, _ = layer(x); (out.float().pow(2).mean() + l_aux).backward()`` with the
gradients of x and of every parameter (no optimizer). Times: CUDA events around each step, median
of ``--reps`` after ``--warmup``. Expert TFLOP/s: 12 * hidden * ffn flops per (token, expert)
assignment over the median step, against the measured dense bf16 matmul peak (torch.matmul at
8192^3, same process). ``--profile`` prints the device time per kernel of one dslab step and
whether the step synchronises with the host.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dslab.models.moe_naive import NaiveMoE  # noqa: E402
from dslab.moe import MoE  # noqa: E402

TOKENS, HIDDEN, FFN, EXPERTS = 16384, 1024, 4096, 8


def median_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_tflops():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ a, 3, 10)
    return 2 * 8192 ** 3 / ms / 1e9


def build(k):
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(approximate="tanh"), nn.Linear(FFN, HIDDEN))
    fast = MoE(HIDDEN, expert, num_experts=EXPERTS, k=k, drop_tokens=False).cuda()
    naive = NaiveMoE(HIDDEN, FFN, num_experts=EXPERTS, k=k, drop_tokens=False).cuda()
    naive.load_state_dict(fast.state_dict())
    return fast, naive


def step_fn(layer, x):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, l_aux, _ = layer(x)
        (out.float().pow(2).mean() + l_aux).backward()
        x.grad = None
        for p in layer.parameters():
            p.grad = None
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    peak = peak_tflops()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; measured bf16 peak {peak:.0f} TFLOP/s")
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rows = []
    for k in (1, 2):
        fast, naive = build(k)
        fast.eval(), naive.eval()  # no gate noise: both must route identically
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out_f, aux_f, counts_f = fast(x)
            out_n, aux_n, counts_n = naive(x)
        err = ((out_f.float() - out_n.float()).norm() / out_n.float().norm()).item()
        assert torch.equal(counts_f.cpu(), counts_n.cpu()), "routing differs"
        fast.train(), naive.train()
        flops = 12 * HIDDEN * FFN * TOKENS * k
        for name, layer in (("dslab", fast), ("naive loop", naive)):
            ms = median_ms(step_fn(layer, x), args.warmup, args.reps)
            rows.append((k, name, ms, flops / ms / 1e9, err))
        if args.profile:
            step = step_fn(fast, x)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            step()
            torch.cuda.set_sync_debug_mode(0)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                    torch.profiler.ProfilerActivity.CPU]) as prof:
                step()
                torch.cuda.synchronize()
            print(f"top-{k} dslab step, by device time:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(f"\n{'k':>2} {'layer':<11} {'fwd+bwd ms':>10} {'expert TFLOP/s':>15} {'% peak':>7} {'rel err vs naive':>17}")
    for k, name, ms, tflops, err in rows:
        print(f"{k:>2} {name:<11} {ms:>10.3f} {tflops:>15.0f} {100 * tflops / peak:>6.1f}% {err:>17.2e}")
    for k in (1, 2):
        d = [r for r in rows if r[0] == k]
        print(f"top-{k}: dslab / naive loop speed-up {d[1][2] / d[0][2]:.2f}x")


if __name__ == "__main__":
    main()
