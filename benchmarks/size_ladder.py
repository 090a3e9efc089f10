"""The largest GPT-2-family model a ZeRO config trains on this machine: a ladder over the GPT-3
paper's sizes (Brown et al. 2020, table 2.1), then larger by layers.

    python benchmarks/size_ladder.py [--configs stage3,offload,deepspeed-offload]
        [--sizes 1.3b,2.7b,6.7b,13b,13b-48l] [--micro-batch 8] [--seq 1024] [--accum 4]
        [--warmup 1] [--steps 2] [--size-timeout 600] [--json OUT.json] [--ratio 0.5]
        [--accumulate-on gpu|cpu|gpu_resident] [--staging-buffers N] [--staging-dtype bf16]
        [--prefetch ELEMENTS] [--fetch-dtype bf16]
        [--memory-sites N [--memory-entries 500000]] [--nproc N]
    python benchmarks/size_ladder.py --tiny   # CPU: two tiny sizes, the whole pipeline

For each config, the sizes run in order, each in a process of its own (a failed size leaves
nothing behind); the ladder of a config stops at its first size that does not train: CUDA
out-of-memory (caught, recorded as ``oom`` with where it happened), the process killed (host
memory; recorded as ``killed``), or past ``--size-timeout`` (``timeout``). Each size runs with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the caller set it. A size trains when it
completes ``--warmup`` + ``--steps`` optimizer steps; the loss of each is recorded.

Sizes are the GPT-3 paper's by name (``1.3b`` ... ``13b``), or any of them with another layer
count, ``<size>-<N>l`` (``13b-80l``: 13B's width in 80 layers, 25.4B parameters).

``--nproc N`` runs each size data-parallel on N processes of this machine (one per GPU, nccl; gloo
on a CPU), started as torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT): ZeRO-3
shards the model over them (``zero.Init`` builds each rank's shard only), each rank trains on its
own micro-batches, and a step is ``N x micro-batch x seq x accum`` tokens. MFU divides by the sum
of the ranks' measured peaks; peak GPU memory is the largest rank's, peak host memory the sum of
the ranks' (they share the host); the offload columns are rank 0's. A rank that runs out of
memory records where, and the others are stopped (a collective would wait for it forever); the
row names the rank.

The model: dslab's GPT-2 (dslab kernels, bf16 autocast over fp32 parameters, dropout 0,
vocab 50257, every layer an activation checkpoint), built under ``dslab.zero.Init`` so no
process ever holds it whole; AdamW (lr 1e-4), clipping 1.0, micro-batch x seq tokens per
micro-step and ``--accum`` micro-steps per optimizer step.

Configs:

- ``stage3``: ZeRO stage 3, everything on the GPU.
- ``offload``: stage 3 with ``offload_optimizer`` and ``offload_param`` on the CPU (pinned).
- ``offload-split``: ``offload`` with ``offload_optimizer.ratio`` ``--ratio`` (default 0.5):
  that fraction of the shards steps on the CPU with its parameters in host memory, the rest
  stays on the GPU (host memory, not the GPU, is what bounds ``offload`` on one H200).
  ``--accumulate-on cpu`` sets the dslab offload configs' ``offload_optimizer.accumulate_on``:
  later micro-steps' gradient shards are added on the CPU, not copied back to the GPU for it;
  ``--accumulate-on gpu_resident`` keeps the window's sum on the GPU and copies it to the host
  once per optimizer step. ``--overlap-step`` sets ``offload_optimizer.overlap_step`` of
  ``offload`` and ``offload-split``: the CPU step of the offloaded parameters runs while the next
  forward starts (each row's ``overlap_step_s``, and the forward's ``update_wait_s``). Every
  offload row has the CPU step's own time on the engine's thread (``cpu_step_s``).
  ``--fetch-dtype bf16`` sets ``offload_param.fetch_dtype`` of ``offload`` and ``offload-split``:
  the shards cross PCIe as bf16 copies, widened on the GPU. ``--staging-buffers N`` sets
  ``offload_optimizer.staging_buffers`` (the pinned buffers the host adds drain) and
  ``--staging-dtype bf16`` its ``staging_dtype`` (those shards cross PCIe in bf16).
- ``offload-opt``: stage 3 with ``offload_optimizer`` on the CPU only.
- ``offload-nvme``: ZeRO-Infinity on disk: ``offload_optimizer`` and ``offload_param`` on NVMe
  (``--nvme-path``, a fresh directory per size, removed after it): masters, Adam states and
  released parameter shards in files, read through ``dslab.io`` around each use.
- ``deepspeed-stage3`` / ``deepspeed-offload`` / ``deepspeed-offload-split``: the same jobs
  through DeepSpeed (when it imports): ``deepspeed.zero.Init`` around the same model, its bf16
  engine and CPU Adam; ``-split`` passes ``--ratio`` as DeepSpeed's own
  ``offload_optimizer.ratio`` (its stage-3 partial offload: that fraction of the optimizer
  states steps in CPU Adam, the rest on the GPU), the config dslab's ``offload-split`` mirrors.

Per size: step time (median of ``--steps``), tokens/s, model TFLOP/s by Megatron's count
(Narayanan et al. 2021: ``72 B s L h^2 (1 + s/6h + V/12Lh)`` per step, the recompute not
counted), MFU against the bf16 matmul peak measured in the same process
(:func:`dslab.bench.measure.measure_peaks`), peak GPU memory allocated, the process's peak host
RSS, and for dslab with parameter offload the bytes fetched per step and how long the device
stood waiting for them (:mod:`dslab.engine.zero.param_offload`), and with optimizer offload the
gradient bytes copied to the host and back to the GPU per step and how long the host waited for
its additions (``accumulate_on: cpu``; :mod:`dslab.engine.zero.offload`). The table prints last.
``--memory-sites N`` (CUDA) records the allocator's trace from before the build and prints the N
allocation sites holding most GPU memory at the trace's peak (or where it ran out of memory), by
dslab's or this script's line (:mod:`dslab.profilers.memory_sites`); the recording slows the
step, so its times are not the ladder's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # name: (layers, hidden, heads): the GPT-3 paper's, heads of 128 (2.7B: 80 -> 128)
    "tiny-a": (2, 128, 4),
    "tiny-b": (4, 128, 4),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 20),
    "6.7b": (32, 4096, 32),
    "13b-2l": (2, 5120, 40),  # 13B's layer shapes in two layers: a quick check of its kernels
    "13b": (40, 5120, 40),
    "13b-48l": (48, 5120, 40),
    "13b-56l": (56, 5120, 40),
}
VOCAB = 50257


def size_shape(name: str) -> tuple[int, int, int]:
    """``(layers, hidden, heads)`` of a size name: one of :data:`SIZES`, or ``<size>-<N>l``, that
    size's width in N layers (module docstring)."""
    if name in SIZES:
        return SIZES[name]
    base, _, layers = name.rpartition("-")
    if base in SIZES and layers.endswith("l") and layers[:-1].isdigit() and int(layers[:-1]) > 0:
        return int(layers[:-1]), *SIZES[base][1:]
    raise ValueError(f"unknown size {name!r}; known: {', '.join(SIZES)}, or one of them with another layer "
                     f"count as '<size>-<N>l' (e.g. 13b-80l)")
CONFIGS = ("stage3", "offload", "offload-split", "offload-opt", "offload-nvme", "deepspeed-stage3",
           "deepspeed-offload", "deepspeed-offload-split")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="stage3,offload")
    parser.add_argument("--sizes", default="1.3b,2.7b,6.7b,13b,13b-48l")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--prefetch", type=int, default=None,
                        help="zero_optimization.stage3_prefetch_bucket_size (elements gathered ahead of use; "
                             "default: the engine's, DeepSpeed's 5e7), for every config")
    parser.add_argument("--fetch-dtype", choices=("bf16", "fp16"), default=None,
                        help="offload_param.fetch_dtype of the dslab CPU offload configs: fetch copies of the "
                             "shards in this dtype (half the bytes over PCIe)")
    parser.add_argument("--accumulate-on", choices=("gpu", "cpu", "gpu_resident"), default="gpu",
                        help="offload_optimizer.accumulate_on of the dslab offload configs: where a "
                             "micro-step's gradient shard is added to the window's sum")
    parser.add_argument("--overlap-step", action="store_true",
                        help="offload_optimizer.overlap_step of offload and offload-split: the CPU "
                             "step of the offloaded parameters overlaps the next forward")
    parser.add_argument("--staging-dtype", choices=("bf16",), default=None,
                        help="offload_optimizer.staging_dtype of the dslab offload configs under "
                             "--accumulate-on cpu: later micro-steps' gradient shards cross PCIe in bf16")
    parser.add_argument("--staging-buffers", type=int, default=None,
                        help="offload_optimizer.staging_buffers of the dslab offload configs under "
                             "--accumulate-on cpu (default: the engine's, 4)")
    parser.add_argument("--memory-sites", type=int, default=0, metavar="N",
                        help="record the CUDA allocator's trace from before the build (slower; a "
                             "diagnostic run) and print the N allocation sites holding most memory at "
                             "its peak")
    parser.add_argument("--memory-entries", type=int, default=500_000,
                        help="the trace's length for --memory-sites (host memory: several KB an entry)")
    parser.add_argument("--max-in-cpu", type=int, default=None,
                        help="offload-nvme's offload_param.max_in_cpu (default: DeepSpeed's, 1e9 elements)")
    parser.add_argument("--nvme-path", default=None,
                        help="offload-nvme's directory (default: a fresh one under the system's temp dir)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--size-timeout", type=float, default=600.0)
    parser.add_argument("--budget", type=float, default=0.0,
                        help="seconds for the whole ladder (0: none); sizes past it are skipped")
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes (GPUs) per size: data-parallel ZeRO over them (default 1)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # config:size, run in this process
    parser.add_argument("--rank-json", action="store_true", help=argparse.SUPPRESS)  # --json gets .rank<R>
    args = parser.parse_args(argv)
    if args.tiny:
        args.micro_batch, args.seq, args.accum = 2, 64, 2
        if args.sizes == parser.get_default("sizes"):
            args.sizes = "tiny-a,tiny-b"
        args.configs = args.configs if args.configs != "stage3,offload" else "stage3,offload"
    for name in args.configs.split(","):
        if name not in CONFIGS:
            parser.error(f"--configs: unknown config {name!r}; known: {', '.join(CONFIGS)}")
    for name in args.sizes.split(","):
        try:
            size_shape(name)
        except ValueError as err:
            parser.error(f"--sizes: {err}")
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    return args


def model_flops_per_step(layers: int, hidden: int, seq: int, tokens: int) -> float:
    """Megatron's model flops of one optimizer step over ``tokens`` tokens (module docstring)."""
    batch = tokens / seq
    return 72 * batch * seq * layers * hidden**2 * (
        1 + seq / (6 * hidden) + VOCAB / (12 * layers * hidden))


def parameter_count(layers: int, hidden: int, seq: int) -> int:
    per_layer = 12 * hidden**2 + 13 * hidden
    return layers * per_layer + VOCAB * hidden + seq * hidden + 2 * hidden


def engine_config(config: str, args) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 100_000}
    if args.prefetch is not None:
        zero["stage3_prefetch_bucket_size"] = args.prefetch
    if config in ("offload", "offload-split", "offload-opt", "deepspeed-offload", "deepspeed-offload-split"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if config in ("offload-split", "deepspeed-offload-split"):
        zero["offload_optimizer"]["ratio"] = args.ratio
    if config in ("offload", "offload-split", "deepspeed-offload", "deepspeed-offload-split"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if config in ("offload", "offload-split") and args.fetch_dtype is not None:
        zero["offload_param"]["fetch_dtype"] = args.fetch_dtype
    if config in ("offload", "offload-split") and args.overlap_step:
        zero["offload_optimizer"]["overlap_step"] = True
    if config == "offload-nvme":
        for key in ("offload_optimizer", "offload_param"):
            zero[key] = {"device": "nvme", "nvme_path": args.nvme_path, "pin_memory": True}
        if args.max_in_cpu is not None:
            zero["offload_param"]["max_in_cpu"] = args.max_in_cpu
    if config in ("offload", "offload-split", "offload-opt", "offload-nvme"):
        zero["offload_optimizer"]["accumulate_on"] = args.accumulate_on
        if args.staging_buffers is not None:
            zero["offload_optimizer"]["staging_buffers"] = args.staging_buffers
        if args.staging_dtype is not None:
            zero["offload_optimizer"]["staging_dtype"] = args.staging_dtype
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


# -- one size, in its own process -----------------------------------------------------------


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(config: str, size: str, args) -> dict:
    import torch

    import dslab
    from dslab.bench.measure import measure_peaks
    from dslab.models.gpt2 import GPT2Config, GPT2LMHeadModel

    layers, hidden, heads = size_shape(size)
    world, rank = 1, 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by run_size with --nproc
        from dslab.comm import init_distributed

        init_distributed()  # nccl on GPU LOCAL_RANK, gloo on a CPU
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    peaks = measure_peaks(device)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=args.seq, hidden=hidden, layers=layers,
                     heads=heads, dropout=0.0, checkpoint_layers=1)
    kernels = "dslab" if device.type == "cuda" else "torch"
    ds_config = engine_config(config, args)
    row = {"config": config, "size": size, "layers": layers, "hidden": hidden, "heads": heads,
           "params": parameter_count(layers, hidden, args.seq), "peaks": peaks, "world_size": world,
           "rank": rank}
    phase = "build"
    if args.memory_sites and device.type == "cuda":  # from before the model exists: every block is in the trace
        from dslab.profilers.memory_sites import start_trace

        start_trace(args.memory_entries)
    try:
        t0 = time.perf_counter()
        if config.startswith("deepspeed"):
            import deepspeed

            with deepspeed.zero.Init(config_dict_or_path=ds_config):
                model = GPT2LMHeadModel(cfg, kernels=kernels)
            phase = "initialize"
            engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                                   model_parameters=model.parameters())
        else:
            with dslab.zero.Init(config_dict_or_path=ds_config):
                model = GPT2LMHeadModel(cfg, kernels=kernels)
            phase = "initialize"
            engine, _, _, _ = dslab.initialize(model=model, config=ds_config)
        row["build_s"] = time.perf_counter() - t0
        g = torch.Generator(device="cpu").manual_seed(rank)  # each rank its own data
        batches = [torch.randint(0, VOCAB, (args.micro_batch, args.seq), generator=g).to(device)
                   for _ in range(args.accum)]
        losses, times = [], []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        home = getattr(getattr(engine, "zero", None), "param_home", None)
        offload = getattr(getattr(engine, "zero", None), "offload", None)
        grads_before = None
        before = home.stats() if home is not None else None
        for step in range(args.warmup + args.steps):
            phase = f"step {step}"
            if step == args.warmup and home is not None:
                before = home.stats()
            if step == args.warmup and offload is not None:
                grads_before = offload.stats()
            start = time.perf_counter()
            total = 0.0
            for ids in batches:
                loss = engine(ids, labels=ids)
                engine.backward(loss)
                engine.step()
                total += float(loss.detach())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = _max_over_ranks(time.perf_counter() - start, world, device)  # the slowest rank's
            losses.append(_mean_over_ranks(total / len(batches), world, device))
            if step >= args.warmup:
                times.append(elapsed)
            if rank == 0:
                print(f"  {config} {size} step {step}: {elapsed:.2f} s loss {losses[-1]:.4f}", flush=True)
        step_s = statistics.median(times)
        tokens = args.micro_batch * args.seq * args.accum * world
        flops = model_flops_per_step(layers, hidden, args.seq, tokens)
        row.update(status="ok", losses=losses, step_s=step_s, step_times_s=times,
                   tokens_per_step=tokens, tokens_per_s=tokens / step_s,
                   model_tflops=flops / step_s / 1e12)
        if peaks.get("bf16_matmul_tflops"):
            row["peak_tflops_sum"] = _sum_over_ranks(peaks["bf16_matmul_tflops"], world, device)
            row["mfu"] = row["model_tflops"] / row["peak_tflops_sum"]
        if device.type == "cuda":
            row["peak_gpu_bytes"] = int(_max_over_ranks(torch.cuda.max_memory_allocated(device), world, device))
        if home is not None:
            after = home.stats()
            row["param_offload_per_step"] = {
                k: (after[k] - before[k]) / args.steps for k in after if k != "device"}
        if grads_before is not None:
            after = offload.stats()
            row["grad_offload_per_step"] = {k: (after[k] - grads_before[k]) / args.steps for k in after}
    except torch.OutOfMemoryError as err:
        row.update(status="oom", where=phase, error=str(err).splitlines()[0][:300])
    if args.memory_sites and device.type == "cuda":  # at the end, or where it ran out of memory
        row.update(memory_sites(device, args.memory_sites, args.memory_entries))
    row["peak_host_rss_bytes"] = _peak_rss_bytes()
    if world > 1 and row["status"] == "ok":  # every rank got here: the ranks share the host
        row["peak_host_rss_bytes"] = int(_sum_over_ranks(row["peak_host_rss_bytes"], world, device))
    return row


def _reduced(value: float, world: int, device, op) -> float:
    if world == 1:
        return value
    import torch

    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=op)
    return float(t.item())


def _sum_over_ranks(value, world, device):
    import torch

    return _reduced(value, world, device, torch.distributed.ReduceOp.SUM)


def _max_over_ranks(value, world, device):
    import torch

    return _reduced(value, world, device, torch.distributed.ReduceOp.MAX)


def _mean_over_ranks(value, world, device):
    return _sum_over_ranks(value, world, device) / world


def memory_sites(device, top: int, max_entries: int) -> dict:
    """The blocks live at the recorded trace's peak, summed by the dslab or benchmark line that
    allocated them (:func:`dslab.profilers.memory_sites.sites_at_peak`); printed, and returned
    for the row."""
    from dslab.profilers.memory_sites import format_sites, sites_at_peak

    result = sites_at_peak(device.index or 0, top, max_entries, within=("dslab/", "benchmarks/"))
    for line in format_sites(result):
        print(f"  {line}", flush=True)
    return {"memory_sites_peak_bytes": result["peak_bytes"], "memory_sites": result["sites"],
            "memory_trace_full": result["trace_full"]}


# -- the ladder -----------------------------------------------------------------------------


def run_size(config: str, size: str, args, out_dir: Path, timeout: float) -> dict:
    out = out_dir / f"{config}-{size}.json"
    cmd = [sys.executable, __file__, "--child", f"{config}:{size}", "--json", str(out),
           "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
           "--accum", str(args.accum), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--ratio", str(args.ratio), "--accumulate-on", args.accumulate_on]
    if args.prefetch is not None:
        cmd += ["--prefetch", str(args.prefetch)]
    if args.fetch_dtype is not None:
        cmd += ["--fetch-dtype", args.fetch_dtype]
    if args.overlap_step:
        cmd += ["--overlap-step"]
    if args.staging_buffers is not None:
        cmd += ["--staging-buffers", str(args.staging_buffers)]
    if args.staging_dtype is not None:
        cmd += ["--staging-dtype", args.staging_dtype]
    if args.memory_sites:
        cmd += ["--memory-sites", str(args.memory_sites), "--memory-entries", str(args.memory_entries)]
    nvme = None
    if config == "offload-nvme":  # a fresh directory per size, removed after it
        nvme = Path(tempfile.mkdtemp(prefix=f"ladder-{size}-", dir=args.nvme_path))
        cmd += ["--nvme-path", str(nvme)]
        if args.max_in_cpu is not None:
            cmd += ["--max-in-cpu", str(args.max_in_cpu)]
    start = time.perf_counter()
    try:
        codes, errors = _run_ranks(cmd, args.nproc, timeout)
    finally:
        if nvme is not None:
            shutil.rmtree(nvme, ignore_errors=True)
    seconds = time.perf_counter() - start
    rows = [json.loads(path.read_text()) for path in _rank_files(out, args.nproc) if path.exists()]
    for path in _rank_files(out, args.nproc):
        path.unlink(missing_ok=True)
        path.with_suffix(".tmp").unlink(missing_ok=True)  # a rank stopped while writing
    failed = [r for r in rows if r.get("status") != "ok"]
    which = (lambda rank: f" (rank {rank})") if args.nproc > 1 else (lambda rank: "")
    if failed:  # a rank that ran out of memory says where; the others were stopped waiting for it
        row = failed[0]
    elif len(rows) == args.nproc and rows:
        row = next(r for r in rows if r.get("rank", 0) == 0)
    elif codes is None:
        row = {"config": config, "size": size, "status": "timeout"}
    elif killed := [rank for rank, code in enumerate(codes) if code is not None and (code < 0 or code == 137)]:
        code = codes[killed[0]]
        row = {"config": config, "size": size, "status": "killed",
               "error": f"signal {-code if code < 0 else 9} (host memory){which(killed[0])}"}
    else:
        rank = next((rank for rank, code in enumerate(codes) if code), 0)
        tail = errors[rank].strip().splitlines()[-3:]
        row = {"config": config, "size": size, "status": "error",
               "error": (" | ".join(tail)[-400:]) + which(rank)}
    row["seconds"] = seconds
    row.setdefault("world_size", args.nproc)  # an ok row has the process group's own
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(row, indent=1))
    os.replace(tmp, out)
    return row


def _rank_files(out: Path, nproc: int) -> list[Path]:
    """Where each rank of a size writes its row: ``out`` itself for one process."""
    if nproc == 1:
        return [out]
    return [out.with_name(f"{out.stem}.rank{rank}.json") for rank in range(nproc)]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: Seconds the other ranks are given to finish once one rank has ended badly (they are then stopped:
#: a collective would wait for the missing rank until the process group's timeout).
RANK_GRACE_S = 10.0


def _run_ranks(cmd: list[str], nproc: int, timeout: float) -> tuple[list | None, list[str]]:
    """Run ``cmd`` as ``nproc`` ranks (torchrun's environment when more than one) and wait for them.
    Returns each rank's exit code (None for one stopped here) -- or None for all when the size ran
    past ``timeout`` -- and each rank's stderr."""
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # near-full sizes fragment otherwise
    if nproc > 1:
        env.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
    with tempfile.TemporaryDirectory(prefix="size-ladder-") as logs:
        procs, files = [], []
        for rank in range(nproc):
            files.append(open(Path(logs) / f"rank{rank}.err", "w+"))
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if nproc > 1 else env
            procs.append(subprocess.Popen(cmd + (["--rank-json"] if nproc > 1 else []), env=rank_env,
                                          stderr=files[-1], stdout=None if rank == 0 else subprocess.DEVNULL))
        deadline, stop_at, timed_out, stopped = time.monotonic() + timeout, None, False, set()
        while [proc.poll() for proc in procs].count(None):  # polls every rank (sets its returncode)
            now = time.monotonic()
            if stop_at is None and any(proc.returncode not in (None, 0) for proc in procs):
                stop_at = now + RANK_GRACE_S
            if stop_at is None and nproc > 1 and any(proc.returncode == 0 for proc in procs) \
                    and _some_rank_failed(cmd, nproc):
                stop_at = now + RANK_GRACE_S
            if now > deadline or (stop_at is not None and now > stop_at):
                timed_out = now > deadline
                for rank, proc in enumerate(procs):
                    if proc.poll() is None:
                        proc.kill()
                        stopped.add(rank)
                for proc in procs:
                    proc.wait()
                break
            time.sleep(0.2)
        errors = []
        for handle in files:
            handle.seek(0)
            errors.append(handle.read())
            handle.close()
    codes = None if timed_out else [None if rank in stopped else proc.returncode for rank, proc in enumerate(procs)]
    return codes, errors


def _some_rank_failed(cmd: list[str], nproc: int) -> bool:
    """Whether a rank that has ended wrote a row other than ``ok`` (out of memory: it exits cleanly)."""
    out = Path(cmd[cmd.index("--json") + 1])
    for path in _rank_files(out, nproc):
        try:
            if json.loads(path.read_text()).get("status") != "ok":
                return True
        except (OSError, ValueError):
            continue
    return False


def fmt_table(rows: list[dict]) -> str:
    lines = ["| config | size | params | status | step s | tokens/s | TFLOP/s | MFU | peak GPU GiB "
             "| peak host GiB | fetched GB/step | disk read/write GB/step | device wait ms/step "
             "| gradients out/back GB/step | host adds wait s/step (worker: copy wait / adding) "
             "| CPU step s/step (background: fetches waited) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        def num(key, scale=1.0, digits=1):
            value = r.get(key)
            return f"{value / scale:.{digits}f}" if isinstance(value, (int, float)) else ""
        offload = r.get("param_offload_per_step") or {}
        fetched = f"{offload['h2d_bytes'] / 1e9:.1f}" if offload else ""
        waited = f"{offload['copy_stall_ms']:.0f}" if offload else ""
        disk = (f"{offload['disk_read_bytes'] / 1e9:.1f} / {offload['disk_write_bytes'] / 1e9:.1f}"
                if offload.get("disk_read_bytes") else "")
        grads = r.get("grad_offload_per_step") or {}
        traffic = (f"{grads['grad_d2h_bytes'] / 1e9:.1f} / {grads['grad_h2d_bytes'] / 1e9:.1f}"
                   if grads.get("grad_d2h_bytes") else "")
        adds = (f"{grads['staging_wait_s'] + grads['adds_wait_s']:.2f} "
                f"({grads.get('add_copy_wait_s', 0.0):.2f} / {grads.get('add_s', 0.0):.2f})"
                if grads.get("host_adds") else "")
        cpu_step = grads.get("cpu_step_s", 0.0) + grads.get("overlap_step_s", 0.0)
        background = (f"{cpu_step:.2f} (bg {grads['overlap_step_s']:.2f}: {offload.get('update_wait_s', 0.0):.2f})"
                      if grads.get("overlap_step_s") else f"{cpu_step:.2f}" if cpu_step else "")
        status = r["status"] + (f" ({r['where']})" if r.get("where") else "")
        params = f"{r['params'] / 1e9:.2f}B" if r.get("params") else ""
        config = r["config"] + (f" x{r['world_size']}" if r.get("world_size", 1) > 1 else "")
        lines.append(
            f"| {config} | {r['size']} | {params} | {status} | {num('step_s', digits=2)} "
            f"| {num('tokens_per_s', digits=0)} | {num('model_tflops')} | {num('mfu', 0.01)}{'%' if 'mfu' in r else ''} "
            f"| {num('peak_gpu_bytes', 2**30)} | {num('peak_host_rss_bytes', 2**30)} | {fetched} "
            f"| {disk} | {waited} | {traffic} | {adds} | {background} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        config, size = args.child.split(":")
        row = run_child(config, size, args)
        out = args.json
        if args.rank_json:
            out = _rank_files(args.json, int(os.environ["WORLD_SIZE"]))[int(os.environ["RANK"])]
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, indent=1))
        os.replace(tmp, out)
        if args.rank_json and row["status"] != "ok":
            sys.stdout.flush()
            os._exit(0)  # the others wait in a collective for this rank: no process-group teardown
        return 0
    out_dir = (args.json.parent if args.json else Path("reports")) / "size_ladder_rows"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    start = time.perf_counter()
    for config in args.configs.split(","):
        for size in args.sizes.split(","):
            left = args.budget - (time.perf_counter() - start) if args.budget else args.size_timeout
            if left < 30:
                rows.append({"config": config, "size": size, "status": "skipped (budget)"})
                continue
            print(f"{config} {size} ...", flush=True)
            row = run_size(config, size, args, out_dir, min(args.size_timeout, left))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "peaks"}), flush=True)
            if row["status"] != "ok":
                break  # larger sizes of this config will not fit either
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                   "rows": rows}, indent=1))
        os.replace(tmp, args.json)
    print(fmt_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
