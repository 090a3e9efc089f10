"""Run reports for the dashboard and trace tests, made in the shapes the profilers write.

:func:`make_report` builds one run's ``run.json`` content: two cases, three arms with trials, and
every profiler section per case as ``dslab.bench.training`` stores it (flops module tree, memory
steps and activations, multi-rank comms with a straggler, NVML telemetry, wall clock). The comms
section is made by the real analysis functions (:mod:`dslab.profilers.comms_analysis`) from
generated records, so its shape follows the comms logger's. :func:`make_small_report` is the
minimal report of the 500-run load test. :func:`make_scaling_report` is a data-parallel run
(``suites/zero``'s shape: cases ``<model case>-n<N>``) with made-up, consistent numbers.
:func:`make_autotune_report` is a ``dslab autotune`` run: one result per experiment and the
tuner's ``profilers["autotuning"]`` section, from :data:`AUTOTUNE_EXPERIMENTS`.
"""

from __future__ import annotations

import json
import random
import threading
import zlib
from pathlib import Path

from dslab.profilers.comms_analysis import DEFINITIONS, analyze_stragglers, summarize, summary_rows

GPU = "NVIDIA H100 80GB HBM3"
CASES = ("seq128", "seq512")
ARMS = ("dslab", "torch", "torch-compile")
STRAGGLER_RANK = 3
WORLD = 4
LAYERS = 3


def _module(name, type_, depth, params, fwd, latency_ms, calls=1):
    return {"name": name, "type": type_, "depth": depth, "params": params, "forward_flops": fwd,
            "backward_flops": 2 * fwd, "macs": (3 * fwd) // 2, "elementwise_flops": fwd // 100,
            "forward_latency_ms": latency_ms, "backward_latency_ms": 2 * latency_ms, "calls": calls}


def flops_section(scale: float = 1.0) -> dict:
    """A GPT-like module tree: embeddings, a ModuleList of layers (never called itself: calls 0,
    its figures the sum of its layers), attention and MLP Linears, a head."""
    d = 1024
    tokens = int(8 * 512 * scale)
    lin = lambda n_in, n_out: 2 * tokens * n_in * n_out  # noqa: E731
    modules = []
    layer_modules = []
    for i in range(LAYERS):
        qkv, out = lin(d, 3 * d), lin(d, d)
        attn_core = 4 * tokens * 512 * d
        fc_in, fc_out = lin(d, 4 * d), lin(4 * d, d)
        attn = qkv + out + attn_core
        mlp = fc_in + fc_out
        p = f"layers.{i}"
        layer_modules += [
            _module(p, "TransformerLayer", 2, 12 * d * d, attn + mlp, 6.0 + i),
            _module(f"{p}.attention", "SelfAttention", 3, 4 * d * d, attn, 3.0 + i),
            _module(f"{p}.attention.qkv", "Linear", 4, 3 * d * d, qkv, 1.0),
            _module(f"{p}.attention.out_proj", "Linear", 4, d * d, out, 0.4),
            _module(f"{p}.attention_norm", "LayerNorm", 3, 2 * d, 0, 0.1),
            _module(f"{p}.mlp", "FeedForward", 3, 8 * d * d, mlp, 2.5),
            _module(f"{p}.mlp.fc_in", "Linear", 4, 4 * d * d, fc_in, 1.2),
            _module(f"{p}.mlp.fc_out", "Linear", 4, 4 * d * d, fc_out, 1.2),
        ]
    layers_fwd = sum(m["forward_flops"] for m in layer_modules if m["depth"] == 2)
    layers_lat = sum(m["forward_latency_ms"] for m in layer_modules if m["depth"] == 2)
    head = lin(d, 32000)
    total_fwd = layers_fwd + head
    modules.append(_module("", "GPT2LMHead", 0, 40 * d * d, total_fwd, layers_lat + 4.0))
    modules.append(_module("embeddings", "Embedding", 1, 32000 * d, 0, 0.3))
    modules.append(_module("layers", "ModuleList", 1, 12 * d * d * LAYERS, layers_fwd, layers_lat, calls=0))
    modules.extend(layer_modules)
    modules.append(_module("lm_head", "Linear", 1, 32000 * d, head, 3.0))
    duration_ms = 3 * (layers_lat + 4.0) + 5.0
    total = 3 * total_fwd
    return {
        "profile_step": 3, "profiled": True, "total_flops": total, "forward_flops": total_fwd,
        "backward_flops": 2 * total_fwd, "optimizer_flops": 0, "total_macs": total // 2,
        "params": 40 * d * d, "duration_ms": duration_ms, "forward_latency_ms": layers_lat + 4.0,
        "backward_latency_ms": 2 * (layers_lat + 4.0), "optimizer_latency_ms": 5.0,
        "achieved_tflops": total / (duration_ms / 1e3) / 1e12,
        "elementwise_flops": {"forward": 1, "backward": 2, "optimizer": 3, "total": 6},
        "cpu_attention_flops": {"forward": 0, "backward": 0, "optimizer": 0, "total": 0},
        "flops_by_op": {"aten::mm": {"figure": "matmul", "flops": total}},
        "flops_by_dtype": {"bfloat16": total}, "uncounted_autograd_functions": [],
        "mfu": {"measured": total / (duration_ms / 1e3) / 700e12, "datasheet": total / (duration_ms / 1e3) / 989.5e12},
        "peaks": {"device": GPU, "measured_tflops": 700.0, "datasheet_tflops": 989.5,
                  "datasheet_gpu": "H100 SXM5 80GB", "datasheet_by_dtype": {"bfloat16": 989.5}, "note": None},
        "world_size": WORLD, "batch_size": 8,
        "timing": "CUDA events on the current stream, read after one synchronize at stop_profile",
        "counting": "ops executed under a TorchDispatchMode, forward and backward",
        "modules": modules,
    }


def comms_section(t0_ns: int, steps: int = 4, seed: int = 0) -> dict:
    """Four ranks' all_reduce and all_gather records; rank 3 arrives 4-6 ms late to every
    collective, so the others wait for it."""
    rng = random.Random(seed)
    per_rank = {rank: [] for rank in range(WORLD)}
    group = ",".join(str(r) for r in range(WORLD))
    seqs: dict[str, int] = {}
    for step in range(steps):
        for k, (op, nbytes) in enumerate((("all_reduce", 1 << 20), ("all_reduce", 16 << 20),
                                          ("all_gather", 8 << 20), ("all_reduce", 64 << 20))):
            seq = seqs.get(op, 0)
            seqs[op] = seq + 1
            base = t0_ns + step * 200_000_000 + k * 20_000_000
            arrivals = {r: base + rng.randint(0, 300_000) for r in range(WORLD)}
            arrivals[STRAGGLER_RANK] += rng.randint(4_000_000, 6_000_000)
            last = max(arrivals.values())
            transfer_ms = nbytes / 150e9 * 1e3 * 2
            for r in range(WORLD):
                per_rank[r].append({
                    "op": op, "group": group, "group_size": WORLD, "seq": seq, "bytes": nbytes,
                    "dtype": "bfloat16", "async": False, "step": step, "arrival_ns": arrivals[r],
                    "host_arrival_ns": arrivals[r], "latency_ms": (last - arrivals[r]) / 1e6 + transfer_ms,
                })
    analysis = analyze_stragglers(per_rank, {r: 0 for r in per_rank})
    as_str = lambda v: {str(k): as_str(x) for k, x in v.items()} if isinstance(v, dict) else v  # noqa: E731
    return {
        "rank": 0, "ops": summary_rows(summarize(per_rank[0])),
        "per_rank": {str(r): recs for r, recs in per_rank.items()},
        "stragglers": analysis["stragglers"], "straggler": as_str(analysis),
        "clock_offsets_ns": {str(r): 0 for r in per_rank}, "dropped_records": 0, "definitions": DEFINITIONS,
    }


def memory_section(steps: int = 12) -> dict:
    acts = []
    for i in range(LAYERS):
        acts += [{"module": f"layers.{i}.attention.qkv", "bytes": 8 << 20, "tensors": 1, "storages": 1, "shared_bytes": 0},
                 {"module": f"layers.{i}.attention", "bytes": 32 << 20, "tensors": 4, "storages": 3, "shared_bytes": 0},
                 {"module": f"layers.{i}.mlp.fc_in", "bytes": 8 << 20, "tensors": 1, "storages": 1, "shared_bytes": 0},
                 {"module": f"layers.{i}.mlp.fc_out", "bytes": 32 << 20, "tensors": 1, "storages": 1, "shared_bytes": 4 << 20}]
    acts.append({"module": "lm_head", "bytes": 250 << 20, "tensors": 1, "storages": 1, "shared_bytes": 0})
    params = 40 * 1024 * 1024 * 2
    return {
        "cuda": True, "note": None, "device": "cuda:0", "profile_step": 5,
        "steps": [{"step": s, "peak_allocated": (3 << 30) + s * (20 << 20), "peak_reserved": (4 << 30) + s * (8 << 20)}
                  for s in range(1, steps + 1)],
        "steps_stride": 1, "peak": {"allocated": (3 << 30) + steps * (20 << 20), "reserved": 5 << 30},
        "phases": {"forward_delta": 600 << 20, "backward_delta": -(500 << 20), "optimizer_delta": 0, "allocated": {}},
        "activations": acts, "activation_bytes": sum(a["bytes"] for a in acts),
        "model_states": {"num_params": params // 2, "params": params, "grads": params, "optimizer_states": 4 * params,
                         "optimizer_params": 0, "total": 6 * params, "bytes_per_param": 12.0,
                         "estimate": 6 * params, "estimate_bytes_per_param": 12.0,
                         "estimate_formula": "sum_p numel(p) * bytes(p.dtype) * (1 + requires_grad(p) + k)",
                         "estimate_note": None},
        "snapshot": None, "snapshot_note": None,
    }


def telemetry_section(started: float, n: int = 30, gpus: int = 2) -> dict:
    out = {"available": True, "reason": None, "interval_ms": 500, "max_samples": 4096,
           "started_at_unix": started, "gpus": {}, "summary": {}}
    for g in range(gpus):
        uuid = f"GPU-0000000{g}-aaaa-bbbb-cccc-dddddddddddd"
        samples = [{"t": 0.5 * i, "util_gpu": 90.0 - 5 * g + (i % 3), "util_mem": 40.0, "sm_clock_mhz": 1980.0 - 10 * (i % 4),
                    "mem_used_bytes": (30 << 30) + i * (10 << 20), "power_w": 600.0 + 10 * g + (i % 5),
                    "temp_c": 60.0 + i / 10, "throttle": ["sw_power_cap"] if i % 7 == 0 else []} for i in range(n)]
        out["gpus"][uuid] = {"index": g, "nvml_index": g, "name": GPU, "stride": 1, "samples": samples, "errors": {}}
        out["summary"][uuid] = {"samples_taken": n, "throttle_counts": {"sw_power_cap": (n + 6) // 7}}
    return out


def _results(throughput: float, rng: random.Random) -> list[dict]:
    results = []
    for case, tokens in zip(CASES, (128, 512)):
        for arm, factor in zip(ARMS, (1.0, 0.8, 0.95)):
            trials = []
            for t in range(3):
                sps = throughput * factor * (1 + rng.uniform(-0.02, 0.02)) * (128 / tokens)
                step_ms = 8 / sps * 1e3
                trials.append({"trial": t, "step_times_ms": [step_ms * (1 + 0.01 * k) for k in range(3)],
                               "metrics": {"samples_per_s": sps, "tokens_per_s": sps * tokens, "step_time_ms": step_ms,
                                           "model_tflops": sps * 0.9, "mfu_measured": sps * 0.9 / 700,
                                           "peak_memory_bytes": float(5 << 30)}})
            metrics = {k: sorted(tr["metrics"][k] for tr in trials)[1] for k in trials[0]["metrics"]}
            results.append({"case": case, "arm": arm, "status": "ok", "error": None, "trials": trials, "metrics": metrics})
    results.append({"case": CASES[1], "arm": "hf", "status": "failed",
                    "error": "CUDA out of memory. Tried to allocate 2.00 GiB", "trials": [], "metrics": {}})
    return results


def make_report(run_id: str, suite: str = "gpt2_medium", *, created: str = "2026-11-20T10:00:00+00:00",
                commit: str = "a1b2c3d4e5f6", throughput: float = 400.0, profilers: bool = True, seed: int = 0) -> dict:
    """The ``run.json`` content of one full run (see the module docstring)."""
    rng = random.Random(seed)
    results = _results(throughput, rng)
    ratios = {}
    for case in CASES:
        mine = next(r for r in results if r["case"] == case and r["arm"] == "dslab")["metrics"]["samples_per_s"]
        ratios[case] = {f"dslab/{r['arm']}": mine / r["metrics"]["samples_per_s"]
                        for r in results if r["case"] == case and r["arm"] != "dslab" and r["metrics"]}
    t0 = 1_795_000_000_000_000_000
    sections = {name: None for name in ("flops", "memory", "comms", "telemetry", "wall_clock")}
    if profilers:
        sections = {
            "flops": {c: flops_section(1.0 + i) for i, c in enumerate(CASES)},
            "memory": {c: memory_section() for c in CASES},
            "comms": {c: comms_section(t0 + i * 10**10, seed=seed + i) for i, c in enumerate(CASES)},
            "telemetry": {c: telemetry_section(t0 / 1e9 + i * 10) for i, c in enumerate(CASES)},
            "wall_clock": {c: {"phases": {p: {"count": 8, "mean_ms": ms, "median_ms": ms, "min_ms": ms * 0.9, "max_ms": ms * 1.1}
                                          for p, ms in (("forward", 10.0), ("backward", 20.0), ("step", 3.0))},
                               "timing": "CUDA events on the current stream"} for c in CASES},
        }
    return {
        "schema": "dslab.run", "schema_version": 1, "run_id": run_id, "suite": suite, "status": "complete",
        "created": created, "finished": created,
        "environment": {
            "python": {"version": "3.11.7"}, "torch": {"version": "2.13.0+cu128", "cuda": "12.8"},
            "dslab": {"version": "0.1.0", "git_commit": commit, "git_dirty": False},
            "cuda": {"available": True, "device_count": 2,
                     "gpus": [{"index": i, "name": GPU, "total_memory_bytes": 85 << 30} for i in range(2)]},
            "hostname": "gpu-host",
        },
        "config": {"scale": "full", "precision": "bf16", "trials": 3, "steps": 3, "warmup_steps": 1,
                   "cases": [{"name": c, "seq_len": n, "micro_batch": 8} for c, n in zip(CASES, (128, 512))]},
        "data": {"kind": "synthetic", "description": "synthetic tokens"},
        "peaks": {"bf16_matmul_tflops": 700.0, "copy_gbps": 2800.0, "datasheet_bf16_tflops": 989.5},
        "results": results, "ratios": ratios, "profilers": sections, "notes": [],
    }


def make_small_report(run_id: str, suite: str, created: str, throughput: float) -> dict:
    """A report without profiler sections: one case, two arms, three trials."""
    results = []
    for arm, factor in (("dslab", 1.0), ("torch", 0.8)):
        trials = [{"trial": t, "step_times_ms": [10.0], "metrics": {"samples_per_s": throughput * factor * (1 + 0.01 * t),
                                                                     "step_time_ms": 10.0}} for t in range(3)]
        results.append({"case": "seq128", "arm": arm, "status": "ok", "error": None, "trials": trials,
                        "metrics": {"samples_per_s": throughput * factor * 1.01, "step_time_ms": 10.0}})
    return {"schema": "dslab.run", "schema_version": 1, "run_id": run_id, "suite": suite, "status": "complete",
            "created": created, "environment": {"dslab": {"git_commit": f"{zlib.crc32(run_id.encode()):010x}"},
                                                "cuda": {"gpus": [{"name": GPU}]}},
            "config": {}, "data": {}, "peaks": {}, "results": results, "ratios": {}, "profilers": {}, "notes": []}


# A data-parallel run (make_scaling_report): tokens/s (all ranks) and peak GiB per GPU (largest rank) of
# each (model case, arm) at N processes; None: the arm failed there (out of memory). SCALING_SKIPPED ran
# nowhere (DeepSpeed does not import).
SCALING_SUITE = "zero"
SCALING_RUN_ID = "20261205T100000Z-zero00"
SCALING_SEQ = 1024
SCALING_MICRO_BATCH = 8
SCALING_TOKENS = {
    "355m": {"dslab-zero0": {1: 10000.0, 2: 19000.0, 4: 36000.0},
             "ddp": {1: 9000.0, 2: 16650.0, 4: 30600.0},
             "dslab-zero3": {1: 8000.0, 2: 14400.0, 4: 25600.0},
             "fsdp2": {1: 8000.0, 2: 12800.0, 4: None}},
    "124m": {"dslab-zero0": {1: 30000.0, 2: 57000.0},
             "ddp": {1: 30000.0, 2: 54000.0}},
}
SCALING_PEAK_GIB = {
    "355m": {"dslab-zero0": {1: 12.0, 2: 12.0, 4: 12.0},
             "ddp": {1: 13.0, 2: 13.0, 4: 13.0},
             "dslab-zero3": {1: 12.0, 2: 7.0, 4: 4.5},
             "fsdp2": {1: 12.5, 2: 7.5, 4: None}},
    "124m": {"dslab-zero0": {1: 4.0, 2: 4.0},
             "ddp": {1: 4.5, 2: 4.5}},
}
SCALING_SKIPPED = "deepspeed-zero3"
SCALING_OOM = "CUDA out of memory. Tried to allocate 3.00 GiB on rank 2"


def make_scaling_report(run_id: str = SCALING_RUN_ID, suite: str = SCALING_SUITE, *,
                        created: str = "2026-12-05T10:00:00+00:00") -> dict:
    """The ``run.json`` content of a data-parallel run: model cases ``355m`` (N = 1, 2, 4; arms
    dslab-zero0, ddp, dslab-zero3, fsdp2 failing out of memory at N=4, and deepspeed-zero3 skipped
    everywhere) and ``124m`` (N = 1, 2; dslab-zero0 and ddp), numbers from :data:`SCALING_TOKENS`
    and :data:`SCALING_PEAK_GIB`, three trials each with the table's value as their median."""
    tokens_per_step = SCALING_SEQ * SCALING_MICRO_BATCH
    cases, results = [], []
    for base, arms in SCALING_TOKENS.items():
        counts = sorted(next(iter(arms.values())))
        for n in counts:
            case = f"{base}-n{n}"
            cases.append({"name": case, "base_case": base, "nprocs": n, "model": f"gpt2_{base}",
                          "seq_len": SCALING_SEQ, "micro_batch": SCALING_MICRO_BATCH})
            for arm, by_n in arms.items():
                tokens = by_n[n]
                if tokens is None:
                    results.append({"case": case, "arm": arm, "status": "failed", "error": SCALING_OOM + "\nTraceback ...",
                                    "trials": [], "metrics": {}})
                    continue
                peak = SCALING_PEAK_GIB[base][arm][n] * 2**30
                metrics = {"tokens_per_s": tokens, "samples_per_s": tokens / SCALING_SEQ,
                           "step_time_ms": n * tokens_per_step / tokens * 1e3, "peak_memory_bytes": peak,
                           **{f"peak_memory_bytes_rank{r}": peak - r * 2**20 for r in range(n)}}
                trials = [{"trial": t, "step_times_ms": [metrics["step_time_ms"] / f] * 3,
                           "metrics": {k: (v * f if k in ("tokens_per_s", "samples_per_s") else v)
                                       for k, v in metrics.items()}}
                          for t, f in enumerate((0.99, 1.0, 1.01))]
                results.append({"case": case, "arm": arm, "status": "ok", "error": None, "trials": trials,
                                "metrics": metrics})
            if base == "355m":
                results.append({"case": case, "arm": SCALING_SKIPPED, "status": "skipped",
                                "error": "deepspeed is not importable: No module named 'deepspeed'",
                                "trials": [], "metrics": {}})
    return {
        "schema": "dslab.run", "schema_version": 3, "run_id": run_id, "suite": suite, "status": "complete",
        "created": created, "finished": created,
        "environment": {"dslab": {"version": "0.1.0", "git_commit": "5ca1ab1e00", "git_dirty": False},
                        "cuda": {"available": True, "device_count": 4,
                                 "gpus": [{"index": i, "name": GPU, "total_memory_bytes": 85 << 30} for i in range(4)]}},
        "config": {"kind": "data_parallel", "scale": "full", "precision": "bf16", "trials": 3, "cases": cases},
        "data": {"kind": "synthetic", "description": "synthetic tokens"}, "peaks": {},
        "results": results, "ratios": {}, "best_plain": {}, "profilers": {}, "inference": {}, "notes": [],
    }


PIPELINE_RUN_ID = "20261206T100000Z-pipe00"
PIPELINE_CASE = "1.5b dslab-pp2"
# two stages, two micro-batches: stage 0 warms up with F0 F1, stage 1 alternates
PIPELINE_TIMELINES = {
    0: [["forward", 0, 0.0, 2.0], ["forward", 1, 2.0, 4.0], ["backward", 0, 9.0, 13.0], ["backward", 1, 13.0, 17.0]],
    1: [["forward", 0, 2.5, 4.5], ["backward", 0, 4.5, 8.5], ["forward", 1, 8.5, 10.5], ["backward", 1, 10.5, 14.5]],
}
PIPELINE_BUSY = {0: (96.0, 160.0), 1: (112.0, 160.0)}  # stage: (busy ms, wall ms) over the batches


def make_pipeline_report(run_id: str = PIPELINE_RUN_ID) -> dict:
    """A run whose ``dslab-pp2`` arm recorded the pipeline engine's per-stage times."""
    data = make_report(run_id, "parallel")
    data["profilers"]["pipeline"] = {PIPELINE_CASE: {"stages": 2, "micro_batches": 2, "bubble_fraction": 1 / 3,
                                                     "per_stage": [
        {"stage": stage, "stages": 2, "micro_batches": 2, "busy_ms": busy, "wall_ms": wall,
         "idle_fraction": 1 - busy / wall, "bubble_fraction": 1 / 3,
         "batches": [{"step": 0, "wall_ms": wall / 2, "busy_ms": busy / 2},
                     {"step": 1, "wall_ms": wall / 2, "busy_ms": busy / 2, "timeline": PIPELINE_TIMELINES[stage]}]}
        for stage, (busy, wall) in PIPELINE_BUSY.items()]}}
    return data


AUTOTUNE_SUITE = "autotune"
AUTOTUNE_RUN_ID = "20261207T100000Z-tune00"
AUTOTUNE_BUDGET_BYTES = 80 * 10**9
AUTOTUNE_WORLD = 4
AUTOTUNE_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB\nTraceback ..."
AUTOTUNE_FAILED = "RuntimeError: NCCL error in: all_gather_into_tensor\nTraceback ..."
# In run order: (name, ZeRO stage, micro-batch, gradient accumulation, other overrides, status, throughput
# (samples/s; None: no metric), estimated GB per GPU (10^9 bytes), reason (None: the first line of the error)).
AUTOTUNE_EXPERIMENTS = (
    ("z0_mbs2_gas1", 0, 2, 1, {}, "ok", 110.0, 40.2, None),
    ("z0_mbs4_gas1", 0, 4, 1, {}, "ok", 150.0, 62.5, None),
    ("z0_mbs8_gas1", 0, 8, 1, {}, "pruned", None, 91.2, "estimated 91.2 GB > 80.0 GB budget"),
    ("z1_mbs4_gas1", 1, 4, 1, {}, "ok", 170.0, 51.0, None),
    ("z1_mbs8_gas1", 1, 8, 1, {}, "oom", None, 78.9, None),
    ("z2_mbs4_gas1", 2, 4, 1, {}, "early_stopped", 120.0, 44.0, "stopped after 2 profiled steps: more than 5% "
                                                                "worse than the best so far"),
    ("z2_mbs8_gas2", 2, 8, 2, {"offload_optimizer": "cpu", "activation_checkpointing": True}, "ok", 165.0, 70.3,
     None),
    ("z3_mbs4_gas1", 3, 4, 1, {}, "failed", None, 30.1, None),
    ("z3_mbs16_gas1", 3, 16, 1, {}, "pruned", None, 120.5, "estimated 120.5 GB > 80.0 GB budget"),
)


def make_autotune_report(run_id: str = AUTOTUNE_RUN_ID, suite: str = AUTOTUNE_SUITE, *,
                         created: str = "2026-12-07T10:00:00+00:00") -> dict:
    """The ``run.json`` content of a ``dslab autotune`` run (gridsearch on throughput, 4 GPUs) over
    :data:`AUTOTUNE_EXPERIMENTS`: per experiment a result (arm dslab; ``ok`` with three profiled
    steps for ok and early-stopped ones, the latter with ``early_stopped`` = 1; ``skipped`` with the
    reason for pruned ones; ``oom`` and ``failed`` with their errors) and an entry of
    ``profilers["autotuning"]``, whose best is the fastest ok experiment."""
    results, entries = [], []
    best = None
    for order, (name, stage, mbs, gas, other, status, throughput, estimated_gb, reason) in enumerate(
            AUTOTUNE_EXPERIMENTS):
        config = {"zero_stage": stage, "micro_batch_size": mbs, "gradient_accumulation_steps": gas, **other}
        wall = 24.0 + 2 * order if status != "pruned" else 0.0
        if status == "ok" and (best is None or throughput > best[1]):
            best = (name, throughput)
        result = {"case": name, "arm": "dslab",
                  "status": {"pruned": "skipped", "early_stopped": "ok"}.get(status, status),
                  "error": {"pruned": reason, "oom": AUTOTUNE_OOM, "failed": AUTOTUNE_FAILED}.get(status),
                  "trials": [], "metrics": {}}
        if throughput is not None:
            samples = mbs * gas * AUTOTUNE_WORLD
            step_s = samples / throughput
            metrics = {"samples_per_s": throughput, "latency_ms": step_s * 1e3, "tflops_per_gpu": throughput * 0.5,
                       "peak_memory_gb": round(estimated_gb * 0.9, 3)}
            if status == "early_stopped":
                metrics["early_stopped"] = 1.0
            steps = 2 if status == "early_stopped" else 3
            result["trials"] = [{"trial": 0, "step_times_ms": [step_s * 1e3] * steps, "metrics": metrics}]
            result["metrics"] = dict(metrics)
        results.append(result)
        if reason is None and result["error"]:
            reason = result["error"].splitlines()[0]
        entries.append({"name": name, "order": order, "config": config, "status": status, "metric": throughput,
                        "estimated_memory_bytes": int(round(estimated_gb * 1e9)), "reason": reason,
                        "wall_time_s": wall})
    section = {"metric": "throughput", "tuner_type": "gridsearch", "best": best[0], "best_metric": best[1],
               "wall_time_s": sum(e["wall_time_s"] for e in entries) + 5.0, "experiments": entries,
               "memory_budget_bytes": AUTOTUNE_BUDGET_BYTES, "model": {"num_params": 355_000_000}}
    return {
        "schema": "dslab.run", "schema_version": 3, "run_id": run_id, "suite": suite, "status": "partial",
        "created": created, "finished": created,
        "environment": {"dslab": {"version": "0.1.0", "git_commit": "7e57ab1e00", "git_dirty": False},
                        "cuda": {"available": True, "device_count": AUTOTUNE_WORLD,
                                 "gpus": [{"index": i, "name": GPU, "total_memory_bytes": 85 << 30}
                                          for i in range(AUTOTUNE_WORLD)]}},
        "config": {"autotuning": {"enabled": True, "metric": "throughput", "tuner_type": "gridsearch"}},
        "data": {}, "peaks": {}, "results": results, "ratios": {}, "best_plain": {},
        "profilers": {"autotuning": section}, "inference": {}, "notes": [],
    }


def write_run(root: Path, data: dict | str, suite: str | None = None, run_id: str | None = None) -> Path:
    """Write ``data`` (a dict, or raw text for malformed fixtures) as ``<root>/<suite>/<run_id>/run.json``."""
    suite = suite or data["suite"]
    run_id = run_id or data["run_id"]
    path = Path(root) / suite / run_id / "run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path.parent


def write_gate_files(root: Path, suite: str, run_ids: list[str], throughput: float) -> None:
    """A baseline file and a change point, as ``dslab gate`` writes them."""
    baseline = {"schema": "dslab.baseline", "schema_version": 1, "suite": suite, "label": f"run {run_ids[0]}",
                "source_runs": [run_ids[0]], "fingerprint": {"key": "abc123"},
                "results": [{"case": "seq128", "arm": "dslab", "status": "ok", "error": None,
                             "trials": {"samples_per_s": [throughput * 0.97, throughput, throughput * 1.03]}}]}
    path = Path(root) / "baselines" / suite / "abc123.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(baseline))
    points = {"schema": "dslab.change_points", "schema_version": 1, "suite": suite,
              "change_points": [{"run_id": run_ids[-1], "case": "seq128", "arm": "dslab", "metric": "samples_per_s",
                                 "kind": "regression", "change": 0.8, "ci": [0.75, 0.85], "p_value": 0.01}]}
    (Path(root) / suite / "change_points.json").write_text(json.dumps(points))


# The fixture reports directory of the dashboard tests (tests/dashboards/conftest.py).
SUITE = "gpt2_medium"
RUN_IDS = [f"2026112{i}T100000Z-aaaa0{i}" for i in range(5)]
PARTIAL = "20261126T100000Z-partia"
NOT_JSON = "20261127T100000Z-badjsn"
NOT_OBJECT = "20261128T100000Z-notobj"


def partial_report() -> dict:
    """A run cut short, with every profiler section malformed in its own way."""
    data = make_report(PARTIAL, SUITE, created="2026-11-26T10:00:00+00:00")
    for key in ("environment", "config", "finished", "ratios"):
        data.pop(key)
    data["status"] = "incomplete"
    data["results"].append("not a result")
    data["results"][0]["trials"].append(7)
    data["profilers"] = {
        "flops": {"seq128": {"modules": "not a list"}},
        "comms": {"seq128": {"per_rank": {"rank-zero": []}}},
        "memory": {"seq128": {"steps": [1, 2, 3], "activations": "x"}},
        "telemetry": "garbage",
        "wall_clock": None,
        "io": {"results": [{"block_size": 1 << 20, "queue_depth": 8, "read_GBps": 6.1}]},
    }
    return data


def serve_dashboard(root: Path):
    """Generator for a fixture: the dashboard over ``root`` on 127.0.0.1 (a free port); yields its
    base URL, stops the server when resumed."""
    from werkzeug.serving import make_server

    from dashboards.app import create_app

    httpd = make_server("127.0.0.1", 0, create_app(root).server, threaded=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    thread.join(timeout=10)


def late_rank_records(late_rank: int, late_ms: float, collectives: int = 12, world: int = WORLD,
                      first_late: tuple[int, float] | None = None, seed: int = 0) -> dict[int, list[dict]]:
    """Every rank's records of ``collectives`` blocking 8 MiB all_reduces, one per step, 20 ms
    apart on one clock: arrivals jitter by up to 0.3 ms, ``late_rank`` arrives ``late_ms`` later
    still, and ``first_late = (rank, ms)`` makes that rank that much later to the first one (a
    warm-up collective). Each latency is the wait for the last arrival plus the transfer."""
    rng = random.Random(seed)
    per_rank: dict[int, list[dict]] = {rank: [] for rank in range(world)}
    group = ",".join(str(r) for r in range(world))
    for seq in range(collectives):
        base = 1_795_000_000_000_000_000 + seq * 20_000_000
        arrivals = {r: base + rng.randint(0, 300_000) for r in range(world)}
        arrivals[late_rank] += int(late_ms * 1e6)
        if first_late is not None and seq == 0:
            arrivals[first_late[0]] += int(first_late[1] * 1e6)
        last = max(arrivals.values())
        for r in range(world):
            per_rank[r].append({"op": "all_reduce", "group": group, "group_size": world, "seq": seq, "bytes": 8 << 20,
                                "dtype": "bfloat16", "async": False, "step": seq, "arrival_ns": arrivals[r],
                                "host_arrival_ns": arrivals[r], "latency_ms": (last - arrivals[r]) / 1e6 + 0.25})
    return per_rank


def comms_record(per_rank: dict[int, list[dict]], rank: int = 0) -> dict:
    """The comms logger's record (``profilers["comms"][case]``) of ``per_rank``'s records, as
    :class:`dslab.profilers.comms.CommsLogger` writes it: the straggler analysis run on them (one
    clock), the summary of rank ``rank``'s."""
    analysis = analyze_stragglers(per_rank, {r: 0 for r in per_rank})
    as_str = lambda v: {str(k): as_str(x) for k, x in v.items()} if isinstance(v, dict) else v  # noqa: E731
    return {"rank": rank, "ops": summary_rows(summarize(per_rank[rank])),
            "per_rank": {str(r): recs for r, recs in per_rank.items()},
            "stragglers": analysis["stragglers"], "straggler": as_str(analysis),
            "clock_offsets_ns": {str(r): 0 for r in per_rank}, "dropped_records": 0, "definitions": DEFINITIONS}
