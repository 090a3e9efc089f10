"""Where dslab's flash attention spends its time, shape by shape, against SDPA's flash backend.

    python3 benchmarks/kernels/attention_sweep.py [--out DIR] [--shapes 0,1,2,3] [--paths]
        [--profile] [--launch]

For each dropout-free shape of ``bench_attention.SHAPES`` (bf16, self-attention) and for dslab and SDPA
(``SDPBackend.FLASH_ATTENTION``), three callables are timed: the forward, the backward alone
(``torch.autograd.grad`` on a saved output, ``retain_graph=True``), and forward + backward. Each is
measured four ways (medians over ``--iters`` calls):

- ``evt``: CUDA events around each call, calls back to back, as ``run.py`` does. When the host
  takes longer to issue a call than the GPU takes to run it, this is the host's time.
- ``dev``: the same, with the calls queued behind a ``torch.cuda._sleep`` long enough for the
  host to issue all of them first, so each interval is device time alone.
- ``host``: CPU wall time per call while issuing calls without synchronising (median of 5 runs).
- ``host_queued``: CPU time per call while issuing the ``dev`` calls behind the sleep.

A call is host-bound when ``host`` > ``dev``; then ``evt`` follows ``host``.

``--paths`` times each backward launch plan of ``attention_triton_bwd.backward_roles`` that applies
(FUSED, BOTH, DQ_ONLY + DKDV_ONLY, ATOMIC), forced one at a time: the backward alone with no autograd
(``bwd_<plan>``) and forward + backward through ``attention`` (``fb_<plan>``). Every autotuner's
choice, its per-config timings and each compiled kernel's registers, spills and shared memory go to
``DIR/sweep.json``; ``--profile`` adds per-kernel device times (torch profiler) and a cProfile of
the host path at the first shape; ``--launch`` times the host side of the forward and backward
launches with and without the launch caches, and an empty autograd.Function against a builtin op.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_attention import SHAPES  # noqa: E402

from dslab.kernels.attention import attention_triton, attention_triton_bwd  # noqa: E402
from dslab.kernels.attention.attention import attention  # noqa: E402
from dslab.kernels.dispatch import kernel_backend  # noqa: E402

CLOCK_HZ = 1.98e9  # H100/H200 boost clock: turns the sleep's seconds into cycles (a longer sleep is harmless)


def _sync():
    torch.cuda.synchronize()


def measure(fn, iters: int) -> dict:
    """``host``, ``evt`` and ``dev`` per-call times of ``fn`` in ms (see the module docstring)."""
    for _ in range(3):
        fn()
    _sync()
    hosts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(max(1, iters // 5)):
            fn()
        hosts.append((time.perf_counter() - t0) * 1e3 / max(1, iters // 5))
        _sync()
    host = statistics.median(hosts)
    result = {"host": host}
    for mode in ("evt", "dev"):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        _sync()
        if mode == "dev":
            sleep_s = 2.0 * host * 1e-3 * iters + 0.02
            torch.cuda._sleep(int(sleep_s * CLOCK_HZ))
            t0 = time.perf_counter()
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        if mode == "dev":
            issued_s = time.perf_counter() - t0
            result["dev_queue_ok"] = issued_s < sleep_s
            result["host_queued"] = issued_s * 1e3 / iters
        _sync()
        result[mode] = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    return result


def kernel_breakdown(fn, reps: int = 5) -> list[tuple[str, float, int]]:
    """(kernel name, device us per call, launches per call) from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        _sync()
    rows = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append((evt.key[:90], us / reps, evt.count // reps))
    return sorted(rows, key=lambda r: -r[1])


def _jit_of(fn):
    while not hasattr(fn, "device_caches"):
        fn = fn.fn
    return fn


def compiled_kernels(autotuner) -> list[dict]:
    """Registers, spills, shared memory and constexprs of every compiled variant of ``autotuner``."""
    out = []
    jit = _jit_of(autotuner)
    for caches in jit.device_caches.values():
        for key, kernel in caches[0].items():
            consts = re.findall(r"\('constexpr', ([^)]*)\)", str(key))
            meta = kernel.metadata
            out.append({
                "constexprs": ",".join(consts),
                "warps": getattr(meta, "num_warps", None),
                "stages": getattr(meta, "num_stages", None),
                "shared": getattr(meta, "shared", None),
                "regs": getattr(kernel, "n_regs", None),
                "spills": getattr(kernel, "n_spills", None),
            })
    return out


def autotuners(head_dim: int) -> dict:
    bwd = attention_triton_bwd
    found = {"fwd": attention_triton._fwd_kernel_for(head_dim)}
    for name, roles in (("dq_only", bwd.DQ_ONLY), ("dkdv_only", bwd.DKDV_ONLY), ("both", bwd.BOTH),
                        ("atomic", bwd.ATOMIC)):
        found[name] = bwd.bwd_kernel_for(head_dim, roles, None)
    for bn in (64, 128):
        found[f"fused{bn}"] = bwd.bwd_kernel_for(head_dim, bwd.FUSED, bn)
    return found


def autotune_report(tuners: dict) -> dict:
    report = {}
    for name, at in tuners.items():
        timings = getattr(at, "configs_timings", None)
        entry = {"cache": {str(k): str(v) for k, v in getattr(at, "cache", {}).items()}}
        if timings:
            entry["timings"] = sorted(((str(c), t if isinstance(t, float) else list(t)) for c, t in timings.items()),
                                      key=lambda x: x[1] if isinstance(x[1], float) else x[1][0])
        report[name] = entry
        at.configs_timings = None
    return report


def best_config(at) -> str:
    cfg = getattr(at, "best_config", None)
    if cfg is None:
        return "-"
    kw = cfg.kwargs
    tiles = "x".join(str(v) for k, v in kw.items() if k.startswith("BLOCK"))
    return f"{tiles} w{cfg.num_warps} s{cfg.num_stages}"


def plans(seq: int, batch_heads: int) -> list[tuple[str, dict]]:
    """The backward launch plans that apply to a self-attention shape, with the module settings
    that force each."""
    bwd = attention_triton_bwd
    found = []
    if bwd.fused_block_n(seq, seq, batch_heads) is not None:
        found.append(("fused", {}))
    found.append(("both", {"FUSED_MAX_SEQ_K": 0, "BOTH_MAX_WORK": 2**62}))
    found.append(("split", {"FUSED_MAX_SEQ_K": 0, "BOTH_MAX_WORK": -1, "ATOMIC_MIN_WORK": 2**62}))
    found.append(("atomic", {"FUSED_MAX_SEQ_K": 0, "BOTH_MAX_WORK": -1, "ATOMIC_MIN_WORK": 0}))
    return found


class forced:
    """Set ``attention_triton_bwd`` module settings inside a ``with`` block."""

    def __init__(self, settings: dict):
        self.settings = settings

    def __enter__(self):
        self.saved = {name: getattr(attention_triton_bwd, name) for name in self.settings}
        for name, value in self.settings.items():
            setattr(attention_triton_bwd, name, value)

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(attention_triton_bwd, name, value)


def shape_inputs(batch, heads, seq, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, grad


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(q, k, v, grad, causal) -> dict:
    """Relative error of dslab and of SDPA-flash in bf16 against SDPA in fp32 (out, dq, dk, dv)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(fn, tensors):
        x = [t.detach().requires_grad_() for t in tensors[:3]]
        out = fn(*x)
        return (out, *torch.autograd.grad(out, x, tensors[3]))

    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        exact = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal),
                    [t.float() for t in (q, k, v, grad)])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), (q, k, v, grad))
    with kernel_backend("triton"):  # the Triton kernels (a differentiated causal call would go to cuDNN)
        ours = run(lambda a, b, c: attention(a, b, c, causal=causal), (q, k, v, grad))
    names = ("out", "dq", "dk", "dv")
    return {n: (rel_err(o, e), rel_err(f, e)) for n, o, f, e in zip(names, ours, flash, exact)}


def host_profile(fn, calls: int = 200) -> str:
    fn()
    _sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    _sync()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    return text.getvalue()


def launch_overhead(q, k, v, grad, causal) -> dict:
    """Host us per call of the forward and of the backward launches (no autograd): with the
    launch caches (``attention_triton.CachedLaunch``) warm, and emptied before every call so that
    each launch takes Triton's own path."""
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = attention_triton.attention_forward(q, k, v, None, 0, causal, 0.0, scale)

    def fwd():
        return attention_triton.attention_forward(q, k, v, None, 0, causal, 0.0, scale)

    def bwd():
        return attention_triton_bwd.attention_backward(grad, q, k, v, out, lse, None, 0, causal, 0.0, scale)

    def uncached(fn):
        def call():
            attention_triton.clear_launch_caches()
            return fn()
        return call

    def per_call(fn, n=200):
        fn()
        _sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t0) * 1e6 / n
        _sync()
        return round(us, 1)

    return {"fwd_cached": per_call(fwd), "fwd_triton": per_call(uncached(fwd)), "bwd_cached": per_call(bwd),
            "bwd_triton": per_call(uncached(bwd)), "torch_empty_like": per_call(lambda: torch.empty_like(q))}


class _EmptyFunction(torch.autograd.Function):
    """The host side of ``attention``'s autograd.Function with no kernels: allocations, saved
    tensors and ctx attributes only."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, seed, causal, dropout_p, scale):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)
        ctx.seed, ctx.causal, ctx.dropout_p, ctx.scale = seed, causal, dropout_p, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None, None, None, None


class _EmptyFunctionAttributes(torch.autograd.Function):
    """As ``_EmptyFunction`` with the inputs and lse kept as ctx attributes (only ``out`` saved)."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, seed, causal, dropout_p, scale):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(out)
        ctx.tensors = (q, k, v, lse, key_padding_mask)
        ctx.params = (seed, causal, dropout_p, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (out,) = ctx.saved_tensors
        q, k, v, lse, key_padding_mask = ctx.tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None, None, None, None


class _BareFunction(torch.autograd.Function):
    """No allocations, nothing saved: the autograd.Function machinery alone."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q.detach()

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, grad_out, grad_out


def autograd_overhead(iters: int) -> dict:
    """Host ms per call of empty autograd.Functions (fwd, bwd alone, fwd+bwd) on small CUDA tensors,
    against a builtin op (``q * k``) in the same roles, with the autograd engine's device threads
    on (the default) and off (``torch.autograd.set_multithreading_enabled(False)``)."""
    q, k, v = (torch.randn(2, 2, 8, 64, device="cuda", requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 2, 8, 64, device="cuda")
    args = (None, 0, False, 0.0, 0.125)
    out = _EmptyFunction.apply(q, k, v, *args)
    builtin_out = q * k
    cases = {
        "function_fwd": lambda: _EmptyFunction.apply(q, k, v, *args),
        "function_bwd": lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
        "function_fwdbwd": lambda: torch.autograd.grad(_EmptyFunction.apply(q, k, v, *args), (q, k, v), grad),
        "attrs_fwdbwd": lambda: torch.autograd.grad(_EmptyFunctionAttributes.apply(q, k, v, *args), (q, k, v), grad),
        "bare_fwdbwd": lambda: torch.autograd.grad(_BareFunction.apply(q, k, v), (q, k, v), grad),
        "mul_fwd": lambda: q * k,
        "mul_bwd": lambda: torch.autograd.grad(builtin_out, (q, k), grad, retain_graph=True),
        "mul_fwdbwd": lambda: torch.autograd.grad(q * k, (q, k), grad),
    }
    result = {name: round(measure(fn, iters)["host"], 4) for name, fn in cases.items()}
    with torch.autograd.set_multithreading_enabled(False):
        for name in ("function_fwdbwd", "bare_fwdbwd", "mul_fwdbwd"):
            result[name + "_single_thread"] = round(measure(cases[name], iters)["host"], 4)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default=None, help="comma-separated indices into bench_attention.SHAPES")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--launch", action="store_true")
    parser.add_argument("--paths", action="store_true")
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import triton

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    header = (f"{torch.cuda.get_device_name()} ({props.multi_processor_count} SMs) | torch {torch.__version__} | "
              f"triton {triton.__version__}")
    print(header)
    dropout_free = [i for i, shape in enumerate(SHAPES) if not shape[-1]]
    indices = [int(i) for i in args.shapes.split(",")] if args.shapes else dropout_free
    for idx in indices:
        if idx not in dropout_free:
            parser.error(f"--shapes: {idx} is a dropout shape; the sweep covers {dropout_free}")
    report = {"device": header, "shapes": []}
    if args.launch:
        report["autograd_overhead_ms"] = autograd_overhead(100)
        print("autograd host ms:", report["autograd_overhead_ms"])
    table = []
    for idx in indices:
        label, batch, heads, seq, head_dim, causal, target, _ = SHAPES[idx]
        q, k, v, grad = shape_inputs(batch, heads, seq, head_dim)
        scale = 1 / math.sqrt(head_dim)
        entry = {"label": label, "shape": [batch, heads, seq, head_dim, causal]}
        tuners = autotuners(head_dim)

        def dslab_fwd():
            with kernel_backend("triton"):
                return attention(q, k, v, causal=causal)

        def sdpa_fwd():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        t0 = time.perf_counter()
        dslab_out, sdpa_out = dslab_fwd(), sdpa_fwd()
        torch.autograd.grad(dslab_out, (q, k, v), grad, retain_graph=True)
        _sync()
        entry["first_call_s"] = time.perf_counter() - t0
        entry["autotune"] = autotune_report(tuners)
        entry["best"] = {name: best_config(at) for name, at in tuners.items()}
        entry["check"] = check(q, k, v, grad, causal)
        timings = {}
        for side, fwd, out in (("dslab", dslab_fwd, dslab_out), ("sdpa", sdpa_fwd, sdpa_out)):
            timings[side] = {
                "fwd": measure(fwd, args.iters),
                "bwd": measure(lambda out=out: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), args.iters),
                "fwdbwd": measure(lambda fwd=fwd: torch.autograd.grad(fwd(), (q, k, v), grad), args.iters),
            }
        if args.paths:
            with torch.no_grad():
                o, lse = attention_triton.attention_forward(q, k, v, None, 0, causal, 0.0, scale)
            bwd_args = (grad, q.detach(), k.detach(), v.detach(), o, lse, None, 0, causal, 0.0, scale)
            default = attention_triton_bwd.attention_backward(*bwd_args)
            entry["plan_rel_diff"] = {}
            for plan, settings in plans(seq, batch * heads):
                with forced(settings):
                    grads = attention_triton_bwd.attention_backward(*bwd_args)
                    entry["plan_rel_diff"][plan] = max(rel_err(a, b) for a, b in zip(grads, default))
                    timings[f"bwd_{plan}"] = measure(
                        lambda: attention_triton_bwd.attention_backward(*bwd_args), args.iters)
                    timings[f"fb_{plan}"] = measure(
                        lambda: torch.autograd.grad(dslab_fwd(), (q, k, v), grad), args.iters)
            entry["autotune_paths"] = autotune_report(tuners)
            entry["best_after_paths"] = {name: best_config(at) for name, at in tuners.items()}
        entry["timings"] = timings
        entry["kernels"] = {name: compiled_kernels(at) for name, at in tuners.items()}
        if args.profile:
            entry["profile_dslab"] = kernel_breakdown(lambda: torch.autograd.grad(dslab_fwd(), (q, k, v), grad))
            entry["profile_sdpa"] = kernel_breakdown(lambda: torch.autograd.grad(sdpa_fwd(), (q, k, v), grad))
            for side in ("dslab", "sdpa"):
                print(f"  {label} {side} kernels (us/call, launches):")
                for name, us, count in entry[f"profile_{side}"][:6]:
                    print(f"    {us:8.1f} x{count} {name}")
            if idx == indices[0]:
                text = host_profile(lambda: torch.autograd.grad(dslab_fwd(), (q, k, v), grad))
                (out_dir / "host_profile.txt").write_text(text)
                text = host_profile(lambda: torch.autograd.grad(dslab_out, (q, k, v), grad, retain_graph=True))
                (out_dir / "host_profile_bwd.txt").write_text(text)
        if args.launch and idx == indices[0]:
            entry["launch_us"] = launch_overhead(q.detach(), k.detach(), v.detach(), grad, causal)
            print("  launch us:", entry["launch_us"])
        report["shapes"].append(entry)
        (out_dir / "sweep.json").write_text(json.dumps(report, indent=1, default=str))
        d, s = timings["dslab"], timings["sdpa"]
        row = (f"{label[:24]:<24} fwd {d['fwd']['dev']:.3f}/{s['fwd']['dev']:.3f} bwd {d['bwd']['dev']:.3f}/"
               f"{s['bwd']['dev']:.3f} | host f {d['fwd']['host']:.3f}/{s['fwd']['host']:.3f} b {d['bwd']['host']:.3f}/"
               f"{s['bwd']['host']:.3f} fb {d['fwdbwd']['host']:.3f}/{s['fwdbwd']['host']:.3f} fbq "
               f"{d['fwdbwd']['host_queued']:.3f}/{s['fwdbwd']['host_queued']:.3f} | evt "
               f"{d['fwdbwd']['evt']:.3f}/{s['fwdbwd']['evt']:.3f} x{s['fwdbwd']['evt'] / d['fwdbwd']['evt']:.2f}")
        extra = [f"{key[3:]} {t['evt']:.3f}/{t['dev']:.3f}/{t['host']:.3f}" for key, t in timings.items()
                 if key.startswith("fb_")]
        extra += [f"{key[4:]} {t['dev']:.3f}/{t['host']:.3f}" for key, t in timings.items() if key.startswith("bwd_")]
        if "plan_rel_diff" in entry:
            extra.append("rel diff vs default " + " ".join(f"{n} {e:.1e}" for n, e in entry["plan_rel_diff"].items()))
        best = " ".join(f"{n}={c}" for n, c in entry["best"].items() if c != "-")
        errs = " ".join(f"{n} {a:.1e}/{b:.1e}" for n, (a, b) in entry["check"].items())
        table.append((row, "   plans fb evt/dev/host; bwd dev/host: " + "; ".join(extra), "   best: " + best,
                      "   err d/s: " + errs))
        print(*table[-1], sep="\n")
        del q, k, v, grad, dslab_out, sdpa_out
        torch.cuda.empty_cache()
    print("\n=== summary (ms; dslab/sdpa; fwd,bwd dev = device time; host = CPU issue time per fwd+bwd; "
          "evt = run.py-style) ===")
    for rows in table:
        print(*rows, sep="\n")


if __name__ == "__main__":
    main()
