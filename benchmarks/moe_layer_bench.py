"""The MoE layer alone at the anchor shape (16,384 tokens, hidden 1024, FFN 4096, 8 experts,
dropless), forward + backward, dslab's layer against the naive per-expert loop
(:class:`dslab.models.moe_naive.NaiveMoE`, same weights), in one process.

    python3 benchmarks/moe_layer_bench.py [--reps 20] [--warmup 5] [--profile] [--host-profile]

Two precisions, each for top-1 and top-2:

* ``bf16``: the layers' parameters cast to bf16, as DeepSpeed's bf16 engine runs a module (the
  anchor's setting);
* ``fp32+autocast``: fp32 parameters under bf16 autocast, as dslab's engine runs a module (the
  products cast the weights every step).

A step is ``out, l_aux, _ = layer(x)`` and the backward of ``(out, l_aux)`` from a fixed random
upstream gradient ``dy`` (bf16, [tokens, hidden]) and 1 for ``l_aux``: the layer's own work, with
the gradients of x and of every parameter (no loss kernels, no optimizer). Rows: ``dslab`` (eager),
``naive loop`` (eager), and ``dslab graph``, the dslab step captured once as a CUDA graph and
replayed (the device time of the step without the host's launches; what the engine's
``cuda_graphs`` section gives a model). Times: CUDA events around each step, median of ``--reps``
after ``--warmup``. Expert TFLOP/s: 12 * hidden * ffn flops per (token, expert) assignment over the
median step, against the measured dense bf16 matmul peak (torch.matmul at 8192^3, same process).
``--profile`` prints the device time per kernel of one eager dslab step; ``--host-profile`` a
cProfile of the eager steps' host side.
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


PRECISIONS = ("bf16", "fp32+autocast")


def build(k, precision):
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(approximate="tanh"), nn.Linear(FFN, HIDDEN))
    fast = MoE(HIDDEN, expert, num_experts=EXPERTS, k=k, drop_tokens=False).cuda()
    naive = NaiveMoE(HIDDEN, FFN, num_experts=EXPERTS, k=k, drop_tokens=False).cuda()
    naive.load_state_dict(fast.state_dict())
    if precision == "bf16":
        fast, naive = fast.bfloat16(), naive.bfloat16()
    return fast, naive


def run_layer(layer, x, precision):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision != "bf16", cache_enabled=False):
        return layer(x)


def step_fn(layer, x, dy, precision):
    one = torch.ones((), device="cuda")

    def step():
        out, l_aux, _ = run_layer(layer, x, precision)
        torch.autograd.backward([out, l_aux], [dy, one])
        x.grad = None
        for p in layer.parameters():
            p.grad = None
    return step


def graphed_step_fn(layer, x, dy, precision):
    """The same step captured as one CUDA graph (forward and ``torch.autograd.grad`` of every
    parameter and of x) and replayed: the device time of the step without the host's launches."""
    params = [p for p in layer.parameters() if p.requires_grad]
    one = torch.ones((), device="cuda")

    def step():
        out, l_aux, _ = run_layer(layer, x, precision)
        return torch.autograd.grad([out, l_aux], [x] + params, [dy, one])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def host_profile(step, reps):
    """cProfile of ``reps`` eager steps: the host functions that take the step's time."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--host-profile", action="store_true", help="cProfile the host side of dslab's steps")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated subset of "
                        + ", ".join(PRECISIONS))
    parser.add_argument("--ks", default="1,2", help="gating k values, comma-separated")
    parser.add_argument("--fused-activation", action="store_true",
                        help="dslab's experts with the activation in the grouped GEMM epilogues (grouped_mlp)")
    args = parser.parse_args()
    precisions = [p for p in args.precisions.split(",") if p]
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown:
        parser.error(f"--precisions: unknown {unknown}; choose from {PRECISIONS}")
    ks = [int(k) for k in args.ks.split(",") if k]
    peak = peak_tflops()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; measured bf16 peak {peak:.0f} TFLOP/s")
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows = []
    for precision in precisions:
        for k in ks:
            fast, naive = build(k, precision)
            for module in fast.modules():
                if hasattr(module, "fused_activation"):
                    module.fused_activation = args.fused_activation
            fast.eval(), naive.eval()  # no gate noise: both must route identically
            with torch.no_grad():
                out_f, _, counts_f = run_layer(fast, x, precision)
                out_n, _, counts_n = run_layer(naive, x, precision)
            err = ((out_f.float() - out_n.float()).norm() / out_n.float().norm()).item()
            assert torch.equal(counts_f.cpu(), counts_n.cpu()), "routing differs"
            fast.train(), naive.train()
            flops = 12 * HIDDEN * FFN * TOKENS * k
            for name, layer in (("dslab", fast), ("naive loop", naive)):
                ms = median_ms(step_fn(layer, x, dy, precision), args.warmup, args.reps)
                rows.append((precision, k, name, ms, flops / ms / 1e9, err))
            ms = median_ms(graphed_step_fn(fast, x, dy, precision), args.warmup, args.reps)
            rows.append((precision, k, "dslab graph", ms, flops / ms / 1e9, err))
            if args.host_profile:
                print(f"{precision} top-{k} dslab eager step, host profile of {args.reps} steps:")
                host_profile(step_fn(fast, x, dy, precision), args.reps)
            if args.profile:
                step = step_fn(fast, x, dy, precision)
                step()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                        torch.profiler.ProfilerActivity.CPU]) as prof:
                    step()
                    torch.cuda.synchronize()
                print(f"{precision} top-{k} dslab step, by device time:")
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22,
                                                max_name_column_width=60))
            del fast, naive
            torch.cuda.empty_cache()
    print(f"\n{'params':<14} {'k':>2} {'layer':<12} {'fwd+bwd ms':>10} {'expert TFLOP/s':>15} {'% peak':>7} "
          f"{'rel err vs naive':>17}")
    for precision, k, name, ms, tflops, err in rows:
        print(f"{precision:<14} {k:>2} {name:<12} {ms:>10.3f} {tflops:>15.0f} {100 * tflops / peak:>6.1f}% "
              f"{err:>17.2e}")
    for precision in precisions:
        for k in ks:
            d = {r[2]: r[3] for r in rows if r[0] == precision and r[1] == k}
            print(f"{precision} top-{k}: speed-up over the naive loop: dslab {d['naive loop'] / d['dslab']:.2f}x, "
                  f"dslab graph {d['naive loop'] / d['dslab graph']:.2f}x")

if __name__ == "__main__":
    main()
