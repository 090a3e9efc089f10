"""Causal attention at 32k-256k tokens on one GPU: the per-GPU work of DeepSpeed-Ulysses.

Under Ulysses sequence parallelism over p GPUs each GPU runs attention over the whole sequence
for ``heads / p`` of the heads. This times that work for a 1.5B-class model (16 heads of 128,
so 4 heads per GPU on 4 GPUs; ``--heads``, ``--kv-heads``, ``--head-dim`` change it), forward and
forward + backward, bf16, for the dslab Triton kernel (:func:`dslab.kernels.attention.attention`)
and PyTorch's ``scaled_dot_product_attention`` (its flash backend, and cuDNN's where it runs):

    python3 benchmarks/long_attention.py --seqs 32768,65536,131072,262144 --json out.json

Per (arm, seq): median time of ``--reps`` CUDA-event-timed calls after a warm-up, TFLOP/s with the
causal flops counted as computed (the lower triangle: ``2 * 2 * B * H * S^2 * D / 2`` forward,
2.5x that for the backward: dq, dk, dv and the recomputed scores), that over the measured bf16
matmul peak (``dslab.bench.measure``) and over the H200 datasheet's 989 TFLOP/s dense bf16, and the
peak memory the call adds above its inputs, per token (a constant across sequence lengths means
memory linear in the sequence: no ``S x S`` buffer).

Correctness (``--check-seq``, default 32768): dslab's and SDPA's bf16 outputs and gradients against
an fp32 reference (SDPA's memory-efficient backend on fp32 copies: exact softmax, no ``S x S``
buffer); dslab's error must be at most 2x SDPA's bf16 error plus 1e-3 (flash-attention's rule),
else the script exits 1 after printing the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dslab.kernels.attention.attention import attention
from dslab.kernels.dispatch import kernel_backend

DATASHEET_BF16_TFLOPS = 989.0


def causal_flops(batch: int, heads: int, seq: int, head_dim: int, backward: bool) -> float:
    """Matmul flops of causal attention as computed (the lower triangle): forward ``q k^T`` and
    ``p v``, 2 * S^2 * D / 2 each per head; the backward's dv, dp, dq, dk and the recomputed
    scores are 2.5x the forward."""
    forward = 2 * 2 * batch * heads * seq * seq * head_dim / 2
    return forward * (3.5 if backward else 1.0)


def make_inputs(batch, heads, kv_heads, seq, head_dim, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=dtype, generator=g)
    return [t.requires_grad_() for t in (q, k, v)]


def sdpa(backend):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return run


def dslab_attention(q, k, v):
    with kernel_backend("triton"):  # the Triton kernel (a differentiated causal call would go to cuDNN)
        return attention(q, k, v, causal=True)


ARMS = {
    "dslab": dslab_attention,
    "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
}


def time_call(fn, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls, CUDA events around each, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def measure(arm: str, q, k, v, reps: int) -> dict:
    fn = ARMS[arm]
    grad = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def forward_backward():
        out = fn(q, k, v)
        q.grad = k.grad = v.grad = None
        out.backward(grad)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd = time_call(forward, reps)
    fwd_bwd = time_call(forward_backward, reps)
    extra = torch.cuda.max_memory_allocated() - base
    q.grad = k.grad = v.grad = None
    return {"forward_ms": statistics.median(fwd), "forward_backward_ms": statistics.median(fwd_bwd),
            "forward_ms_all": fwd, "forward_backward_ms_all": fwd_bwd, "peak_extra_bytes": extra}


def check(batch, heads, kv_heads, seq, head_dim, device, seed) -> dict:
    """Max and mean absolute errors of dslab's and SDPA-flash's bf16 output and gradients against
    fp32 (the max is mostly the bf16 rounding of the largest values, the same for any kernel that
    rounds correctly; the mean tells the kernels' accumulation apart)."""
    q, k, v = make_inputs(batch, heads, kv_heads, seq, head_dim, device, torch.bfloat16, seed)
    grad = torch.randn_like(q)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = sdpa(SDPBackend.EFFICIENT_ATTENTION)(*ref_inputs)
    out.backward(grad.float())
    reference = [out.detach()] + [t.grad for t in ref_inputs]
    del out, ref_inputs
    errors = {}
    for arm in ("dslab", "sdpa-flash"):
        for t in (q, k, v):
            t.grad = None
        out = ARMS[arm](q, k, v)
        out.backward(grad)
        got = [out.detach()] + [t.grad for t in (q, k, v)]
        errors[arm] = {}
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, reference):
            diff = (g.float() - r).abs()
            errors[arm][name] = diff.max().item()
            errors[arm][f"{name}_mean"] = diff.mean().item()
        del out, got
    ok = all(errors["dslab"][n] <= 2 * errors["sdpa-flash"][n] + 1e-3 for n in errors["dslab"])
    return {"seq": seq, "errors": errors, "ok": ok}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="32768,65536,131072,262144")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4, help="query heads per GPU (16 heads over 4 GPUs: 4)")
    parser.add_argument("--kv-heads", type=int, default=None, help="kv heads per GPU (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--arms", default="dslab,sdpa-flash,sdpa-cudnn")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--check-seq", type=int, default=32768, help="0 skips the correctness check")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("long_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    kv_heads = args.kv_heads or args.heads
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {sorted(ARMS)}")
    from dslab.bench.measure import measure_peaks
    peaks = measure_peaks(device)
    peak = peaks.get("bf16_matmul_tflops") or DATASHEET_BF16_TFLOPS
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "peaks": peaks,
              "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": kv_heads, "head_dim": args.head_dim},
              "rows": [], "check": None}
    failed = False
    if args.check_seq:
        result["check"] = check(args.batch, args.heads, kv_heads, args.check_seq, args.head_dim, device, 7)
        failed = not result["check"]["ok"]
        print(f"check at seq {args.check_seq}: {json.dumps(result['check']['errors'])} ok={result['check']['ok']}",
              flush=True)
        torch.cuda.empty_cache()
    for seq in (int(s) for s in args.seqs.split(",")):
        q, k, v = make_inputs(args.batch, args.heads, kv_heads, seq, args.head_dim, device, torch.bfloat16, seq)
        for arm in arms:
            row = {"arm": arm, "seq": seq}
            try:
                row.update(measure(arm, q, k, v, args.reps))
            except (RuntimeError, torch.OutOfMemoryError) as err:
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                torch.cuda.empty_cache()
            else:
                for key, backward in (("forward", False), ("forward_backward", True)):
                    flops = causal_flops(args.batch, args.heads, seq, args.head_dim, backward)
                    row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
                row["mfu_measured_peak"] = row["forward_backward_tflops"] / peak
                row["mfu_datasheet"] = row["forward_backward_tflops"] / DATASHEET_BF16_TFLOPS
                row["extra_bytes_per_token"] = row["peak_extra_bytes"] / (args.batch * seq)
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\npeak divided by: measured bf16 matmul {peak:.0f} TFLOP/s (datasheet {DATASHEET_BF16_TFLOPS:.0f}); "
          f"heads/GPU {args.heads}, kv {kv_heads}, head_dim {args.head_dim}, batch {args.batch}, causal bf16")
    print(f"{'arm':<11} {'seq':>7} {'fwd ms':>9} {'fwd TF/s':>9} {'f+b ms':>9} {'f+b TF/s':>9} {'MFU':>6} "
          f"{'B/token':>8}")
    for row in result["rows"]:
        if "error" in row:
            print(f"{row['arm']:<11} {row['seq']:>7} {row['error']}")
            continue
        print(f"{row['arm']:<11} {row['seq']:>7} {row['forward_ms']:>9.2f} {row['forward_tflops']:>9.1f} "
              f"{row['forward_backward_ms']:>9.2f} {row['forward_backward_tflops']:>9.1f} "
              f"{row['mfu_measured_peak']:>6.1%} {row['extra_bytes_per_token']:>8.0f}")
    by_seq = {}
    for row in result["rows"]:
        if "error" not in row:
            by_seq.setdefault(row["seq"], {})[row["arm"]] = row["forward_backward_ms"]
    for seq, arms_ms in by_seq.items():
        best_peer = min((ms for arm, ms in arms_ms.items() if arm != "dslab"), default=None)
        if "dslab" in arms_ms and best_peer:
            print(f"seq {seq}: dslab fwd+bwd {best_peer / arms_ms['dslab']:.2f}x the best SDPA backend")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
