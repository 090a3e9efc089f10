"""The ``torch`` kernel set's MoE FFN: DeepSpeed-MoE's layer as a PyTorch user writes it, with
a softmax gate, a top-k choice and a Python loop over the experts (``index_select`` of each
expert's tokens, two ``F.linear`` and a tanh GELU, ``index_add_`` of the weighted result).

It computes the function of :class:`dslab.moe.MoE` (:mod:`dslab.moe.gating` states it) with the
same parameters under the same names (``deepspeed_moe.gate.wg.weight``,
``deepspeed_moe.experts.{w1,b1,w2,b2}``), so a state dict moves between the two and, from the same
seed, both draw the same random numbers in the same order (the jitter, the Gumbel noise of the
noisy choice and the random-token-selection priorities are drawn as :mod:`dslab.moe.gating`
draws them) and make the same choices:

    logits = x.float() @ wg.T (fp32, outside autocast); probs = softmax(logits)
    first  = argmax(logits)           second = argmax over the others of (logits + Gumbel noise)
    weight = probs[first] (top-1)     probs[chosen] / sum(probs[chosen]) (top-2)
    l_aux  = E * sum_e mean_t(probs[:, e]) * (share of first choices on e)

Capacity (``drop_tokens=True``): each expert keeps ``max(ceil(T / E * capacity_factor * k),
min_capacity)`` assignments, the first ones in choice-major order (every first choice in token
order, then the second choices) or, for top-1 with ``use_rts``, those with the highest random
priority; top-2 weights are renormalised over the kept choices. ``exp_counts`` counts the
assignments before dropping.

Cost: one ``nonzero`` per expert (a host synchronisation on a GPU), and each expert's matmuls
launched on its own rows; ``ep_size`` must be 1 (every expert on this rank).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

JITTER_EPS = 1e-2


class NaiveGate(nn.Module):
    """``wg``: the router, an fp32 ``Linear(hidden, num_experts, bias=False)``."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False).float()


class NaiveExperts(nn.Module):
    """The experts' weights stacked: ``w1`` [E, F, H], ``b1`` [E, F], ``w2`` [E, H, F], ``b2`` [E, H]."""

    def __init__(self, hidden: int, ffn: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.b1 = nn.Parameter(torch.zeros(num_experts, ffn))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden))
        for w in (self.w1, self.w2):
            if not w.is_meta:
                nn.init.normal_(w, std=0.02)


class NaiveLayer(nn.Module):
    """The gate and the experts, under DeepSpeed's attribute names (``deepspeed_moe.gate``,
    ``deepspeed_moe.experts``), so that the state dict's keys are :class:`dslab.moe.MoE`'s."""

    def __init__(self, gate: NaiveGate, experts: NaiveExperts):
        super().__init__()
        self.gate = gate
        self.experts = experts


def _gumbel(shape, device) -> torch.Tensor:
    tiny = torch.finfo(torch.float32).tiny
    uniform = torch.rand(shape, device=device, dtype=torch.float32).clamp_(min=tiny, max=1.0 - 2 ** -24)
    return -torch.log(-torch.log(uniform))


class NaiveMoE(nn.Module):
    """``forward(x [..., H]) -> (output [..., H], l_aux fp32 scalar, exp_counts [E] int64)``.

    Arguments as :class:`dslab.moe.MoE`'s, the expert given by its inner width ``ffn`` (a
    ``Linear(H, ffn) -> GELU(tanh) -> Linear(ffn, H)`` MLP).
    """

    def __init__(self, hidden_size: int, ffn: int, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True):
        super().__init__()
        if ep_size != 1:
            raise ValueError(f"ep_size={ep_size}: the torch kernel set's MoE keeps every expert on one rank; "
                             "use ep_size=1 or kernels='dslab'")
        if k not in (1, 2):
            raise ValueError(f"k must be 1 or 2, got {k!r}")
        if noisy_gate_policy not in (None, "Jitter", "RSample"):
            raise ValueError(f"noisy_gate_policy must be None, 'Jitter' or 'RSample', got {noisy_gate_policy!r}")
        self.num_experts, self.k = num_experts, k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts = drop_tokens, use_rts
        self.deepspeed_moe = NaiveLayer(NaiveGate(hidden_size, num_experts),
                                        NaiveExperts(hidden_size, ffn, num_experts))

    def capacity(self, tokens: int) -> int | None:
        """Slots per expert (None when dropless)."""
        if not self.drop_tokens:
            return None
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        # In float32, as DeepSpeed computes it, so that products like 10 / 4 * 1.2 round alike.
        scaled = np.float32(factor * self.k) * np.float32(tokens / self.num_experts)
        return max(math.ceil(float(scaled)), self.min_capacity)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, experts = x.shape[0], self.num_experts
        gate_input = x.float()
        if self.training and self.noisy_gate_policy == "Jitter":
            gate_input = gate_input * torch.empty_like(gate_input).uniform_(1.0 - JITTER_EPS, 1.0 + JITTER_EPS)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(gate_input, self.deepspeed_moe.gate.wg.weight.float())
        probs = torch.softmax(logits, dim=1)

        noisy = self.training and ((self.k == 1 and self.noisy_gate_policy == "RSample") or self.k == 2)
        noise = _gumbel(logits.shape, logits.device) if noisy else None
        first = (logits if noise is None or self.k == 2 else logits + noise).argmax(dim=1)
        if self.k == 1:
            expert_index = first[:, None]
            weight = probs.gather(1, expert_index)
        else:
            scores = logits if noise is None else logits + noise
            second = scores.masked_fill(F.one_hot(first, experts).bool(), float("-inf")).argmax(dim=1)
            expert_index = torch.stack([first, second], dim=1)
            chosen = probs.gather(1, expert_index)
            weight = chosen / chosen.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)

        exp_counts = F.one_hot(expert_index, experts).sum(dim=(0, 1))
        first_share = F.one_hot(first, experts).float().mean(dim=0)
        l_aux = torch.sum(probs.mean(dim=0) * first_share) * experts

        capacity = self.capacity(tokens)
        if capacity is not None:
            keep = self._keep(expert_index, capacity, tokens)
            weight = weight * keep
            if self.k == 2:
                weight = weight / weight.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
        else:
            keep = None

        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # summed in fp32
        layer = self.deepspeed_moe.experts
        for e in range(experts):
            routed = expert_index == e if keep is None else (expert_index == e) & keep
            token, choice = torch.where(routed)
            h = F.linear(x.index_select(0, token), layer.w1[e], layer.b1[e])
            h = F.linear(F.gelu(h, approximate="tanh"), layer.w2[e], layer.b2[e])
            out.index_add_(0, token, h.float() * weight[token, choice, None])
        return out.to(x.dtype).reshape(shape), l_aux, exp_counts

    def _keep(self, expert_index: torch.Tensor, capacity: int, tokens: int) -> torch.Tensor:
        """[T, k] bool: the assignments that keep a slot of their expert."""
        keep = torch.zeros_like(expert_index, dtype=torch.bool)
        if self.k == 1 and self.use_rts and capacity < tokens:
            priority = torch.rand(tokens, device=expert_index.device, dtype=torch.float32)
            for e in range(self.num_experts):
                token = torch.where(expert_index[:, 0] == e)[0]
                best = torch.argsort(-priority[token], stable=True)[:capacity]
                keep[token[best], 0] = True
            return keep
        for e in range(self.num_experts):
            choice, token = torch.where(expert_index.t() == e)  # choice-major
            keep[token[:capacity], choice[:capacity]] = True
        return keep
