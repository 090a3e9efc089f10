"""dslab's Evoformer attention (DS4Sci_EvoformerAttention) against naive PyTorch and SDPA, forward +
backward, at the Evoformer anchor shapes.

    python3 benchmarks/evoformer_attention_bench.py [--reps 20] [--warmup 3] [--shapes 256x256,512x512,1024x384]
        [--heads 8] [--dim 32] [--arms dslab,naive,sdpa] [--pair-grad atomic|recompute] [--mask-grad] [--graph]

Workload per shape ``N_seq x N_res``: q, k, v ``[1, N_seq, N_res, H, D]`` bf16 (H = 8, D = 32 by
default), OpenFold's mask bias ``[1, N_seq, 1, 1, N_res]`` (``-1e9`` on a fifth of the keys, no
gradient unless ``--mask-grad``) and a pair bias ``[1, 1, H, N_res, N_res]`` requiring a gradient;
one call is the forward and the backward to q, k, v and the biases (``torch.autograd.grad`` with a
random output gradient). Flops: ``4 * N_seq * N_res**2 * H * D`` forward, 2.5x that backward
(FlashAttention's count), so 3.5x forward per call.

Arms:

- ``dslab``: :func:`dslab.kernels.evoformer.evoformer_attention.evoformer_attention` (the Triton kernels; the
  pair-bias gradient reduced as ``--pair-grad`` says, see
  :mod:`dslab.kernels.evoformer.evoformer_attention_triton_bwd`);
- ``naive``: :func:`evoformer_attention_reference`, the plain PyTorch computation (materialises the
  ``[N_seq, H, N_res, N_res]`` scores and keeps them for autograd);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on ``[N_seq, H, N_res, D]`` heads with
  the two biases summed into one float ``attn_mask`` ``[N_seq, H, N_res, N_res]`` (materialised by
  the sum; PyTorch picks the kernel that accepts it).

What is measured (STYLE.md #9): ms is the median over ``--reps`` calls of CUDA events around each
call, after ``--warmup`` calls (the first includes Triton's autotuning); with ``--graph``, around
each replay of the call captured in a CUDA graph (every arm alike: device time without the host's
launch and autograd overhead); "extra GiB" is
``torch.cuda.max_memory_allocated`` during one call minus the memory allocated just before it (the
inputs and the output gradient); "x naive" is the naive arm's ms over the arm's ms; TFLOP/s is the
flops above over the median. Errors are against the reference in fp32 (the bf16 inputs upcast):
"out err" the largest absolute error of the output, "grad err" the largest absolute error of any
gradient relative to that gradient's largest value. Before any timing, the correctness check runs
each arm once per shape and fails (exit status 1) when dslab's error exceeds twice the naive bf16
arm's error plus one bf16 ulp at the result's scale. The device, versions and the autotuner's
chosen tiles are printed at the end, then the table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dslab.kernels.evoformer import evoformer_attention_triton_bwd  # noqa: E402
from dslab.kernels.evoformer.evoformer_attention import evoformer_attention, evoformer_attention_reference  # noqa: E402

ARMS = ("dslab", "naive", "sdpa")
GRAD_NAMES = ("dq", "dk", "dv", "dmask", "dpair")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"256x256,512x512"`` -> [(256, 256), (512, 512)] as (N_seq, N_res)."""
    shapes = []
    for item in text.split(","):
        try:
            n_seq, n_res = (int(part) for part in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {item!r} is not N_SEQxN_RES (e.g. 512x512)") from None
        if n_seq <= 0 or n_res <= 0:
            raise argparse.ArgumentTypeError(f"shape {item!r} must be positive")
        shapes.append((n_seq, n_res))
    return shapes


def parse_arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(f"arms must be a comma-separated subset of {','.join(ARMS)}, got {text!r}")
    return arms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("256x256,512x512,1024x384"),
                        help="comma-separated N_SEQxN_RES (default 256x256,512x512,1024x384)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=32, choices=(16, 32, 64, 128))
    parser.add_argument("--arms", type=parse_arms, default=list(ARMS),
                        help="comma-separated subset of dslab,naive,sdpa")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pair-grad", choices=evoformer_attention_triton_bwd.PAIR_GRAD_MODES,
                        default=evoformer_attention_triton_bwd.pair_grad_mode,
                        help="how dslab reduces the pair-bias gradient over sequences")
    parser.add_argument("--mask-grad", action="store_true", help="the mask bias requires a gradient too")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--graph", action="store_true",
                        help="time replays of each arm's call captured in a CUDA graph (device time) "
                             "instead of eager calls")
    return parser.parse_args(argv)


def make_inputs(n_seq: int, n_res: int, args, dtype=torch.bfloat16) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    shape = (1, n_seq, n_res, args.heads, args.dim)
    q, k, v, grad = (torch.randn(shape, device="cuda", generator=gen).to(dtype) for _ in range(4))
    keep = torch.rand((1, n_seq, 1, 1, n_res), device="cuda", generator=gen) > 0.2
    keep[..., 0] = True
    mask = (1e9 * (keep.float() - 1)).to(dtype)
    pair = torch.randn((1, 1, args.heads, n_res, n_res), device="cuda", generator=gen).to(dtype)
    return dict(q=q, k=k, v=v, grad=grad, mask=mask, pair=pair)


def as_dtype(inputs: dict, dtype: torch.dtype) -> dict:
    return {name: t.to(dtype) for name, t in inputs.items()}


def sdpa(q, k, v, biases):
    """SDPA over ``[*, N_seq, H, N_res, D]`` heads with the biases summed into one float mask."""
    heads = [t.transpose(-2, -3) for t in (q, k, v)]
    attn_mask = None
    for bias in biases:
        if bias is not None:
            attn_mask = bias if attn_mask is None else attn_mask + bias
    return F.scaled_dot_product_attention(*heads, attn_mask=attn_mask).transpose(-2, -3)


FUNCTIONS = {"dslab": evoformer_attention, "naive": evoformer_attention_reference, "sdpa": sdpa}


def make_call(fn, inputs: dict, mask_grad: bool):
    """A closure running fn's forward and backward; returns (out, dq, dk, dv, dmask or None, dpair)."""
    q, k, v, pair = (inputs[n].detach().requires_grad_() for n in ("q", "k", "v", "pair"))
    mask = inputs["mask"].detach().requires_grad_(mask_grad)
    wrt = (q, k, v, mask, pair) if mask_grad else (q, k, v, pair)
    grad = inputs["grad"]

    def call():
        out = fn(q, k, v, [mask, pair])
        grads = torch.autograd.grad(out, wrt, grad)
        if not mask_grad:
            grads = (*grads[:3], None, grads[3])
        return (out, *grads)

    return call


def time_ms(call, warmup: int, reps: int) -> float:
    """Median ms per call from CUDA events around each call, after ``warmup`` calls."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_graph_ms(call, warmup: int, reps: int) -> float:
    """Median ms per replay of one call captured in a CUDA graph (after ``warmup`` eager calls,
    which include the autotuning): the device time of the call without the host's launch and
    autograd overhead, which at small shapes is larger than the kernels' time."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # a warm-up on the capture stream, as torch.cuda.make_graphed_callables does
        with torch.cuda.graph(graph, stream=stream):
            result = call()
    torch.cuda.current_stream().wait_stream(stream)
    ms = time_ms(graph.replay, 2, reps)
    del result, graph
    return ms


def extra_peak_bytes(call) -> int:
    """Peak memory allocated during one call beyond what was allocated just before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = call()
    torch.cuda.synchronize()
    del result
    return torch.cuda.max_memory_allocated() - before


def errors(result, exact) -> tuple[float, float]:
    """(largest absolute error of the output, largest error of a gradient relative to its largest
    value) against the fp32 reference's ``exact``."""
    out_err = (result[0].float() - exact[0]).abs().max().item()
    grad_err = 0.0
    for got, ref in zip(result[1:], exact[1:]):
        if ref is not None:
            grad_err = max(grad_err, (got.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30))
    return out_err, grad_err


def check_and_measure_errors(shape, inputs, args) -> tuple[dict, bool]:
    """Run each arm once against the fp32 reference; returns ({arm: (out err, grad err)}, passed),
    passed when every dslab output is within twice the naive bf16 error plus one bf16 ulp."""
    exact = [t.detach() if t is not None else None
             for t in make_call(evoformer_attention_reference, as_dtype(inputs, torch.float32), args.mask_grad)()]
    results, passed = {}, True
    naive = make_call(evoformer_attention_reference, inputs, args.mask_grad)()
    for arm in args.arms:
        got = naive if arm == "naive" else make_call(FUNCTIONS[arm], inputs, args.mask_grad)()
        results[arm] = errors(got, exact)
        if arm != "dslab":
            continue
        eps = torch.finfo(torch.bfloat16).eps
        for name, g, lo, ref in zip(("out", *GRAD_NAMES), got, naive, exact):
            if ref is None:
                continue
            err = (g.float() - ref).abs().max().item()
            naive_err = (lo.float() - ref).abs().max().item()
            if not err <= 2 * naive_err + eps * ref.abs().max().item():
                print(f"FAILED {shape[0]}x{shape[1]} {name}: dslab err {err:.3g} vs naive bf16 err {naive_err:.3g}")
                passed = False
    del exact, naive
    torch.cuda.empty_cache()
    return results, passed


def describe_tuning(head_dim: int) -> list[str]:
    """The tiles the autotuners chose for ``head_dim``, per kernel and autotune key."""
    from dslab.kernels.evoformer import evoformer_attention_triton as fwd

    bwd = evoformer_attention_triton_bwd
    kernels = [("forward", fwd._fwd_kernel), ("dq", bwd._dq_kernel), ("dkdv", bwd._dkdv_kernel),
               ("dpair", bwd._dpair_kernel)]
    return [
        f"  {name} key={key}: {config}"
        for name, factory in kernels
        for key, config in factory(head_dim, False).cache.items()
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("evoformer_attention_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    evoformer_attention_triton_bwd.pair_grad_mode = args.pair_grad
    rows, all_passed = [], True
    for n_seq, n_res in args.shapes:
        inputs = make_inputs(n_seq, n_res, args)
        errs, passed = check_and_measure_errors((n_seq, n_res), inputs, args)
        all_passed &= passed
        flops = 4 * n_seq * n_res * n_res * args.heads * args.dim * 7 // 2
        timings = {}
        for arm in args.arms:
            call = make_call(FUNCTIONS[arm], inputs, args.mask_grad)
            try:
                ms = (time_graph_ms if args.graph else time_ms)(call, args.warmup, args.reps)
                extra = extra_peak_bytes(call)
            except torch.cuda.OutOfMemoryError:
                ms = extra = None
            del call
            torch.cuda.empty_cache()
            timings[arm] = (ms, extra)
        naive_ms = timings.get("naive", (None,))[0]
        for arm in args.arms:
            ms, extra = timings[arm]
            rows.append(dict(shape=f"{n_seq}x{n_res}", arm=arm, ms=ms, extra=extra,
                             ratio=(naive_ms / ms if naive_ms and ms else None),
                             tflops=(flops / ms / 1e9 if ms else None), errors=errs[arm]))
        del inputs
        torch.cuda.empty_cache()

    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB); "
          f"torch {torch.__version__}, triton {_triton_version()}, python {platform.python_version()}")
    print(f"config: heads={args.heads} dim={args.dim} bf16 reps={args.reps} warmup={args.warmup} "
          f"timing={'CUDA-graph replay' if args.graph else 'eager calls'} "
          f"pair_grad={args.pair_grad} mask_grad={args.mask_grad} seed={args.seed}")
    for line in describe_tuning(args.dim):
        print(line)
    print(f"correctness check: {'passed' if all_passed else 'FAILED'}")
    print()
    header = (f"{'shape':>10} {'arm':>6} {'ms':>9} {'TFLOP/s':>8} {'extra GiB':>10} {'x naive':>8} "
              f"{'out err':>9} {'grad err':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        ms = f"{row['ms']:.3f}" if row["ms"] is not None else "OOM"
        tflops = f"{row['tflops']:.1f}" if row["tflops"] is not None else "-"
        extra = f"{row['extra'] / 2**30:.3f}" if row["extra"] is not None else "-"
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        out_err, grad_err = row["errors"]
        print(f"{row['shape']:>10} {row['arm']:>6} {ms:>9} {tflops:>8} {extra:>10} {ratio:>8} "
              f"{out_err:>9.2e} {grad_err:>9.2e}")
    return 0 if all_passed else 1


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
