"""The MoE records of a run report: ``report.profilers["moe"][case]`` and each arm's
``expert_tflops``.

The routing comes from the dslab arm's model after its last timed step (``moe_stats()``: per MoE
layer, each expert's assignment count before dropping and the assignments dropped past
capacity), moved to the host once, at the end of the case. The record::

    {"source": "...", "family": "gpt2_moe", "num_experts": 8, "k": 2, "hidden": 768, "ffn": 3072,
     "ep_size": 1, "drop_tokens": false, "capacity_factor": 1.0, "tokens_per_step": 8192,
     "layers": [{"layer": 1, "exp_counts": [..E ints..], "tokens": 8192, "k": 2, "capacity": null,
                 "assignments": 16384, "dropped": 0, "kept": 16384, "dropped_fraction": 0.0,
                 "max_over_mean": 1.31}, ...],
     "assignments": ..., "dropped": ..., "dropped_fraction": ...,   # over every layer
     "expert_flops_per_step": {"dslab": ..., "torch": ..., "hf": ...},
     "expert_flops_note": "...",
     "all_to_all": [comms-logger rows of the all_to_all ops]}      # ep_size > 1 only

``expert_tflops`` (a result metric, per trial) is the arm's expert flops per step over its step
time. The expert flops are counted from the routing, not from a profiler: 12 * hidden * ffn per
kept assignment per MoE layer (two matmuls of 2 * H * F flops forward, twice that backward),
with the dslab arm's kept assignments for every arm on our model (dropless: tokens * k in every
arm); the hf arm's gated experts do three matmuls (:func:`dslab.bench.hf_moe.expert_flops`).
"""

from __future__ import annotations

import torch

from dslab.bench.workloads import Workload

EXPERT_FLOPS_NOTE = (
    "counted from the routing: 12 * hidden * ffn flops per kept (token, expert) assignment per MoE layer "
    "(forward: two hidden x ffn matmuls, 4 * H * F; backward twice that), the dslab arm's kept assignments "
    "for every arm on our model (dropless: tokens * k); the hf arm's gated experts (three matrices of width "
    "gated_intermediate): 18 * H * F_gated per assignment"
)


def stats_to_host(stats: list[dict]) -> list[dict]:
    """``moe_stats()`` with its device tensors read in one device-to-host copy."""
    if not stats:
        return []
    flat = torch.cat([torch.cat([s["exp_counts"].reshape(-1).long(), s["dropped"].reshape(1).long()])
                      for s in stats]).tolist()
    out, at = [], 0
    for s in stats:
        experts = s["exp_counts"].numel()
        counts, dropped = flat[at:at + experts], flat[at + experts]
        at += experts + 1
        out.append({**{k: v for k, v in s.items() if k not in ("exp_counts", "dropped")},
                    "exp_counts": counts, "dropped": dropped})
    return out


def moe_record(workload: Workload, host_stats: list[dict], plain_arms: list[str],
               comms: dict | None = None) -> dict:
    """The ``profilers["moe"][case]`` record (module docstring) from the host stats."""
    cfg = workload.model_config()
    layers, routed_total, dropped_total = [], 0, 0
    for s in host_stats:
        counts = [int(c) for c in s["exp_counts"]]
        routed, dropped = sum(counts), int(s["dropped"])
        routed_total += routed
        dropped_total += dropped
        mean = routed / len(counts) if counts else 0.0
        layers.append({"layer": s["layer"], "exp_counts": counts, "tokens": s["tokens"], "k": s["k"],
                       "capacity": s["capacity"], "assignments": routed, "dropped": dropped, "kept": routed - dropped,
                       "dropped_fraction": dropped / routed if routed else 0.0,
                       "max_over_mean": max(counts) / mean if mean else None})
    kept = [layer["kept"] for layer in layers] or None
    flops = {"dslab": workload.expert_flops_per_step(kept)}
    for arm in plain_arms:
        flops[arm] = workload.expert_flops_per_step(kept, hf=arm == "hf")
    record = {
        "source": "the dslab arm's model after its last timed step (this rank's tokens), read once at the end",
        "family": workload.family, "num_experts": cfg.num_experts, "k": cfg.k, "hidden": cfg.hidden,
        "ffn": cfg.intermediate if workload.family == "gpt2_moe" else cfg.ffn, "ep_size": cfg.ep_size,
        "drop_tokens": cfg.drop_tokens, "capacity_factor": cfg.capacity_factor,
        "tokens_per_step": workload.samples_and_tokens()[1], "layers": layers,
        "assignments": routed_total, "dropped": dropped_total,
        "dropped_fraction": dropped_total / routed_total if routed_total else 0.0,
        "expert_flops_per_step": flops, "expert_flops_note": EXPERT_FLOPS_NOTE,
    }
    if cfg.ep_size > 1:
        rows = (comms or {}).get("ops") if isinstance(comms, dict) else None
        record["all_to_all"] = [r for r in rows or [] if isinstance(r, dict) and r.get("op") == "all_to_all"]
    return record


def expert_tflops(flops_per_step: int | None, step_time_ms: float) -> float | None:
    if not flops_per_step or not step_time_ms:
        return None
    return flops_per_step / (step_time_ms / 1e3) / 1e12
