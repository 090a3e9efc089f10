"""Activation checkpointing on GPT-2 1.5B: activation memory and step time, with and without.

    python benchmarks/activation_memory.py [--size 1.5b] [--micro-batch 8] [--seq 1024]
        [--warmup 3] [--steps 10] [--json OUT.json]
    python benchmarks/activation_memory.py --tiny   # CPU, the pipeline only

One process, one engine per arm in turn (each destroyed and its memory freed before the next):
dslab's GPT-2 (dslab kernels on CUDA), bf16 autocast over fp32 parameters, AdamW, clipping 1.0,
ZeRO stage 0, dropout 0.1 (the recompute replays it). Arms:

- ``graphs``: no checkpointing, the layer stack replayed from CUDA graphs (dslab's default);
- ``eager``: no checkpointing, eager layers;
- ``ckpt-1``: every layer an activation checkpoint (``checkpoint_layers: 1``; checkpointed
  segments run eagerly: a graph cannot restore the random state of a recompute);
- ``ckpt-2``: segments of two layers.

``--size`` picks GPT-2 355M, 774M or 1.5B (default). Each row has the estimate of
:mod:`dslab.profilers.activation_model` beside the measurement.

Per arm: ``activation bytes``, what the forward leaves allocated for the backward (CUDA
``memory_allocated`` after the forward minus before it, on the last measured step; with CUDA
graphs the graph pool's activations are counted by the pool's growth instead, see below);
the step time (median of ``--steps`` CUDA-event timed steps after ``--warmup``); the peak
allocated over the measured steps. The ratios printed are against ``eager``
(activation memory) and against ``graphs`` and ``eager`` (step time).

With CUDA graphs the forward's activations live in the graph's private pool, allocated once at
capture, so ``memory_allocated`` does not move across a replayed forward; the ``graphs`` arm's
activation bytes are therefore not measured and its peak includes the pool.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import dslab
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_355m, gpt2_774m, gpt2_1558m, gpt2_tiny
from dslab.profilers.activation_model import estimate_activation_memory

ARMS = {"graphs": (0, True), "eager": (0, False), "ckpt-1": (1, False), "ckpt-2": (2, False)}
SIZES = {"355m": gpt2_355m, "774m": gpt2_774m, "1.5b": gpt2_1558m}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="1.5b")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    for arm in args.arms.split(","):
        if arm not in ARMS:
            parser.error(f"--arms: unknown arm {arm!r}; known: {', '.join(ARMS)}")
    if args.tiny:
        args.micro_batch, args.seq, args.warmup, args.steps = 2, 64, 1, 2
    return args


def run_arm(name: str, args, device: torch.device) -> dict:
    every, graphs = ARMS[name]
    make = gpt2_tiny if args.tiny else SIZES[args.size]
    cfg = make(n_positions=max(args.seq, 64), checkpoint_layers=every)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg, kernels="dslab" if device.type == "cuda" else "torch")
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "cuda_graphs": {"enabled": graphs and device.type == "cuda"}}
    engine, _, _, _ = dslab.initialize(model=model, config=config)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    cuda = device.type == "cuda"
    times, activations, losses = [], [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            before = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        loss = engine(ids, labels=ids)
        if cuda:
            activations.append(torch.cuda.memory_allocated(device) - before)
        engine.backward(loss)
        engine.step()
        if cuda:
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - t0) * 1e3
        losses.append(float(loss.detach()))
        if step >= args.warmup:
            times.append(elapsed)
    row = {"arm": name, "checkpoint_layers": every, "cuda_graphs": graphs and cuda,
           "step_ms": statistics.median(times), "step_times_ms": times, "losses": losses,
           "estimate_bytes": estimate_activation_memory(cfg, args.micro_batch, args.seq)["total"]}
    if cuda:
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        if not row["cuda_graphs"]:
            row["activation_bytes"] = activations[-1]
    engine.destroy()
    del engine, model
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = {}
    for name in args.arms.split(","):
        rows[name] = run_arm(name, args, device)
        print(json.dumps({k: v for k, v in rows[name].items() if k != "step_times_ms"}), flush=True)
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"micro_batch": args.micro_batch, "seq": args.seq,
                                   "rows": rows}, indent=1))
        os.replace(tmp, args.json)
    eager = rows.get("eager", {})
    graphs = rows.get("graphs", {})
    print(f"GPT-2 {args.size if not args.tiny else 'tiny'}, micro-batch {args.micro_batch} x {args.seq}")
    print("| arm | step ms | vs graphs | vs eager | activation GiB | estimate GiB | vs eager | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        act = r.get("activation_bytes")
        ratio_g = f"{r['step_ms'] / graphs['step_ms']:.2f}" if graphs else ""
        ratio_e = f"{r['step_ms'] / eager['step_ms']:.2f}" if eager else ""
        act_ratio = (f"{eager['activation_bytes'] / act:.2f}x smaller"
                     if act and eager.get("activation_bytes") else "")
        print(f"| {name} | {r['step_ms']:.1f} | {ratio_g} | {ratio_e} | "
              f"{act / 2**30 if act else float('nan'):.2f} | {r['estimate_bytes'] / 2**30:.2f} | {act_ratio} | "
              f"{r.get('peak_bytes', 0) / 2**30:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
