"""BERT for pretraining: masked-LM and next-sentence-prediction heads over a transformer encoder
(Devlin et al. 2019), as a plain ``nn.Module`` on dslab's op set (:mod:`dslab.models.ops`).

Shapes: ``input_ids``, ``token_type_ids``, ``attention_mask`` and ``masked_lm_labels`` are
``[batch, seq]`` (int64; the mask any integer or bool dtype, 1 = real token, 0 = padding, as in
HuggingFace); ``next_sentence_label`` is ``[batch]``. Hidden states are ``[batch, seq, hidden]``.

Parameters are laid out as in HuggingFace's ``BertForPreTraining`` except that each layer's
query/key/value projections are one ``[3 * hidden, hidden]`` matrix and the MLM decoder is the
word-embedding matrix itself (one ``Parameter``); :meth:`BertForPreTraining.from_hf_state_dict` and
:meth:`~BertForPreTraining.to_hf_state_dict` convert (:mod:`dslab.models.hf_mapping`).

Sparse MLM (``BertConfig.sparse_mlm``, on by default): with labels, the MLM head (transform,
LayerNorm and the ``hidden x vocab`` decoder) runs only on the rows whose label is not -100 — about
15% of the tokens in BERT pretraining — which saves ~85% of the head's flops and of the
``[tokens, vocab]`` logits memory. The loss is unchanged (ignored rows contribute nothing to
cross-entropy). NVIDIA's BERT pretraining code does the same.

Selecting those rows needs their number K on the host (it sizes the gathered tensor). Learning it
after the encoder, as ``nonzero`` does, makes the host wait for the whole encoder's forward and
then leaves the GPU idle while the host issues the head, the loss and the start of the backward
(~5 ms of a 43-60 ms BERT-large step on an H200). So on CUDA, ``forward`` queues the count of
labelled positions and its copy into pinned host memory before the encoder (:class:`LabelCount`),
and the loss waits only for that copy, which the GPU reaches right after the previous step's tail
while the encoder's kernels are still queued behind it; ``torch.nonzero_static`` with that K then
picks the rows, in ``nonzero``'s order, without reading anything back (:func:`labelled_rows`).
The plain ``nonzero`` path remains on CPU, under ``torch.compile`` (the traced graph is left as it
was), inside a CUDA-graph capture, on torch < 2.7 (CUDA's ``nonzero_static`` came with 2.6 at the
earliest) and for :meth:`BertForPreTraining.mlm_loss` called without a count.

Embeddings: the word, position and token-type tables go through the op set's ``embedding`` and
``position_embedding`` (:mod:`dslab.models.ops`). With the dslab set, each forward that needs
gradients arms a tie between the word embeddings and the MLM decoder (``ops.embedding_tie``): the
word lookup's backward then writes their fp32 gradient once, the decoder's included
(:mod:`dslab.kernels.embedding.embedding`); the positions are ``position_embeddings.weight[:seq]``, whose
gradient is a sum over the batch, and the token types' two rows take the small-vocabulary kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from dslab.models import hf_mapping
from dslab.models.graphs import CudaGraphLayers
from dslab.models.ops import (
    IGNORE_INDEX, Embedding, LayerNorm, PositionEmbedding, TransformerLayer, check_head_dim, init_normal_, op_set,
)
from dslab.models.tensor_parallel_layers import (
    ParallelTokenEmbedding, bert_tp_state_dict, check_tensor_parallel_group, tensor_parallel_layer,
)
from dslab.models.weight_cast import Linear, weight
from dslab.parallel.tensor_parallel import gather_tensor_parallel_state_dict, set_tensor_model_parallel_attributes
from dslab.parallel.tensor_parallel_regions import gather_from_tensor_parallel_region, tensor_parallel_rank
from dslab.parallel.vocab_parallel import parallel_lm_logits, vocab_parallel_cross_entropy


@dataclass
class BertConfig:
    """BERT's shape and regularisation. Defaults are BERT-large with the vocabulary padded from
    30522 to 30528 (a multiple of 8, for tensor-core-friendly decoder matmuls).

    ``chain_layer_norms`` (pre-LN only; post-LN layers never read another layer's parameters):
    True fuses each layer's last residual add with the next layer's first LayerNorm, so layer i
    reads layer i+1's norm parameters; False keeps each layer to its own parameters, which
    FSDP2's per-layer ``fully_shard`` and pipeline stages need. The loss is the same either way
    (:func:`dslab.models.ops.run_layer_stack`).
    ``checkpoint_layers``: in training, the layer stack in segments of that many layers, each an
    activation checkpoint (:mod:`dslab.models.checkpoint`); 0 (the default) keeps every activation."""

    vocab_size: int = 30528
    hidden: int = 1024
    layers: int = 24
    heads: int = 16
    intermediate: int = 4096
    max_position: int = 512
    type_vocab: int = 2
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    pre_ln: bool = False
    sparse_mlm: bool = True
    initializer_range: float = 0.02
    chain_layer_norms: bool = True
    checkpoint_layers: int = 0
    tp_size: int = 1

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for key in ("vocab_size", "hidden", "layers", "heads", "intermediate", "max_position", "type_vocab"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"heads={self.heads} must divide hidden={self.hidden}")
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"{key} must be in [0, 1), got {getattr(self, key)!r}")
        if not self.layer_norm_eps >= 0.0:
            raise ValueError(f"layer_norm_eps must be >= 0, got {self.layer_norm_eps!r}")
        if not self.initializer_range > 0.0:
            raise ValueError(f"initializer_range must be > 0, got {self.initializer_range!r}")
        if not isinstance(self.chain_layer_norms, bool):
            raise ValueError(f"chain_layer_norms must be a bool, got {self.chain_layer_norms!r}")
        if isinstance(self.checkpoint_layers, bool) or not isinstance(self.checkpoint_layers, int) \
                or self.checkpoint_layers < 0:
            raise ValueError(f"checkpoint_layers must be an int >= 0, got {self.checkpoint_layers!r}")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size <= 0:
            raise ValueError(f"tp_size must be a positive int, got {self.tp_size!r}")
        for key in ("heads", "intermediate", "vocab_size"):
            if getattr(self, key) % self.tp_size:
                raise ValueError(f"{key}={getattr(self, key)} does not divide by tp_size={self.tp_size}: each "
                                 "tensor-parallel rank holds an equal part (pad vocab_size to a multiple)")

    @classmethod
    def from_hf(cls, hf_config, **overrides) -> BertConfig:
        """The config of a ``transformers.BertConfig`` (post-LN, exact-erf GELU)."""
        if getattr(hf_config, "hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act={hf_config.hidden_act!r}: only 'gelu' (exact) is supported")
        fields = dict(
            vocab_size=hf_config.vocab_size, hidden=hf_config.hidden_size, layers=hf_config.num_hidden_layers,
            heads=hf_config.num_attention_heads, intermediate=hf_config.intermediate_size,
            max_position=hf_config.max_position_embeddings, type_vocab=hf_config.type_vocab_size,
            hidden_dropout=hf_config.hidden_dropout_prob, attention_dropout=hf_config.attention_probs_dropout_prob,
            layer_norm_eps=hf_config.layer_norm_eps, initializer_range=hf_config.initializer_range,
        )
        return cls(**{**fields, **overrides})


def bert_large(**overrides) -> BertConfig:
    """BERT-large: 24 layers, hidden 1024, 16 heads; 336.2M parameters with the heads."""
    return dataclasses.replace(BertConfig(), **overrides)


def bert_base(**overrides) -> BertConfig:
    """BERT-base: 12 layers, hidden 768, 12 heads; 110.1M parameters with the heads."""
    return dataclasses.replace(BertConfig(hidden=768, layers=12, heads=12, intermediate=3072), **overrides)


def bert_tiny(**overrides) -> BertConfig:
    """2 layers, hidden 128, 4 heads (head dim 32, the smallest dslab's attention takes),
    vocab 1000, 128 positions: for CPU tests and the suites' ``tiny`` scale."""
    return dataclasses.replace(
        BertConfig(vocab_size=1000, hidden=128, layers=2, heads=4, intermediate=512, max_position=128),
        **overrides,
    )


# CUDA's nonzero_static, a kernel that writes the first K indices without reading K back, came with
# torch 2.6 at the earliest; on older releases the count is not prepared and the loss takes nonzero.
_NONZERO_STATIC_ON_CUDA = TorchVersion(torch.__version__) >= (2, 7)


def labelled_rows(mask: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """Indices (int64, ascending) of the True entries of the 1-D bool ``mask``, as
    ``mask.nonzero(as_tuple=True)[0]``. ``count``, the number of True entries already known on
    the host, sizes the result without a device-to-host synchronisation (``torch.nonzero_static``);
    without it, ``nonzero`` reads the number back from the device. ``count`` must be exact: a
    smaller one drops the last rows, a larger one pads with -1."""
    if count is None:
        return mask.nonzero(as_tuple=True)[0]
    if not 0 <= count <= mask.numel():
        raise ValueError(f"count={count} is not a number of entries of a mask of {mask.numel()}")
    return torch.nonzero_static(mask, size=count).squeeze(1)


class LabelCount:
    """The number of labelled positions (label not -100) of one batch's ``labels``, on its way to
    the host: ``host`` (a pinned int64 scalar) holds it once ``event``, if any, has completed.
    :meth:`queue` starts the count and its copy on the labels' CUDA device; :meth:`get` waits for
    the copy and returns the number. The count belongs to ``labels`` (this very tensor) and to the
    forward that prepared it: :meth:`BertForPreTraining.mlm_loss` refuses it for other labels."""

    def __init__(self, labels: torch.Tensor, host: torch.Tensor, event: torch.cuda.Event | None = None):
        self.labels = labels
        self.host = host
        self.event = event

    @classmethod
    def queue(cls, labels: torch.Tensor) -> LabelCount:
        """Queue, on the current stream of ``labels``' CUDA device, the count and its
        non-blocking copy into a fresh pinned tensor, and record an event after the copy."""
        with torch.cuda.device(labels.device):
            host = torch.empty((), dtype=torch.int64, pin_memory=True)
            host.copy_((labels != IGNORE_INDEX).sum(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return cls(labels, host, event)

    def get(self) -> int:
        """The number of labelled positions; waits for the copy (not for the stream's later work)."""
        if self.event is not None:
            self.event.synchronize()
        return int(self.host)


class BertEmbeddings(nn.Module):
    """``dropout(LayerNorm(word[ids] + position[0..seq) + token_type[types]))``."""

    def __init__(self, config: BertConfig, ops, tp_group=None):
        super().__init__()
        self.dropout = config.hidden_dropout
        if config.tp_size == 1:
            self.word_embeddings = Embedding(config.vocab_size, config.hidden, ops)
        else:  # the vocabulary's rows split over the tensor-parallel group
            self.word_embeddings = ParallelTokenEmbedding(config.vocab_size, config.hidden, tp_group, False)
        self.position_embeddings = PositionEmbedding(config.max_position, config.hidden, ops)
        self.token_type_embeddings = Embedding(config.type_vocab, config.hidden, ops)
        self.norm = LayerNorm(config.hidden, config.layer_norm_eps, ops)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, tie=None) -> torch.Tensor:
        """``tie``: from ``ops.embedding_tie(self.word_embeddings.weight)``, for the MLM decoder."""
        x = self.word_embeddings(input_ids, tie) + self.position_embeddings(input_ids.shape[1])
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]  # every token of type 0, without an ids tensor
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return F.dropout(self.norm(x), self.dropout, self.training)


class BertForPreTraining(CudaGraphLayers, nn.Module):
    """BERT with its pretraining heads.

    ``forward(input_ids, token_type_ids=None, attention_mask=None, masked_lm_labels=None,
    next_sentence_label=None)`` returns the fp32 loss ``mlm + nsp`` (the mean cross-entropies; only
    the terms whose labels are given) when either label is given, else ``(mlm_logits [batch, seq,
    vocab], nsp_logits [batch, 2])``. ``kernels`` picks the op set (:func:`dslab.models.ops.op_set`).

    ``config.pre_ln`` moves each LayerNorm before its sublayer and adds one after the last layer
    (``final_norm``); the embedding LayerNorm stays.

    ``tp_group``: with ``config.tp_size`` > 1, the process group the model is split over
    (Megatron-LM's layout, :mod:`dslab.models.tensor_parallel_layers`): each rank holds
    ``heads/tp`` heads and ``intermediate/tp`` MLP columns of every layer and ``vocab/tp`` rows of
    the word embeddings (and of the MLM decoder's bias); the MLM loss is the vocabulary-parallel
    cross-entropy of each rank's logits, the pooler, NSP and MLM transform are replicated. Ranks
    seeded alike hold the slices of the dense model built from the same seed
    (:meth:`dense_state_dict`, :meth:`load_dense_state_dict` convert).
    """

    _read_through_weight = ("mlm_dense_bias",)

    def __init__(self, config: BertConfig, kernels: str = "dslab", tp_group=None):
        super().__init__()
        config.validate()
        self.ops = op_set(kernels)
        check_head_dim(self.ops, config.hidden, config.heads)
        check_tensor_parallel_group(config.tp_size, tp_group)
        self.config = config
        self.kernels = kernels
        self.tp_group = tp_group
        h = config.hidden
        self.embeddings = BertEmbeddings(config, self.ops, tp_group)
        layer = TransformerLayer if config.tp_size == 1 else functools.partial(tensor_parallel_layer, group=tp_group)
        self.layers = nn.ModuleList(
            layer(h, config.heads, config.intermediate, config.hidden_dropout, config.attention_dropout,
                  config.layer_norm_eps, config.pre_ln, causal=False, gelu_approximate="none",
                  ops=self.ops, chain_layer_norms=config.chain_layer_norms)
            for _ in range(config.layers)
        )
        self.final_norm = LayerNorm(h, config.layer_norm_eps, self.ops) if config.pre_ln else None
        self.pooler = Linear(h, h)
        self.nsp_classifier = Linear(h, 2)
        self.mlm_dense = Linear(h, h, bias=False)
        self.mlm_dense_bias = nn.Parameter(torch.zeros(h))
        self.mlm_norm = LayerNorm(h, config.layer_norm_eps, self.ops)
        # the decoder's bias (this rank's rows of it under tensor parallelism)
        self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size // config.tp_size))
        if config.tp_size > 1:
            set_tensor_model_parallel_attributes(self.mlm_bias, True, 0)
        init_normal_(self, config.initializer_range)

    @property
    def mlm_decoder_weight(self) -> nn.Parameter:
        """The MLM decoder matrix ``[vocab, hidden]``: the word embeddings (tied)."""
        return self.embeddings.word_embeddings.weight

    def encode(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
               key_padding_mask: torch.Tensor | None = None, tie=None) -> torch.Tensor:
        """Hidden states ``[batch, seq, hidden]`` after the last layer (and ``final_norm``);
        ``tie`` as for :class:`BertEmbeddings`."""
        x = self.run_layers(self.embeddings(input_ids, token_type_ids, tie), key_padding_mask)
        return x if self.final_norm is None else self.final_norm(x)

    def mlm_head(self, hidden: torch.Tensor, tie=None) -> torch.Tensor:
        """Vocabulary logits ``[..., vocab]`` of hidden states ``[..., hidden]``:
        ``LayerNorm(gelu(h W + b)) E^T + b_dec`` with ``E`` the word embeddings (read through
        ``tie`` when the forward armed one)."""
        h = self.ops.bias_gelu(self.mlm_dense(hidden), weight(self.mlm_dense_bias), "none")
        if self.config.tp_size > 1:  # this rank's vocabulary columns
            return parallel_lm_logits(self.mlm_norm(h), self.mlm_decoder_weight, self.tp_group) + self.mlm_bias
        decoder = self.mlm_decoder_weight if tie is None else tie.head_weight()
        return F.linear(self.mlm_norm(h), decoder, self.mlm_bias)

    def nsp_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """NSP logits ``[batch, 2]`` from the [CLS] (first) position: ``tanh(h_cls Wp + bp) Wc + bc``."""
        return self.nsp_classifier(torch.tanh(self.pooler(hidden[:, 0])))

    def mlm_loss(self, hidden: torch.Tensor, labels: torch.Tensor, *,
                 label_count: LabelCount | None = None, tie=None) -> torch.Tensor:
        """Mean MLM cross-entropy over the positions whose label is not -100 (see the module
        docstring for ``sparse_mlm``). ``label_count``, prepared for this ``labels`` tensor by
        :meth:`label_count_ahead`, spares the sparse path its synchronisation after the encoder;
        ``tie`` goes to :meth:`mlm_head`."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        targets = labels.reshape(-1)
        if self.config.sparse_mlm:
            if label_count is not None and label_count.labels is not labels:
                raise ValueError("label_count was prepared for another labels tensor")
            count = None if label_count is None else label_count.get()
            keep = labelled_rows(targets != IGNORE_INDEX, count)
            rows, targets = rows.index_select(0, keep), targets.index_select(0, keep)
        if self.config.tp_size > 1:
            losses = vocab_parallel_cross_entropy(self.mlm_head(rows), targets, self.tp_group, IGNORE_INDEX,
                                                  self.config.vocab_size)
            return losses.sum() / (targets != IGNORE_INDEX).sum()
        return self.ops.softmax_cross_entropy(self.mlm_head(rows, tie), targets, IGNORE_INDEX)

    def label_count_ahead(self, labels: torch.Tensor | None) -> LabelCount | None:
        """The count of ``labels``' labelled positions, queued now for :meth:`mlm_loss` (call it
        before the encoder), or None where the loss is to take the plain ``nonzero`` path: no
        labels, dense MLM, labels off CUDA, under ``torch.compile``, inside a CUDA-graph capture,
        or a torch without CUDA ``nonzero_static``."""
        if (labels is None or not self.config.sparse_mlm or torch.compiler.is_compiling()
                or not labels.is_cuda or not _NONZERO_STATIC_ON_CUDA):
            return None
        with torch.cuda.device(labels.device):
            if torch.cuda.is_current_stream_capturing():
                return None
        return LabelCount.queue(labels)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, masked_lm_labels: torch.Tensor | None = None,
                next_sentence_label: torch.Tensor | None = None):
        self._check_inputs(input_ids, token_type_ids, attention_mask, masked_lm_labels, next_sentence_label)
        label_count = self.label_count_ahead(masked_lm_labels)
        tie = self.ops.embedding_tie(self.mlm_decoder_weight) if self.config.tp_size == 1 else None
        hidden = self.encode(input_ids, token_type_ids, key_padding_mask_of(attention_mask), tie)
        nsp_logits = self.nsp_head(hidden)
        if masked_lm_labels is None and next_sentence_label is None:
            logits = self.mlm_head(hidden, tie)
            if self.config.tp_size > 1:
                logits = gather_from_tensor_parallel_region(logits, self.tp_group)
            return logits, nsp_logits
        losses = []
        if masked_lm_labels is not None:
            losses.append(self.mlm_loss(hidden, masked_lm_labels, label_count=label_count, tie=tie))
        if next_sentence_label is not None:
            losses.append(self.ops.softmax_cross_entropy(nsp_logits, next_sentence_label, IGNORE_INDEX))
        return losses[0] if len(losses) == 1 else losses[0] + losses[1]

    def _check_inputs(self, input_ids, token_type_ids, attention_mask, masked_lm_labels, next_sentence_label):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.config.max_position:
            raise ValueError(
                f"input_ids has seq {input_ids.shape[1]} > max_position={self.config.max_position}"
            )
        for name, t in (("token_type_ids", token_type_ids), ("attention_mask", attention_mask),
                        ("masked_lm_labels", masked_lm_labels)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(t.shape)}")
        if next_sentence_label is not None and tuple(next_sentence_label.shape) != (input_ids.shape[0],):
            raise ValueError(
                f"next_sentence_label must be [batch] = [{input_ids.shape[0]}], got {tuple(next_sentence_label.shape)}"
            )

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense model's state dict (with tensor parallelism every shard gathered whole, on
        every rank: a collective over ``tp_group``)."""
        if self.config.tp_size == 1:
            return self.state_dict()
        return gather_tensor_parallel_state_dict(self, self.tp_group)

    def load_dense_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load a dense BERT state dict, of which this rank keeps its shards."""
        if self.config.tp_size > 1:
            state_dict = bert_tp_state_dict(state_dict, tensor_parallel_rank(self.tp_group), self.config.tp_size)
        return self.load_state_dict(state_dict, strict=strict)

    def enable_cuda_graphs(self, enabled: bool = True, segments: int = 1) -> None:
        """As :meth:`CudaGraphLayers.enable_cuda_graphs`. With tensor parallelism the graphs capture
        the layers' all-reduces (:mod:`dslab.models.graphs`); refused with tensor parallelism and
        attention dropout, which switches to the rank's own generator stream
        (:mod:`dslab.parallel.random`), as no capture may."""
        if enabled and self.config.tp_size > 1 and self.config.attention_dropout > 0:
            raise ValueError(f"'cuda_graphs.enabled' with tp_size={self.config.tp_size} and attention_dropout="
                             f"{self.config.attention_dropout}: tensor-parallel attention dropout switches "
                             "generator states, which a CUDA graph capture cannot; set it to 0 or turn graphs off")
        super().enable_cuda_graphs(enabled, segments)

    @classmethod
    def from_hf_state_dict(cls, state_dict: dict, config: BertConfig, kernels: str = "dslab") -> BertForPreTraining:
        """A model with ``config`` and the weights of a HuggingFace ``BertForPreTraining`` state dict."""
        if config.pre_ln:
            raise ValueError("pre_ln=True: HuggingFace's BERT is post-LN, its weights do not fit a pre-LN model")
        model = cls(config, kernels)
        model.load_state_dict(hf_mapping.bert_from_hf(state_dict, config.layers))
        return model

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under HuggingFace ``BertForPreTraining``'s keys (post-LN only;
        with tensor parallelism gathered whole, a collective over ``tp_group``)."""
        if self.config.pre_ln:
            raise ValueError("pre_ln=True: HuggingFace's BERT is post-LN and has no place for these weights")
        return hf_mapping.bert_to_hf(self.dense_state_dict(), self.config.layers)


def key_padding_mask_of(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Bool ``[batch, seq]``, True at padding (``attention_mask == 0``), or None when nothing is
    padded. Deciding "nothing" reads one bool back from the device; it lets the attention take
    its unmasked path (for SDPA, the flash kernel)."""
    if attention_mask is None:
        return None
    padding = attention_mask == 0
    return padding if bool(padding.any()) else None
