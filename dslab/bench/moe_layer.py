"""The ``moe_layer`` family: one MoE layer alone, timed forward and backward.

The model (:class:`MoELayerModel`) holds one MoE FFN of the kernel set (``dslab``:
:class:`dslab.moe.MoE`; ``torch``: the plain loop of :class:`dslab.models.moe_naive.NaiveMoE`) and
computes ``loss = mean(output.float() ** 2) + moe_loss_coeff * l_aux`` from a fixed batch of hidden
states ``[micro_batch, seq_len, hidden]`` (one token per row, in the suite's precision). The input
passes through a learnable scalar scale (one parameter, initialised to 1), so that the backward
computes the input's gradient as a layer inside a model does. Weights are initialised as
GPT-2-MoE's MoE layers (:func:`dslab.models.gpt2_moe.init_moe_`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from dslab.models.graphs import CudaGraphLayers, LayerStackGraphs
from dslab.models.gpt2_moe import MoEAuxLoss, MoESettings, MoEStatsMixin, build_moe, check_graphable, init_moe_


@dataclass
class MoELayerConfig(MoESettings):
    """The layer's shape (``hidden``, expert inner width ``ffn``) and its MoE settings."""

    hidden: int = 1024
    ffn: int = 4096
    initializer_range: float = 0.02

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for key in ("hidden", "ffn"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if not self.initializer_range > 0.0:
            raise ValueError(f"initializer_range must be > 0, got {self.initializer_range!r}")
        self.validate_moe()


def moe_layer_1024h_8e(**overrides) -> MoELayerConfig:
    """The anchor layer: hidden 1024, expert FFN 4096 (tanh GELU), 8 experts, dropless."""
    return dataclasses.replace(MoELayerConfig(hidden=1024, ffn=4096, num_experts=8, drop_tokens=False), **overrides)


def moe_layer_tiny(**overrides) -> MoELayerConfig:
    """Hidden 64, FFN 256, 4 experts, dropless: for CPU tests and the tiny scale."""
    return dataclasses.replace(MoELayerConfig(hidden=64, ffn=256, num_experts=4, drop_tokens=False), **overrides)


class ScaledMoE(MoEStatsMixin, nn.Module):
    """``moe(x * input_scale)``, recording the routing; called as a layer, ``(x, key_padding_mask)``."""

    def __init__(self, config: MoELayerConfig, kernels: str):
        super().__init__()
        self.settings = config
        seed = int(torch.randint(0, 2**62, (1,), device="cpu"))
        self.input_scale = nn.Parameter(torch.ones(()))
        self.moe = build_moe(config.hidden, config.ffn, config, kernels)
        init_moe_(self.moe, config.initializer_range, config.initializer_range, seed)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        out, l_aux, exp_counts = self.moe(x * self.input_scale.to(x.dtype))
        self.record(x, l_aux, exp_counts)
        return out


class MoELayerModel(CudaGraphLayers, nn.Module):
    """``forward(hidden_states [..., hidden]) -> loss`` (fp32 scalar); see the module docstring.

    The layer is ``layers[0]`` (a :class:`ScaledMoE`), so that with ``kernels="dslab"``
    :meth:`enable_cuda_graphs` runs it from captured CUDA graphs as GPT-2-MoE's stack does, its
    ``l_aux`` the side output (:mod:`dslab.models.graphs`)."""

    def __init__(self, config: MoELayerConfig, kernels: str = "dslab"):
        super().__init__()
        if not isinstance(config, MoELayerConfig):
            raise ValueError(f"config must be a MoELayerConfig, got {type(config).__name__}")
        config.validate()
        self.config = config
        self.kernels = kernels
        self.layers = nn.ModuleList([ScaledMoE(config, kernels)])
        self._aux_side = MoEAuxLoss([self.layers[0]])

    def enable_cuda_graphs(self, enabled: bool = True) -> None:
        self.release_cuda_graphs()
        self._layer_graphs = None
        if enabled:
            check_graphable(self.config, self.kernels)
            self._layer_graphs = LayerStackGraphs(self.layers, side=self._aux_side)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[-1] != self.config.hidden:
            raise ValueError(f"hidden_states must be [..., {self.config.hidden}], got {tuple(hidden_states.shape)}")
        if self._layer_graphs is not None:
            out, l_aux = self._layer_graphs(hidden_states, None)
        else:
            out = self.layers[0](hidden_states)
            l_aux = self._aux_side.loss()
        return out.float().pow(2).mean() + self.config.moe_loss_coeff * l_aux

    def moe_stats(self) -> list[dict]:
        """The last forward's routing as GPT-2-MoE reports it, for the one layer (index 0)."""
        return [{"layer": 0, **self.layers[0].stats()}]
