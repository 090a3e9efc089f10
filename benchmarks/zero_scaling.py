"""ZeRO stages 0-3 on N GPUs: throughput, peak memory, and model states measured vs estimated.

Run under torchrun (one process per GPU); ``benchmarks/zero_scaling.sh`` runs it on 1, 2 and 4
GPUs and prints the weak-scaling table::

    torchrun --standalone --nproc_per_node 2 benchmarks/zero_scaling.py [--stages 0,1,2,3,2o]
        [--micro-batch 8] [--seq 1024] [--warmup 5] [--steps 20] [--trials 1] [--cuda-graphs]
        [--offload-sub-group N] [--granularity N] [--reuse N] [--json OUT.json]
    torchrun --standalone --nproc_per_node 2 benchmarks/zero_scaling.py --tiny   # CPU, gloo

For each stage in turn, in one process group: build GPT-2 355M (``dslab.models.gpt2_355m``,
dslab kernels) inside the engine with bf16 autocast over fp32 parameters, AdamW and clipping at
1.0, ZeRO at that stage; train ``--warmup`` steps, then time ``--steps`` steps one by one with CUDA
events (host clock on a CPU). Every rank trains on its own fixed random batch of ``micro-batch ×
seq`` tokens. Then the engine is destroyed and memory freed before the next stage. Per stage:

- ``tokens/s``: global, ``micro_batch × seq × N / step time``; the step time is the slowest
  rank's median.
- ``peak alloc``: the CUDA allocator's peak allocated bytes over the stage's warm-up and measured
  steps (``max_memory_allocated`` after ``reset_peak_memory_stats``), the largest over ranks.
  It includes activations and communication buffers, which are not model states.
- ``measured``: this rank's model states, counted by unique storage by the memory tracer's
  :func:`dslab.profilers.memory.model_state_bytes` just after the last warm-up backward (the
  gradients held, the optimizer states built); the largest over ranks.
- ``estimate``: :func:`dslab.estimate_zero_memory`'s per-GPU model states for the engine's layout
  (``param_bytes=4, master_bytes=0``: fp32 parameters under autocast, no master copy), less stage
  3's transient gather buffer, which is not live between modules; ``ratio = measured /
  estimate``. At stage 1 with one micro-step per optimizer step dslab reduce-scatters the
  gradients as backward produces them and never holds them whole, so ``measured`` is below the
  estimate's ``4·Ψ`` of gradients there. At stage 3, modules of at most
  ``stage3_param_persistence_threshold`` elements (``--persistence-threshold``; the engine's
  default 100,000 keeps GPT-2 355M's LayerNorms gathered, 0 with ``--tiny``, whose layers are all
  below the default) stay whole on every rank, above the estimate's ``Ψ/N``.

A stage written with an ``o`` (``1o``, ``2o``, ``3o``) runs with ``offload_optimizer: {device:
cpu, pin_memory: true}``: ``measured`` is then what stays on the GPU beside the offload layout's
per-GPU estimate, and the row adds the CPU side (``cpu GiB``: the offload's masters, gradient
buffers and Adam moments, beside the rank's share of the CPU estimate). With
``--offload-sub-group N`` each offloaded stage runs a second time with
``zero_optimization.sub_group_size`` N: the CPU step in chunks of about N shard elements, each
chunk's new shards copied back while the next one steps (the default, 1e9, is one chunk here).
With ``--granularity N`` each stage 3 runs a second time with
``zero_optimization.stage3_module_granularity_threshold`` N: modules whose parameters per
module in their subtree fall below N are gathered whole (1.5e6 makes each GPT-2 355M layer one
gather instead of four), fewer collectives and hooks per step. With ``--reuse N`` each stage 3
arm also runs with ``zero_optimization.stage3_max_reuse_distance`` N (0 releases every module
after its forward and gathers it again in backward; the engine's default, DeepSpeed's 1e9,
keeps GPT-2 355M gathered from each module's forward to its backward).

With ``--trials N`` the stages run N rounds, interleaved (stage 0, 1, ..., then again), and each
row reports the median step time with every trial's beside it (``trials_ms``): the step is
partly host-bound with eager kernels, and a lent machine's host is noisy. ``--cuda-graphs``
replays the layer stack from CUDA graphs (stages 0-2), which takes most of the host out.

Rank 0 prints one line per stage and, with ``--json``, writes the rows (with the world size,
model size and settings) for the wrapper.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import dslab
from dslab import comm
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_355m, gpt2_tiny
from dslab.profilers.memory import model_state_bytes

GIB = 1024 ** 3


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default="0,1,2,3",
                        help="comma-separated ZeRO stages; 1o, 2o, 3o offload the optimizer to CPU")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the engine's cuda_graphs section on (the layer stack replayed from "
                             "CUDA graphs at stages 0-2; stage 3 runs it eagerly)")
    parser.add_argument("--trials", type=int, default=1,
                        help="rounds over the stages, interleaved; rows report the median step time")
    parser.add_argument("--offload-sub-group", type=int, default=None, metavar="N",
                        help="also run each offloaded stage with sub_group_size N (a chunked CPU step)")
    parser.add_argument("--granularity", type=int, default=None, metavar="N",
                        help="also run each stage 3 with stage3_module_granularity_threshold N "
                             "(modules gathered whole; 1500000 gathers GPT-2 355M layer by layer)")
    parser.add_argument("--reuse", type=int, default=None, metavar="N",
                        help="also run each stage 3 arm with stage3_max_reuse_distance N (0: "
                             "release every module after its forward; the default is 1e9)")
    parser.add_argument("--micro-batch", type=int, default=None, help="per GPU (default 8; 2 with --tiny)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; 64 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5; 2 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 20; 3 with --tiny)")
    parser.add_argument("--kernels", default="dslab", choices=("dslab", "torch"))
    parser.add_argument("--persistence-threshold", type=int, default=None,
                        help="zero_optimization.stage3_param_persistence_threshold (default: the "
                             "engine's 100,000 elements; 0 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="gpt2_tiny, small batch: a CPU check")
    parser.add_argument("--json", default=None, help="rank 0 writes the rows here")
    args = parser.parse_args(argv)
    tiny = args.tiny
    if tiny and args.persistence_threshold is None:
        args.persistence_threshold = 0
    for name, full, small in (("micro_batch", 8, 2), ("seq", 1024, 64), ("warmup", 5, 2), ("steps", 20, 3)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else full)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    valid = {"0", "1", "2", "3", "1o", "2o", "3o"}
    if not stages or any(s not in valid for s in stages):
        parser.error(f"--stages must name ZeRO stages 0-3, or 1o-3o with optimizer offload, "
                     f"got {args.stages!r}")
    args.stages = []
    for token in stages:
        stage, offload = int(token.rstrip("o")), token.endswith("o")
        args.stages.append(Arm(stage, offload))
        if offload and args.offload_sub_group:
            args.stages.append(Arm(stage, offload, sub_group=args.offload_sub_group))
        if stage == 3:
            arms = [Arm(stage, offload)] + (
                [Arm(stage, offload, granularity=args.granularity)] if args.granularity else [])
            if args.reuse is not None:
                args.stages += [Arm(a.stage, a.offload, granularity=a.granularity, reuse=args.reuse)
                                for a in arms]
            args.stages += arms[1:]
    for name in ("micro_batch", "seq", "steps", "trials"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 2:
        parser.error("--warmup must be >= 2: model states are measured at the last warm-up "
                     "backward, after an earlier step has built the optimizer states")
    return args


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Arm:
    """One row: a ZeRO stage, with or without optimizer offload, and the optional settings."""

    stage: int
    offload: bool
    sub_group: int | None = None
    granularity: int | None = None
    reuse: int | None = None

    @property
    def label(self) -> str:
        return (f"{self.stage}" + ("+off" if self.offload else "")
                + (f"/sg{self.sub_group:.0e}" if self.sub_group else "")
                + (f"/g{self.granularity:.2g}" if self.granularity else "")
                + (f"/r{self.reuse:.2g}" if self.reuse is not None else ""))

    def zero_section(self, persistence_threshold: int | None) -> dict:
        section = {"stage": self.stage}
        if persistence_threshold is not None:
            section["stage3_param_persistence_threshold"] = persistence_threshold
        if self.offload:
            section["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if self.sub_group:
            section["sub_group_size"] = self.sub_group
        if self.granularity:
            section["stage3_module_granularity_threshold"] = self.granularity
        if self.reuse is not None:
            section["stage3_max_reuse_distance"] = self.reuse
        return section


def run_stage(arm: Arm, args, device: torch.device, world: int, rank: int) -> dict:
    """One arm's row on this rank: step times, peak memory, model states and the estimate."""
    stage, offload = arm.stage, arm.offload
    config_of = gpt2_tiny if args.tiny else gpt2_355m
    model_config = config_of(n_positions=max(args.seq, 128) if args.tiny else 1024)
    if args.seq > model_config.n_positions:
        raise ValueError(f"--seq {args.seq} exceeds the model's {model_config.n_positions} positions")
    torch.manual_seed(1234)
    with torch.device(device):
        model = GPT2LMHeadModel(model_config, kernels=args.kernels)
    (estimate,) = dslab.estimate_zero_memory(model, world, stage, precision="bf16",
                                             param_bytes=4, master_bytes=0,
                                             offload_optimizer="cpu" if offload else "none")
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": arm.zero_section(args.persistence_threshold),
        "steps_per_print": 10 ** 9,
    }
    if args.cuda_graphs:
        config["cuda_graphs"] = {"enabled": True}
    if device.type == "cuda":
        _free(device)
        torch.cuda.reset_peak_memory_stats(device)
    engine, _, _, _ = dslab.initialize(model=model, config=config)
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    ids = torch.randint(0, model_config.vocab_size, (args.micro_batch, args.seq), generator=g, device=device)

    states = None
    for i in range(args.warmup):
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        if i == args.warmup - 1:
            states = model_state_bytes(engine.module, engine.optimizer, world, runtime=engine.zero, stage=stage)
        engine.step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.steps)]
        for start, end in events:
            start.record()
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
        peak = torch.cuda.max_memory_allocated(device)
    else:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
        peak = None
    compared = states["zero_estimate"]["compared"]
    row = {
        "stage": stage,
        "label": arm.label,
        "offload": offload,
        "step_time_ms": statistics.median(times),
        "peak_allocated_bytes": peak,
        "measured_model_states": compared["measured"],
        "cpu_measured": compared.get("cpu_measured"),
        "cpu_estimate": compared.get("cpu_estimate"),
        "measured": {k: states[k] for k in ("params", "grads", "optimizer_params", "optimizer_states")},
        "estimate_total": estimate.gpu_total,
        "estimate_buffer": estimate.gpu_buffer,
        "num_params": estimate.num_params,
        "final_loss": float(loss.detach().float()),
    }
    engine.destroy()
    del engine, model, ids, loss
    _free(device)
    return row


def combine(rows: list[dict], args, world: int) -> dict:
    """The ranks' rows of one stage as one: slowest step, largest peaks and model states."""
    step_ms = max(r["step_time_ms"] for r in rows)
    peaks = [r["peak_allocated_bytes"] for r in rows]
    measured = max(r["measured_model_states"] for r in rows)
    estimate = rows[0]["estimate_total"] - rows[0]["estimate_buffer"]
    cpu = [r["cpu_measured"] for r in rows]
    return {
        "stage": rows[0]["stage"],
        "label": rows[0]["label"],
        "offload": rows[0]["offload"],
        "world_size": world,
        "step_time_ms": step_ms,
        "tokens_per_s": args.micro_batch * args.seq * world / (step_ms / 1e3),
        "peak_allocated_bytes": None if any(p is None for p in peaks) else max(peaks),
        "measured_model_states": measured,
        "measured_per_rank": [r["measured"] for r in rows],
        "estimate_model_states": estimate,
        "estimate_total": rows[0]["estimate_total"],
        "ratio": measured / estimate if estimate else None,
        "cpu_measured": None if any(c is None for c in cpu) else max(cpu),
        "cpu_estimate": rows[0]["cpu_estimate"],
        "num_params": rows[0]["num_params"],
    }


def median_row(rows: list[dict], args, world: int) -> dict:
    """One label's trials as one row: the median step time (and its tokens/s), every trial's
    step time, and the memory figures (the same in every trial) of the last."""
    step_ms = statistics.median(r["step_time_ms"] for r in rows)
    return {**rows[-1], "step_time_ms": step_ms, "trials_ms": [r["step_time_ms"] for r in rows],
            "tokens_per_s": args.micro_batch * args.seq * world / (step_ms / 1e3)}


def print_row(row: dict, prefix: str) -> None:
    cpu = "-" if row["cpu_measured"] is None else (
        f"{_gib(row['cpu_measured'])} ({_gib(row['cpu_estimate'])})")
    print(f"{prefix}{row['label']:>13} {row['tokens_per_s']:>12,.0f} {row['step_time_ms']:>9.2f} "
          f"{_gib(row['peak_allocated_bytes']):>9} {_gib(row['measured_model_states']):>13} "
          f"{_gib(row['estimate_model_states']):>13} {row['ratio']:>6.3f} {cpu:>16}", flush=True)


def _gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.3f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    comm.init_distributed()
    world, rank = comm.get_world_size(), comm.get_rank()
    device = _device()
    out = []
    if rank == 0:
        print(f"ZeRO scaling: {'gpt2_tiny' if args.tiny else 'gpt2_355m'} ({args.kernels} kernels), "
              f"{world} rank(s) on {device.type}, micro-batch {args.micro_batch}, seq {args.seq}, "
              f"bf16 autocast over fp32 params, AdamW; {args.warmup} warm-up + {args.steps} measured steps",
              flush=True)
        print(f"{'stage':>13} {'tokens/s':>12} {'step ms':>9} {'peak GiB':>9} {'measured GiB':>13} "
              f"{'estimate GiB':>13} {'ratio':>6} {'cpu GiB (est)':>16}", flush=True)
    trials: dict[str, list[dict]] = {}
    for trial in range(args.trials):
        for arm in args.stages:
            row = run_stage(arm, args, device, world, rank)
            stage_row = combine(comm.all_gather_object(row), args, world)
            trials.setdefault(stage_row["label"], []).append(stage_row)
            if rank == 0:
                print_row(stage_row, f"[{trial + 1}/{args.trials}]" if args.trials > 1 else "")
    for label, rows in trials.items():
        out.append(median_row(rows, args, world))
    if rank == 0 and args.trials > 1:
        print(f"median of {args.trials} trials (stages interleaved trial by trial):", flush=True)
        for stage_row in out:
            print_row(stage_row, "")
    if rank == 0 and args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"world_size": world, "device": str(device), "tiny": args.tiny,
                                   "micro_batch": args.micro_batch, "seq": args.seq, "rows": out}, indent=1))
        os.replace(tmp, path)
    comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
