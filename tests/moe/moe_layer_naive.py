"""Brute-force references for the MoE tests: per-token loops, written from the semantics in
dslab.moe.gating's docstring and independent of dslab's code."""

from __future__ import annotations

import copy

import torch
from torch import nn


def naive_gating(logits, k, capacity, used=None, first_noise=None, second_noise=None):
    """Loop over tokens and choices. ``capacity`` None = dropless.

    Returns a dict: choices [T][k] ints, position [T][k], keep [T][k] bools, weight [T][k]
    floats (float64), counts [E] (before dropping), l_aux (float).
    """
    logits = logits.detach().double()
    tokens, experts = logits.shape
    probs = torch.softmax(logits, dim=1)
    used = [True] * tokens if used is None else [bool(u) for u in used]
    choices = []
    for t in range(tokens):
        scores = logits[t] if first_noise is None else logits[t] + first_noise[t].double()
        first = int(torch.argmax(scores))
        row = [first]
        if k == 2:
            second_scores = logits[t] if second_noise is None else logits[t] + second_noise[t].double()
            second = max((e for e in range(experts) if e != first), key=lambda e: float(second_scores[e]))
            row.append(second)
        choices.append(row)
    counter = [0] * experts
    position = [[-1] * k for _ in range(tokens)]
    for c in range(k):  # choice-major
        for t in range(tokens):
            if used[t]:
                position[t][c] = counter[choices[t][c]]
                counter[choices[t][c]] += 1
    keep = [[used[t] and (capacity is None or position[t][c] < capacity) for c in range(k)] for t in range(tokens)]
    weight = []
    for t in range(tokens):
        p = [float(probs[t, choices[t][c]]) if keep[t][c] else 0.0 for c in range(k)]
        if k == 2:
            total = max(sum(p), torch.finfo(torch.float32).eps)
            p = [v / total for v in p]
        weight.append(p)
    first_fraction = [sum(1 for t in range(tokens) if used[t] and choices[t][0] == e) / tokens for e in range(experts)]
    mean_probs = probs.mean(0)
    l_aux = experts * sum(float(mean_probs[e]) * first_fraction[e] for e in range(experts))
    return {"choices": choices, "position": position, "keep": keep, "weight": weight, "counts": counter,
            "l_aux": l_aux}


def ds_capacity(tokens, experts, capacity_factor, k, min_capacity):
    """DeepSpeed's ``_capacity`` expression, literally."""
    capacity = torch.ceil((tokens / experts) * torch.tensor(capacity_factor * k)).to(torch.int64)
    return max(int(capacity), min_capacity)


def expert_modules(moe) -> list[nn.Module]:
    """The layer's experts as separate ``nn.Sequential`` MLPs with the stacked weights (copies)."""
    ex = moe.deepspeed_moe.experts
    if not ex.stacked:
        return list(ex.deepspeed_experts)
    act = {"gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "relu": nn.ReLU(), "silu": nn.SiLU()}
    modules = []
    for j in range(ex.num_local_experts):
        fc1 = nn.Linear(ex.w1.shape[2], ex.w1.shape[1], bias=ex.b1 is not None)
        fc2 = nn.Linear(ex.w2.shape[2], ex.w2.shape[1], bias=ex.b2 is not None)
        with torch.no_grad():
            fc1.weight.copy_(ex.w1[j])
            fc2.weight.copy_(ex.w2[j])
            if ex.b1 is not None:
                fc1.bias.copy_(ex.b1[j])
                fc2.bias.copy_(ex.b2[j])
        modules.append(nn.Sequential(fc1, copy.deepcopy(act[ex.activation]), fc2))
    return modules


def naive_moe_forward(moe, x2d, capacity, used=None):
    """The layer's output for tokens ``x2d`` [T, H], one token and one expert at a time (no noise)."""
    gate_w = moe.deepspeed_moe.gate.wg.weight.detach().double()
    logits = x2d.detach().double() @ gate_w.t()
    decision = naive_gating(logits, moe.deepspeed_moe.gate.k, capacity, used)
    experts = expert_modules(moe)
    out = torch.zeros_like(x2d, dtype=torch.float64)
    for t in range(x2d.shape[0]):
        for c, e in enumerate(decision["choices"][t]):
            if decision["keep"][t][c]:
                y = experts[e](x2d[t:t + 1])
                y = y[0] if isinstance(y, tuple) else y
                out[t] += decision["weight"][t][c] * y[0].double()
    if moe.use_residual:
        dense = moe.mlp(x2d).double()
        coef = torch.softmax(moe.coefficient(x2d).double(), dim=-1)
        out = out * coef[:, :1] + dense * coef[:, 1:]
    return out, decision


def dense_capacity(moe, tokens):
    """The capacity the layer uses for ``tokens`` tokens in its current mode, by DeepSpeed's formula."""
    gate = moe.deepspeed_moe.gate
    cfg = gate.config
    if not cfg.drop_tokens:
        return None
    factor = cfg.capacity_factor if gate.training else cfg.eval_capacity_factor
    return ds_capacity(tokens, gate.num_experts, factor, gate.k, cfg.min_capacity)

