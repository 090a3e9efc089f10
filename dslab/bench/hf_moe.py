"""The ``hf`` arm of the MoE workloads: transformers' Mixtral sparse-MoE block
(``MixtralSparseMoeBlock``: ``MixtralTopKRouter`` + ``MixtralExperts``) at the shape of dslab's
MoE FFN, in a transformers ``GPT2LMHeadModel`` (every other block's MLP) or alone.

How it differs from dslab's MoE FFN (``suites/moe/README.md`` says the same):

- The experts are gated (GeGLU here: ``down(gelu_tanh(gate(x)) * up(x))``, three matrices, no
  biases) where ours are ``w2 gelu_tanh(w1 x + b1) + b2``. To do the same expert work, the gated
  inner width is 8H/3 rounded to a multiple of 64 (:func:`gated_intermediate`): 2048 at H=768
  (exactly our flops and weights), 2752 at H=1024 (0.8% more). :func:`expert_flops` counts what
  the block does.
- The router renormalises the top-k weights (top-1 weight is always 1, so the router learns
  only from the load-balancing loss) and draws no noise for the second choice; the experts run
  dropless through transformers' ``experts_implementation="grouped_mm"`` (``torch`` grouped
  matmuls; the default of transformers' MoE models), and the load-balancing loss is
  transformers' ``load_balancing_loss_func`` (Switch's, over the top-k assignments).
- Under autocast the wrapper gives the experts their weights in the autocast dtype
  (``torch.func.functional_call``): transformers' grouped matmul is not autocast-enabled and,
  with the fp32 weights of an autocast loop, would cast the tokens up and multiply in fp32.

The wrappers call the block's router and experts themselves (what ``MixtralSparseMoeBlock.forward``
does with ``router_jitter_noise=0``) to keep the router logits for the load-balancing loss; with
transformers 4, whose block returns them (its experts a per-expert loop), they call the block.
"""

from __future__ import annotations

import torch
import torch.nn as nn

GATED_WIDTH_MULTIPLE = 64
# What the Mixtral block is built with; transformers' MoE models pick grouped_mm by default.
EXPERTS_IMPLEMENTATION = "grouped_mm"
HIDDEN_ACT = "gelu_pytorch_tanh"


def gated_intermediate(hidden: int) -> int:
    """The gated experts' inner width doing the work of a 4*hidden two-matrix MLP: 8H/3, rounded
    to a multiple of 64 (at least 64)."""
    return max(GATED_WIDTH_MULTIPLE, round(8 * hidden / 3 / GATED_WIDTH_MULTIPLE) * GATED_WIDTH_MULTIPLE)


def expert_flops(assignments: int, hidden: int) -> int:
    """Forward + backward flops of the gated experts over ``assignments`` (token, expert) pairs:
    three ``hidden x gated_intermediate`` matmuls, 2 flops per multiply-add, backward twice."""
    return 3 * 3 * 2 * assignments * hidden * gated_intermediate(hidden)


def mixtral_config(hidden: int, num_experts: int, k: int, initializer_range: float):
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=gated_intermediate(hidden), num_local_experts=num_experts,
        num_experts_per_tok=k, hidden_act=HIDDEN_ACT, router_jitter_noise=0.0,
        initializer_range=initializer_range, num_hidden_layers=1, num_attention_heads=1, vocab_size=1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    config._experts_implementation = EXPERTS_IMPLEMENTATION
    return config


class MixtralMoE(nn.Module):
    """A ``MixtralSparseMoeBlock`` returning ``(output, router_logits)``: ``x`` [..., H] ->
    ``[..., H]`` and ``[tokens, E]``. Weights ~ N(0, ``initializer_range``) (the block is built
    outside a ``PreTrainedModel``, which would otherwise initialise it)."""

    def __init__(self, hidden: int, num_experts: int, k: int, initializer_range: float):
        super().__init__()
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        self.block = MixtralSparseMoeBlock(mixtral_config(hidden, num_experts, k, initializer_range))
        for param in self.block.parameters():
            if not param.is_meta:
                nn.init.normal_(param, mean=0.0, std=initializer_range)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.block.gate, nn.Linear):  # transformers 4: the block returns its router logits
            return self.block(x)
        flat = x.reshape(-1, x.shape[-1])
        router_logits, weights, index = self.block.gate(flat)
        experts = self.block.experts
        if torch.is_autocast_enabled(x.device.type):
            # transformers' grouped_mm is not autocast-enabled: with fp32 weights it would cast the
            # activations up and multiply in fp32. Hand the experts their weights in the autocast
            # dtype, as autocast does for an nn.Linear (the gradients reach the fp32 weights).
            dtype = torch.get_autocast_dtype(x.device.type)
            cast = {name: p.to(dtype) for name, p in experts.named_parameters()}
            out = torch.func.functional_call(experts, cast, (flat, index, weights))
        else:
            out = experts(flat, index, weights)
        return out.reshape(x.shape), router_logits


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, k: int) -> torch.Tensor:
    """transformers' Switch load-balancing loss over the layers' router logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func(tuple(router_logits), num_experts, k)


class _MixtralMLP(nn.Module):
    """A GPT2Block's ``mlp``: the MoE output, its router logits kept for the loss."""

    def __init__(self, moe: MixtralMoE, dropout: float):
        super().__init__()
        self.moe = moe
        self.dropout = nn.Dropout(dropout)
        self.router_logits = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out, self.router_logits = self.moe(hidden_states)
        return self.dropout(out)


class HFGPT2MoE(nn.Module):
    """transformers' ``GPT2LMHeadModel`` (vocab unpadded, SDPA attention) whose blocks at
    ``moe_layers`` run a :class:`MixtralMoE`. ``forward(input_ids, labels)`` -> LM loss +
    ``moe_loss_coeff`` * the load-balancing loss."""

    def __init__(self, config):
        super().__init__()
        import transformers

        hf_config = transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.hidden,
            n_layer=config.layers, n_head=config.heads, resid_pdrop=config.dropout, embd_pdrop=config.dropout,
            attn_pdrop=config.dropout, layer_norm_epsilon=config.layer_norm_epsilon, attn_implementation="sdpa",
        )
        self.model = transformers.GPT2LMHeadModel(hf_config)
        self.num_experts, self.k, self.moe_loss_coeff = config.num_experts, config.k, config.moe_loss_coeff
        self.moe_layers = list(config.moe_layers)
        for i in self.moe_layers:
            moe = MixtralMoE(config.hidden, config.num_experts, config.k, config.initializer_range)
            self.model.transformer.h[i].mlp = _MixtralMLP(moe, config.dropout)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.model(input_ids=input_ids, labels=labels).loss
        logits = [self.model.transformer.h[i].mlp.router_logits for i in self.moe_layers]
        return loss + self.moe_loss_coeff * load_balancing_loss(logits, self.num_experts, self.k)


class HFMoELayer(nn.Module):
    """The MoE layer benchmark's model (:class:`dslab.bench.moe_layer.MoELayerModel`) on a
    :class:`MixtralMoE`: same input scale, same loss."""

    def __init__(self, config):
        super().__init__()
        self.input_scale = nn.Parameter(torch.ones(()))
        self.moe = MixtralMoE(config.hidden, config.num_experts, config.k, config.initializer_range)
        self.num_experts, self.k, self.moe_loss_coeff = config.num_experts, config.k, config.moe_loss_coeff

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out, router_logits = self.moe(hidden_states * self.input_scale.to(hidden_states.dtype))
        aux = load_balancing_loss([router_logits], self.num_experts, self.k)
        return out.float().pow(2).mean() + self.moe_loss_coeff * aux
