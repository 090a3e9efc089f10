"""dslab's grouped GEMM at the mixture-of-experts anchor, against the measured dense matmul peak.

    python3 benchmarks/grouped_gemm_bench.py [--reps 30] [--warmup 5] [--no-bias]

The anchor: 16384 tokens routed top-2, so M = 32768 rows over G = 8 experts of uneven sizes
(3000 .. 5200 rows), bf16, through both expert matmuls of an MLP: x [M, 1024] @ w1[g].T with
w1 [8, 4096, 1024], then h [M, 4096] @ w2[g].T with w2 [8, 1024, 4096]. Each matmul is
2 * M * N * K flops forward and twice that backward (dx and dw); both, forward and backward,
are 12 * M * 4096 * 1024 = 1.65 TFLOP.

What is divided by what (STYLE.md #9): TFLOP/s are those flops over the median time; "% peak" is
that against the measured dense bf16 peak, the better of torch.matmul at 8192^3 and the dense
equivalent of the workload (the same six matmuls with all rows in one group). Times are CUDA events
around each call, calls back to back after a warm-up (which includes the Triton autotuning), the
median of ``--reps`` calls. Rows:

- ``triton``: :func:`dslab.kernels.moe.grouped_gemm.grouped_gemm` (the Triton kernels);
- ``torch loop``: :func:`grouped_gemm_reference`, one ``F.linear`` per expert (it reads the offsets
  on the host each call, as a per-expert loop must);
- ``torch._grouped_mm``: PyTorch's grouped matmul (torch 2.8+, sm_90+), informative only; it takes
  no bias here, and its backward is timed where autograd supports it.

Before timing, each implementation's output and gradients are compared with an fp32 reference
(the bf16 inputs upcast): the relative error ||a - ref|| / ||ref|| is printed beside PyTorch's
own bf16 error. The configs the autotuner chose are printed at the end, with the device, the
versions and the full config.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dslab.kernels import kernel_backend  # noqa: E402
from dslab.kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_reference  # noqa: E402

GROUP_SIZES = [3000, 5200, 4100, 3900, 4500, 3300, 4268, 4500]  # sum 32768
MATMULS = [(1024, 4096), (4096, 1024)]  # (K, N): the expert MLP's up and down projections


def time_ms(fn, warmup: int, reps: int) -> float:
    """Median ms per call of ``fn`` from CUDA events around each call, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def dense_peak(args) -> dict:
    """TFLOP/s of torch.matmul at 8192^3 and of the workload's six matmuls with one group."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cube = 2 * 8192**3 / time_ms(lambda: a @ b, args.warmup, args.reps) / 1e9
    m = sum(GROUP_SIZES)
    tensors = []
    for k, n in MATMULS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        tensors.append((x, w, dy))

    def dense_workload():
        for x, w, dy in tensors:
            x @ w.T, dy @ w, dy.T @ x

    flops = sum(6 * m * n * k for k, n in MATMULS)
    workload = flops / time_ms(dense_workload, args.warmup, args.reps) / 1e9
    return {"matmul 8192^3": cube, "dense equivalent": workload}


def grouped_mm_fn():
    """``torch._grouped_mm`` as ``(x, w [G, N, K], offsets) -> y``, or None where unavailable."""
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        return None

    def run(x, w, offsets, bias=None):
        return grouped_mm(x, w.transpose(-2, -1), offs=offsets[1:].to(torch.int32))

    return run


def make_inputs(k: int, n: int, with_bias: bool, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, groups = sum(GROUP_SIZES), len(GROUP_SIZES)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(groups, n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(groups, n, device="cuda", generator=gen).to(torch.bfloat16) if with_bias else None
    dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    offsets = torch.tensor([0, *torch.tensor(GROUP_SIZES).cumsum(0).tolist()], device="cuda")
    return x, w, bias, dy, offsets


def outputs_and_grads(fn, x, w, bias, dy, offsets, dtype=None):
    x, w = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, w))
    bias = bias.detach().to(dtype or bias.dtype).requires_grad_() if bias is not None else None
    y = fn(x, w, offsets, bias)
    wrt = [x, w] + ([bias] if bias is not None else [])
    try:
        grads = torch.autograd.grad(y, wrt, dy.to(y.dtype))
    except RuntimeError:
        grads = ()
    return [y.detach(), *grads]


def relative_errors(got, exact) -> str:
    names = ["y", "dx", "dw", "dbias"]
    parts = [f"{name} {((a.float() - e).norm() / e.norm()).item():.2e}" for name, a, e in zip(names, got, exact)]
    return ", ".join(parts) if len(got) > 1 else parts[0] + " (no backward)"


def time_implementation(fn, x, w, bias, dy, offsets, args) -> dict:
    """Median ms of the forward, the backward alone (autograd.grad on a kept graph) and both."""
    x, w = (t.detach().requires_grad_() for t in (x, w))
    bias = bias.detach().requires_grad_() if bias is not None else None
    wrt = [x, w] + ([bias] if bias is not None else [])
    times = {"fwd": time_ms(lambda: fn(x, w, offsets, bias), args.warmup, args.reps)}
    y = fn(x, w, offsets, bias)
    try:
        torch.autograd.grad(y, wrt, dy, retain_graph=True)
    except RuntimeError as error:
        times["note"] = f"no backward: {str(error).splitlines()[0][:60]}"
        return times
    times["bwd"] = time_ms(lambda: torch.autograd.grad(y, wrt, dy, retain_graph=True), args.warmup, args.reps)
    times["total"] = time_ms(lambda: torch.autograd.grad(fn(x, w, offsets, bias), wrt, dy), args.warmup, args.reps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="timed calls per measurement (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before each measurement")
    parser.add_argument("--no-bias", action="store_true", help="time the grouped GEMMs without a bias")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("grouped_gemm_bench needs a CUDA GPU")
    if args.reps < 20:
        sys.exit("--reps must be at least 20")
    with_bias = not args.no_bias

    import triton

    from dslab.kernels.moe import grouped_gemm_triton

    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}")
    m = sum(GROUP_SIZES)
    print(f"config: M={m} rows in G={len(GROUP_SIZES)} groups {GROUP_SIZES}, bf16, (K, N) = {MATMULS}, "
          f"bias={with_bias}, warmup={args.warmup}, reps={args.reps} (median)")

    peaks = dense_peak(args)
    peak = max(peaks.values())
    print("measured dense bf16 peak: " + ", ".join(f"{name} {tflops:.0f} TFLOP/s" for name, tflops in peaks.items())
          + f" -> dividing by {peak:.0f}")

    implementations = {
        "triton": lambda *a: grouped_gemm(*a),
        "torch loop": grouped_gemm_reference,
    }
    grouped_mm = grouped_mm_fn()
    if grouped_mm is not None:
        implementations["torch._grouped_mm"] = grouped_mm

    print("\naccuracy against fp32 (relative Frobenius error)")
    results = {}
    for k, n in MATMULS:
        x, w, bias, dy, offsets = make_inputs(k, n, with_bias, seed=k)
        exact = {}  # by whether the bias is in: fp32 output and gradients
        for name, fn in implementations.items():
            impl_bias = None if name == "torch._grouped_mm" else bias
            has_bias = impl_bias is not None
            if has_bias not in exact:
                exact[has_bias] = outputs_and_grads(grouped_gemm_reference, x, w, impl_bias, dy, offsets,
                                                    dtype=torch.float32)
            try:
                with kernel_backend("triton" if name == "triton" else "auto"):
                    got = outputs_and_grads(fn, x, w, impl_bias, dy, offsets)
                    print(f"  K={k:<5d} N={n:<5d} {name:18s} {relative_errors(got, exact[has_bias])}")
                    results[(name, k, n)] = time_implementation(fn, x, w, impl_bias, dy, offsets, args)
            except (RuntimeError, NotImplementedError) as error:
                print(f"  K={k:<5d} N={n:<5d} {name:18s} unavailable: {str(error).splitlines()[0][:100]}")
        del x, w, bias, dy, exact
        torch.cuda.empty_cache()

    print(f"\n{'implementation':18s} {'K':>5s} {'N':>5s} {'fwd ms':>8s} {'bwd ms':>8s} {'total ms':>9s} "
          f"{'TFLOP/s':>8s} {'% peak':>7s}")
    for name in implementations:
        totals = []
        for k, n in MATMULS:
            times = results.get((name, k, n))
            if times is None:
                continue
            flops = 6 * m * n * k
            total = times.get("total")
            tflops = flops / total / 1e9 if total else None
            cells = [f"{times.get(key, float('nan')):8.3f}" for key in ("fwd", "bwd")]
            print(f"{name:18s} {k:5d} {n:5d} {' '.join(cells)} {total or float('nan'):9.3f} "
                  + (f"{tflops:8.0f} {100 * tflops / peak:6.1f}%" if tflops else f"{'-':>8s} {'-':>7s}")
                  + (f"  {times['note']}" if "note" in times else ""))
            totals.append((flops, total))
        if len(totals) == len(MATMULS) and all(total for _, total in totals):
            flops = sum(f for f, _ in totals)
            seconds_ms = sum(t for _, t in totals)
            tflops = flops / seconds_ms / 1e9
            print(f"{name:18s} {'both':>11s} {'':17s} {seconds_ms:9.3f} {tflops:8.0f} {100 * tflops / peak:6.1f}%")

    print("\nautotuned configs (key: N, K, dtypes -> config)")
    for label, tuner in (("forward", grouped_gemm_triton._forward_tuned),
                         ("input grad", grouped_gemm_triton._input_grad_tuned),
                         ("weight grad", grouped_gemm_triton._weight_grad_tuned)):
        for key, config in tuner.cache.items():
            print(f"  {label:12s} {key[:2]} -> {config}")


if __name__ == "__main__":
    main()
