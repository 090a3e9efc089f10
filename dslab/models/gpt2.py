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

Tensor parallelism (``GPT2Config.tp_size`` > 1, ``GPT2LMHeadModel(config, kernels, tp_group)``,
Megatron-LM's layout; :mod:`dslab.models.tensor_parallel_layers`): each rank holds ``heads/tp``
attention heads and ``4 * hidden/tp`` MLP columns of every layer and ``padded_vocab_size/tp``
rows of ``wte``; the tied LM head computes the logits of its rows only and the loss is
:func:`dslab.parallel.vocab_parallel.vocab_parallel_cross_entropy` of them (same definition as
above). Every rank of the group gets the same loss and must be fed the same batch (and seeded
alike). ``sequence_parallel`` also splits the stream between the layers' projections along the
sequence (``seq`` must divide by ``tp_size``); the replicated parameters' gradients are then
partial sums, which :func:`dslab.parallel.tensor_parallel.allreduce_sequence_parallel_grads` adds
up. The dense form converts to and from the split one: :meth:`GPT2LMHeadModel.dense_state_dict`,
:meth:`GPT2LMHeadModel.load_dense_state_dict` and, offline,
:func:`~dslab.models.tensor_parallel_layers.gpt2_tp_state_dict` and
:func:`~dslab.models.tensor_parallel_layers.gpt2_dense_state_dict`.

Sequence parallelism (DeepSpeed-Ulysses; ``GPT2Config.sequence_parallel_size`` > 1,
``GPT2LMHeadModel(config, kernels, sp_group=...)``), as dslab's Llama has it: every rank of the
group is handed the whole batch and keeps its contiguous chunk of each sequence (rank r: positions
``[r s/p, (r+1) s/p)``, which read the learned position rows of those positions); attention runs
through :class:`dslab.parallel.sequence.DistributedAttention`
(:mod:`dslab.models.sequence_parallel_layers`). The targets are shifted on the whole sequence
before the split, and the loss is the whole sequence's mean
(:func:`dslab.parallel.sequence.sequence_mean_loss`); every rank returns it, and a rank's
gradients are its chunk's share, which summed over the group are the unsplit model's. Without
labels ``forward`` returns this rank's chunk of the logits. ``heads`` must divide by the size;
tensor parallelism is not combined with it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab import comm
from dslab.models import hf_mapping
from dslab.models.graphs import CudaGraphLayers
from dslab.models.ops import (
    IGNORE_INDEX, Embedding, LayerNorm, PositionEmbedding, TransformerLayer, check_head_dim, init_normal_, op_set,
    scale_residual_init_,
)
from dslab.models.sequence_parallel_layers import sequence_parallel_layer
from dslab.models.tensor_parallel_layers import (
    ParallelTokenEmbedding, check_group_size, check_tensor_parallel_group, gpt2_tp_state_dict,
    mark_sequence_parallel_replicas, sequence_shard, tensor_parallel_layer, tensor_parallel_lm_logits,
    tensor_parallel_lm_loss,
)
from dslab.parallel.sequence import sequence_mean_loss, split_sequence
from dslab.parallel.tensor_parallel import gather_tensor_parallel_state_dict
from dslab.parallel.tensor_parallel_regions import tensor_parallel_rank


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
    backward; 0 (the default) keeps them all.

    ``tp_size``: the ranks of the tensor-parallel group the model is split over (1: dense); it
    must divide ``heads``, the MLP width and ``padded_vocab_size`` (pad the vocabulary with
    ``vocab_pad_multiple``). ``sequence_parallel``: with ``tp_size`` > 1, the stream between the
    projections split along the sequence too.

    ``sequence_parallel_size``: the ranks of the DeepSpeed-Ulysses group each sequence is split
    over (1: none; module docstring); it must divide ``heads``."""

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
    tp_size: int = 1
    sequence_parallel: bool = False
    sequence_parallel_size: int = 1

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for key in ("vocab_size", "n_positions", "hidden", "layers", "heads", "vocab_pad_multiple",
                    "sequence_parallel_size"):
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
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size <= 0:
            raise ValueError(f"tp_size must be a positive int, got {self.tp_size!r}")
        if self.heads % self.tp_size:
            raise ValueError(f"heads={self.heads} does not divide by tp_size={self.tp_size}: each rank holds "
                             "whole attention heads")
        if self.intermediate % self.tp_size:
            raise ValueError(f"the MLP width 4 * hidden = {self.intermediate} does not divide by "
                             f"tp_size={self.tp_size}")
        if self.padded_vocab_size % self.tp_size:
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} (vocab_size={self.vocab_size}, "
                             f"vocab_pad_multiple={self.vocab_pad_multiple}) does not divide by "
                             f"tp_size={self.tp_size}: set vocab_pad_multiple to a multiple of tp_size")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError("sequence_parallel needs tp_size > 1")
        if self.heads % self.sequence_parallel_size:
            raise ValueError(f"heads={self.heads} does not divide by sequence_parallel_size="
                             f"{self.sequence_parallel_size}: each rank attends with whole heads")
        if self.sequence_parallel_size > 1 and self.tp_size > 1:
            raise ValueError(f"sequence_parallel_size={self.sequence_parallel_size} with tp_size={self.tp_size}: "
                             "Ulysses sequence parallelism is not combined with tensor parallelism; pick one")

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
    (:func:`dslab.models.ops.op_set`).

    ``tp_group``: with ``config.tp_size`` > 1, the process group of ``tp_size`` ranks the model is
    split over (None: the default group, which must then have ``tp_size`` ranks); see the module
    docstring. Ranks seeded alike build the slices of the dense model built from the same seed.

    ``sp_group``: with ``config.sequence_parallel_size`` > 1, the process group of that many ranks
    each sequence is split over (None: the default group, which must then have that many ranks;
    :func:`dslab.parallel.sequence.initialize_sequence_parallel` makes the ones the engine uses)."""

    def __init__(self, config: GPT2Config, kernels: str = "dslab", tp_group=None, sp_group=None):
        super().__init__()
        config.validate()
        self.ops = op_set(kernels)
        check_head_dim(self.ops, config.hidden, config.heads)
        check_tensor_parallel_group(config.tp_size, tp_group)
        check_group_size(config.sequence_parallel_size, sp_group, "sequence_parallel_size", "sp_group")
        self.config = config
        self.kernels = kernels
        self.tp_group = tp_group
        self.sp_group = sp_group
        self.sp_rank = comm.get_rank(sp_group) if config.sequence_parallel_size > 1 else 0
        if config.tp_size == 1:
            self.wte = Embedding(config.padded_vocab_size, config.hidden, self.ops)
        else:
            self.wte = ParallelTokenEmbedding(config.padded_vocab_size, config.hidden, tp_group,
                                              config.sequence_parallel)
        self.wpe = PositionEmbedding(config.n_positions, config.hidden, self.ops)
        self.layers = nn.ModuleList(self._layer() for _ in range(config.layers))
        self.final_norm = LayerNorm(config.hidden, config.layer_norm_epsilon, self.ops)
        init_normal_(self, config.initializer_range)
        scale_residual_init_(self.layers, config.initializer_range)
        if config.sequence_parallel:
            mark_sequence_parallel_replicas(self)

    def _layer(self) -> TransformerLayer:
        config = self.config
        args = (config.hidden, config.heads, config.intermediate, config.dropout, config.dropout,
                config.layer_norm_epsilon)
        options = dict(pre_ln=True, causal=True, gelu_approximate="tanh", ops=self.ops,
                       chain_layer_norms=config.chain_layer_norms)
        if config.sequence_parallel_size > 1:
            return sequence_parallel_layer(*args, **options, sp_group=self.sp_group)
        if config.tp_size == 1:
            return TransformerLayer(*args, **options)
        return tensor_parallel_layer(*args, **options, group=self.tp_group, sequence_parallel=config.sequence_parallel)

    @property
    def lm_head_weight(self) -> nn.Parameter:
        """The LM head ``[padded_vocab, hidden]``: the token embeddings (tied); with tensor
        parallelism this rank's rows ``[padded_vocab/tp, hidden]``."""
        return self.wte.weight

    def hidden_states(self, input_ids: torch.Tensor, tie=None) -> torch.Tensor:
        """``[batch, seq, hidden]`` after the final LayerNorm (with sequence parallelism this
        rank's ``[batch, seq/tp, hidden]``; with ``sequence_parallel_size`` > 1 ``input_ids`` is
        this rank's chunk, at positions from ``sp_rank * seq``). ``tie``: from
        ``ops.embedding_tie(self.wte.weight)``, for the head that reads the result."""
        if self.config.sequence_parallel_size > 1:
            chunk = input_ids.shape[1]
            start = self.sp_rank * chunk
            x = self.wte(input_ids, tie) + self.wpe(start + chunk)[start:]
        elif self.config.sequence_parallel:
            positions = sequence_shard(self.wpe(input_ids.shape[1]), self.tp_group)
            x = self.wte(input_ids, tie) + positions
        else:
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
        if self.config.tp_size > 1:
            return self._tensor_parallel_forward(input_ids, labels)
        targets = None if labels is None else F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        if self.config.sequence_parallel_size > 1:
            input_ids, targets = self._sequence_chunk(input_ids, targets)
        tie = self.ops.embedding_tie(self.lm_head_weight)
        hidden = self.hidden_states(input_ids, tie)
        if labels is None:
            logits = F.linear(hidden, self.lm_head_weight if tie is None else tie.head_weight())
            return logits[..., :vocab] if logits.shape[-1] != vocab else logits
        loss = self.ops.linear_cross_entropy(hidden.reshape(-1, self.config.hidden), self.lm_head_weight,
                                             targets.reshape(-1), vocab, IGNORE_INDEX, tie=tie)
        if self.config.sequence_parallel_size == 1:
            return loss
        return sequence_mean_loss(loss, targets, self.sp_group, IGNORE_INDEX)

    def _sequence_chunk(self, input_ids: torch.Tensor, targets: torch.Tensor | None):
        """This rank's contiguous chunk of the ids and of the (whole-sequence shifted) targets."""
        size = self.config.sequence_parallel_size
        if input_ids.shape[1] % size:
            raise ValueError(f"input_ids has seq {input_ids.shape[1]}, which sequence_parallel_size={size} splits "
                             f"over its ranks: it must divide by {size}")
        return split_sequence((input_ids, targets), self.sp_rank, size)

    def _tensor_parallel_forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward` split over the tensor-parallel group: the head's logits of this rank's
        vocabulary rows, and the vocabulary-parallel loss (or the logits all-gathered)."""
        config = self.config
        if config.sequence_parallel and input_ids.shape[1] % config.tp_size:
            raise ValueError(f"input_ids has seq {input_ids.shape[1]}, which sequence_parallel splits over "
                             f"tp_size={config.tp_size} ranks: it must divide by {config.tp_size}")
        hidden = self.hidden_states(input_ids)
        if labels is None:
            return tensor_parallel_lm_logits(hidden, self.lm_head_weight, config.vocab_size, self.tp_group,
                                             config.sequence_parallel)
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return tensor_parallel_lm_loss(hidden, self.lm_head_weight, targets, config.vocab_size, self.tp_group,
                                       config.sequence_parallel, IGNORE_INDEX)

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense model's state dict: :meth:`state_dict` when ``tp_size`` is 1; with tensor
        parallelism every shard gathered whole, on every rank (a collective: every rank of
        ``tp_group`` calls it)."""
        if self.config.tp_size == 1:
            return self.state_dict()
        return gather_tensor_parallel_state_dict(self, self.tp_group)

    def load_dense_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load a dense GPT-2 state dict, of which this rank keeps its shards
        (:func:`~dslab.models.tensor_parallel_layers.gpt2_tp_state_dict`)."""
        if self.config.tp_size > 1:
            state_dict = gpt2_tp_state_dict(state_dict, tensor_parallel_rank(self.tp_group), self.config.tp_size,
                                            self.config)
        return self.load_state_dict(state_dict, strict=strict)

    def enable_cuda_graphs(self, enabled: bool = True, segments: int = 1) -> None:
        """As :meth:`CudaGraphLayers.enable_cuda_graphs`. With tensor or sequence parallelism the
        graphs capture the layers' collectives (:mod:`dslab.models.graphs`); refused with tensor
        parallelism and dropout, whose attention dropout switches to the rank's own generator
        stream (:mod:`dslab.parallel.random`), which no capture may do."""
        if enabled and self.config.tp_size > 1 and self.config.dropout > 0:
            raise ValueError(f"'cuda_graphs.enabled' with tp_size={self.config.tp_size} and dropout="
                             f"{self.config.dropout}: tensor-parallel attention dropout switches generator "
                             "states, which a CUDA graph capture cannot; set dropout 0 or turn graphs off")
        super().enable_cuda_graphs(enabled, segments)

    @classmethod
    def from_hf_state_dict(cls, state_dict: dict, config: GPT2Config, kernels: str = "dslab",
                           tp_group=None, sp_group=None) -> GPT2LMHeadModel:
        """A model with ``config`` and the weights of a HuggingFace ``GPT2LMHeadModel`` state dict
        (with ``config.tp_size`` > 1, this rank's shards of them)."""
        model = cls(config, kernels, tp_group=tp_group, sp_group=sp_group)
        model.load_dense_state_dict(hf_mapping.gpt2_from_hf(state_dict, config.layers, config.padded_vocab_size))
        return model

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under HuggingFace ``GPT2LMHeadModel``'s keys (with tensor
        parallelism gathered whole: a collective over ``tp_group``)."""
        return hf_mapping.gpt2_to_hf(self.dense_state_dict(), self.config.layers, self.config.vocab_size)
