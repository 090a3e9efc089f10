"""dslab's inference kernels at GPT-2 decode shapes, against their PyTorch equivalents, in GB/s of
the measured device-to-device copy bandwidth.

    python3 benchmarks/inference_kernels_bench.py [--reps 50] [--inner 20]

Cases (bf16, batch 1 and 32):

- decode attention, one new token per sequence over a KV cache: GPT-2 124M (12 heads of 64) and
  1.5B (25 heads of 64), caches of 160 positions (prompt 32 + 128 new tokens, all valid) and 2048
  (a long context, all valid). ``dslab`` is :func:`dslab.kernels.decode.decode_attention.decode_attention` (the Triton
  flash-decoding kernels); ``torch sdpa`` is ``F.scaled_dot_product_attention`` of the one query
  over the whole cache with a boolean mask of the valid positions, as a static-cache decoder runs
  it. Bytes: the valid k and v read once, q read and out written.
- int8 linear, the decode GEMMs ``[M, K] x [N, K]^T`` of the four projections of each model (QKV,
  attention out, MLP up, MLP down). ``torch bf16`` is ``F.linear`` on the bf16 weight (cuBLAS);
  ``dslab int8`` and ``dslab int8 g128`` are :func:`dslab.kernels.quant.int8_linear.int8_linear` per output channel
  and per group of 128 (``g64`` where 128 does not divide K: the 1.5B model's K = 1600). Bytes: the weight (2 or 1 per element) and its scales, x read, y written.

How it is timed (STYLE.md #9): each implementation is captured in a CUDA graph of ``--inner``
back-to-back calls (or more, to pass once over all the copies below), as the inference engine
replays its decode step; the graph is replayed
``--reps`` times between CUDA events after a warm-up, and the median replay over ``--inner`` is
the time per call. The calls cycle through enough copies of the weights / caches to exceed four
times the L2 cache, so every call reads from device memory, not from L2. GB/s are the bytes above
over that time; "% copy" divides by the measured device-to-device copy bandwidth (``Tensor.copy_``
of 1 GiB, read + write bytes, median of 20). Before timing, each output is compared with a
float64 reference (relative Frobenius error, printed beside PyTorch's own).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dslab.kernels import kernel_backend  # noqa: E402
from dslab.kernels.decode.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from dslab.kernels.quant.int8_linear import int8_linear, int8_linear_reference, quantize_int8  # noqa: E402

MODELS = {"124M": dict(hidden=768, heads=12), "1.5B": dict(hidden=1600, heads=25)}
HEAD_DIM = 64
BATCHES = (1, 32)
CACHE_LENGTHS = (160, 2048)
GROUP = 128
FALLBACK_GROUP = 64  # where 128 does not divide K: GPT-2 1.5B's hidden size 1600 = 25 * 64


def copy_bandwidth_gbs(reps: int = 20) -> float:
    """Device-to-device copy bandwidth: read + write bytes of a 1 GiB ``copy_``, median of ``reps``."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * src.numel() / statistics.median(times) / 1e6


def graph_time_us(calls, inner: int, reps: int) -> float:
    """Median microseconds per call: ``calls`` (a list of zero-argument functions, cycled) captured
    in one CUDA graph, ``inner`` of them or one pass over all if there are more, replayed ``reps``
    times between CUDA events."""
    inner = max(inner, len(calls))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
        for i in range(2 * len(calls)):
            calls[i % len(calls)]()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(inner):
            calls[i % len(calls)]()
    for _ in range(3):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3 / inner


def copies_beyond_l2(nbytes: int) -> int:
    """How many copies of an ``nbytes`` operand make four L2 caches' worth (at least 2)."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(2, math.ceil(4 * l2 / nbytes))


def relative_error(got, exact) -> float:
    return ((got.double() - exact).norm() / exact.norm()).item()


def decode_attention_rows(args, results: list) -> None:
    for model, shape in MODELS.items():
        heads = shape["heads"]
        for batch in BATCHES:
            for s_max in CACHE_LENGTHS:
                gen = torch.Generator(device="cuda").manual_seed(batch * s_max)
                cache_bytes = 2 * batch * heads * s_max * HEAD_DIM * 2
                copies = copies_beyond_l2(cache_bytes)
                q = torch.randn(batch, heads, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
                caches = [(torch.randn(batch, heads, s_max, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16),
                           torch.randn(batch, heads, s_max, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16))
                          for _ in range(copies)]
                start = torch.zeros(batch, dtype=torch.int32, device="cuda")
                end = torch.full((batch,), s_max, dtype=torch.int32, device="cuda")
                mask = (torch.arange(s_max, device="cuda") < end[:, None])[:, None, None, :]

                def sdpa(k, v):
                    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask)[:, :, 0]

                implementations = {
                    "dslab": lambda k, v: decode_attention(q, k, v, start, end),
                    "torch sdpa": sdpa,
                }
                k0, v0 = caches[0]
                exact = decode_attention_reference(q.double(), k0.double(), v0.double(), start, end)
                nbytes = cache_bytes + 2 * q.numel() * 2
                label = f"{model} B={batch} S={s_max}"
                for name, fn in implementations.items():
                    with kernel_backend("triton" if name == "dslab" else "auto"):
                        error = relative_error(fn(k0, v0), exact)
                        us = graph_time_us([lambda k=k, v=v, fn=fn: fn(k, v) for k, v in caches], args.inner,
                                           args.reps)
                    results.append(dict(op="decode_attention", case=label, impl=name, us=us, bytes=nbytes,
                                        error=error))
                del caches
                torch.cuda.empty_cache()


def int8_linear_rows(args, results: list) -> None:
    for model, shape in MODELS.items():
        hidden = shape["hidden"]
        projections = {"qkv": (3 * hidden, hidden), "attn out": (hidden, hidden), "mlp up": (4 * hidden, hidden),
                       "mlp down": (hidden, 4 * hidden)}
        for batch in BATCHES:
            for proj, (n, k) in projections.items():
                gen = torch.Generator(device="cuda").manual_seed(n + k + batch)
                copies = copies_beyond_l2(n * k * 2)
                weights = [torch.randn(n, k, device="cuda", generator=gen) * 0.02 for _ in range(copies)]
                x = torch.randn(batch, k, device="cuda", generator=gen).to(torch.bfloat16)
                bias = (torch.randn(n, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
                bf16 = [w.to(torch.bfloat16) for w in weights]
                per_channel = [quantize_int8(w) for w in weights]
                group = GROUP if k % GROUP == 0 else FALLBACK_GROUP
                grouped = [quantize_int8(w, group) for w in weights]
                del weights
                io_bytes = 2 * batch * (k + n) + 2 * n
                implementations = {
                    "torch bf16": ([lambda w=w: F.linear(x, w, bias) for w in bf16], 2 * n * k, None, bf16[0]),
                    "dslab int8": ([lambda q=q, s=s: int8_linear(x, q, s, bias) for q, s in per_channel],
                                   n * k + 4 * n, None, per_channel[0]),
                    f"dslab int8 g{group}": ([lambda q=q, s=s: int8_linear(x, q, s, bias, group) for q, s in grouped],
                                             n * k + 4 * n * k // group, group, grouped[0]),
                }
                label = f"{model} {proj} M={batch} [{n}x{k}]"
                for name, (calls, weight_bytes, group_size, first) in implementations.items():
                    if name == "torch bf16":
                        exact = F.linear(x.double(), first.double(), bias.double())
                    else:
                        exact = int8_linear_reference(x.double(), *first, bias.double(), group_size)
                    with kernel_backend("triton" if name.startswith("dslab") else "auto"):
                        error = relative_error(calls[0](), exact)
                        us = graph_time_us(calls, args.inner, args.reps)
                    results.append(dict(op="int8_linear", case=label, impl=name, us=us, bytes=weight_bytes + io_bytes,
                                        error=error))
                del bf16, per_channel, grouped, implementations
                torch.cuda.empty_cache()


def print_table(results: list, copy_gbs: float) -> None:
    baselines = {r["case"]: r["us"] for r in results if r["impl"] in ("torch sdpa", "torch bf16")}
    print(f"\n{'op':17s} {'case':36s} {'impl':16s} {'us/call':>8s} {'GB/s':>7s} {'% copy':>7s} "
          f"{'vs torch':>8s} {'rel err':>9s}")
    for r in results:
        gbs = r["bytes"] / r["us"] / 1e3
        speedup = baselines[r["case"]] / r["us"]
        print(f"{r['op']:17s} {r['case']:36s} {r['impl']:16s} {r['us']:8.2f} {gbs:7.0f} {100 * gbs / copy_gbs:6.1f}% "
              f"{speedup:7.2f}x {r['error']:9.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=50, help="timed graph replays per measurement (median)")
    parser.add_argument("--inner", type=int, default=20, help="calls captured in each graph")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("inference_kernels_bench needs a CUDA GPU")
    if args.reps < 10 or args.inner < 1:
        sys.exit("--reps must be at least 10 and --inner at least 1")

    import triton

    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, "
          f"L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MiB; torch {torch.__version__}, "
          f"triton {triton.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}")
    print(f"config: bf16, head_dim {HEAD_DIM}, batches {BATCHES}, caches {CACHE_LENGTHS} (all valid), "
          f"int8 group {GROUP} (else {FALLBACK_GROUP}), inner={args.inner} calls per graph, reps={args.reps} (median)")
    copy_gbs = copy_bandwidth_gbs()
    print(f"measured device-to-device copy bandwidth: {copy_gbs:.0f} GB/s (read + write; dividing by it)")

    results: list = []
    decode_attention_rows(args, results)
    int8_linear_rows(args, results)
    print_table(results, copy_gbs)


if __name__ == "__main__":
    main()
