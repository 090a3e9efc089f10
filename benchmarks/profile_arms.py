"""Where a suite case's step time goes, arm by arm (one GPU).

    python3 benchmarks/profile_arms.py suites/bert_large --case seq128 [--variants ...] [--out DIR]

Variants (built one at a time, timed interleaved, then each profiled):

* ``dslab``: the suite's ``dslab`` arm (engine, dslab kernels, the suite's profilers on);
* ``dslab-noprof``: the same with every profiler section taken out of the engine config;
* ``dslab-eager``: ``dslab-noprof`` with ``cuda_graphs`` off (every op visible to the profiler);
* ``dslab-torchops``: the engine (no profilers) over the model on PyTorch's ops;
* ``torch`` and ``torch-compile``: the suite's plain-loop arms.

For each variant: the median step time of ``--trials`` trials of ``--steps`` steps (CUDA events);
then ``torch.profiler`` over 3 steps, whose tables (top ops by device time and by host time) are
written to ``DIR/profile-<variant>.txt`` with a cProfile of 3 more steps (the host's Python
functions by own and cumulative time), and a summary row: host busy time per step (the
profiler's span of the step on the host) beside the device's kernel time per step. A step whose
device time is well under its wall time is host-bound; the device's idle time in the profiled
steps (:func:`device_idle`: launch gaps between dependent kernels, and longer waits with the
kernels on either side) says where.

Last, the kernels' device time per step by category (:func:`kernel_category`: attention forward
and backward, GEMMs, cross-entropy, layer norm (RMSNorm too), rope, SwiGLU, optimizer, casts and
copies, other fused or elementwise work), one column per variant and the difference of each to
the first: the size of each lever between dslab and a plain arm.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from dslab.bench.arms import EngineArm, PlainArm
from dslab.bench.measure import run_trial
from dslab.bench.suite import load_suite
from dslab.bench.workloads import workloads_for

PROFILER_SECTIONS = ("flops_profiler", "memory_tracer", "comms_logger", "telemetry", "wall_clock_breakdown")


def build(variant: str, workload, device, suite):
    cfg = dict(suite.engine)
    if variant == "dslab":
        return EngineArm(workload, device, suite.precision, cfg)
    if variant in ("dslab-noprof", "dslab-eager", "dslab-torchops"):
        for key in PROFILER_SECTIONS:
            cfg.pop(key, None)
        if variant == "dslab-eager":
            cfg["cuda_graphs"] = {"enabled": False}
        if variant == "dslab-torchops":
            cfg["kernels"] = "torch"
            arm = EngineArm.__new__(EngineArm)
            import dslab
            config = {**cfg, "train_micro_batch_size_per_gpu": workload.case.micro_batch,
                      "gradient_accumulation_steps": 1, suite.precision: {"enabled": True},
                      "steps_per_print": 10**9}
            model = workload.build_model(kernels="torch", device=device)
            arm.engine, _, _, _ = dslab.initialize(model=model, config=config, dist_init_required=False)
            arm.batch, arm.sleep_s = workload.make_batch(device), 0.0
            return arm
        return EngineArm(workload, device, suite.precision, cfg)
    return PlainArm(variant, workload, device, suite.precision, cfg)


#: (category, substrings of a kernel's lower-cased name, or ``=name`` for the whole name: dslab's
#: cross-entropy kernels are ``_forward_kernel`` and ``_backward_kernel``), tried in order: the
#: first match wins.
CATEGORIES = (
    ("attention bwd", ("attn_bwd", "attention_bwd", "_bwd_kernel_dq", "_bwd_kernel_dk", "flash_bwd",
                       "fmha_bwd", "mha_bwd", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop",
                       # cuDNN's backward also runs rowsum(dO * O) and dq's fp32 -> 16-bit conversion
                       "cudnn::fusion::compute_dot_do_o", "cudnn::fusion::convert_dq_to_16bits")),
    ("attention fwd", ("attn_fwd", "attention_fwd", "flash_fwd", "fmha_fwd", "mha_fwd", "_attn_kernel",
                       "sdpa_sm90_flash_fprop", "flash_attn")),
    ("cross-entropy", ("cross_entropy", "log_softmax", "nll_loss", "=_forward_kernel", "=_backward_kernel",
                       "=_loss_and_grad_kernel")),
    ("layer norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm")),
    ("rope", ("_rope_kernel", "rotary")),
    ("swiglu", ("swiglu", "silu")),
    ("optimizer", ("adam", "multi_tensor", "_foreach")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "sm90_", "sm80_")),
    ("casts and copies", ("copy", "_to_copy", "cast", "cat_", "memcpy", "memset")),
)


def kernel_category(name: str) -> str:
    """The :data:`CATEGORIES` entry of a kernel, by name; ``other`` (fused or elementwise work:
    bias + GELU, dropout, residual adds, inductor's pointwise and reduction kernels) otherwise."""
    lower = name.lower()
    for category, keys in CATEGORIES:
        if any(lower == key[1:] if key.startswith("=") else key in lower for key in keys):
            return category
    return "other"


def kernel_time_by_category(events, steps: int) -> dict[str, float]:
    """ms per step by :func:`kernel_category` of the device events of a ``torch.profiler`` run over
    ``steps`` steps. User annotations on the device timeline (``Optimizer.step#AdamW.step``, which
    spans the optimizer's kernels) are left out, or their kernels would count twice."""
    by_category: dict[str, float] = {}
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        category = kernel_category(event.name)
        by_category[category] = by_category.get(category, 0.0) + event.device_time_total / steps / 1e3
    return by_category


def device_idle(events, steps: int, launch_gap_us: float = 8.0, top: int = 5) -> dict:
    """Where the device sat idle between the first and the last kernel of a profiled run of
    ``steps`` steps (the same events as :func:`kernel_time_by_category`), in ms per step: ``busy``
    (the union of the kernels' intervals), ``span``, ``launch_gaps`` (gaps of at most
    ``launch_gap_us``: a dependent kernel's start latency, which only fewer kernels shrink) and
    ``long_gaps`` (the rest: the device waiting on the host or a synchronisation), and ``largest``:
    the ``top`` long gaps as ``(us, kernel before, kernel after)``, longest first."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    )
    if not kernels:
        return {"busy": 0.0, "span": 0.0, "launch_gaps": 0.0, "long_gaps": 0.0, "largest": []}
    busy = launch = long = 0.0
    largest = []
    run_start, run_end, last = kernels[0][0], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > run_end:
            gap = start - run_end
            if gap <= launch_gap_us:
                launch += gap
            else:
                long += gap
                largest.append((gap, last, name))
            busy += run_end - run_start
            run_start = start
        if end >= run_end:
            run_end, last = end, name
    busy += run_end - run_start
    largest.sort(key=lambda item: -item[0])
    per_step = 1e3 * steps
    return {"busy": busy / per_step, "span": (run_end - kernels[0][0]) / per_step, "launch_gaps": launch / per_step,
            "long_gaps": long / per_step, "largest": largest[:top]}


def category_table(per_variant: dict[str, dict[str, float]]) -> str:
    """Rows of ms/step by category, a column per variant, then each column minus the first."""
    names = list(per_variant)
    categories = [c for c, _ in CATEGORIES] + ["other"]
    lines = [f"{'category':<18}" + "".join(f"{n:>16}" for n in names)
             + "".join(f"{n + ' - ' + names[0]:>28}" for n in names[1:])]
    for category in categories + ["total"]:
        values = [sum(v.values()) if category == "total" else v.get(category, 0.0) for v in per_variant.values()]
        lines.append(f"{category:<18}" + "".join(f"{x:>16.2f}" for x in values)
                     + "".join(f"{x - values[0]:>28.2f}" for x in values[1:]))
    return "\n".join(lines)


def profile(arm, out: Path, name: str, shapes: bool = False) -> tuple[float, float, dict[str, float], dict]:
    """(host ms per step, device kernel ms per step, kernel ms per step by category,
    :func:`device_idle`) over 3 profiled steps; tables to a file."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    steps = 3
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes) as prof:
        for _ in range(steps):
            arm.step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in averages if e.device_type == torch.autograd.DeviceType.CPU)
    by_category = kernel_time_by_category(prof.events(), steps)
    idle = device_idle(prof.events(), steps)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    host_us = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) if events else 0
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        arm.step()
    torch.cuda.synchronize()
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(40)
    with open(out / f"profile-{name}.txt", "w") as f:
        f.write(f"{name}: host span {host_us / steps / 1e3:.2f} ms/step, device {device_us / steps / 1e3:.2f} ms/step\n\n")
        f.write(averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
        f.write("\n\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
        if shapes:
            f.write("\n\nBy input shape (device time):\n")
            f.write(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_device_time_total", row_limit=80, max_name_column_width=40, max_shapes_column_width=90))
        f.write(f"\n\ncProfile of {steps} more steps (host functions):\n")
        f.write(stream.getvalue())
    return host_us / steps / 1e3, device_us / steps / 1e3, by_category, idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite")
    parser.add_argument("--case", required=True)
    parser.add_argument("--variants", default="dslab,dslab-noprof,dslab-torchops,torch,torch-compile")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="profile-out")
    parser.add_argument("--shapes", action="store_true", help="also a table of device time by op and input shapes")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite, _ = load_suite(args.suite)
    (workload,) = workloads_for(suite, "full", [args.case])
    device = torch.device("cuda")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    rows, categories, idles = [], {}, {}
    for name in variants:
        try:
            arm = build(name, workload, device, suite)
            times = []
            for _ in range(args.trials):
                trial = run_trial(arm.step, device, args.warmup, args.steps)
                times.append(statistics.median(trial["step_times_ms"]))
            host, dev, categories[name], idles[name] = profile(arm, out, name, args.shapes)
            rows.append((name, statistics.median(times), host, dev))
            print(f"{name}: {statistics.median(times):.2f} ms/step", flush=True)
            del arm
            torch.cuda.empty_cache()
        except Exception as exc:  # a variant that fails is reported, the others go on
            print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)
            rows.append((name, float("nan"), float("nan"), float("nan")))
    print(f"\n{suite.name}/{args.case} on {torch.cuda.get_device_name()}, micro-batch {workload.case.micro_batch}")
    print(f"{'variant':<16} {'step ms':>8} {'host ms':>8} {'device ms':>10}")
    for name, step, host, dev in rows:
        print(f"{name:<16} {step:>8.2f} {host:>8.2f} {dev:>10.2f}")
    if idles:
        print("\ndevice idle per step in the profiled steps (ms; launch gaps <= 8 us, long gaps > 8 us):")
        print(f"{'variant':<16} {'span':>8} {'busy':>8} {'launch':>8} {'long':>8}  largest long gaps (us, before -> after)")
        for name, idle in idles.items():
            largest = "; ".join(f"{gap:.0f} {before[:40]} -> {after[:40]}" for gap, before, after in idle["largest"][:3])
            print(f"{name:<16} {idle['span']:>8.2f} {idle['busy']:>8.2f} {idle['launch_gaps']:>8.2f} "
                  f"{idle['long_gaps']:>8.2f}  {largest}")
    if categories:
        print("\nkernel time per step by category (ms):")
        print(category_table(categories))


if __name__ == "__main__":
    main()
