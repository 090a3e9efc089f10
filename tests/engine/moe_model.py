"""A small model with an expert-parallel part that keeps DeepSpeed-MoE's contract with the engine,
for the engine's MoE tests (independent of dslab.moe's layer).

:class:`ExpertParallelLinear` holds ``experts / ep_size`` of ``experts`` linear experts, cut
from one set of full weights drawn from its own seed (so every ep_size starts from the same
experts). Every rank sends all its tokens to each member of its expert-parallel group with
``dslab.comm.all_to_all_single`` inside an autograd function, each member applies its experts,
and a second all_to_all brings the outputs back: the gradient of a rank's experts is the sum over
its expert-parallel group's tokens. Its parameters carry ``allreduce = False`` and
``group_name = "ep_size_{p}"``.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab import comm
from dslab.moe.groups import create_expert_groups

DIM, HIDDEN, EXPERTS, CLASSES = 7, 5, 4, 3


class _AllToAll(torch.autograd.Function):
    """Equal-split all_to_all over ``group``; its backward is the same exchange of the
    gradients (the slice that came from rank j goes back to rank j)."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, _AllToAll.apply(ctx.group, grad)


class ExpertParallelLinear(nn.Module):
    """``x [n, dim] -> [n, experts, hidden]``: every expert applied to every token, the experts
    sharded over the expert-parallel group of ``ep_size`` ranks."""

    def __init__(self, experts: int, dim: int, hidden: int, ep_size: int, seed: int = 1):
        super().__init__()
        groups = create_expert_groups(ep_size)
        self.ep_size, self.group = ep_size, groups.expert_parallel
        self.local = experts // ep_size
        g = torch.Generator().manual_seed(seed)
        weight = torch.randn(experts, hidden, dim, generator=g) / math.sqrt(dim)
        bias = 0.1 * torch.randn(experts, hidden, generator=g)
        lo = groups.ep_rank * self.local
        self.weight = nn.Parameter(weight[lo:lo + self.local].clone())
        self.bias = nn.Parameter(bias[lo:lo + self.local].clone())
        for p in (self.weight, self.bias):
            p.allreduce = False
            p.group_name = groups.name

    def forward(self, x):
        n, p = x.shape[0], self.ep_size
        received = _AllToAll.apply(self.group, x.repeat(p, 1))  # slice j: member j's tokens
        out = torch.einsum("td,ehd->teh", received, self.weight) + self.bias
        back = _AllToAll.apply(self.group, out.reshape(p * n, -1))  # slice j: member j's experts
        return back.view(p, n, self.local, -1).permute(1, 0, 2, 3).reshape(n, p * self.local, -1)


class MoENet(nn.Module):
    """Dense input layer and gate, the expert-parallel layer, a dense head."""

    def __init__(self, ep_size: int, dim=DIM, hidden=HIDDEN, experts=EXPERTS, classes=CLASSES,
                 expert_seed: int = 1):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, experts)
        self.experts = ExpertParallelLinear(experts, dim, hidden, ep_size, seed=expert_seed)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        weights = F.softmax(self.gate(h), dim=-1)
        mixed = (weights.unsqueeze(-1) * self.experts(h)).sum(1)
        return F.cross_entropy(self.head(torch.relu(mixed)).float(), y)


class RealMoENet(nn.Module):
    """The same shape of model around dslab.moe's ``MoE`` (top-1, DeepSpeed's API): its experts
    are deep copies of one MLP, so every ep_size starts from the same experts."""

    def __init__(self, ep_size: int, dim=DIM, width=8, experts=EXPERTS, classes=CLASSES):
        super().__init__()
        from dslab.moe import MoE

        self.inp = nn.Linear(dim, width)
        expert = nn.Sequential(nn.Linear(width, 12), nn.ReLU(), nn.Linear(12, width))
        self.moe = MoE(hidden_size=width, expert=expert, num_experts=experts, ep_size=ep_size,
                       k=1, use_rts=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x, y):
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return F.cross_entropy(self.head(h).float(), y) + 0.01 * l_aux


def dense_and_expert_groups(model: nn.Module, name: str) -> list[dict]:
    """The param groups DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``
    makes from ``[{"params": model.parameters(), "name": "dense_params"}]``."""
    params = list(model.parameters())
    return [{"params": [p for p in params if getattr(p, "allreduce", True)], "name": "dense_params"},
            {"params": [p for p in params if not getattr(p, "allreduce", True)], "name": name,
             "moe": True}]
