"""What a generated token costs beyond its decode step: ``engine.generate``'s loop on the GPU.

    python3 benchmarks/generate_gaps.py [--preset llama3_1b] [--batch 1] [--new 64] [--trials 3]

Injects one random transformers model (the suites' builder, bf16), then per trial runs a greedy
``engine.generate`` of ``--new`` tokens after a 32-token prompt as the inference suites call it
(graphs captured by a warm-up call first) and reports:

- ``per-token ms``: the engine's token clock (``engine.token_clock``, CUDA events after each
  token: what ``dslab bench`` reports), median over the gaps and trials;
- ``step ms``: the decode step's CUDA graph replayed back to back (the same slot's graph);
- under ``torch.profiler`` (one more generation): the device's busy time a token, split into the
  step graph's kernels and the loop's own kernels (token choice, copies) by name, each kernel
  outside the graph with its mean time a token, and the idle time a token (the span of the
  tokens' kernels minus their busy time: launch gaps, or a host that fell behind).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dslab.bench.inference import build_hf_gpt2, build_hf_llama, make_prompts  # noqa: E402
from dslab.inference import init_inference  # noqa: E402
from dslab.inference.timing import TokenClock  # noqa: E402

PROMPT = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3_1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    build = build_hf_llama if args.preset.startswith("llama") else build_hf_gpt2
    model = build(args.preset, {}, 0, torch.bfloat16, device)
    # room for the generations and the step replays after them (each replay writes one more position)
    engine = init_inference(model, dtype=torch.bfloat16, max_out_tokens=PROMPT + args.new + 50 * args.trials + 16)
    prompts = make_prompts(args.batch, PROMPT, engine.module.vocab_size, 0, device)
    # as the suites call it (dslab/bench/inference.py): the model's generation config (eos id 0) applies
    run = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=args.new)
    engine.generate(prompts, **run)  # captures the graphs
    engine.generate(prompts, **run)
    torch.cuda.synchronize()

    clock = TokenClock(device)
    engine.token_clock = clock
    gaps = []
    for _ in range(args.trials):
        engine.generate(prompts, **run)
        torch.cuda.synchronize()
        gaps += clock.result()["per_token_ms"][1:]
    engine.token_clock = None
    per_token = statistics.median(gaps)

    runner = engine._runner
    slot = runner.slot(args.batch)
    graph = slot.graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step_times = []
    for _ in range(args.trials):
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        end.synchronize()
        step_times.append(start.elapsed_time(end) / 50)
    step = statistics.median(step_times)

    # the step's kernels, by name, from a profiled replay
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    cuda_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    step_sequence = [e.name for e in sorted(cuda_events, key=lambda e: e.time_range.start)]
    step_names = set(step_sequence)
    anchor = "_decode_split_kernel"  # decode attention: in every step, never in the prefill
    offset = step_sequence.index(anchor)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = engine.generate(prompts, **run)
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    # the decode tokens: from the first step's first kernel (found by its attention) to the end
    names = [k[2] for k in kernels]
    tokens = kernels[names.index(anchor) - offset:]
    span = tokens[-1][1] - tokens[0][0]
    busy_step = sum(e - s for s, e, name in tokens if name in step_names)
    outside = defaultdict(float)
    for s, e, name in tokens:
        if name not in step_names:
            outside[name] += e - s
    busy = busy_step + sum(outside.values())
    steps = out.shape[1] - PROMPT - 1  # decode steps (an eos may end it early)
    print(f"{torch.cuda.get_device_name()}: {args.preset} batch {args.batch}, {out.shape[1] - PROMPT} new tokens")
    print(f"per-token ms (token clock, median of {len(gaps)} gaps): {per_token:.4f}")
    print(f"step ms (graph replays): {step:.4f}")
    print(f"profiled: span {span / steps / 1e3:.4f} ms a token; busy {busy / steps / 1e3:.4f} "
          f"(step kernels {busy_step / steps / 1e3:.4f}, loop kernels {sum(outside.values()) / steps / 1e3:.4f}); "
          f"idle {(span - busy) / steps / 1e3:.4f}")
    for name, us in sorted(outside.items(), key=lambda item: -item[1]):
        print(f"  {us / steps:8.2f} us a token  {name[:110]}")


if __name__ == "__main__":
    main()
