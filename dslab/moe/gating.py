"""Top-k gating of DeepSpeed-MoE (Switch top-1, GShard top-2) on dslab's ``moe_gating`` kernel.

The gate scores T tokens against E experts with an fp32 ``Linear(hidden, E, bias=False)`` and
decides, for each token and each of its k choices, the expert, the combine weight, the slot
(position) inside that expert's buffer and whether the slot exists (capacity):

    logits [T, E] = x.float() @ wg.T          (x jittered in training when noisy_gate_policy='Jitter')
    probs  [T, E] = softmax(logits)
    choice 1      = argmax(logits)             (+ Gumbel noise in training with 'RSample', top-1)
    choice 2      = argmax over the others of logits (+ Gumbel noise in training when
                    top2_2nd_expert_sampling; DeepSpeed samples in eval too, dslab keeps eval
                    deterministic)
    position      = rank of the assignment inside its expert in choice-major order: all first
                    choices in token order, then the second choices, offset by the expert's
                    first-choice count
    capacity      = max(ceil(T / E * capacity_factor * k), min_capacity) (eval_capacity_factor in
                    eval); an assignment keeps its slot when position < capacity; with
                    drop_tokens=False there is no capacity and nothing is dropped
    l_aux         = E * sum_e mean_t(probs[:, e]) * (fraction of tokens whose first choice is e)
    exp_counts[e] = assignments to e before dropping

Random token selection (``use_rts``, top-1 only, as DeepSpeed): when dropping can happen, the
tokens of an expert that keep its ``capacity`` slots are those with the highest uniform random
priority instead of the first ones; the kept tokens then take slots in token order. DeepSpeed
applies it in eval too, and so does dslab. Top-2 combine weights are normalised over the choices
that kept their slot (DeepSpeed divides the kept gates by their sum; with both kept that is the
normalisation over the two chosen, with one dropped the other gets weight 1).

``used_token`` (0 = the token takes no expert) removes a token's assignments before slots are
counted, for k = 1 and k = 2 (DeepSpeed's top-2 gating ignores it).

The plain-PyTorch one-hot/cumsum formulation (DeepSpeed's ``top1gating``/``top2gating``) lives in
:mod:`dslab.moe.sharded_moe`; the tests hold this kernel path against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from dslab.kernels.moe.gate_linear import gate_linear
from dslab.kernels.moe.moe_gating import MAX_EXPERTS, moe_gating, moe_gating_reference

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
JITTER_EPS = 1e-2


@dataclass(frozen=True)
class GateConfig:
    """The gate's settings (DeepSpeed's ``TopKGate`` arguments), checked where they are built."""

    num_experts: int
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    noisy_gate_policy: str | None = None
    drop_tokens: bool = True
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True

    def __post_init__(self):
        if self.noisy_gate_policy == "None":  # DeepSpeed accepts the string too
            object.__setattr__(self, "noisy_gate_policy", None)
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {self.num_experts!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k not in (1, 2):
            raise ValueError(f"k must be 1 or 2 (top-1 or top-2 gating), got {self.k!r}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if isinstance(self.min_capacity, bool) or not isinstance(self.min_capacity, int) or self.min_capacity < 0:
            raise ValueError(f"min_capacity must be an int >= 0, got {self.min_capacity!r}")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy must be None, 'Jitter' or 'RSample', got {self.noisy_gate_policy!r}")
        for name in ("drop_tokens", "use_rts", "top2_2nd_expert_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


def _round_to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even; normal range)."""
    if value == 0.0:
        return 0.0
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * 2.0 ** 24), exponent - 24)


def gate_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: ``max(ceil(num_tokens / num_experts * capacity_factor), min_capacity)``.

    The product is taken in float32, as DeepSpeed computes it (a float32 tensor times a Python
    float), so that an exact product such as 10 / 4 * 1.2 rounds to the same integer; the product
    of two float32 values is exact in float64, so one rounding reproduces it. Pass
    ``capacity_factor * k`` for top-k. Plain Python: no device work and no host sync.
    """
    scaled = _round_to_float32(_round_to_float32(float(capacity_factor)) * _round_to_float32(num_tokens / num_experts))
    return max(math.ceil(scaled), int(min_capacity))


def gumbel_rsample(shape, device) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(U))``, U ~ uniform(0, 1), fp32 ``shape`` on ``device``."""
    tiny = torch.finfo(torch.float32).tiny
    uniform = torch.rand(shape, device=device, dtype=torch.float32).clamp_(min=tiny, max=1.0 - 2 ** -24)
    return -torch.log(-torch.log(uniform))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = JITTER_EPS) -> torch.Tensor:
    """``x * uniform(1 - epsilon, 1 + epsilon)`` elementwise (Switch Transformer's input jitter)."""
    if epsilon == 0:
        return x
    noise = torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)
    return x * noise


def rts_priority(num_tokens: int, device) -> torch.Tensor:
    """One uniform random priority per token [T] fp32 (random token selection)."""
    return torch.rand(num_tokens, device=device, dtype=torch.float32)


def _rank_within_expert(expert: torch.Tensor, valid: torch.Tensor, num_experts: int,
                        sort_key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For N assignments (``expert`` [N] int64, ``valid`` [N] bool): the count of valid ones per
    expert [E] int64, and each assignment's rank among the valid assignments of its expert [N]
    int64, by index order, or by ascending ``sort_key`` [N] when given (ties in index order).
    Invalid assignments are ranked in a sentinel bucket E; their rank means nothing."""
    n = expert.numel()
    bucket = torch.where(valid, expert, num_experts)
    if sort_key is None:
        perm = torch.argsort(bucket, stable=True)
    else:
        by_key = torch.argsort(sort_key, stable=True)
        perm = by_key[torch.argsort(bucket[by_key], stable=True)]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(bucket)
    rank[perm] = torch.arange(n, device=expert.device) - starts[bucket[perm]]
    return counts[:num_experts], rank


def assign_slots(expert_index: torch.Tensor, num_experts: int, capacity: int | None,
                 valid: torch.Tensor | None = None, priority: torch.Tensor | None = None):
    """Slots in plain PyTorch, for what the kernel does not know (masked tokens, random selection).

    Args:
        expert_index: [T, k] int, the chosen experts.
        capacity: slots per expert, or None (dropless).
        valid: [T] bool, the tokens that take part (``used_token``), or None for all.
        priority: [T] float, random priorities; when given (and ``capacity`` is), each expert keeps
            its ``capacity`` highest-priority assignments instead of the first ones.

    Returns:
        position [T, k] int64 (choice-major rank among the kept assignments of the expert),
        keep [T, k] bool, counts [E] int64 (valid assignments before dropping).
    """
    t, k = expert_index.shape
    flat = expert_index.t().reshape(-1).long()  # choice-major
    valid_flat = (torch.ones(t, dtype=torch.bool, device=flat.device) if valid is None else valid).repeat(k)
    if capacity is not None and priority is not None:
        counts, priority_rank = _rank_within_expert(flat, valid_flat, num_experts, sort_key=-priority.repeat(k))
        keep = valid_flat & (priority_rank < capacity)
        _, rank = _rank_within_expert(flat, keep, num_experts)  # the kept take slots in choice-major order
    else:
        counts, rank = _rank_within_expert(flat, valid_flat, num_experts)
        keep = valid_flat if capacity is None else valid_flat & (rank < capacity)
    return rank.view(k, t).t(), keep.view(k, t).t(), counts


@dataclass
class GateDecision:
    """Where each of T tokens goes, for its k choices.

    expert_index [T, k] int64; gate_weight [T, k] fp32 (combine weight, 0 where dropped);
    position [T, k] int64 (slot inside the expert, meaningful where kept); keep [T, k] bool;
    exp_counts [E] int64 (assignments before dropping); l_aux fp32 scalar; capacity (slots per
    expert) or None when dropless.
    """

    expert_index: torch.Tensor
    gate_weight: torch.Tensor
    position: torch.Tensor
    keep: torch.Tensor
    exp_counts: torch.Tensor
    l_aux: torch.Tensor
    capacity: int | None


class TopKGate(nn.Module):
    """DeepSpeed's ``TopKGate``: ``wg`` = fp32 ``Linear(model_dim, num_experts, bias=False)``."""

    def __init__(self, model_dim: int, config: GateConfig):
        super().__init__()
        self.config = config
        self.k = config.k
        self.num_experts = config.num_experts
        self.wg = nn.Linear(model_dim, config.num_experts, bias=False).float()
        # the kernel holds a row of logits in registers; wider gates run its PyTorch reference
        self._gating = moe_gating if config.num_experts <= MAX_EXPERTS else moe_gating_reference

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] (any dtype) -> fp32 logits [T, E], in fp32 even under autocast: the tokens are
        read in their own dtype and scored in fp32 (:func:`dslab.kernels.moe.gate_linear.gate_linear`,
        with no fp32 copy of x), the weight cast to fp32 where a module cast made it half."""
        if self.config.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x.float())
        weight = self.wg.weight
        return gate_linear(x, weight if weight.dtype == torch.float32 else weight.float())

    def selection_noise(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Gumbel noise [T, E] for the noisy choice (RSample's first, top-2's second), training only."""
        if not self.training:
            return None
        if self.k == 1 and self.config.noisy_gate_policy == "RSample":
            return gumbel_rsample(logits.shape, logits.device)
        if self.k == 2 and self.config.top2_2nd_expert_sampling:
            return gumbel_rsample(logits.shape, logits.device)
        return None

    def capacity(self, num_tokens: int) -> int | None:
        """Slots per expert for ``num_tokens`` tokens in the current mode (None when dropless)."""
        if not self.config.drop_tokens:
            return None
        factor = self.config.capacity_factor if self.training else self.config.eval_capacity_factor
        return gate_capacity(num_tokens, self.num_experts, factor * self.k, self.config.min_capacity)

    def draw_priority(self, num_tokens: int, capacity: int | None, device) -> torch.Tensor | None:
        """RTS priorities [T] when random token selection applies and a token can be dropped."""
        if self.k == 1 and self.config.use_rts and capacity is not None and capacity < num_tokens:
            return rts_priority(num_tokens, device)
        return None

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> GateDecision:
        """Gate ``x`` [T, H]; ``used_token`` [T] (nonzero = take part) or None."""
        num_tokens = x.shape[0]
        logits = self.compute_logits(x)
        noise = self.selection_noise(logits)
        capacity = self.capacity(num_tokens)
        priority = self.draw_priority(num_tokens, capacity, x.device)
        if self.k == 1 and noise is not None:  # RSample: the noisy logits choose, the clean ones weigh
            out = self._gating(logits + noise, 1)
            probs = torch.softmax(logits, dim=-1)
            gate_weight = probs.gather(1, out.expert_index.long())
        else:
            out = self._gating(logits, self.k, noise)
            probs, gate_weight = out.probs, out.gate_weight
        expert_index = out.expert_index.long()
        valid = None if used_token is None else used_token.reshape(-1) != 0
        if valid is None and priority is None:
            position, exp_counts = out.position.long(), out.expert_counts.long()
            keep = (torch.ones_like(position, dtype=torch.bool) if capacity is None else position < capacity)
        else:
            position, keep, exp_counts = assign_slots(expert_index, self.num_experts, capacity, valid, priority)
        l_aux = self._load_balancing_loss(probs, expert_index[:, 0], valid)
        if capacity is not None or valid is not None:
            gate_weight = gate_weight * keep
            if self.k == 2:
                gate_weight = gate_weight / gate_weight.sum(1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
        return GateDecision(expert_index, gate_weight, position, keep, exp_counts, l_aux, capacity)

    def _load_balancing_loss(self, probs, first_choice, valid) -> torch.Tensor:
        """E * sum_e mean_t(probs[:, e]) * (first-choice count of e) / T."""
        ones = torch.ones_like(first_choice, dtype=torch.float32)
        if valid is not None:
            ones = ones * valid
        first_counts = torch.zeros(self.num_experts, dtype=torch.float32, device=probs.device)
        first_counts.scatter_add_(0, first_choice, ones)
        return torch.sum(probs.mean(0) * first_counts / first_choice.numel()) * self.num_experts
