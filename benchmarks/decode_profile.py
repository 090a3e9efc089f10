"""Where a decode step's time goes: the inference engine's per-token step, fused
(:mod:`dslab.inference.fused_decode`) and op by op, timed and profiled kernel by kernel.

    python3 benchmarks/decode_profile.py [--presets gpt2_124m,gpt2_1558m] [--batches 1,32]
        [--dtypes bf16,int8] [--replays 100] [--trials 5] [--top 8] [--dependent-launch]
        [--attention-combine] [--short-cache]

For each preset x batch x dtype it injects one random transformers model (GPT-2 for ``gpt2_*``
presets, Llama for ``llama*``; bf16, the suite's seed), prefills a 32-token prompt and captures the
step's CUDA graph for both variants (fused at every batch here; the engine fuses GPT-2 up to 8
rows, Llama at 1, the fastest choices these rows show; a model without a fused step has the
op-by-op variant only), then:

- ``ms/step``: the graph replayed ``--replays`` times back to back between CUDA events (the step
  alone: no token choice, no host work between steps), median of ``--trials``; both variants
  interleaved trial by trial;
- agreement: the fused step's logits against the op-by-op step's over 8 steps from the same cache
  (max |difference| over max |logit|) and whether their greedy tokens agree;
- kernels: ``torch.profiler`` over 20 replays of each graph (CUPTI reports the kernels inside a
  graph): launches per step and the ``--top`` kernels by device time per step; then one layer's
  launches in order, each the mean over the model's layers and the replays (a name such as
  ``_decode_linear_kernel`` serves every projection; its place in the layer tells which), and the
  launches outside the layers (embedding, final norm, LM head), found as the step's run of
  ``num_hidden_layers`` identical blocks;
- the fused and op-by-op variants are captured without programmatic dependent launch and with
  decode attention's combine kernel; the engine's defaults (``DSLAB_DEPENDENT_LAUNCH=auto``: the
  batch-1 step's kernels launched dependent; attention's fused combine) are the next variants
  (``--attention-combine --dependent-launch`` at batch 1: the engine's step);
- ``--dependent-launch``: a third variant, the fused step captured with programmatic dependent
  launch (:func:`dslab.kernels.dispatch.dependent_launch`), timed in the same interleave; its
  logits must equal the fused step's bit for bit (same kernels, same order of arithmetic);
- ``--attention-combine``: another variant, the fused step captured with decode attention's fused
  combine (:func:`dslab.kernels.decode.decode_attention_triton.combine_mode`), timed in the same
  interleave (with dependent launch at batch 1 when ``--dependent-launch`` is given, as the engine
  runs it); its logits must equal the fused step's bit for bit (the same sums in the same order);
- ``--short-cache``: the engine's step (``--attention-combine``'s variant) against the same with
  decode attention's short caches split over programs and combined as longer ones are, instead of
  one block a row (:data:`dslab.kernels.decode.decode_attention_triton.SHORT_CACHE_ELEMENTS`);
- the weights-read floor: the weight bytes at the measured device-to-device copy bandwidth
  (``Tensor.copy_`` of 1 GiB, bytes read + written per second: what the memory system moves), about
  the best a batch-1 step can do.

A short table comes last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_kernels_bench import copy_bandwidth_gbs  # noqa: E402

from dslab.bench.inference import build_hf_gpt2, build_hf_llama, make_prompts  # noqa: E402
from dslab.inference import init_inference  # noqa: E402
from dslab.inference.decode import DecodeRunner  # noqa: E402
from dslab.kernels.decode.decode_attention_triton import combine_mode, short_cache  # noqa: E402
from dslab.kernels.dispatch import dependent_launch, dependent_launches  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8}
PROMPT = 32


class Variant:
    """One engine's slot at a batch, its step captured with the step fused or not."""

    def __init__(self, engine, prompts, fused: bool, name: str | None = None):
        self.engine, self.fused = engine, fused
        self.name = name or ("fused" if fused else "op by op")
        self.runner = DecodeRunner(engine.module, engine.max_seq, True)  # its own slot and graph
        fusable = hasattr(engine.module, "fused_decode")
        if fusable:
            previous = engine.module.fused_decode, engine.module.fused_decode_rows
            engine.module.fused_decode = fused
            engine.module.fused_decode_rows = 64  # fused at every batch here (the engine's own limit is per model)
        self.slot = self.runner.slot(prompts.shape[0])
        self.prompts = prompts
        self.reset()
        self.runner.step(self.slot)  # captures
        if fusable:
            engine.module.fused_decode, engine.module.fused_decode_rows = previous

    def reset(self):
        with torch.no_grad():
            logits = self.engine.module.prefill(self.prompts, None, self.slot.cache)
        self.slot.start(logits.argmax(-1), self.prompts.shape[1],
                        torch.zeros(self.prompts.shape[0], dtype=torch.int32, device=self.prompts.device))

    def steps(self, n: int) -> list[torch.Tensor]:
        out = []
        for _ in range(n):
            logits = self.runner.step(self.slot)[:self.prompts.shape[0]].float().clone()
            self.slot.tokens[:self.prompts.shape[0]].copy_(logits.argmax(-1))
            out.append(logits)
        return out

    def time_ms(self, replays: int) -> float:
        self.reset()
        graph = self.slot.graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / replays

    def kernels(self, replays: int = 20) -> dict[str, list[float]]:
        self.reset()
        graph = self.slot.graph
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        per_name = defaultdict(lambda: [0, 0.0])
        launches = []
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in event.name.lower():
                entry = per_name[event.name]
                entry[0] += 1
                entry[1] += event.device_time_total
                launches.append((event.time_range.start, event.name, event.device_time_total))
        launches.sort()
        self.sequence = [(name, us) for _, name, us in launches]
        return {name: [count / replays, us / replays] for name, (count, us) in per_name.items()}


def layer_breakdown(sequence: list[tuple[str, float]], replays: int, layers: int):
    """Split a profiled run of ``replays`` identical steps into one layer's launches and the rest.

    ``sequence`` is every launch of the run in start order, as (kernel name, device us). Returns
    ``(layer, outside, blocks)``: ``layer`` lists (name, mean us) for each launch of the repeating
    block (the mean over its ``blocks`` repeats in every step and the replays), ``outside`` the
    step's other launches in order with their mean us, ``blocks`` how many layers the block covers:
    ``layers``, or one or two fewer where the first or last layer launches differently (those
    layers' launches are then in ``outside``). None when no such run is found."""
    if replays < 1 or layers < 1 or len(sequence) % replays:
        return None
    per_step = len(sequence) // replays
    steps = [sequence[i * per_step:(i + 1) * per_step] for i in range(replays)]
    names = [name for name, _ in steps[0]]
    if any([name for name, _ in step] != names for step in steps):
        return None
    mean = [statistics.fmean(step[i][1] for step in steps) for i in range(per_step)]
    # all the layers alike, else all but the first or last (which may launch one kernel more or less)
    for count in (layers, layers - 1, layers - 2):
        for period in range(per_step // max(count, 1), 0, -1) if count >= 2 else ():  # the longest block first
            for start in range(per_step - period * count + 1):
                block = names[start:start + period]
                if all(names[start + j * period:start + (j + 1) * period] == block for j in range(1, count)):
                    layer = [(block[i], statistics.fmean(mean[start + j * period + i] for j in range(count)))
                             for i in range(period)]
                    end = start + period * count
                    outside = [(names[i], mean[i]) for i in (*range(start), *range(end, per_step))]
                    return layer, outside, count
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="gpt2_124m,gpt2_1558m")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--dependent-launch", action="store_true",
                        help="also time the fused step captured with programmatic dependent launch")
    parser.add_argument("--attention-combine", action="store_true",
                        help="also time the fused step captured with decode attention's fused combine "
                             "(the last split of a row combines it: one launch per layer, not two)")
    parser.add_argument("--short-cache", action="store_true",
                        help="also time the engine's step with decode attention's short caches split over "
                             "programs and combined, as longer caches are (not one block a row)")
    args = parser.parse_args()
    device = torch.device("cuda")
    read_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy {read_gbs:.0f} GB/s (read + write)", flush=True)
    rows = []
    for preset in args.presets.split(","):
        build = build_hf_llama if preset.startswith("llama") else build_hf_gpt2
        model = build(preset, {}, 0, torch.bfloat16, device)
        for dtype_name in args.dtypes.split(","):
            engine = init_inference(model, dtype=DTYPES[dtype_name], max_out_tokens=PROMPT + 2 * args.replays + 16)
            weight_bytes = engine.memory_records()["weights_bytes"]
            for batch in (int(b) for b in args.batches.split(",")):
                prompts = make_prompts(batch, PROMPT, engine.module.vocab_size, 0, device)
                fusable = hasattr(engine.module, "fused_decode")
                # without dependent launch and with attention's combine kernel: the engine's defaults
                # (dependent launch at batch 1, the fused combine) are the variants below
                with dependent_launches(False), combine_mode("kernel"):
                    plain = Variant(engine, prompts, False)
                    fused = Variant(engine, prompts, True) if fusable else plain
                variants = (fused, plain) if fusable else (plain,)
                dependent = None
                if fusable and args.dependent_launch:
                    with dependent_launches(True), combine_mode("kernel"):
                        if not dependent_launch(device):
                            raise SystemExit("--dependent-launch: this GPU or Triton has no programmatic dependent "
                                             "launch (compute capability 9.0 and tl.extra.cuda.gdc_wait)")
                        dependent = Variant(engine, prompts, True, name="fused, dependent launch")
                    variants = (fused, dependent, plain)
                combined = None
                if fusable and args.attention_combine:
                    with combine_mode("fused"), dependent_launches(args.dependent_launch and batch == 1):
                        combined = Variant(engine, prompts, True, name="fused, attention combine fused")
                    variants = (*variants[:-1], combined, plain)
                split_cache = None
                if fusable and args.short_cache:  # the engine's launches with every cache split and combined
                    with combine_mode("fused"), dependent_launches(batch == 1), short_cache(False):
                        split_cache = Variant(engine, prompts, True, name="engine, short cache split")
                for variant in variants:
                    variant.reset()
                a, b = fused.steps(8), plain.steps(8)
                scale = max(x.abs().max().item() for x in b)
                diff = max((x - y).abs().max().item() for x, y in zip(a, b)) / scale
                first = (a[0] - b[0]).abs().max().item() / b[0].abs().max().item()
                same = all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b))
                if dependent is not None:
                    fused.reset()
                    dependent.reset()
                    c, d = fused.steps(8), dependent.steps(8)
                    dependent_equal = all(torch.equal(x, y) for x, y in zip(c, d))
                if combined is not None:
                    fused.reset()
                    combined.reset()
                    c, d = fused.steps(8), combined.steps(8)
                    combined_equal = all(torch.equal(x, y) for x, y in zip(c, d))
                timed = (*variants, split_cache) if split_cache is not None else variants
                times = {variant.name: [] for variant in timed}
                for _ in range(args.trials):
                    for variant in timed:
                        times[variant.name].append(variant.time_ms(args.replays))
                t_plain = statistics.median(times[plain.name])
                t_fused = statistics.median(times["fused"]) if fusable else float("nan")
                t_dependent = statistics.median(times[dependent.name]) if dependent is not None else float("nan")
                t_combined = statistics.median(times[combined.name]) if combined is not None else float("nan")
                label = f"{preset} b{batch} {dtype_name}"
                print(f"\n== {label}: fused {t_fused:.4f} ms/step, op by op {t_plain:.4f} "
                      f"(trials {' | '.join(', '.join(f'{t:.4f}' for t in ts) for ts in times.values())}); "
                      f"logits rel diff {diff:.2e} over 8 steps (each variant feeding back its own tokens), "
                      f"{first:.2e} at the first step; greedy same {same}", flush=True)
                if dependent is not None:
                    print(f"  fused with dependent launch: {t_dependent:.4f} ms/step ({t_fused / t_dependent:.3f}x "
                          f"the fused step); logits over 8 steps equal to the fused step's bit for bit: "
                          f"{dependent_equal}", flush=True)
                if combined is not None:
                    print(f"  fused with attention's fused combine: {t_combined:.4f} ms/step "
                          f"({t_fused / t_combined:.3f}x the fused step); logits over 8 steps equal to the fused "
                          f"step's bit for bit: {combined_equal}", flush=True)
                if split_cache is not None:
                    engine_like = combined or fused
                    engine_like.reset()
                    split_cache.reset()
                    c, d = engine_like.steps(1), split_cache.steps(1)
                    print(f"  engine's launches with the short cache split and combined: "
                          f"{statistics.median(times[split_cache.name]):.4f} ms/step against "
                          f"{statistics.median(times[engine_like.name]):.4f} with one block a row "
                          f"({engine_like.name}); first step's logits max |difference| "
                          f"{(c[0] - d[0]).abs().max().item():.2e} of max |logit| {d[0].abs().max().item():.2f}",
                          flush=True)
                for variant in variants:
                    kernels = variant.kernels()
                    launches = sum(c for c, _ in kernels.values())
                    busy = sum(us for _, us in kernels.values())
                    print(f"  {variant.name}: {launches:.0f} kernels/step, "
                          f"{busy:.1f} us kernel time/step")
                    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]:
                        print(f"    {us:8.1f} us {count:5.0f}x  {name[:110]}")
                    split = layer_breakdown(variant.sequence, 20, len(engine.module.layers))
                    if split is None:
                        print("    (no repeating layer block found in the launch order)")
                        continue
                    layer, outside, blocks = split
                    print(f"    one layer, in launch order ({sum(us for _, us in layer):.1f} us, mean of "
                          f"{blocks} of {len(engine.module.layers)} layers):")
                    for i, (name, us) in enumerate(layer):
                        print(f"      {i:2d} {us:8.2f} us  {name[:100]}")
                    print(f"    outside the layers ({sum(us for _, us in outside):.1f} us):")
                    for name, us in outside:
                        print(f"         {us:8.2f} us  {name[:100]}")
                floor = weight_bytes / read_gbs / 1e6
                rows.append((label, t_fused, t_plain, floor, diff, same, t_dependent, t_combined))
                engine.release_cuda_graphs()
            del engine
        del model
        torch.cuda.empty_cache()
    print(f"\n{'case':<24} {'fused ms':>9} {'op-by-op':>9} {'speedup':>8} {'floor ms':>9} {'rel diff':>9} greedy"
          f"{' dependent ms' if args.dependent_launch else ''}{' combine-fused ms' if args.attention_combine else ''}")
    for label, tf, tp, floor, diff, same, td, tc in rows:
        print(f"{label:<24} {tf:>9.4f} {tp:>9.4f} {tp / tf:>8.2f} {floor:>9.4f} {diff:>9.1e} {str(same):<6}"
              + (f" {td:>12.4f}" if args.dependent_launch else "")
              + (f" {tc:>16.4f}" if args.attention_combine else ""))


if __name__ == "__main__":
    main()
