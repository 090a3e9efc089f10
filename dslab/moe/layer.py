"""DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``), same constructor and return values.

    from dslab.moe.layer import MoE
    moe = MoE(hidden_size=H, expert=nn.Sequential(nn.Linear(H, F), nn.GELU(), nn.Linear(F, H)),
              num_experts=8, ep_size=2, k=2)
    output, l_aux, exp_counts = moe(hidden_states)     # hidden_states [B, S, H] or [T, H]

``output`` has ``hidden_states``' shape; add ``coeff * l_aux`` (fp32 scalar, the load-balancing
loss) to the training loss (``moe.deepspeed_moe.l_aux`` keeps a detached copy: no module attribute
holds the forward's autograd graph). ``exp_counts`` [E] int64 counts each expert's assignments before
dropping, for this rank's tokens. It stays on the device (no host sync); DeepSpeed returns it on
the CPU, so call ``.cpu()`` where a script relies on that.

Expert parallelism (``ep_size`` = p > 1) needs a process group whose world size p divides; the
experts are sharded over contiguous blocks of p ranks (:mod:`dslab.moe.groups`) and tokens move
with all_to_all (:mod:`dslab.moe.expert_parallel`). Each rank gates its own tokens, so output,
l_aux and exp_counts are what ep_size 1 gives on those tokens; with drop_tokens=True the ranks of a
group must feed equal token counts (the capacity buffers they exchange must agree), as in
DeepSpeed; dropless takes any counts at the price of one host sync per call. Expert parameters
carry ``allreduce = False`` and ``group_name = "ep_size_{p}"``. Gradient scaling the engine must
apply: with a world of W ranks each back-propagating its own mean loss, the gradient of the global
mean loss is ``(1 / W) * sum over ranks`` for a dense parameter. An expert parameter's local
gradient is already the sum over the p ranks of its expert-parallel group (the all_to_all brings
their tokens' gradients home), so the engine sums it over the expert-data-parallel group (W / p
ranks) and divides by W, not by W / p (averaging over the expert-data-parallel group alone would
leave expert gradients p times too large).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dslab.moe import groups
from dslab.moe.experts import Experts
from dslab.moe.gating import GateConfig, TopKGate
from dslab.moe.sharded_moe import MOELayer


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class MoE(nn.Module):
    """A mixture of ``num_experts`` copies of ``expert`` (each [.., H] -> [.., H]).

    Args (DeepSpeed's):
        hidden_size: H, the width of the tokens.
        expert: the expert module, deep-copied num_experts / ep_size times on each rank. An MLP
            (``nn.Sequential(Linear(H, F), GELU | ReLU | SiLU, Linear(F, H))`` or
            :class:`dslab.moe.experts.MLPExpert`) runs as grouped GEMMs; any other module in a
            per-expert loop.
        num_experts: E in total; ep_size: expert-parallel degree (E % ep_size == 0).
        k: 1 (Switch) or 2 (GShard).
        capacity_factor / eval_capacity_factor: slots per expert = max(ceil(T / E * factor * k),
            min_capacity), in training / eval.
        use_residual: PR-MoE: ``expert`` itself also runs densely on every token and a learned
            ``coefficient`` Linear(H, 2) mixes the two outputs.
        noisy_gate_policy: None, 'Jitter' (input jitter) or 'RSample' (Gumbel top-1), training only.
        drop_tokens: False runs dropless (every token reaches its experts).
        use_rts: random token selection among a full expert's tokens (top-1).
        top2_2nd_expert_sampling: Gumbel-sampled second expert in training (top-2).
        use_tutel, enable_expert_tensor_parallelism: not supported by dslab (must be False).
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        _positive_int("hidden_size", hidden_size)
        _positive_int("num_experts", num_experts)
        _positive_int("ep_size", ep_size)
        if not isinstance(expert, nn.Module):
            raise ValueError(f"expert must be an nn.Module, got {type(expert).__name__}")
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by ep_size={ep_size} "
                             "(each rank of an expert-parallel group holds num_experts / ep_size experts)")
        if use_tutel:
            raise ValueError("use_tutel=True is not supported by dslab: its dispatch runs on dslab's own "
                             "moe_permute/grouped_gemm kernels; pass use_tutel=False")
        if enable_expert_tensor_parallelism:
            raise ValueError("enable_expert_tensor_parallelism=True is not supported by dslab (no tensor "
                             "parallelism inside experts); pass enable_expert_tensor_parallelism=False")
        if not isinstance(use_residual, bool):
            raise ValueError(f"use_residual must be a bool, got {use_residual!r}")
        if k == 2 and num_experts < 2:
            raise ValueError(f"k=2 needs num_experts >= 2, got num_experts={num_experts}")
        config = GateConfig(num_experts=num_experts, k=k, capacity_factor=capacity_factor,
                            eval_capacity_factor=eval_capacity_factor, min_capacity=min_capacity,
                            noisy_gate_policy=noisy_gate_policy, drop_tokens=drop_tokens, use_rts=use_rts,
                            top2_2nd_expert_sampling=top2_2nd_expert_sampling)
        self.hidden_size = hidden_size
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.expert_group_name = groups.group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self._expert_groups = groups.create_expert_groups(ep_size)  # checks that ep_size divides the world
        experts = Experts(expert, self.num_local_experts, self.expert_group_name, hidden_size)
        self.deepspeed_moe = MOELayer(TopKGate(hidden_size, config), experts, self.expert_group_name, ep_size,
                                      self.num_local_experts)
        self.deepspeed_moe._set_ep_group(self._expert_groups.expert_parallel)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    @property
    def expert_groups(self) -> groups.ExpertGroups:
        """This layer's expert-parallel and expert-data-parallel groups."""
        return self._expert_groups

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine hook; dslab creates the groups in the constructor, so this only checks."""
        if use_data_before_expert_parallel_:
            raise ValueError("use_data_before_expert_parallel_=True is not supported by dslab (its expert "
                             "groups are contiguous blocks of ep_size ranks)")
        self._expert_groups = groups.create_expert_groups(self.ep_size)
        self.deepspeed_moe._set_ep_group(self._expert_groups.expert_parallel)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """``hidden_states`` [B, S, H] or [T, H]; ``used_token`` [T] (0 = the token takes no expert).

        Returns ``(output [hidden_states' shape], l_aux fp32 scalar, exp_counts [E] int64 on the
        device)``.
        """
        if hidden_states.dim() < 2 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [..., hidden_size={self.hidden_size}], got shape "
                             f"{tuple(hidden_states.shape)}")
        num_tokens = hidden_states.numel() // self.hidden_size
        if used_token is not None and used_token.numel() != num_tokens:
            raise ValueError(f"used_token must hold one entry per token ({num_tokens}), got shape "
                             f"{tuple(used_token.shape)}")
        output, l_aux = self.deepspeed_moe.run(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, l_aux, self.deepspeed_moe.exp_counts
