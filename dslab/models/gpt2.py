"""GPT-2 language model (Radford et al. 2019) as a plain ``nn.Module`` on dslab's op set
(:mod:`dslab.models.ops`): learned positions, pre-LN blocks with causal attention and tanh-GELU
MLPs, a final LayerNorm and an LM head tied to the token embeddings.

Shapes: ``input_ids`` and ``labels`` ``[batch, seq]`` (int64, seq <= ``n_positions``); logits
``[batch, seq, vocab_size]``.

Vocabulary padding (``GPT2Config.vocab_pad_multiple``): with 64, the embedding matrix has 50304
rows instead of 50257, so the LM head's ``[tokens, hidden] x [hidden, vocab]`` matmul gets
tile-friendly shapes (nanoGPT, llm.c). The logits are the first ``vocab_size`` columns of the
padded product, so the padding rows never reach the softmax: the model computes exactly the
unpadded function and the extra rows receive zero gradient. Without labels ``forward`` returns
them as a strided view of the padded product (no copy).

The loss is next-token cross-entropy averaged over the positions with a next token: position ``t``
is scored against ``labels[:, t + 1]``, the last position against nothing (-100, as is any -100
label). Shifting the labels instead of the logits keeps the hidden states contiguous. The LM head
and the loss are one op, ``ops.linear_cross_entropy`` (:mod:`dslab.models.ops`), given the hidden
states, the padded head and the vocabulary size: the torch set computes the padded logits, slices
them and calls ``F.cross_entropy`` on their fp32 upcast (its backward writes the sliced gradient
into a zero-filled padded buffer). The dslab set's op, on CUDA in bf16 or fp16 (under autocast,
or in a half-precision model), overwrites the padded logits with their gradient (zero over the
padding columns) in its forward, so that its backward is the head's two matmuls; in fp32 it
hands the strided slice to ``softmax_cross_entropy`` (:mod:`dslab.kernels.loss.linear_cross_entropy`).

Embeddings: ``wte`` and ``wpe`` go through the op set's ``embedding`` and ``position_embedding``
(:mod:`dslab.models.ops`). With the dslab set, each forward that needs gradients arms a tie
between ``wte`` and the LM head (``ops.embedding_tie``): the token lookup's backward then writes
``wte``'s fp32 gradient once, the head's included (:mod:`dslab.kernels.embedding.embedding`), and the
positions are ``wpe.weight[:seq]``, whose gradient is a sum over the batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.models import hf_mapping
from dslab.models.graphs import CudaGraphLayers
from dslab.models.ops import (
    IGNORE_INDEX, Embedding, LayerNorm, PositionEmbedding, TransformerLayer, check_head_dim, init_normal_, op_set,
    scale_residual_init_,
)


@dataclass
class GPT2Config:
    """GPT-2's shape and regularisation (defaults: the 124M model). ``dropout`` is used for the
    embeddings, the attention probabilities and the residual branches alike.

    ``chain_layer_norms``: True fuses each block's last residual add with the next block's first
    LayerNorm (one ``dropout_add_layer_norm``, so block i reads block i+1's norm parameters);
    False makes each block read only its own parameters (the next block normalizes its input
    itself), which FSDP2's per-block ``fully_shard`` and pipeline stages need. The loss is the
    same either way (:func:`dslab.models.ops.run_layer_stack`).

    ``checkpoint_layers``: in training, the layer stack in segments of that many layers, each an
    activation checkpoint (:mod:`dslab.models.checkpoint`): its activations recomputed in the
    backward; 0 (the default) keeps them all."""

    vocab_size: int = 50257
    n_positions: int = 1024
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    dropout: float = 0.1
    layer_norm_epsilon: float = 1e-5
    vocab_pad_multiple: int = 1
    initializer_range: float = 0.02
    chain_layer_norms: bool = True
    checkpoint_layers: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for key in ("vocab_size", "n_positions", "hidden", "layers", "heads", "vocab_pad_multiple"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"heads={self.heads} must divide hidden={self.hidden}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not self.layer_norm_epsilon >= 0.0:
            raise ValueError(f"layer_norm_epsilon must be >= 0, got {self.layer_norm_epsilon!r}")
        if not self.initializer_range > 0.0:
            raise ValueError(f"initializer_range must be > 0, got {self.initializer_range!r}")
        if not isinstance(self.chain_layer_norms, bool):
            raise ValueError(f"chain_layer_norms must be a bool, got {self.chain_layer_norms!r}")
        if isinstance(self.checkpoint_layers, bool) or not isinstance(self.checkpoint_layers, int) \
                or self.checkpoint_layers < 0:
            raise ValueError(f"checkpoint_layers must be an int >= 0, got {self.checkpoint_layers!r}")

    @property
    def intermediate(self) -> int:
        """The MLP's inner width, 4 * hidden."""
        return 4 * self.hidden

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding matrix: ``vocab_size`` rounded up to ``vocab_pad_multiple``."""
        return math.ceil(self.vocab_size / self.vocab_pad_multiple) * self.vocab_pad_multiple

    @classmethod
    def from_hf(cls, hf_config, **overrides) -> GPT2Config:
        """The config of a ``transformers.GPT2Config`` (tanh GELU, 4x MLP, one dropout rate)."""
        if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"activation_function={hf_config.activation_function!r}: only tanh GELU is supported")
        if hf_config.n_inner not in (None, 4 * hf_config.n_embd):
            raise ValueError(f"n_inner={hf_config.n_inner}: only 4 * n_embd is supported")
        rates = {hf_config.resid_pdrop, hf_config.embd_pdrop, hf_config.attn_pdrop}
        if len(rates) != 1:
            raise ValueError(f"resid_pdrop, embd_pdrop and attn_pdrop must be equal, got {sorted(rates)}")
        fields = dict(
            vocab_size=hf_config.vocab_size, n_positions=hf_config.n_positions, hidden=hf_config.n_embd,
            layers=hf_config.n_layer, heads=hf_config.n_head, dropout=rates.pop(),
            layer_norm_epsilon=hf_config.layer_norm_epsilon, initializer_range=hf_config.initializer_range,
        )
        return cls(**{**fields, **overrides})


def gpt2_124m(**overrides) -> GPT2Config:
    """12 layers, hidden 768, 12 heads: 124,439,808 parameters (vocab 50257, tied head)."""
    return dataclasses.replace(GPT2Config(), **overrides)


def gpt2_355m(**overrides) -> GPT2Config:
    """24 layers, hidden 1024, 16 heads (GPT-2 medium): 354,823,168 parameters."""
    return dataclasses.replace(GPT2Config(hidden=1024, layers=24, heads=16), **overrides)


def gpt2_774m(**overrides) -> GPT2Config:
    """36 layers, hidden 1280, 20 heads (GPT-2 large): 774,030,080 parameters."""
    return dataclasses.replace(GPT2Config(hidden=1280, layers=36, heads=20), **overrides)


def gpt2_1558m(**overrides) -> GPT2Config:
    """48 layers, hidden 1600, 25 heads (GPT-2 XL): 1,557,611,200 parameters."""
    return dataclasses.replace(GPT2Config(hidden=1600, layers=48, heads=25), **overrides)


def gpt2_tiny(**overrides) -> GPT2Config:
    """2 layers, hidden 128, 4 heads (head dim 32, the smallest dslab's attention takes),
    vocab 1000, 128 positions: for CPU tests and the suite's ``tiny`` scale."""
    return dataclasses.replace(
        GPT2Config(vocab_size=1000, n_positions=128, hidden=128, layers=2, heads=4), **overrides
    )


class GPT2LMHeadModel(CudaGraphLayers, nn.Module):
    """GPT-2 with its tied LM head. ``forward(input_ids, labels=None)`` returns the fp32 mean
    next-token loss when ``labels`` is given, else the logits. ``kernels`` picks the op set
    (:func:`dslab.models.ops.op_set`)."""

    def __init__(self, config: GPT2Config, kernels: str = "dslab"):
        super().__init__()
        config.validate()
        self.ops = op_set(kernels)
        check_head_dim(self.ops, config.hidden, config.heads)
        self.config = config
        self.kernels = kernels
        self.wte = Embedding(config.padded_vocab_size, config.hidden, self.ops)
        self.wpe = PositionEmbedding(config.n_positions, config.hidden, self.ops)
        self.layers = nn.ModuleList(
            TransformerLayer(config.hidden, config.heads, config.intermediate, config.dropout, config.dropout,
                             config.layer_norm_epsilon, pre_ln=True, causal=True, gelu_approximate="tanh",
                             ops=self.ops, chain_layer_norms=config.chain_layer_norms)
            for _ in range(config.layers)
        )
        self.final_norm = LayerNorm(config.hidden, config.layer_norm_epsilon, self.ops)
        init_normal_(self, config.initializer_range)
        scale_residual_init_(self.layers, config.initializer_range)

    @property
    def lm_head_weight(self) -> nn.Parameter:
        """The LM head ``[padded_vocab, hidden]``: the token embeddings (tied)."""
        return self.wte.weight

    def hidden_states(self, input_ids: torch.Tensor, tie=None) -> torch.Tensor:
        """``[batch, seq, hidden]`` after the final LayerNorm. ``tie``: from
        ``ops.embedding_tie(self.wte.weight)``, for the head that reads the result."""
        x = self.wte(input_ids, tie) + self.wpe(input_ids.shape[1])
        return self.final_norm(self.run_layers(F.dropout(x, self.config.dropout, self.training)))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.config.n_positions:
            raise ValueError(f"input_ids has seq {input_ids.shape[1]} > n_positions={self.config.n_positions}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        vocab = self.config.vocab_size
        tie = self.ops.embedding_tie(self.lm_head_weight)
        hidden = self.hidden_states(input_ids, tie)
        if labels is None:
            logits = F.linear(hidden, self.lm_head_weight if tie is None else tie.head_weight())
            return logits[..., :vocab] if logits.shape[-1] != vocab else logits
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return self.ops.linear_cross_entropy(hidden.reshape(-1, self.config.hidden), self.lm_head_weight,
                                             targets.reshape(-1), vocab, IGNORE_INDEX, tie=tie)

    @classmethod
    def from_hf_state_dict(cls, state_dict: dict, config: GPT2Config, kernels: str = "dslab") -> GPT2LMHeadModel:
        """A model with ``config`` and the weights of a HuggingFace ``GPT2LMHeadModel`` state dict."""
        model = cls(config, kernels)
        model.load_state_dict(hf_mapping.gpt2_from_hf(state_dict, config.layers, config.padded_vocab_size))
        return model

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under HuggingFace ``GPT2LMHeadModel``'s keys."""
        return hf_mapping.gpt2_to_hf(self.state_dict(), self.config.layers, self.config.vocab_size)
