"""Llama-family causal language model (Llama 2/3, and the layout Mistral and Qwen2 share) as a plain
``nn.Module`` on dslab's op sets (:mod:`dslab.models.ops` for the embedding and the fused LM-head
loss, :mod:`dslab.models.llama_ops` for RMSNorm, SwiGLU, rotary positions and grouped-query
attention).

The block (pre-norm, no biases)::

    y = RMSNorm1(x);  x = x + Wo attention(rope(q), rope(k), v)     q, k, v = y Wqkv (Hq, Hkv, Hkv heads)
    y = RMSNorm2(x);  x = x + Wdown swiglu(y Wgate_up)               swiglu(a) = silu(a[:, :I]) * a[:, I:]

then a final RMSNorm and the LM head (tied to the token embeddings when
``tie_word_embeddings``, Llama 3.2's 1B and 3B, else a matrix of its own).

Layouts: ``qkv`` is one ``[(Hq + 2 Hkv) * head_dim, hidden]`` projection, rows q (head by head),
then k, then v, so that one matmul makes all three; ``gate_up`` is ``[2 * intermediate, hidden]``,
the gate's rows first. transformers' separate ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` are stacked on the way in and split on the way out
(:func:`dslab.models.hf_mapping.llama_from_hf`, :func:`~dslab.models.hf_mapping.llama_to_hf`).

The rotary tables (``rope_theta``, and transformers' ``rope_scaling``: default, linear, Llama 3)
are :class:`dslab.models.llama_ops.RotaryTables`, one per model, shared by its layers. The
residual add before each norm is the norm's (``rms_norm(x, w, eps, residual=)``), and, as in
GPT-2, a layer's last add computes the next layer's first norm (``chain_layer_norms``,
:func:`dslab.models.ops.run_layer_stack`), so a block is five matmuls, attention, two norms with
their adds, rope and SwiGLU. The layer stack runs through CUDA graphs as GPT-2's does
(:class:`dslab.models.graphs.CudaGraphLayers`) and in activation-checkpoint segments with
``checkpoint_layers``.

The loss is next-token cross-entropy over the positions with a next token (GPT-2's definition,
:mod:`dslab.models.gpt2`), through the op set's ``linear_cross_entropy`` with the head's padded
rows (``vocab_pad_multiple``) excluded from the softmax.

Sequence parallelism (DeepSpeed-Ulysses; ``LlamaConfig.sequence_parallel_size`` > 1,
``LlamaForCausalLM(config, kernels, sp_group)``): every rank of the group is handed the whole
batch and keeps its contiguous chunk of each sequence (rank r: positions ``[r s/p, (r+1) s/p)``,
rotated at those positions); attention runs through
:class:`dslab.parallel.sequence.DistributedAttention`, which trades the sequence split for a
head split around it (all-to-alls through :mod:`dslab.comm`). The targets are shifted on the whole
sequence before the split, so the last position of a chunk is scored against the next chunk's
first token, and the loss is the mean over the whole sequence's targets: each rank's sum of its
targets' losses, all-reduced, over the all-reduced count. Every rank returns that loss; a rank's
parameter gradients are then its chunk's share, which summed over the group are the unsplit
model's (the data-parallel reduction over a group that contains the sequence ranks does it). Every
chunk must hold at least one target (a chunk of ignored labels only makes the loss NaN). Without
labels, ``forward`` returns this rank's chunk of the logits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab import comm
from dslab.models import hf_mapping
from dslab.models.graphs import CudaGraphLayers
from dslab.models.llama_ops import LlamaOps, RotaryTables, llama_op_set
from dslab.models.ops import IGNORE_INDEX, Embedding, OpSet, init_normal_, op_set
from dslab.models.tensor_parallel_layers import check_group_size
from dslab.models.weight_cast import Linear, weight
from dslab.parallel.sequence import DistributedAttention, sequence_mean_loss, split_sequence

ROPE_TYPES = ("default", "linear", "llama3")


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value > 0


@dataclass
class LlamaConfig:
    """A Llama-family model's shape (defaults: Llama 2 7B's). ``kv_heads`` None means ``heads``
    (multi-head attention); ``head_dim`` None means ``hidden // heads``. ``rope_scaling`` is
    transformers' dict (``rope_type`` default, linear or llama3 with their keys) or None.

    ``chain_layer_norms``, ``checkpoint_layers`` and ``vocab_pad_multiple`` mean what they mean for
    :class:`dslab.models.gpt2.GPT2Config`."""

    vocab_size: int = 32000
    max_positions: int = 4096
    hidden: int = 4096
    intermediate: int = 11008
    layers: int = 32
    heads: int = 32
    kv_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    vocab_pad_multiple: int = 1
    chain_layer_norms: bool = True
    checkpoint_layers: int = 0
    sequence_parallel_size: int = 1
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.head_dim is None and _positive_int(self.heads) and _positive_int(self.hidden):
            self.head_dim = self.hidden // self.heads
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for key in ("vocab_size", "max_positions", "hidden", "intermediate", "layers", "heads", "kv_heads",
                    "head_dim", "vocab_pad_multiple", "sequence_parallel_size"):
            value = getattr(self, key)
            if not _positive_int(value):
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads} (grouped-query attention "
                             f"gives each key/value head the same number of query heads)")
        if self.heads % self.sequence_parallel_size:
            raise ValueError(f"heads={self.heads} does not divide by sequence_parallel_size="
                             f"{self.sequence_parallel_size}: each rank attends with whole heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary positions rotate pairs)")
        if not self.rms_norm_eps >= 0.0:
            raise ValueError(f"rms_norm_eps must be >= 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ValueError(f"rope_scaling must be a dict or None, got {self.rope_scaling!r}")
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"rope_scaling rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if not self.initializer_range > 0.0:
            raise ValueError(f"initializer_range must be > 0, got {self.initializer_range!r}")
        for key in ("tie_word_embeddings", "chain_layer_norms"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be a bool, got {getattr(self, key)!r}")
        if isinstance(self.checkpoint_layers, bool) or not isinstance(self.checkpoint_layers, int) \
                or self.checkpoint_layers < 0:
            raise ValueError(f"checkpoint_layers must be an int >= 0, got {self.checkpoint_layers!r}")

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding (and head) matrix: ``vocab_size`` rounded up to ``vocab_pad_multiple``."""
        return math.ceil(self.vocab_size / self.vocab_pad_multiple) * self.vocab_pad_multiple

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @classmethod
    def from_hf(cls, hf_config, **overrides) -> LlamaConfig:
        """The config of a ``transformers.LlamaConfig`` (SiLU MLP, no attention or MLP biases)."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r}: only silu (SwiGLU) is supported")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(hf_config, flag, False):
                raise ValueError(f"{flag}=True: dslab's Llama has no biases")
        rope_scaling = getattr(hf_config, "rope_scaling", None)
        rope_theta = getattr(hf_config, "rope_theta", None)
        parameters = getattr(hf_config, "rope_parameters", None)
        if isinstance(parameters, dict):  # transformers >= 5 keeps theta and scaling together
            rope_theta = parameters.get("rope_theta", rope_theta)
            kind = parameters.get("rope_type", "default")
            rope_scaling = None if kind == "default" else {k: v for k, v in parameters.items() if k != "rope_theta"}
        fields = dict(
            vocab_size=hf_config.vocab_size, max_positions=hf_config.max_position_embeddings,
            hidden=hf_config.hidden_size, intermediate=hf_config.intermediate_size,
            layers=hf_config.num_hidden_layers, heads=hf_config.num_attention_heads,
            kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
            rms_norm_eps=hf_config.rms_norm_eps, rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            initializer_range=hf_config.initializer_range,
        )
        return cls(**{**fields, **overrides})

    def hf_kwargs(self) -> dict:
        """Keyword arguments of the ``transformers.LlamaConfig`` of this shape."""
        kwargs = dict(
            vocab_size=self.vocab_size, max_position_embeddings=self.max_positions, hidden_size=self.hidden,
            intermediate_size=self.intermediate, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range, hidden_act="silu", attention_bias=False, mlp_bias=False,
        )
        if self.rope_scaling is not None:
            kwargs["rope_scaling"] = dict(self.rope_scaling)
        return kwargs


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}


def llama3_1b(**overrides) -> LlamaConfig:
    """Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 heads over 8 key/value heads (head dim 64),
    SwiGLU width 8192, vocab 128256, tied head: 1,235,814,400 parameters."""
    return dataclasses.replace(LlamaConfig(
        vocab_size=128256, max_positions=131072, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
        head_dim=64, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_SCALING), tie_word_embeddings=True,
    ), **overrides)


def llama3_3b(**overrides) -> LlamaConfig:
    """Llama-3.2-3B's shape: 28 layers, hidden 3072, 24 heads over 8 key/value heads (head dim 128),
    SwiGLU width 8192, vocab 128256, tied head: 3,212,749,824 parameters."""
    return dataclasses.replace(LlamaConfig(
        vocab_size=128256, max_positions=131072, hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8,
        head_dim=128, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_SCALING), tie_word_embeddings=True,
    ), **overrides)


def llama3_8b(**overrides) -> LlamaConfig:
    """Llama-3.1-8B's shape: 32 layers, hidden 4096, 32 heads over 8 key/value heads, SwiGLU width
    14336, vocab 128256, untied head: 8,030,261,248 parameters."""
    return dataclasses.replace(LlamaConfig(
        vocab_size=128256, max_positions=131072, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
        head_dim=128, rope_theta=500000.0, rope_scaling={**_LLAMA3_SCALING, "factor": 8.0},
    ), **overrides)


def llama_tiny(**overrides) -> LlamaConfig:
    """2 layers, hidden 128, 4 query heads over 2 key/value heads (head dim 32), SwiGLU width 352,
    vocab 1000, Llama 3 rope scaling, tied head: for CPU tests and the suite's ``tiny`` scale."""
    return dataclasses.replace(LlamaConfig(
        vocab_size=1000, max_positions=256, hidden=128, intermediate=352, layers=2, heads=4, kv_heads=2, head_dim=32,
        rope_theta=500000.0, rope_scaling={**_LLAMA3_SCALING, "original_max_position_embeddings": 64},
        tie_word_embeddings=True,
    ), **overrides)


class RMSNorm(nn.Module):
    """RMSNorm with a weight (initialised to ones), through the op set: ``forward(x)``, or with
    ``residual`` the pair ``(norm(x + residual), x + residual)``; :meth:`fork` is ``(norm(x), x)``."""

    def __init__(self, hidden: int, eps: float, ops: LlamaOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                fork: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            return self.ops.rms_norm(x, self.weight, self.eps, residual)
        if fork:
            return self.ops.rms_norm_fork(x, self.weight, self.eps)
        return self.ops.rms_norm(x, self.weight, self.eps)

    def fork(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(x, fork=True)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary positions: ``Wo attention(rope(q), rope(k), v)``."""

    def __init__(self, config: LlamaConfig, ops: LlamaOps, rotary: RotaryTables, sp_group=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.ops = ops
        self.rotary = rotary
        self.qkv = Linear(config.hidden, config.qkv_rows, bias=False)
        self.o_proj = Linear(config.heads * config.head_dim, config.hidden, bias=False)
        self.sp_size = config.sequence_parallel_size
        # batch-first chunks [b, s/p, h, d] in, the whole sequence of h/p heads to the kernel
        self.sequence_attention = (DistributedAttention(self._local_attention, sp_group, scatter_idx=2, gather_idx=1)
                                   if self.sp_size > 1 else None)
        self.sp_rank = comm.get_rank(sp_group) if self.sp_size > 1 else 0

    def _local_attention(self, q, k, v, key_padding_mask=None):
        """Causal attention of ``[b, s, h, d]`` q, k, v -> ``[b, s, h, d]``."""
        context = self.ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                     key_padding_mask=key_padding_mask)
        return context.transpose(1, 2)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        cos, sin = self.rotary.tables(seq, x.device, start=self.sp_rank * seq)
        q, k = self.ops.rope(q, k, cos, sin)
        if self.sequence_attention is None:
            context = self._local_attention(q, k, v, key_padding_mask)
        else:
            if key_padding_mask is not None:
                raise ValueError("key_padding_mask is not supported with sequence_parallel_size > 1")
            context = self.sequence_attention(q, k, v)
        return self.o_proj(context.reshape(batch, seq, self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    """``Wdown swiglu(x Wgate_up)``."""

    def __init__(self, config: LlamaConfig, ops: LlamaOps):
        super().__init__()
        self.ops = ops
        self.gate_up = Linear(config.hidden, 2 * config.intermediate, bias=False)
        self.down = Linear(config.intermediate, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.ops.swiglu(self.gate_up(x)))


class LlamaLayer(nn.Module):
    """One pre-norm block (module docstring), called as :class:`dslab.models.ops.TransformerLayer`
    is: ``layer(x, key_padding_mask, normed=None, next_norm=None)``, so that
    :func:`dslab.models.ops.run_layer_stack` chains a layer's last residual add into the next
    layer's first norm (``CHAINS_NORMS``)."""

    CHAINS_NORMS = True
    pre_ln = True

    def __init__(self, config: LlamaConfig, ops: LlamaOps, rotary: RotaryTables, sp_group=None):
        super().__init__()
        self.chain_layer_norms = config.chain_layer_norms
        self.attention_norm = RMSNorm(config.hidden, config.rms_norm_eps, ops)
        self.attention = LlamaAttention(config, ops, rotary, sp_group)
        self.mlp_norm = RMSNorm(config.hidden, config.rms_norm_eps, ops)
        self.mlp = LlamaMLP(config, ops)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                normed: torch.Tensor | None = None,
                next_norm: RMSNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if normed is None:
            normed, x = self.attention_norm.fork(x)
        y, x = self.mlp_norm(self.attention(normed, key_padding_mask), residual=x)
        out = self.mlp(y)
        if next_norm is None:
            return x + out
        return next_norm(out, residual=x)


class LlamaForCausalLM(CudaGraphLayers, nn.Module):
    """The Llama language model with its head. ``forward(input_ids, labels=None)`` returns the fp32
    mean next-token loss when ``labels`` is given, else the logits ``[batch, seq, vocab_size]``.
    ``kernels`` picks the op sets ("dslab" or "torch"); ``sp_group``, with
    ``config.sequence_parallel_size`` > 1, the process group of that many ranks the sequence is
    split over (None: the default group, which must then have that many ranks; module docstring)."""

    def __init__(self, config: LlamaConfig, kernels: str = "dslab", sp_group=None):
        super().__init__()
        config.validate()
        check_sequence_parallel_group(config.sequence_parallel_size, sp_group)
        self.sp_group = sp_group
        self.ops: OpSet = op_set(kernels)
        self.llama_ops = llama_op_set(kernels)
        if self.ops.head_dims is not None and config.head_dim not in self.ops.head_dims:
            raise ValueError(f"head_dim={config.head_dim} is not one kernels={kernels!r} supports; supported head "
                             f"dims: {self.ops.head_dims}")
        self.config = config
        self.kernels = kernels
        self.rotary = RotaryTables(config.head_dim, config.rope_theta, config.rope_scaling)
        self.embed = Embedding(config.padded_vocab_size, config.hidden, self.ops)
        self.layers = nn.ModuleList(LlamaLayer(config, self.llama_ops, self.rotary, sp_group)
                                    for _ in range(config.layers))
        self.final_norm = RMSNorm(config.hidden, config.rms_norm_eps, self.llama_ops)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden, config.padded_vocab_size,
                                                                      bias=False)
        init_normal_(self, config.initializer_range)

    def _head(self, tie) -> torch.Tensor:
        if self.lm_head is not None:
            return weight(self.lm_head.weight)
        return self.embed.weight if tie is None else tie.head_weight()

    def _loss_head(self) -> torch.Tensor:
        # the fused loss reads a tied head through its tie, so it gets the embedding itself
        return self.embed.weight if self.lm_head is None else weight(self.lm_head.weight)

    def hidden_states(self, input_ids: torch.Tensor, tie=None) -> torch.Tensor:
        """``[batch, seq, hidden]`` after the final norm."""
        return self.final_norm(self.run_layers(self.embed(input_ids, tie)))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.config.max_positions:
            raise ValueError(f"input_ids has seq {input_ids.shape[1]} > max_positions={self.config.max_positions}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        vocab = self.config.vocab_size
        targets = None if labels is None else F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        if self.config.sequence_parallel_size > 1:
            input_ids, targets = self._sequence_chunk(input_ids, targets)
        tie = self.ops.embedding_tie(self.embed.weight) if self.lm_head is None else None
        hidden = self.hidden_states(input_ids, tie)
        if labels is None:
            logits = F.linear(hidden, self._head(tie))
            return logits[..., :vocab] if logits.shape[-1] != vocab else logits
        loss = self.ops.linear_cross_entropy(hidden.reshape(-1, self.config.hidden), self._loss_head(),
                                             targets.reshape(-1), vocab, IGNORE_INDEX, tie=tie)
        if self.config.sequence_parallel_size == 1:
            return loss
        return sequence_mean_loss(loss, targets, self.sp_group, IGNORE_INDEX)  # the whole sequence's mean

    def _sequence_chunk(self, input_ids: torch.Tensor, targets: torch.Tensor | None):
        """This rank's contiguous chunk of the ids and of the shifted targets."""
        size = self.config.sequence_parallel_size
        if input_ids.shape[1] % size:
            raise ValueError(f"input_ids has seq {input_ids.shape[1]}, which sequence_parallel_size={size} splits "
                             f"over its ranks: it must divide by {size}")
        return split_sequence((input_ids, targets), comm.get_rank(self.sp_group), size)

    @classmethod
    def from_hf_state_dict(cls, state_dict: dict, config: LlamaConfig, kernels: str = "dslab") -> LlamaForCausalLM:
        """A model with ``config`` and the weights of a transformers ``LlamaForCausalLM`` state dict."""
        model = cls(config, kernels)
        model.load_state_dict(hf_mapping.llama_from_hf(state_dict, config))
        return model

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under transformers ``LlamaForCausalLM``'s keys."""
        return hf_mapping.llama_to_hf(self.state_dict(), self.config)


def check_sequence_parallel_group(sp_size: int, group) -> None:
    """ValueError naming ``sequence_parallel_size`` unless ``group`` (None: the default group) has
    that many ranks (:func:`dslab.models.tensor_parallel_layers.check_group_size`)."""
    check_group_size(sp_size, group, "sequence_parallel_size", "sp_group")


def llama_parameter_count(config: LlamaConfig) -> int:
    """Parameters of the unpadded model (the figure model cards quote)."""
    per_layer = (config.hidden * config.qkv_rows + config.heads * config.head_dim * config.hidden
                 + 3 * config.hidden * config.intermediate + 2 * config.hidden)
    head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden
    return config.vocab_size * config.hidden + config.layers * per_layer + config.hidden + head
