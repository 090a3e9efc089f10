"""Where a prefill's time goes: dslab's injected model against transformers' on the same prompts,
host and device separately.

    python3 benchmarks/prefill_profile.py [--presets llama3_1b,gpt2_124m] [--prompts 32,512]
        [--batch 1] [--trials 10] [--top 12]

For each preset (a random transformers model of dslab's preset: Llama for ``llama*``, GPT-2 for
``gpt2_*``; bf16, seed 0) and prompt length it times, median of ``--trials`` after two warm-ups,
each call synchronised on both sides:

- ``generate1``: ``engine.generate(prompts, max_new_tokens=1)`` (the suite's prefill: start of the
  call to the first new token, host work included) and transformers' ``generate`` the same way;
- ``forward``: the injected module's ``prefill`` alone, and transformers' model forward;
- ``forward, FastJit off``: the injected module's ``prefill`` with every
  :class:`dslab.kernels._launch.FastJit` kernel launched through Triton's own path, interleaved
  trial by trial with it on (the ``forward`` figure), to show what the direct launches save;
- for dslab's ``generate1``: ``torch.profiler`` (CPU and CUDA) over one call: kernels launched,
  device busy time (the kernels' union), and the ``--top`` host ops by self CPU time, so that a
  host-bound prefill shows which calls hold it.

A short table comes last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dslab.bench.inference import build_hf_gpt2, build_hf_llama, make_prompts  # noqa: E402
from dslab.inference import init_inference  # noqa: E402
from dslab.kernels._launch import FastJit  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(call, trials: int) -> list[float]:
    for _ in range(2):
        call()
    sync()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The union of ``(start_us, end_us)`` intervals, in ms."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def host_profile(call, top: int) -> tuple[int, float, list[tuple[str, float, int]]]:
    """``(kernels launched, device busy ms, [(host op, self CPU ms, calls)])`` of one ``call``."""
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        call()
        sync()
    kernels, intervals = 0, []
    host = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            intervals.append((event.time_range.start, event.time_range.end))
        else:
            entry = host[event.name]
            entry[0] += event.self_cpu_time_total / 1e3
            entry[1] += 1
    ranked = sorted(((name, ms, n) for name, (ms, n) in host.items()), key=lambda item: -item[1])
    return kernels, busy_ms(intervals), ranked[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="llama3_1b,gpt2_124m")
    parser.add_argument("--prompts", default="32,512")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for preset in args.presets.split(","):
        build = build_hf_llama if preset.startswith("llama") else build_hf_gpt2
        model = build(preset, {}, 0, torch.bfloat16, device)
        lengths = [int(p) for p in args.prompts.split(",")]
        engine = init_inference(model, dtype=torch.bfloat16, max_out_tokens=max(lengths) + 8)
        for length in lengths:
            prompts = make_prompts(args.batch, length, engine.module.vocab_size, 0, device)
            mask = torch.ones_like(prompts)

            def dslab_generate():
                return engine.generate(prompts, attention_mask=mask, max_new_tokens=1)

            def hf_generate():
                with torch.no_grad():
                    return model.generate(prompts, attention_mask=mask, max_new_tokens=1, min_new_tokens=1,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)

            def hf_forward():
                with torch.no_grad():
                    return model(prompts, attention_mask=mask).logits

            def dslab_forward():
                with torch.no_grad():
                    return engine.module(prompts, mask)

            measured = {name: statistics.median(timed_ms(call, args.trials)) for name, call in
                        (("dslab generate1", dslab_generate), ("hf generate1", hf_generate),
                         ("dslab forward", dslab_forward), ("hf forward", hf_forward))}
            launch_times = {True: [], False: []}
            for _ in range(args.trials):
                for enabled in (True, False):
                    for launcher in FastJit.instances:
                        launcher.enabled = enabled
                    launch_times[enabled] += timed_ms(dslab_forward, 1)
            for launcher in FastJit.instances:
                launcher.enabled = True
            measured["dslab forward, FastJit on"] = statistics.median(launch_times[True])
            measured["dslab forward, FastJit off"] = statistics.median(launch_times[False])
            kernels, busy, top = host_profile(dslab_generate, args.top)
            label = f"{preset} b{args.batch} p{length}"
            print(f"\n== {label}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in measured.items())
                  + f"; dslab generate1: {kernels} kernels, device busy {busy:.2f} ms", flush=True)
            for name, ms, calls in top:
                print(f"    {ms:8.2f} ms self CPU {calls:6d}x  {name[:100]}")
            rows.append((label, measured, kernels, busy))
        engine.release_cuda_graphs()
        engine = model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"\n{'case':<22} {'dslab gen1':>10} {'hf gen1':>8} {'ratio':>6} {'dslab fwd':>9} {'hf fwd':>7} "
          f"{'kernels':>7} {'busy ms':>7} {'fast on':>7} {'off':>7}")
    for label, m, kernels, busy in rows:
        print(f"{label:<22} {m['dslab generate1']:>10.2f} {m['hf generate1']:>8.2f} "
              f"{m['dslab generate1'] / m['hf generate1']:>6.2f} {m['dslab forward']:>9.2f} {m['hf forward']:>7.2f} "
              f"{kernels:>7d} {busy:>7.2f} {m['dslab forward, FastJit on']:>7.2f} {m['dslab forward, FastJit off']:>7.2f}")


if __name__ == "__main__":
    main()
