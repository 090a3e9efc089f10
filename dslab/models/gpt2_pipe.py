"""GPT-2 as a list of pipeline layers (:class:`dslab.parallel.pipe.PipelineModule`).

The same function as :class:`dslab.models.gpt2.GPT2LMHeadModel` on the same kernels, cut where
a pipeline may cut it:

    [embed (tied), block 0, ..., block L-1, final norm, head (tied with embed)]

- ``embed`` (:class:`GPT2Embedding`): token and position embeddings and the embedding dropout.
- each block (:class:`GPT2Block`) is a pre-LN :class:`~dslab.models.ops.TransformerLayer` that
  reads only its own parameters (``chain_layer_norms`` off), so any two blocks may sit on
  different stages.
- the head is the embedding module again (a :class:`~dslab.parallel.pipe.TiedLayerSpec`): its
  position hands ``(hidden, wte.weight)`` to the loss, which runs the model's fused LM-head
  cross-entropy (``ops.linear_cross_entropy``) with the model's next-token targets
  (:func:`gpt2_pipeline_loss`). The pipeline sums the two copies' gradients.

Initialisation follows the model's (N(0, initializer_range), the residual projections scaled by
``1 / sqrt(2 L)``), drawn per layer, so with ``seed_layers`` a layer's weights depend only on its
index. :func:`load_dense_state_dict` puts a dense model's weights into whichever layers a stage
holds.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.models.gpt2 import GPT2Config
from dslab.models.ops import (
    IGNORE_INDEX, Embedding, LayerNorm, PositionEmbedding, TransformerLayer, check_head_dim, init_normal_, op_set,
    scale_residual_init_,
)
from dslab.models.tensor_parallel_layers import (
    ParallelTokenEmbedding, check_tensor_parallel_group, tensor_parallel_layer, tensor_parallel_lm_loss,
)
from dslab.parallel.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec


class GPT2Embedding(nn.Module):
    """``dropout(wte(ids) + wpe(positions))``: ``[batch, seq]`` ids -> ``[batch, seq, hidden]``;
    with ``config.tp_size`` > 1 the token matrix's rows are split over ``tp_group``."""

    def __init__(self, config: GPT2Config, kernels: str = "dslab", tp_group=None):
        super().__init__()
        self.config = config
        self.ops = op_set(kernels)
        if config.tp_size == 1:
            self.wte = Embedding(config.padded_vocab_size, config.hidden, self.ops)
        else:
            self.wte = ParallelTokenEmbedding(config.padded_vocab_size, config.hidden, tp_group, False)
        self.wpe = PositionEmbedding(config.n_positions, config.hidden, self.ops)
        init_normal_(self, config.initializer_range)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[1] > self.config.n_positions:
            raise ValueError(f"input_ids must be [batch, seq <= {self.config.n_positions}], "
                             f"got shape {tuple(input_ids.shape)}")
        x = self.wte(input_ids) + self.wpe(input_ids.shape[1])
        return F.dropout(x, self.config.dropout, self.training)


def lm_head(embedding: GPT2Embedding, hidden: torch.Tensor):
    """The head's position: the final hidden states and the (tied) head matrix, for the loss."""
    return hidden, embedding.wte.weight


class GPT2Block(nn.Module):
    """One pre-LN transformer block reading only its own parameters (split over ``tp_group`` when
    ``config.tp_size`` > 1)."""

    def __init__(self, config: GPT2Config, kernels: str = "dslab", tp_group=None):
        super().__init__()
        ops = op_set(kernels)
        check_head_dim(ops, config.hidden, config.heads)
        args = (config.hidden, config.heads, config.intermediate, config.dropout, config.dropout,
                config.layer_norm_epsilon)
        options = dict(pre_ln=True, causal=True, gelu_approximate="tanh", ops=ops, chain_layer_norms=False)
        if config.tp_size == 1:
            self.layer = TransformerLayer(*args, **options)
        else:
            self.layer = tensor_parallel_layer(*args, **options, group=tp_group)
        init_normal_(self, config.initializer_range)
        scale_residual_init_([self.layer], config.initializer_range, total_layers=config.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class GPT2FinalNorm(nn.Module):
    def __init__(self, config: GPT2Config, kernels: str = "dslab"):
        super().__init__()
        self.norm = LayerNorm(config.hidden, config.layer_norm_epsilon, op_set(kernels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def _check_tensor_parallel(config: GPT2Config, tp_group) -> None:
    if config.sequence_parallel:
        raise ValueError("sequence_parallel with GPT-2's pipeline layers is not supported: the "
                         "stages exchange whole sequences; set sequence_parallel=False")
    check_tensor_parallel_group(config.tp_size, tp_group)


def gpt2_pipeline_layers(config: GPT2Config, kernels: str = "dslab", tp_group=None) -> list:
    """The layer list of the module docstring; with ``config.tp_size`` > 1 every layer is split
    over ``tp_group`` (a pipeline of tensor-parallel stages)."""
    config.validate()
    _check_tensor_parallel(config, tp_group)
    tied = ["wte.weight", "wpe.weight"]
    return [TiedLayerSpec("embed", GPT2Embedding, config, kernels, tp_group, tied_weight_attr=tied),
            *[LayerSpec(GPT2Block, config, kernels, tp_group) for _ in range(config.layers)],
            LayerSpec(GPT2FinalNorm, config, kernels),
            TiedLayerSpec("embed", GPT2Embedding, config, kernels, tp_group, forward_fn=lm_head,
                          tied_weight_attr=tied)]


def gpt2_pipeline_loss(config: GPT2Config, kernels: str = "dslab", tp_group=None):
    """``loss_fn(outputs, labels)`` for :func:`gpt2_pipeline_layers`: the model's mean
    next-token cross-entropy (position t scored against ``labels[:, t + 1]``) through its fused
    LM head (over the split vocabulary when ``config.tp_size`` > 1)."""
    ops = op_set(kernels)

    def loss_fn(outputs, labels: torch.Tensor) -> torch.Tensor:
        hidden, weight = outputs
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        if config.tp_size > 1:
            return tensor_parallel_lm_loss(hidden, weight, targets, config.vocab_size, tp_group, False,
                                           IGNORE_INDEX)
        return ops.linear_cross_entropy(hidden.reshape(-1, config.hidden), weight, targets.reshape(-1),
                                        config.vocab_size, IGNORE_INDEX)

    return loss_fn


def gpt2_pipeline_module(config: GPT2Config, kernels: str = "dslab", *, num_stages: int | None = None,
                         topology=None, grid=None, partition_method: str = "type:GPT2Block",
                         seed_layers: bool = True, base_seed: int = 1234,
                         activation_checkpoint_interval: int = 0) -> PipelineModule:
    """GPT-2 as a :class:`PipelineModule`; by default the blocks are balanced over the stages
    (the embeddings ride with the first, the final norm and the head with the last). With
    ``config.tp_size`` > 1 pass ``grid`` (a :class:`~dslab.parallel.topology.PipelineParallelGrid`
    of a ``PipeModelDataParallelTopology`` with that many ``model`` ranks): each stage's layers
    are split over its tensor-parallel group."""
    tp_group = None
    if config.tp_size > 1:
        if grid is None:
            raise ValueError(f"tp_size={config.tp_size} needs grid= (a PipelineParallelGrid with a model axis)")
        tp_group = grid.get_model_parallel_group()
        if grid.get_model_parallel_world_size() != config.tp_size:
            raise ValueError(f"tp_size={config.tp_size} but the grid's model axis has "
                             f"{grid.get_model_parallel_world_size()} ranks")
    return PipelineModule(gpt2_pipeline_layers(config, kernels, tp_group), num_stages=num_stages,
                          topology=topology, grid=grid, loss_fn=gpt2_pipeline_loss(config, kernels, tp_group),
                          partition_method=partition_method, seed_layers=seed_layers, base_seed=base_seed,
                          activation_checkpoint_interval=activation_checkpoint_interval)


def load_dense_state_dict(module: PipelineModule, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a :class:`~dslab.models.gpt2.GPT2LMHeadModel` state dict into the layers this stage
    holds (the embedding into each stage's tied copy)."""
    layers = sum(1 for spec in module.layer_specs if isinstance(spec, LayerSpec) and spec.typename is GPT2Block)
    mine = module.state_dict()
    out = {}
    for name in mine:
        if name.startswith("tied_modules.embed."):
            source = name.removeprefix("tied_modules.embed.")
        else:
            index, rest = name.split(".", 1)
            index = int(index)
            if 1 <= index <= layers:
                source = f"layers.{index - 1}." + rest.removeprefix("layer.")
            elif index == layers + 1:
                source = "final_norm." + rest.removeprefix("norm.")
            else:
                raise ValueError(f"pipeline parameter {name!r} has no place in a GPT-2 state dict")
        if source not in state_dict:
            raise ValueError(f"the dense state dict has no {source!r} (for pipeline parameter {name!r})")
        out[name] = state_dict[source]
    module.load_state_dict(out)
