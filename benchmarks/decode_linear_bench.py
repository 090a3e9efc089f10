"""decode_linear's kernel at GPT-2 decode shapes, configuration by configuration, against cuBLAS.

    python3 benchmarks/decode_linear_bench.py [--hidden 1600] [--rows 1] [--reps 30] [--inner 20]

For each projection of a GPT-2 layer of width ``--hidden`` (QKV, attention out, MLP up, MLP down)
at ``--rows`` rows, bf16: ``F.linear`` with its bias (cuBLAS), ``decode_linear`` as the engine runs
it (its fixed block sizes; the QKV and MLP-up rows with their residual add and layer norm in front, as in the
fused step: from 2 rows in a kernel of their own, and also timed in every program's prologue), and
``decode_linear`` without a prologue under each of the kernel's configurations (at one row the
persistent row kernel's, :data:`dslab.kernels.decode.decode_row_triton.ROW_SWEEP`).
Timing as in ``inference_kernels_bench.py``: calls cycling over enough weight copies to exceed four
L2 caches, captured in one CUDA graph, median replay. GB/s counts the weight bytes only; the
percentage divides by the device-to-device copy bandwidth (bytes read + written per second).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_kernels_bench import copies_beyond_l2, copy_bandwidth_gbs, graph_time_us  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dslab.kernels.decode import decode_linear_triton as kernels  # noqa: E402
from dslab.kernels.decode import decode_row_triton as row  # noqa: E402
from dslab.kernels.decode.decode_linear import decode_linear  # noqa: E402
from dslab.kernels.quant.int8_linear import quantize_int8  # noqa: E402

linear_module = importlib.import_module("dslab.kernels.decode.decode_linear")  # the package attribute is the function

#: (BLOCK_N, BLOCK_K, num_warps, num_stages) of the bare GEMV below.
BARE_CONFIGS = [(4, 1024, 4, 1), (4, 1024, 4, 3), (8, 512, 4, 3), (16, 256, 4, 3), (2, 2048, 4, 1),
                (8, 2048, 8, 1), (4, 512, 4, 4), (8, 256, 4, 4)]


@triton.jit
def _bare_gemv(X, W, Y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = W x for one row x: the least a Triton GEMV does (no prologue, no epilogue, one
    reduction after the loop), the yardstick for decode_linear's batch-1 path."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + ks, mask=ks < K, other=0.0).to(tl.float32)
        w = tl.load(W + cols.to(tl.int64)[:, None] * K + ks[None, :], mask=(cols < N)[:, None] & (ks < K)[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(Y + cols, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=cols < N)


def bare_gemv(x, w, config):
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config
    _bare_gemv[(triton.cdiv(n, block_n),)](x, w, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                           num_stages=stages)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1600)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--int8", action="store_true", help="int8 weights (per-channel scales) for decode_linear")
    args = parser.parse_args()
    copy = copy_bandwidth_gbs()
    h, m = args.hidden, args.rows
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s; hidden {h}, rows {m}, bf16", flush=True)
    if m == 1:  # the persistent one-row kernel's configurations
        configs, forced, label = row.ROW_SWEEP, row.forced_row_config, "row BN %d BK %d w%d x%d/SM"
    else:
        configs, forced, label = kernels.sweep(kernels.row_block(m)), kernels.forced_config, "BN %d BK %d w%d s%d"
    results = []
    for name, (n, k), prologue in (("qkv", (3 * h, h), True), ("attn out", (h, h), False),
                                   ("mlp up", (4 * h, h), True), ("mlp down", (h, 4 * h), False)):
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        copies = copies_beyond_l2(n * k * (1 if args.int8 else 2))
        weights = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        if args.int8:  # cuBLAS keeps the bf16 weights; decode_linear streams int8 ones
            quantized = [quantize_int8(w) for w in weights]
        bias = (torch.randn(n, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        r = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        norm = (torch.ones(k, device="cuda", dtype=torch.bfloat16), torch.zeros(k, device="cuda", dtype=torch.bfloat16),
                1e-5)
        want = F.linear(x, weights[0], bias).float()
        if args.int8:
            ops = [(lambda q=q, s=s, **kw: decode_linear(x, q, bias, scale=s, **kw)) for q, s in quantized]
            weight_bytes = n * k
        else:
            ops = [(lambda w=w, **kw: decode_linear(x, w, bias, **kw)) for w in weights]
            weight_bytes = 2 * n * k
        err = (ops[0]().float() - want).abs().max().item()
        us = graph_time_us([lambda w=w: F.linear(x, w, bias) for w in weights], args.inner, args.reps)
        results.append((name, f"{n}x{k}", "cuBLAS F.linear (bf16)", us, 2 * n * k / us / 1e3))
        rows = [("decode_linear", [lambda op=op: op() for op in ops], None)]
        if prologue:
            with_norm = [lambda op=op: op(residual=r, norm=norm, return_sum=True) for op in ops]
            rows.append(("decode_linear, add+LN", with_norm, None))
            if m >= linear_module.PROLOGUE_KERNEL_MIN_ROWS:  # the norm in every program instead
                rows.append(("add+LN in the linear", with_norm, linear_module.MAX_ROWS + 1))
        for label, calls, min_rows in rows:
            default = linear_module.PROLOGUE_KERNEL_MIN_ROWS
            linear_module.PROLOGUE_KERNEL_MIN_ROWS = min_rows or default
            try:
                us = graph_time_us(calls, args.inner, args.reps)
            finally:
                linear_module.PROLOGUE_KERNEL_MIN_ROWS = default
            results.append((name, f"{n}x{k}", label, us, weight_bytes / us / 1e3))
        for config in configs:
            with forced(config):
                us = graph_time_us([lambda op=op: op() for op in ops], args.inner, args.reps)
            results.append((name, f"{n}x{k}", label % config, us, weight_bytes / us / 1e3))
        if m == 1 and not args.int8:
            for config in BARE_CONFIGS:
                us = graph_time_us([lambda w=w: bare_gemv(x[0], w, config) for w in weights], args.inner, args.reps)
                results.append((name, f"{n}x{k}", "bare BN %d BK %d w%d s%d" % config, us, n * k * 2 / us / 1e3))
        print(f"{name}: max |decode_linear - F.linear| = {err:.3e}", flush=True)
        del weights, ops
        torch.cuda.empty_cache()
    print(f"\n{'proj':<9} {'N x K':<11} {'implementation':<30} {'us':>8} {'GB/s':>7} {'% copy':>7}")
    for name, shape, label, us, gbs in results:
        print(f"{name:<9} {shape:<11} {label:<30} {us:>8.2f} {gbs:>7.0f} {100 * gbs / copy:>6.0f}%")


if __name__ == "__main__":
    main()
