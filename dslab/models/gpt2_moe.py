"""GPT-2-MoE: GPT-2 (:mod:`dslab.models.gpt2`) with the MLP of every other layer (indices 1, 3,
5, ...) replaced by a mixture of ``num_experts`` tanh-GELU experts of inner width 4 * hidden, top-1
or top-2 gated: DeepSpeed-MoE's "350M+MoE-128" layout (Rajbhandari et al. 2022, section 4.1) at
GPT-2's sizes.

The MoE FFN is :class:`dslab.moe.MoE` with ``kernels="dslab"`` (stacked experts on grouped GEMM
kernels) and :class:`dslab.models.moe_naive.NaiveMoE` with ``kernels="torch"`` (a softmax gate and a
loop over experts). Both hold the same parameters under the same names and are initialised here,
after the dense model, from one generator seeded by a draw from torch's CPU generator: from the
same seed the two kernel sets build the same weights and compute the same function.

Initialisation: the dense parts as GPT-2; the gate ``wg`` and each expert's ``w1`` ~ N(0,
``initializer_range``), its ``w2`` ~ N(0, ``initializer_range / sqrt(2 * layers)``) (GPT-2's scaled
residual init), biases 0. Every expert starts different (DeepSpeed's deep copies start equal).

The loss is the LM loss plus ``moe_loss_coeff`` times the sum of the MoE layers' load-balancing
losses (``l_aux``). After each forward, :meth:`GPT2MoELMHeadModel.moe_stats` gives each MoE layer's
per-expert assignment counts and dropped assignments as device tensors (no host sync).

CUDA graphs: with ``kernels="dslab"`` and ``ep_size`` 1 the layer stack, MoE layers included, is
captured as GPT-2's is (:mod:`dslab.models.graphs`). dslab's MoE layer never synchronises with the
host: its buffers have static sizes (T * k rows dropless, E * C with a capacity) and the experts'
group boundaries are read on the device, so one graph serves every routing. The layers' ``l_aux``
sum is the stack's side output, and the routing statistics point at the replayed buffers after
each replay. The torch set's loop and ``ep_size > 1`` read sizes on the host and are refused.

FSDP2 (``fully_shard`` per block, then the root): with ``chain_layer_norms=False``
(:class:`dslab.models.gpt2.GPT2Config`) every block reads only its own parameters. The MoE FFNs
add no cross-block read: the stack's ``l_aux`` sum is taken from the FFNs' attributes after the
stack, and with ``ep_size`` 1 every rank holds every expert, so the experts' stacked weights are
sharded like any other parameter.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from dslab.models.gpt2 import GPT2Config, GPT2LMHeadModel
from dslab.models.graphs import LayerStackGraphs
from dslab.models.ops import LayerNorm, OpSet, op_set
from dslab.parallel.partitioned import GatheredParameters

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
# The MoE layer's parameters by role, in the order they are initialised.
MOE_PARAMETER_ROLES = ("wg.weight", "w1", "b1", "w2", "b2")


@dataclass
class MoESettings:
    """An MoE FFN's settings, DeepSpeed's ``MoE`` arguments (``moe_loss_coeff`` weighs ``l_aux`` in
    the loss). Defaults are DeepSpeed's, except ``num_experts``."""

    num_experts: int = 8
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = True
    noisy_gate_policy: str | None = None
    ep_size: int = 1
    moe_loss_coeff: float = 0.01

    def validate_moe(self) -> None:
        """ValueError naming the first bad MoE field."""
        for key in ("num_experts", "ep_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if self.k not in (1, 2) or isinstance(self.k, bool):
            raise ValueError(f"k must be 1 or 2 (top-1 or top-2 gating), got {self.k!r}")
        if self.k > self.num_experts:
            raise ValueError(f"k={self.k} must not exceed num_experts={self.num_experts}")
        if self.num_experts % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide num_experts={self.num_experts}")
        for key in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{key} must be a number > 0, got {value!r}")
        if isinstance(self.min_capacity, bool) or not isinstance(self.min_capacity, int) or self.min_capacity < 0:
            raise ValueError(f"min_capacity must be an int >= 0, got {self.min_capacity!r}")
        for key in ("drop_tokens", "use_rts"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be a bool, got {getattr(self, key)!r}")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy must be None, 'Jitter' or 'RSample', got {self.noisy_gate_policy!r}")
        if isinstance(self.moe_loss_coeff, bool) or not isinstance(self.moe_loss_coeff, (int, float)) \
                or not self.moe_loss_coeff >= 0:
            raise ValueError(f"moe_loss_coeff must be a number >= 0, got {self.moe_loss_coeff!r}")

    def moe_arguments(self) -> dict:
        """The keyword arguments of ``dslab.moe.MoE`` (and ``NaiveMoE``) these settings give."""
        return dict(num_experts=self.num_experts, ep_size=self.ep_size, k=self.k,
                    capacity_factor=self.capacity_factor, eval_capacity_factor=self.eval_capacity_factor,
                    min_capacity=self.min_capacity, noisy_gate_policy=self.noisy_gate_policy,
                    drop_tokens=self.drop_tokens, use_rts=self.use_rts)


@dataclass
class GPT2MoEConfig(GPT2Config, MoESettings):
    """GPT-2's shape (:class:`GPT2Config`) and the MoE FFN's settings (:class:`MoESettings`)."""

    def validate(self) -> None:
        GPT2Config.validate(self)
        self.validate_moe()
        if self.tp_size != 1:
            raise ValueError(f"tp_size={self.tp_size}: GPT-2-MoE has no tensor-parallel layers (its experts "
                             "split over ep_size instead)")
        if self.checkpoint_layers:
            raise ValueError(f"checkpoint_layers={self.checkpoint_layers}: GPT-2-MoE does not checkpoint its "
                             "layers (each MoE layer's load-balancing loss leaves the stack beside its output)")

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is an MoE FFN: every other one, from the second (1, 3, 5, ...)."""
        return list(range(1, self.layers, 2))


def gpt2_moe_124m_8e(**overrides) -> GPT2MoEConfig:
    """GPT-2 124M (12 layers, hidden 768) with 8 experts in layers 1, 3, ..., 11: 6 MoE layers of
    8 x 4.7M expert parameters and a 768 x 8 gate, 322,818,816 parameters in all (vocab 50257)."""
    return dataclasses.replace(GPT2MoEConfig(num_experts=8), **overrides)


def gpt2_moe_tiny(**overrides) -> GPT2MoEConfig:
    """The tiny GPT-2 (:func:`dslab.models.gpt2.gpt2_tiny`'s shape) with 4 experts in layer 1."""
    return dataclasses.replace(
        GPT2MoEConfig(vocab_size=1000, n_positions=128, hidden=128, layers=2, heads=4, num_experts=4), **overrides
    )


def build_moe(hidden: int, ffn: int, settings: MoESettings, kernels: str) -> nn.Module:
    """The MoE layer of ``kernels``: ``forward(x [..., H]) -> (out [..., H], l_aux, exp_counts [E])``;
    experts ``Linear(hidden, ffn) -> GELU(tanh) -> Linear(ffn, hidden)``."""
    op_set(kernels)  # a ValueError naming the kernel sets for any other name
    if kernels == "torch":
        from dslab.models.moe_naive import NaiveMoE

        return NaiveMoE(hidden, ffn, **settings.moe_arguments())
    from dslab.moe import MoE

    expert = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, hidden))
    return MoE(hidden, expert, **settings.moe_arguments())


def moe_parameters(moe: nn.Module) -> dict[str, nn.Parameter]:
    """The MoE layer's parameters by role (:data:`MOE_PARAMETER_ROLES`), found by name."""
    found = {}
    for name, param in moe.named_parameters():
        for role in MOE_PARAMETER_ROLES:
            if name == role or name.endswith("." + role):
                if role in found:
                    raise ValueError(f"the MoE layer has two parameters for {role!r}")
                found[role] = param
    missing = [role for role in MOE_PARAMETER_ROLES if role not in found]
    if missing:
        raise ValueError(f"the MoE layer ({type(moe).__name__}) has no parameter for {', '.join(missing)}")
    return found


@torch.no_grad()
def init_moe_(moe: nn.Module, std: float, out_std: float, generator_seed: int) -> None:
    """Gate and ``w1`` ~ N(0, std), ``w2`` ~ N(0, out_std), biases 0, drawn in role order from a
    generator seeded with ``generator_seed`` on the parameters' device (meta parameters stay)."""
    params = moe_parameters(moe)
    device = params["w1"].device
    if device.type == "meta":
        return
    # whole while initialised when built partitioned (dslab.zero.Init; rank 0's values kept)
    with GatheredParameters(list(params.values()), modifier_rank=0):
        generator = torch.Generator(device=params["w1"].device).manual_seed(generator_seed)
        for role in MOE_PARAMETER_ROLES:
            param = params[role]
            if role.startswith("b"):
                param.zero_()
            else:
                param.normal_(0.0, out_std if role == "w2" else std, generator=generator)


def moe_capacity(settings: MoESettings, tokens: int, training: bool) -> int | None:
    """Slots per expert for ``tokens`` tokens (None when dropless): DeepSpeed's rule,
    :func:`dslab.moe.gating.gate_capacity`, which both kernel sets implement."""
    if not settings.drop_tokens:
        return None
    from dslab.moe.gating import gate_capacity

    factor = settings.capacity_factor if training else settings.eval_capacity_factor
    return gate_capacity(tokens, settings.num_experts, factor * settings.k, settings.min_capacity)


class MoEStatsMixin:
    """Keeps an MoE layer's last ``l_aux`` and ``exp_counts`` (device tensors), its token count and
    mode (:meth:`record`), and reports them (:meth:`stats`) without a host sync.

    ``l_aux`` is kept detached; the live one (with its autograd graph) waits for one
    :meth:`take_l_aux`, which hands it to the loss and forgets it, so that no attribute keeps a
    forward's graph alive after the loss is formed (:mod:`dslab.models.graphs` needs that).
    """

    settings: MoESettings
    l_aux = exp_counts = None
    _live_l_aux = None
    tokens = 0
    recorded_training = True

    def record(self, x: torch.Tensor, l_aux: torch.Tensor, exp_counts: torch.Tensor) -> None:
        self._live_l_aux, self.l_aux, self.exp_counts = l_aux, l_aux.detach(), exp_counts
        self.tokens = x.numel() // x.shape[-1]
        self.recorded_training = self.training

    def take_l_aux(self) -> torch.Tensor:
        """The last forward's ``l_aux`` with its graph, once."""
        if self._live_l_aux is None:
            raise ValueError("the MoE layer's l_aux was taken already or no forward has run")
        live, self._live_l_aux = self._live_l_aux, None
        return live

    def routing_state(self) -> tuple:
        return self.l_aux, self.exp_counts, self.tokens, self.recorded_training

    def set_routing_state(self, state: tuple) -> None:
        self.l_aux, self.exp_counts, self.tokens, self.recorded_training = state

    def stats(self) -> dict:
        """The last forward's routing: ``exp_counts`` [E] (assignments per expert before dropping)
        and ``dropped`` (assignments past their expert's capacity, 0-dim) as device tensors;
        ``tokens``, ``k`` and ``capacity`` (None when dropless) as ints."""
        if self.exp_counts is None:
            raise ValueError("no forward has run yet: the MoE layer has no routing to report")
        counts = self.exp_counts.detach()
        capacity = moe_capacity(self.settings, self.tokens, self.recorded_training)
        dropped = counts.new_zeros(()) if capacity is None else (counts - capacity).clamp(min=0).sum()
        return {"exp_counts": counts, "dropped": dropped, "tokens": self.tokens, "k": self.settings.k,
                "capacity": capacity}


class MoEAuxLoss:
    """The side output of a layer stack holding MoE layers (:class:`dslab.models.graphs.StackSideOutput`):
    the sum of their ``l_aux``; the routing statistics are put back after each graph replay."""

    def __init__(self, layers: list[MoEStatsMixin]):
        self.layers = layers

    def loss(self) -> torch.Tensor:
        return torch.stack([layer.take_l_aux() for layer in self.layers]).sum()

    def snapshot(self) -> list[tuple]:
        return [layer.routing_state() for layer in self.layers]

    def restore(self, state: list[tuple]) -> None:
        for layer, routing in zip(self.layers, state):
            layer.set_routing_state(routing)


def check_graphable(settings: MoESettings, kernels: str) -> None:
    """ValueError unless MoE layers of ``settings`` on ``kernels`` can be captured in a CUDA graph:
    dslab's layer with ep_size 1 never synchronises with the host (its dropless groups are as
    large as the routing makes them, read on the device); the torch set's loop reads the group
    sizes on the host, and expert parallelism exchanges split sizes on the host."""
    if kernels != "dslab":
        raise ValueError(f"'cuda_graphs.enabled': the {kernels!r} kernel set's MoE loop reads its expert group "
                         "sizes on the host and cannot be captured; use kernels='dslab' or turn graphs off")
    if settings.ep_size != 1:
        raise ValueError(f"'cuda_graphs.enabled': expert parallelism (ep_size={settings.ep_size}) exchanges "
                         "token counts on the host and cannot be captured; use ep_size=1 or turn graphs off")


class MoEFeedForward(MoEStatsMixin, nn.Module):
    """``residual + dropout(MoE(x))``, in the op set's residual add (with a zero bias: the experts
    add their own), keeping the routing for :meth:`stats`."""

    def __init__(self, hidden: int, ffn: int, settings: MoESettings, hidden_dropout: float, ops: OpSet):
        super().__init__()
        self.moe = build_moe(hidden, ffn, settings, ops.name)
        self.settings = settings
        self.hidden_dropout = hidden_dropout
        self.ops = ops
        self.register_buffer("zero_bias", torch.zeros(hidden), persistent=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                norm: LayerNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`dslab.models.ops.FeedForward.forward`, ``norm`` included."""
        out, l_aux, exp_counts = self.moe(x)
        self.record(x, l_aux, exp_counts)
        if norm is None:
            return self.ops.bias_dropout_residual(out, self.zero_bias, residual, self.hidden_dropout, self.training)
        return norm.after_residual_add(out, self.zero_bias, residual, self.hidden_dropout, self.training)


class GPT2MoELMHeadModel(GPT2LMHeadModel):
    """GPT-2-MoE with its tied LM head: :class:`GPT2LMHeadModel` whose layers in
    ``config.moe_layers`` run a :class:`MoEFeedForward` in place of their MLP. ``forward`` as
    GPT-2's; with ``labels`` the loss adds ``moe_loss_coeff * sum of l_aux``."""

    def __init__(self, config: GPT2MoEConfig, kernels: str = "dslab"):
        if not isinstance(config, GPT2MoEConfig):
            raise ValueError(f"config must be a GPT2MoEConfig, got {type(config).__name__}")
        super().__init__(config, kernels)
        # One draw from the CPU generator seeds the MoE weights, so that the layers' constructors
        # (which differ between kernel sets) cannot shift them.
        seed = int(torch.randint(0, 2**62, (1,), device="cpu"))
        std = config.initializer_range
        out_std = std / math.sqrt(2 * config.layers)
        for i in config.moe_layers:
            ffn = MoEFeedForward(config.hidden, config.intermediate, config, config.dropout, self.ops)
            init_moe_(ffn.moe, std, out_std, seed + i)
            self.layers[i].mlp = ffn
        self._aux_side = MoEAuxLoss([ffn for _, ffn in self.moe_feed_forwards()])
        self._stack_l_aux = None

    def moe_feed_forwards(self) -> list[tuple[int, MoEFeedForward]]:
        return [(i, self.layers[i].mlp) for i in self.config.moe_layers]

    def aux_loss(self) -> torch.Tensor:
        """The sum of the MoE layers' load-balancing losses of the last forward (detached)."""
        return torch.stack([ffn.l_aux for _, ffn in self.moe_feed_forwards()]).sum()

    def run_layers(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The layer stack (graphed when enabled); keeps the sum of ``l_aux`` for :meth:`forward`."""
        if self._layer_graphs is not None:
            x, self._stack_l_aux = self._layer_graphs(x, key_padding_mask)
            return x
        x = super().run_layers(x, key_padding_mask)
        self._stack_l_aux = self._aux_side.loss()
        return x

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(input_ids, labels)
        aux, self._stack_l_aux = self._stack_l_aux, None
        if labels is None:
            return out
        return out + self.config.moe_loss_coeff * aux

    def moe_stats(self) -> list[dict]:
        """Per MoE layer of the last forward: ``{"layer": index, **MoEFeedForward.stats()}``."""
        return [{"layer": i, **ffn.stats()} for i, ffn in self.moe_feed_forwards()]

    def enable_cuda_graphs(self, enabled: bool = True) -> None:
        """Run the layer stack (MoE layers included) from captured CUDA graphs in training, with the
        MoE layers' ``l_aux`` sum as the stack's side output (:mod:`dslab.models.graphs`)."""
        if self._layer_graphs is not None:
            self._layer_graphs.release()
        self._layer_graphs = None
        if enabled:
            check_graphable(self.config, self.kernels)
            self._layer_graphs = LayerStackGraphs(self.layers, side=self._aux_side)

    @classmethod
    def from_hf_state_dict(cls, state_dict: dict, config, kernels: str = "dslab"):
        raise NotImplementedError("GPT-2-MoE has no HuggingFace GPT-2 counterpart to load from")

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("GPT-2-MoE has no HuggingFace GPT-2 counterpart to convert to")
