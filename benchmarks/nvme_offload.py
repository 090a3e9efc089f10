"""ZeRO optimizer offload to NVMe against offload to CPU memory: GPT-2 355M step time on one GPU.

    python benchmarks/nvme_offload.py --nvme-path /local_nvme/dslab [--stage 2] [--trials 2]
        [--warmup 2] [--steps 5] [--micro-batch 8] [--seq 1024] [--sub-group 100000000]
        [--aio '{"block_size": 4194304, "queue_depth": 64, ...}'] [--json OUT.json]
    python benchmarks/nvme_offload.py --tiny --nvme-path /tmp/x     # CPU: checks the pipeline

Three arms in one process, interleaved trial by trial (same model, seed and batch): ``cpu``
(``offload_optimizer: {device: cpu, pin_memory: true}``), ``nvme`` (``device: nvme`` with
``pipeline_read``/``pipeline_write``: the next sub-group's states are read while one steps, and
written back while the next steps) and ``nvme-serial`` (both false: read, step, write in turn).
The model is built as in ``benchmarks/zero_scaling.py``: bf16 autocast over fp32 parameters,
AdamW, clipping at 1.0, ``sub_group_size`` ``--sub-group`` (DeepSpeed's ZeRO-Infinity examples
use 1e8; GPT-2 355M is then 4 sub-groups). Step time is the median of the measured steps (CUDA
events), and every arm reports its swaps from the engine's ``io`` profiler: bytes and GB/s per
direction, and how long the steps waited for prefetched reads.

What to expect: each step reads and writes Adam's two fp32 moments, 8 bytes per parameter each
way (2.8 GB for 355M), so an NVMe step is bounded below by ``2.8 GB / read GB/s`` plus the
write that the next step's first read waits for; ``dslab nvme-tune`` on the same directory gives
the GB/s to expect (pass its ``aio`` block as ``--aio``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

import dslab
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_355m, gpt2_tiny

ARMS = {"cpu": {"device": "cpu", "pin_memory": True},
        "nvme": {"device": "nvme", "pin_memory": True},
        "nvme-serial": {"device": "nvme", "pin_memory": True, "pipeline_read": False,
                        "pipeline_write": False}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvme-path", required=True, help="directory on the NVMe drive for the swap files")
    parser.add_argument("--arms", default="cpu,nvme,nvme-serial", help=f"comma-separated of {', '.join(ARMS)}")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--sub-group", type=int, default=100_000_000, help="zero_optimization.sub_group_size")
    parser.add_argument("--aio", default=None, help="the aio section as JSON (default: DeepSpeed's defaults)")
    parser.add_argument("--tiny", action="store_true", help="GPT-2 tiny on the CPU (a pipeline check)")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown arm {unknown[0]!r} (arms: {', '.join(ARMS)})")
    args.aio = json.loads(args.aio) if args.aio else None
    return args


def run_arm(name: str, args, device: torch.device) -> dict:
    config_of = gpt2_tiny if args.tiny else gpt2_355m
    model_config = config_of(n_positions=max(args.seq, 128) if args.tiny else 1024)
    torch.manual_seed(1234)
    with torch.device(device):
        model = GPT2LMHeadModel(model_config)
    offload = dict(ARMS[name])
    if offload["device"] == "nvme":
        offload.update(nvme_path=args.nvme_path, buffer_count=4)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": device.type == "cuda"},
        "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
        "zero_optimization": {"stage": args.stage, "sub_group_size": args.sub_group,
                              "offload_optimizer": offload},
    }
    if args.aio is not None:
        config["aio"] = args.aio
    engine, _, _, _ = dslab.initialize(model=model, config=config)
    g = torch.Generator(device=device).manual_seed(1000)
    ids = torch.randint(0, model_config.vocab_size, (args.micro_batch, args.seq), generator=g, device=device)
    times = []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= args.warmup:
            times.append(elapsed)
    if hasattr(engine.zero.offload, "flush"):
        engine.zero.offload.flush()  # the last step's write-behind
    io = (engine.profiler_records().get("io") or {}).get("operations", [])
    row = {"arm": name, "step_time_ms": statistics.median(times), "step_times_ms": times,
           "final_loss": float(loss.detach().float()),
           "chunks": len(engine.zero.offload.chunks) if engine.zero.offload is not None else None,
           "io": {op["kind"]: {k: op[k] for k in ("count", "bytes", "GBps", "median_GBps", "wait_s")}
                  for op in io}}
    engine.destroy()
    del engine, model, ids, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return row


def _line(row: dict, prefix: str) -> str:
    io = row["io"]
    swaps = "  ".join(f"{kind} {v['bytes'] / v['count'] / 1e9:.2f} GB x {v['count']} at "
                      f"{v['median_GBps']:.2f} GB/s" + (f", waited {v['wait_s']:.2f} s" if kind == "swap_in" else "")
                      for kind, v in sorted(io.items()))
    return f"{prefix}{row['arm']:<12} {row['step_time_ms']:>9.1f} ms/step  {swaps}"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu") if args.tiny or not torch.cuda.is_available() else torch.device("cuda", 0)
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"NVMe vs CPU optimizer offload: {'gpt2_tiny' if args.tiny else 'gpt2_355m'} on {gpu}, ZeRO "
          f"stage {args.stage}, micro-batch {args.micro_batch} x {args.seq}, sub_group_size "
          f"{args.sub_group:.0e}, swap dir {args.nvme_path}, aio {args.aio or 'defaults'}", flush=True)
    rows: dict[str, list[dict]] = {}
    try:
        for trial in range(args.trials):
            for name in args.arms:
                row = run_arm(name, args, device)
                rows.setdefault(name, []).append(row)
                print(_line(row, f"[{trial + 1}/{args.trials}] "), flush=True)
    finally:
        for leftover in Path(args.nvme_path).glob("dslab_zero_rank*"):
            shutil.rmtree(leftover, ignore_errors=True)
    summary = []
    print(f"median of {args.trials} trial(s), arms interleaved:")
    for name, trials in rows.items():
        median = statistics.median(r["step_time_ms"] for r in trials)
        best = min(trials, key=lambda r: abs(r["step_time_ms"] - median))
        summary.append({**best, "step_time_ms": median, "trials_ms": [r["step_time_ms"] for r in trials]})
        print(_line(summary[-1], ""))
    cpu = next((r for r in summary if r["arm"] == "cpu"), None)
    for row in summary:
        if cpu is not None and row is not cpu:
            print(f"{row['arm']} / cpu step time: {row['step_time_ms'] / cpu['step_time_ms']:.2f}x")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"device": gpu, "args": {k: v for k, v in vars(args).items()},
                                   "rows": summary}, indent=1, default=str))
        os.replace(tmp, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
