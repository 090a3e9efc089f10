"""DeepSpeed's ``sharded_moe``: the MoE layer's dispatch on dslab's kernels, and the readable
plain-PyTorch formulation of the gating it is held against.

:class:`MOELayer` (the fast path) for T tokens of width H, E experts, k choices:

    decision    = gate(x)                                      (dslab.moe.gating, moe_gating kernel)
    row[t, c]   = expert_offset[expert_index[t, c]] + position[t, c], or -1 where dropped
                  capacity:  expert_offset[e] = e * C,            R = E * C rows
                  dropless:  expert_offset[e] = sum_{e' < e} n_e', R = T * k rows
    x_perm      = moe_permute(x, row, R)                       [R, H], zero where no token lands
    y_perm      = experts(x_perm) (grouped GEMMs; all_to_all around them when ep_size > 1)
    y[t]        = sum_c gate_weight[t, c] * y_perm[row[t, c]]  (moe_unpermute)

Dropless is truly dropless: each expert's group holds exactly its tokens (no padding to the
largest count as DeepSpeed does). With ep_size 1 neither mode synchronises with the host.

:func:`top1gating` / :func:`top2gating` are DeepSpeed's one-hot/cumsum formulation, returning
``(l_aux, combine_weights [T, E, C], dispatch_mask [T, E, C], exp_counts [E])``, and
:func:`reference_forward` runs a layer through them with DeepSpeed's einsum dispatch
(``"sec,sm->ecm"``) and combine (``"sec,ecm->sm"``). They are O(T * E * C) and synchronise with the
host in dropless mode: references for tests and readers, not for training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dslab.kernels.moe.moe_permute import moe_permute, moe_unpermute
from dslab.moe import expert_parallel
from dslab.moe.experts import Experts
from dslab.moe.gating import TopKGate, gate_capacity, gumbel_rsample, multiplicative_jitter, rts_priority

__all__ = ["MOELayer", "TopKGate", "gumbel_rsample", "multiplicative_jitter", "reference_forward", "top1gating",
           "top2gating"]


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine. ``forward(hidden_states [..., H], used_token [T] | None)``
    returns the output in ``hidden_states``' shape and leaves ``l_aux`` (fp32 scalar) and
    ``exp_counts`` ([E] int64, on the device) on the module, as DeepSpeed's ``MOELayer`` does.
    :meth:`run` returns ``l_aux`` instead (what :class:`dslab.moe.MoE` calls)."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.num_experts = ep_size * num_local_experts
        self.ep_group = None
        self.l_aux = None
        self.exp_counts = None

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        output, self.l_aux = self.run(hidden_states, used_token)
        return output

    def run(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """``(output, l_aux)``, leaving ``exp_counts`` and a detached ``l_aux`` on the module: no
        module attribute keeps the forward's autograd graph alive (a CUDA-graph capture of a stack
        of these layers relies on that, :mod:`dslab.models.graphs`)."""
        hidden = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, hidden)
        decision = self.gate(x, used_token)
        self.l_aux, self.exp_counts = decision.l_aux.detach(), decision.exp_counts
        if torch.is_autocast_enabled(x.device.type):  # move (and exchange) tokens in the autocast dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if decision.capacity is not None:
            output = self._capacity_forward(x, decision)
        else:
            output = self._dropless_forward(x, decision)
        return output.reshape(hidden_states.shape), decision.l_aux

    def _capacity_forward(self, x, decision):
        capacity = decision.capacity
        row = torch.where(decision.keep, decision.expert_index * capacity + decision.position, -1)
        dispatched = moe_permute(x, row, self.num_experts * capacity)  # DeepSpeed's [E, C, H], flat
        if self.ep_size == 1:
            offsets = torch.arange(self.num_experts + 1, device=x.device) * capacity
            expert_output = self.experts(dispatched, offsets, [capacity] * self.num_experts)
        else:
            args = (self.ep_group, self.ep_size, self.num_local_experts)
            local = expert_parallel.dispatch_capacity(dispatched, *args)
            rows_per_expert = self.ep_size * capacity
            offsets = torch.arange(self.num_local_experts + 1, device=x.device) * rows_per_expert
            local_output = self.experts(local, offsets, [rows_per_expert] * self.num_local_experts)
            expert_output = expert_parallel.combine_capacity(local_output, *args)
        return moe_unpermute(expert_output, row, decision.gate_weight)

    def _dropless_forward(self, x, decision):
        counts = decision.exp_counts
        ends = torch.cumsum(counts, 0)
        row = torch.where(decision.keep, (ends - counts)[decision.expert_index] + decision.position, -1)
        num_rows = decision.expert_index.numel()  # T * k: every assignment has a row
        dispatched = moe_permute(x, row, num_rows)
        if self.ep_size == 1:
            # the grouped GEMM's groups must cover all rows: rows of masked tokens (used_token) sit
            # after the last expert's and ride along in its group; nothing reads their output
            offsets = torch.cat([ends.new_zeros(1), ends[:-1], ends.new_full((1,), num_rows)])
            expert_output = self.experts(dispatched, offsets)
        else:
            plan = expert_parallel.plan_dropless(counts, self.ep_group, self.ep_size, self.num_local_experts)
            local = expert_parallel.dispatch_dropless(dispatched, plan, self.ep_group)
            local_output = self.experts(local, plan.group_offsets, plan.local_sizes)
            expert_output = expert_parallel.combine_dropless(local_output, plan, self.ep_group, num_rows)
        return moe_unpermute(expert_output, row, decision.gate_weight)


def _one_hot_slots(locations: torch.Tensor, capacity: int) -> torch.Tensor:
    """[T] int slots -> [T, C] fp32 one-hot."""
    return F.one_hot(locations, num_classes=capacity).float()


def _used_mask(used_token, num_tokens, device):
    if used_token is None:
        return None
    return (used_token.reshape(num_tokens) != 0).long()[:, None]


def top1gating(logits, capacity_factor, min_capacity, used_token=None, noisy_gate_policy=None, drop_tokens=True,
               use_rts=True, *, gumbel_noise=None, priority=None):
    """Switch top-1 gating of ``logits`` [T, E], DeepSpeed's one-hot formulation.

    ``gumbel_noise`` [T, E] (RSample) and ``priority`` [T] (RTS) are drawn here when the policy asks
    for them and none is given. Returns ``(l_aux, combine_weights [T, E, C] fp32, dispatch_mask
    [T, E, C] bool, exp_counts [E] int64)``.
    """
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    if noisy_gate_policy == "RSample" and gumbel_noise is None:
        gumbel_noise = gumbel_rsample(logits.shape, logits.device)
    choosing = logits + gumbel_noise if noisy_gate_policy == "RSample" else gates
    mask1 = F.one_hot(torch.argmax(choosing, dim=1), num_classes=num_experts)
    used = _used_mask(used_token, num_tokens, logits.device)
    if used is not None:
        mask1 = mask1 * used
    exp_counts = mask1.sum(0).detach()
    l_aux = torch.sum(gates.mean(0) * mask1.float().mean(0)) * num_experts
    capacity = gate_capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    if not drop_tokens:
        capacity = max(int(exp_counts.max()), 1)
    elif capacity < num_tokens:
        if use_rts:
            if priority is None:
                priority = rts_priority(num_tokens, logits.device)
            top = torch.topk(mask1 * priority[:, None], k=capacity, dim=0).indices  # [C, E]
            mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top, 1)
        else:
            mask1 = mask1 * torch.lt(torch.cumsum(mask1, dim=0) - 1, capacity)
    locations1_s = torch.sum((torch.cumsum(mask1, dim=0) - 1) * mask1, dim=1)
    gates = gates * mask1.float()
    combine_weights = torch.einsum("se,sc->sec", gates, _one_hot_slots(locations1_s, capacity))
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def top2gating(logits, capacity_factor, min_capacity, drop_tokens=True, top2_2nd_expert_sampling=True,
               used_token=None, *, gumbel_noise=None):
    """GShard top-2 gating of ``logits`` [T, E], DeepSpeed's one-hot formulation.

    Capacity is computed with ``capacity_factor * 2``. The second choice adds ``gumbel_noise``
    [T, E] (drawn here when sampling is on and none is given). The kept gates are normalised
    over the kept choices. Returns as :func:`top1gating`.
    """
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=num_experts)
    if top2_2nd_expert_sampling and gumbel_noise is None:
        gumbel_noise = gumbel_rsample(logits.shape, logits.device)
    second = logits + gumbel_noise if top2_2nd_expert_sampling else logits
    mask2 = F.one_hot(torch.argmax(second.masked_fill(mask1.bool(), float("-inf")), dim=1),
                      num_classes=num_experts)
    used = _used_mask(used_token, num_tokens, logits.device)
    if used is not None:
        mask1, mask2 = mask1 * used, mask2 * used
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(0) * mask1.float().mean(0)) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        capacity = gate_capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
    else:
        capacity = max(int(exp_counts.max()), 1)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    gates1_s = torch.einsum("se,se->s", gates, mask1.float())
    gates2_s = torch.einsum("se,se->s", gates, mask2.float())
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(torch.float32).eps)
    gates1 = torch.einsum("s,se->se", gates1_s / denom_s, mask1.float())
    gates2 = torch.einsum("s,se->se", gates2_s / denom_s, mask2.float())
    combine_weights = (torch.einsum("se,sc->sec", gates1, _one_hot_slots(locations1_s, capacity))
                       + torch.einsum("se,sc->sec", gates2, _one_hot_slots(locations2_s, capacity)))
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def reference_forward(layer: MOELayer, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
    """``layer``'s forward the DeepSpeed way (ep_size 1): one-hot gating, einsum dispatch into
    [E, C, H], a per-expert ``F.linear`` loop, einsum combine. Draws the same random numbers in
    the same order as ``layer.forward``. Returns ``(output, l_aux, exp_counts)``."""
    if layer.ep_size != 1:
        raise ValueError(f"reference_forward runs ep_size 1 layers only, got ep_size={layer.ep_size}")
    gate = layer.gate
    hidden = hidden_states.shape[-1]
    x = hidden_states.reshape(-1, hidden)
    num_tokens = x.shape[0]
    logits = gate.compute_logits(x)
    noise = gate.selection_noise(logits)
    capacity = gate.capacity(num_tokens)
    priority = gate.draw_priority(num_tokens, capacity, x.device)
    config = gate.config
    factor = config.capacity_factor if gate.training else config.eval_capacity_factor
    if gate.k == 1:
        l_aux, combine, dispatch, exp_counts = top1gating(
            logits, factor, config.min_capacity, used_token, "RSample" if noise is not None else None,
            config.drop_tokens, priority is not None, gumbel_noise=noise, priority=priority)
    else:
        l_aux, combine, dispatch, exp_counts = top2gating(
            logits, factor, config.min_capacity, config.drop_tokens, noise is not None, used_token,
            gumbel_noise=noise)
    experts, slots = combine.shape[1], combine.shape[2]
    dispatched = torch.einsum("sec,sm->ecm", dispatch.type_as(x), x)
    expert_output = layer.experts.reference_forward(dispatched.reshape(experts * slots, hidden), [slots] * experts)
    output = torch.einsum("sec,ecm->sm", combine.type_as(x), expert_output.reshape(experts, slots, hidden))
    return output.reshape(hidden_states.shape), l_aux, exp_counts
