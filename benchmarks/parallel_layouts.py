"""GPT-2 trained on one host's GPUs in several parallel layouts, timed in one process group:

    python -m torch.distributed.run --standalone --nproc_per_node N benchmarks/parallel_layouts.py \
        [--size 1.5b] [--layouts dp,pp4,tp2dp2,pp2dp2,tp2pp2] [--micro 4] [--micro-batches 16] \
        [--seq 1024] [--warmup 2] [--steps 5] [--cuda-graphs] [--json OUT.json]

A layout is ``dp`` (the plain engine, data parallel over every rank), ``ppK`` (K pipeline stages,
the pipeline engine, data parallel over the rest), ``tpK`` (tensor parallel over K ranks, the
plain engine with ``mpu``), or a product such as ``tp2pp2``, ``pp2dp2`` (the ``dp`` factor is
what is left over). On one GPU, ``pp1`` runs the pipeline engine with one stage beside ``dp``:
what the pipeline machinery costs where it has nothing to overlap.

Every layout trains the same model (dslab's GPT-2 on dslab's kernels, bf16 autocast over fp32
parameters, dropout 0, AdamW, clipping 1.0, ZeRO-1 where there is data parallelism) on the same
global batch: ``--micro`` sequences of ``--seq`` tokens per micro-batch per data-parallel rank and
``--micro-batches`` micro-batches per step. Per layout: step time (median of ``--steps`` after
``--warmup``, CUDA-synchronised), host time (until the step's calls return, before the
synchronisation: close to the step time when the host is what the step waits on), tokens/s,
model TFLOP/s per GPU by Megatron's count (``72 B s L h^2 (1 + s/6h + V/12Lh)`` per step,
Narayanan et al. 2021) and MFU against the bf16 matmul peak measured in the same process, peak
memory allocated, and for pipelines every stage's busy and idle time against the 1F1B bubble
``(p-1)/(m+p-1)``. Rank 0 prints the table last.

Without a GPU the same runs on gloo processes with the torch kernels and no MFU (``--size tiny``:
a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch

import dslab
from dslab import comm
from dslab.bench.measure import measure_peaks
from dslab.models.gpt2 import GPT2Config, GPT2LMHeadModel
from dslab.models.gpt2_pipe import gpt2_pipeline_module
from dslab.parallel.topology import PipelineParallelGrid, PipeModelDataParallelTopology

# "1.5b-h50": GPT-2 XL with 50 heads of 32 (same parameters and flops): its 25 heads do not
# split over 2 tensor-parallel ranks
SIZES = {"tiny": (2, 128, 4), "355m": (24, 1024, 16), "1.5b": (48, 1600, 25), "1.5b-h50": (48, 1600, 50),
         "2.7b": (32, 2560, 32), "6.7b": (32, 4096, 32)}
VOCAB = 50257


def parse_layout(name: str, world: int) -> tuple[int, int, int, bool]:
    """``(tp, pp, dp, pipeline engine)`` of a layout name."""
    if name == "dp":
        return 1, 1, world, False
    factors = dict(re.findall(r"(tp|pp|dp)(\d+)", name))
    if "".join(f"{k}{v}" for k, v in re.findall(r"(tp|pp|dp)(\d+)", name)) != name:
        raise ValueError(f"layout {name!r}: 'dp' or products of tpK, ppK, dpK")
    tp, pp = int(factors.get("tp", 1)), int(factors.get("pp", 1))
    dp = int(factors.get("dp", world // (tp * pp)))
    if tp * pp * dp != world:
        raise ValueError(f"layout {name!r} needs {tp * pp * dp} ranks; this run has {world}")
    return tp, pp, dp, "pp" in factors


def model_flops(layers: int, hidden: int, seq: int, tokens: int) -> float:
    return 72 * (tokens / seq) * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + VOCAB / (12 * layers * hidden))


def run_layout(name: str, args, device) -> dict:
    world = comm.get_world_size()
    tp, pp, dp, pipeline = parse_layout(name, world)
    layers, hidden, heads = SIZES[args.size]
    config = GPT2Config(vocab_size=VOCAB, n_positions=args.seq, hidden=hidden, layers=layers, heads=heads,
                        dropout=0.0, vocab_pad_multiple=64 * tp, tp_size=tp, chain_layer_norms=not pipeline)
    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp))
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.micro_batches,
           "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 1 if dp > 1 else 0}}
    torch.manual_seed(0)
    kernels = "dslab" if device.type == "cuda" else "torch"
    if device.type != "cuda":
        del cfg["bf16"]
    graphed = args.cuda_graphs and not pipeline
    if graphed:  # the layer stack replayed from CUDA graphs, its collectives inside (pipelines run eagerly)
        cfg["cuda_graphs"] = {"enabled": True}
    if pipeline:
        model = gpt2_pipeline_module(config, kernels, grid=grid, activation_checkpoint_interval=args.ckpt)
        engine, _, _, _ = dslab.initialize(model=model, config=cfg)
    else:
        model = GPT2LMHeadModel(config, kernels, tp_group=grid.get_model_parallel_group())
        engine, _, _, _ = dslab.initialize(model=model, config=cfg, mpu=grid)
    dp_rank = grid.get_data_parallel_rank()
    g = torch.Generator().manual_seed(dp_rank)

    def batches():
        for _ in range(args.micro_batches):
            ids = torch.randint(0, VOCAB, (args.micro, args.seq), generator=g).to(device)
            yield ids, ids

    def step():
        if pipeline:
            return engine.train_batch(batches())
        for ids, labels in batches():
            loss = engine(ids, labels=labels)
            engine.backward(loss)
            engine.step()
        return loss

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, hosts, losses = [], [], []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        comm.barrier()
        start = time.perf_counter()
        loss = step()
        returned = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            hosts.append(returned - start)
            losses.append(float(loss.detach()))
    step_s = statistics.median(times)
    tokens = args.micro * args.seq * args.micro_batches * dp
    flops = model_flops(layers, hidden, args.seq, tokens)
    row = {"layout": name + ("+graphs" if graphed else ""), "tp": tp, "pp": pp, "dp": dp, "size": args.size,
           "step_s": step_s,
           "steps_s": times, "host_s": statistics.median(hosts), "tokens_per_s": tokens / step_s,
           "tflops_per_gpu": flops / step_s / world / 1e12, "losses": losses,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}
    peaks = comm.all_gather_object(row["peak_gib"])
    row["peak_gib_max"] = max(peaks)
    if pipeline:
        row["pipeline"] = engine.profiler_records()["pipeline"]
    engine.destroy()
    del engine, model
    if cuda:
        torch.cuda.empty_cache()
    return row


def fmt(rows: list[dict], peak: float | None) -> str:
    lines = [f"{'layout':<10}{'tp':>3}{'pp':>3}{'dp':>3}{'step s':>9}{'host s':>8}{'tokens/s':>11}{'TFLOP/s/GPU':>12}"
             f"{'MFU':>7}{'GiB':>7}  stage idle (bubble)"]
    for r in rows:
        idle = ""
        if "pipeline" in r:
            stages = r["pipeline"]["per_stage"]
            idle = " ".join(f"{s['idle_fraction']:.2f}" for s in stages) + f" ({r['pipeline']['bubble_fraction']:.2f})"
        lines.append(f"{r['layout']:<10}{r['tp']:>3}{r['pp']:>3}{r['dp']:>3}{r['step_s']:>9.3f}{r['host_s']:>8.3f}"
                     f"{r['tokens_per_s']:>11,.0f}{r['tflops_per_gpu']:>12.1f}"
                     f"{format(r['tflops_per_gpu'] / peak, '>7.1%') if peak else '      -'}"
                     f"{r['peak_gib_max']:>7.1f}  {idle}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1.5b", choices=sorted(SIZES))
    parser.add_argument("--layouts", default="dp")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--ckpt", type=int, default=0, help="pipeline activation_checkpoint_interval")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay the layer stack of the dp and tp layouts from CUDA graphs (pipelines stay eager)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    comm.init_distributed()
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        peak = measure_peaks(device)["bf16_matmul_tflops"]
    else:
        device, peak = torch.device("cpu"), None
    rows = []
    for name in args.layouts.split(","):
        try:
            rows.append(run_layout(name, args, device))
        except torch.OutOfMemoryError as exc:
            rows.append({"layout": name, "error": f"out of memory: {str(exc).splitlines()[0]}"})
            torch.cuda.empty_cache()
        except ValueError as exc:  # a layout this world or model does not take
            rows.append({"layout": name, "error": str(exc)})
        if comm.get_rank() == 0:
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "pipeline"}), flush=True)
    if comm.get_rank() == 0:
        ok = [r for r in rows if "error" not in r]
        text = fmt(ok, peak)
        where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (gloo, torch kernels)"
        measured = f"bf16 matmul peak {peak:.0f} TFLOP/s (measured)" if peak else "no MFU without a GPU"
        print(f"\nGPT-2 {args.size}, {comm.get_world_size()} x {where}, micro {args.micro} x "
              f"seq {args.seq}, {args.micro_batches} micro-batches, {measured}")
        print(text)
        for r in rows:
            if "error" in r:
                print(f"{r['layout']}: {r['error']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"peak_tflops": peak, "rows": rows, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
