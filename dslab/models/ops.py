"""The op set a model calls, chosen by ``kernels``, and the transformer layers built from it.

Two sets with one signature each (:class:`OpSet`):

- ``"dslab"``: :mod:`dslab.kernels`' fused ops. Each dispatches on its own (Triton on CUDA, its
  PyTorch reference elsewhere; :mod:`dslab.kernels.dispatch`).
- ``"torch"``: what a PyTorch user writes with PyTorch's own best ops — ``F.layer_norm``,
  ``F.gelu(x + b)``, ``residual + F.dropout(x + b)``, ``F.scaled_dot_product_attention`` (which
  picks flash / memory-efficient / math by itself) and ``F.cross_entropy`` on fp32-upcast logits.
  This is the ``torch`` arm of a benchmark.

The ops:

- ``layer_norm(x, weight, bias, eps=1e-5, residual=None)`` -> ``y``, or ``(y, x + residual)``
- ``bias_gelu(x, bias, approximate="none"|"tanh")`` -> ``gelu(x + bias)``
- ``bias_dropout_residual(x, bias, residual, p, training)`` -> ``residual + dropout(x + bias, p)``
- ``dropout_add_layer_norm(x, bias, residual, p, training, norm_weight, norm_bias, eps)`` ->
  ``(layer_norm(h), h)`` with ``h = bias_dropout_residual(x, bias, residual, p, training)``: a
  sublayer's end and the layer norm after it (the dslab set's is one kernel each way,
  :mod:`dslab.kernels.norm.dropout_add_layer_norm`; the torch set's the two ops)
- ``attention(q, k, v, causal=False, key_padding_mask=None, dropout_p=0.0, scale=None)``, q/k/v
  ``[batch, heads, seq, head_dim]``, ``key_padding_mask`` bool ``[batch, seq_k]`` (True = padding)
- ``attention_packed(qkv, heads, causal=False, key_padding_mask=None, dropout_p=0.0, scale=None)``:
  self-attention straight from the packed projection, qkv ``[batch, seq, 3 * hidden]`` (q, k, v
  column blocks, heads in order within each) -> ``[batch, seq, hidden]`` (heads concatenated). The
  torch set splits the heads with views, calls SDPA and merges them back (a copy); the dslab set's
  kernels read and write the packed layouts in place (on Hopper its causal calls run on cuDNN:
  :mod:`dslab.kernels.attention.attention_cudnn`). Where ``packed_bias_grad`` (the dslab set),
  it also takes ``bias=``: the projection's bias, already inside qkv (added in the matmul's
  epilogue with the bias detached), whose gradient the attention backward kernels then compute
  from the rows they write (:mod:`dslab.kernels.attention.attention_packed`); the torch set's projection
  keeps its own bias gradient.
- ``softmax_cross_entropy(logits [N, V], target [N], ignore_index=-100, label_smoothing=0.0)`` ->
  fp32 mean loss
- ``layer_norm_fork(x, weight, bias, eps=1e-5)`` -> ``(layer_norm(x), x)``: for a pre-LN layer's
  residual stream, which feeds its layer norm and its residual add; the dslab set's layer-norm
  backward kernel adds the second output's gradient.
- ``linear_cross_entropy(hidden [N, H], weight [Vp, H], target [N], vocab, ignore_index=-100,
  label_smoothing=0.0)`` -> fp32 mean loss of the LM head's logits ``F.linear(hidden, weight)``
  over their first ``vocab`` columns (rows ``vocab..Vp`` of ``weight`` are padding and get zero
  gradient). The torch set computes the logits, takes the strided slice and calls
  ``F.cross_entropy`` on its fp32 upcast; the dslab set's op
  (:func:`dslab.kernels.loss.linear_cross_entropy.linear_cross_entropy`) writes the logits' gradient
  over the logits in its forward, so its backward is the head's two matmuls. ``tie=``: see
  ``embedding_tie``.
- ``embedding(weight [V, H], ids, tie=None)`` -> ``weight[ids]``: the torch set's is
  ``F.embedding``; the dslab set's (:func:`dslab.kernels.embedding.embedding.embedding`) has a
  deterministic backward that writes the fp32 weight gradient once.
- ``position_embedding(weight [P, H], seq)`` -> the first ``seq`` rows ``[seq, H]``, to be broadcast
  over the batch: the torch set looks up ``arange(seq)`` with ``F.embedding``; the dslab set slices
  the weight, so its gradient is autograd's sum over the batch (no embedding backward).
- ``embedding_tie(weight)`` -> a tie for a token-embedding matrix that a head also reads, or None.
  The torch set never ties (None). The dslab set's is
  :meth:`dslab.kernels.embedding.embedding.EmbeddingTie.arm` (None without autograd or under
  ``torch.compile``): the model hands the tie to ``embedding`` and to the head
  (``linear_cross_entropy(..., tie=)``, or ``tie.head_weight()`` for a plain ``F.linear``), and the
  lookup's backward adds the head's weight gradient into the one gradient it writes, instead of
  autograd casting it to fp32 and adding two dense ``[V, H]`` gradients.

Dtypes under autocast (fp32 parameters, half-precision matmul outputs): the ``dslab`` set runs
each fused op in the dtype of its activation ``x`` and casts the bias and the residual to it, so
that after the first residual add the residual stream is in the autocast dtype (as in a model cast
to bf16). The ``torch`` set casts only the bias (as ``nn.Linear(bias=True)`` under autocast would)
and lets PyTorch promote ``residual + ...`` to the residual's dtype, so its residual stream stays
fp32 under autocast, as in any autocast model (HuggingFace's included). Outside autocast both sets
compute in the one dtype of the model.

The dslab dropout mask is a function of a seed: an int64 ``[1]`` tensor on the activation's device,
drawn per call with ``torch.randint`` from torch's generator for that device (:func:`draw_seed`;
attention draws its own the same way). ``torch.manual_seed`` reproduces a run, the kernels read the
seed on the device (no host synchronisation), and a CUDA graph that captured a step draws new masks
on every replay.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.models.checkpoint import checkpoint
from dslab.parallel.partitioned import GatheredParameters
from dslab.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from dslab.parallel.vocab_parallel import VocabParallelEmbedding
from dslab.models.weight_cast import Linear, linear, weight

KERNEL_SETS = ("dslab", "torch")
IGNORE_INDEX = -100
# Layers that hold a shard of a weight and draw it whole (reset_parameters(init_method)).
TENSOR_PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


@dataclass(frozen=True)
class OpSet:
    """The ops of one kernel set (signatures in the module docstring).

    ``head_dims``: the attention head dims the set supports, None for any. ``packed_bias_grad``:
    ``attention_packed`` takes the projection's ``bias`` and computes its gradient.
    """

    name: str
    layer_norm: Callable
    bias_gelu: Callable
    bias_dropout_residual: Callable
    dropout_add_layer_norm: Callable
    attention: Callable
    attention_packed: Callable
    softmax_cross_entropy: Callable
    linear_cross_entropy: Callable
    layer_norm_fork: Callable
    embedding: Callable
    position_embedding: Callable
    embedding_tie: Callable
    head_dims: tuple[int, ...] | None
    packed_bias_grad: bool = False

    def __reduce__(self):
        # Pickled (and deep-copied) by name: the dslab set's functions are closures.
        return op_set, (self.name,)


# ---------------------------------------------------------------------------------------------
# The torch set.
# ---------------------------------------------------------------------------------------------


def _torch_layer_norm(x, weight, bias, eps=1e-5, residual=None):
    if residual is None:
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    h = x + residual
    return F.layer_norm(h, h.shape[-1:], weight, bias, eps), h


def _torch_bias_gelu(x, bias, approximate="none"):
    return F.gelu(x + bias.to(x.dtype), approximate=approximate)


def _torch_bias_dropout_residual(x, bias, residual, p, training):
    return residual + F.dropout(x + bias.to(x.dtype), p=p, training=training)


def _torch_dropout_add_layer_norm(x, bias, residual, p, training, norm_weight, norm_bias, eps=1e-5):
    h = _torch_bias_dropout_residual(x, bias, residual, p, training)
    return F.layer_norm(h, h.shape[-1:], norm_weight, norm_bias, eps), h


def _torch_attention(q, k, v, causal=False, key_padding_mask=None, dropout_p=0.0, scale=None):
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
    allowed = ~key_padding_mask[:, None, None, :]  # SDPA's bool mask: True = may attend
    if causal:
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        allowed = allowed & torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale)


def _torch_attention_packed(qkv, heads, causal=False, key_padding_mask=None, dropout_p=0.0, scale=None):
    batch, seq, width = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4)
    context = _torch_attention(q, k, v, causal, key_padding_mask, dropout_p, scale)
    return context.transpose(1, 2).reshape(batch, seq, width // 3)


def _torch_cross_entropy(logits, target, ignore_index=IGNORE_INDEX, label_smoothing=0.0):
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, label_smoothing=label_smoothing)


def _refuse_tie(tie) -> None:
    if tie is not None:
        raise ValueError("the torch kernel set takes no tie (its embedding_tie gives None)")


def _torch_linear_cross_entropy(hidden, weight, target, vocab, ignore_index=IGNORE_INDEX, label_smoothing=0.0,
                                tie=None):
    _refuse_tie(tie)
    logits = F.linear(hidden, weight)
    if vocab < logits.shape[-1]:
        logits = logits[..., :vocab]
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, label_smoothing=label_smoothing)


def _torch_layer_norm_fork(x, weight, bias, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps), x


def _torch_embedding(weight, ids, tie=None):
    _refuse_tie(tie)
    return F.embedding(ids, weight)


def _torch_position_embedding(weight, seq):
    return F.embedding(torch.arange(seq, device=weight.device), weight)


def _no_tie(weight):
    return None


TORCH_OPS = OpSet(
    name="torch",
    layer_norm=_torch_layer_norm,
    bias_gelu=_torch_bias_gelu,
    bias_dropout_residual=_torch_bias_dropout_residual,
    dropout_add_layer_norm=_torch_dropout_add_layer_norm,
    attention=_torch_attention,
    attention_packed=_torch_attention_packed,
    softmax_cross_entropy=_torch_cross_entropy,
    linear_cross_entropy=_torch_linear_cross_entropy,
    layer_norm_fork=_torch_layer_norm_fork,
    embedding=_torch_embedding,
    position_embedding=_torch_position_embedding,
    embedding_tie=_no_tie,
    head_dims=None,
)


# ---------------------------------------------------------------------------------------------
# The dslab set: thin wrappers that align dtypes and draw dropout seeds.
# ---------------------------------------------------------------------------------------------


def draw_seed(x: torch.Tensor) -> torch.Tensor:
    """A dropout seed for an op on ``x``: int64 ``[1]`` on x's device, in ``[0, 2**62)``, from
    torch's generator for that device (no host synchronisation; CUDA-graph safe)."""
    from dslab.kernels.dropout.bias_dropout_residual import draw_seed as draw_device_seed

    return draw_device_seed(x.device)


@functools.cache
def _dslab_ops() -> OpSet:
    # Imported from the op modules, not the package: ``dslab.kernels.norm.layer_norm`` names the module
    # once that module has been imported.
    from dslab.kernels.activation.bias_gelu import bias_gelu
    from dslab.kernels.attention.attention import HEAD_DIMS, attention
    from dslab.kernels.attention.attention_packed import attention_packed
    from dslab.kernels.dropout.bias_dropout_residual import bias_dropout_residual
    from dslab.kernels.embedding.embedding import EmbeddingTie, embedding
    from dslab.kernels.loss.cross_entropy import softmax_cross_entropy
    from dslab.kernels.loss.linear_cross_entropy import linear_cross_entropy
    from dslab.kernels.norm.dropout_add_layer_norm import dropout_add_layer_norm
    from dslab.kernels.norm.layer_norm import layer_norm, layer_norm_fork

    def dslab_layer_norm(x, weight, bias, eps=1e-5, residual=None):
        if residual is not None:
            residual = residual.to(x.dtype)
        return layer_norm(x, weight, bias, eps, residual)

    def dslab_bias_gelu(x, bias, approximate="none"):
        return bias_gelu(x, bias.to(x.dtype), approximate)

    def dslab_bias_dropout_residual(x, bias, residual, p, training):
        seed = draw_seed(x) if training and p > 0 else None
        return bias_dropout_residual(x, bias.to(x.dtype), residual.to(x.dtype), p, training, seed)

    def dslab_dropout_add_layer_norm(x, bias, residual, p, training, norm_weight, norm_bias, eps=1e-5):
        seed = draw_seed(x) if training and p > 0 else None
        return dropout_add_layer_norm(x, bias.to(x.dtype), residual.to(x.dtype), p, training, seed,
                                      norm_weight, norm_bias, eps)

    def dslab_linear_cross_entropy(hidden, weight, target, vocab, ignore_index=IGNORE_INDEX, label_smoothing=0.0,
                                   tie=None):
        return linear_cross_entropy(hidden, weight, target, vocab, ignore_index=ignore_index,
                                    label_smoothing=label_smoothing, tie=tie)

    def dslab_position_embedding(weight, seq):
        # A view either way, never the parameter itself (hooks on a module's outputs must not land
        # on a parameter); a whole-table view's backward is free, a slice's fills [P, H] once.
        return weight[:seq] if seq < weight.shape[0] else weight.view_as(weight)

    return OpSet(
        name="dslab",
        layer_norm=dslab_layer_norm,
        bias_gelu=dslab_bias_gelu,
        bias_dropout_residual=dslab_bias_dropout_residual,
        dropout_add_layer_norm=dslab_dropout_add_layer_norm,
        attention=attention,
        attention_packed=attention_packed,
        softmax_cross_entropy=softmax_cross_entropy,
        linear_cross_entropy=dslab_linear_cross_entropy,
        layer_norm_fork=layer_norm_fork,
        embedding=embedding,
        position_embedding=dslab_position_embedding,
        embedding_tie=EmbeddingTie.arm,
        head_dims=tuple(HEAD_DIMS),
        packed_bias_grad=True,
    )


def op_set(kernels: str) -> OpSet:
    """The op set named ``kernels`` ("dslab" or "torch")."""
    if kernels == "torch":
        return TORCH_OPS
    if kernels == "dslab":
        return _dslab_ops()
    raise ValueError(f"kernels={kernels!r} is not a kernel set; choose one of {', '.join(KERNEL_SETS)}")


def check_head_dim(ops: OpSet, hidden: int, heads: int) -> None:
    """ValueError naming ``heads`` unless ``hidden`` splits into ``heads`` heads the set supports."""
    if heads <= 0 or hidden % heads:
        raise ValueError(f"heads={heads} must be positive and divide hidden={hidden}")
    if ops.head_dims is not None and hidden // heads not in ops.head_dims:
        raise ValueError(
            f"hidden / heads = {hidden}/{heads} = {hidden // heads} is a head dim that kernels={ops.name!r} "
            f"does not support; supported head dims: {ops.head_dims}"
        )


# ---------------------------------------------------------------------------------------------
# Layers. Matmuls are nn.Linear (without bias where a fused op adds it); everything else is an op.
# Their weights and the separate biases are read through weight() (a bf16 copy inside the engine's
# copies scope, see dslab.engine.weight_copies); layer norms and embeddings read their fp32
# parameters (a tied head reads its embedding through the op set's tie instead).
# ---------------------------------------------------------------------------------------------


class Embedding(nn.Embedding):
    """``nn.Embedding`` (same parameter, state dict and initialisation) looked up through
    ``ops.embedding``: ``forward(ids, tie=None)`` -> ``[*ids.shape, H]``, ``tie`` from
    ``ops.embedding_tie(self.weight)`` when a head reads this matrix too."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ops: OpSet):
        super().__init__(num_embeddings, embedding_dim)
        self.ops = ops

    def forward(self, ids: torch.Tensor, tie=None) -> torch.Tensor:
        return self.ops.embedding(self.weight, ids, tie)


class PositionEmbedding(Embedding):
    """Learned positions: ``forward(seq)`` -> rows ``0..seq`` ``[seq, H]`` through
    ``ops.position_embedding``, for the caller to broadcast over the batch."""

    def forward(self, seq: int) -> torch.Tensor:
        return self.ops.position_embedding(self.weight, seq)


class LayerNorm(nn.Module):
    """Affine layer norm over the last dimension, through ``ops.layer_norm``."""

    def __init__(self, hidden: int, eps: float, ops: OpSet):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, x_bias: torch.Tensor | None = None,
                p: float = 0.0, training: bool = False,
                fork: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The norm of ``x`` (``(norm(x), x)`` with ``fork``, see :meth:`fork`); with ``residual``,
        of ``h = residual + dropout(x + x_bias, p)`` (dropout when ``training``), returned as
        ``(norm(h), h)`` from ``ops.dropout_add_layer_norm``."""
        if residual is None:
            if fork:
                return self.ops.layer_norm_fork(x, self.weight, self.bias, self.eps)
            return self.ops.layer_norm(x, self.weight, self.bias, self.eps)
        return self.ops.dropout_add_layer_norm(x, x_bias, residual, p, training, self.weight, self.bias, self.eps)

    def after_residual_add(self, x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, p: float,
                           training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(h), h)`` with ``h = residual + dropout(x + bias, p)``: a call of this module, so
        that module hooks (the profilers') see the norm run, inside the sublayer that calls it."""
        return self(x, residual, bias, p, training)

    def fork(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x), x)`` through ``ops.layer_norm_fork`` (x also feeds a residual add), as a call
        of this module."""
        return self(x, fork=True)


class PackedProjection(Linear):
    """The packed q, k, v projection: a :class:`~dslab.models.weight_cast.Linear` whose forward
    can leave its bias's gradient to the attention op (``bias_grad_elsewhere``): the bias is still
    added in the matmul (its epilogue), detached, and the caller hands the bias to
    ``attention_packed(bias=...)``, whose backward computes its gradient."""

    def forward(self, input: torch.Tensor, bias_grad_elsewhere: bool = False) -> torch.Tensor:
        bias = weight(self.bias)
        if bias_grad_elsewhere and bias is not None:
            bias = bias.detach()
        return linear(input, weight(self.weight), bias)


def _residual_add(out, bias, residual, p, training, ops: OpSet, norm: LayerNorm | None):
    """A sublayer's end: ``residual + dropout(out + bias)``, or with ``norm`` the pair
    ``(norm(that), that)`` from one op."""
    if norm is None:
        return ops.bias_dropout_residual(out, bias, residual, p, training)
    return norm.after_residual_add(out, bias, residual, p, training)


class SelfAttention(nn.Module):
    """Multi-head self-attention ending in the residual add:
    ``residual + dropout(attention(x Wqkv + bqkv) Wo + bo)``.

    ``qkv`` is one ``[3 * hidden, hidden]`` projection, rows ordered q, k, v, and within each the
    heads in order (head ``h`` owns rows ``h * head_dim : (h + 1) * head_dim``).
    """

    _read_through_weight = ("out_bias",)

    def __init__(self, hidden: int, heads: int, attention_dropout: float, hidden_dropout: float,
                 causal: bool, ops: OpSet, qkv: nn.Module | None = None, out_proj: nn.Module | None = None):
        """``qkv``, ``out_proj``: the two projections when the caller builds them (tensor-parallel
        ones, :mod:`dslab.models.tensor_parallel_layers`: ``qkv`` then gives this rank's ``heads``
        heads of q, k and v, ``out_proj`` the whole ``[batch, seq, hidden]`` sum); by default the
        dense ``[3 * hidden, hidden]`` and ``[hidden, hidden]`` ones."""
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.hidden_dropout = hidden_dropout
        self.causal = causal
        self.ops = ops
        self.qkv = PackedProjection(hidden, 3 * hidden) if qkv is None else qkv
        # a context manager factory for the attention op's dropout (a tensor-parallel layer's:
        # dslab.parallel.random's fork of the rank's stream); None draws from the default
        self.rng_fork = None
        self.out_proj = Linear(hidden, hidden, bias=False) if out_proj is None else out_proj
        self.out_bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor, residual: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                norm: LayerNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x``, ``residual`` [batch, seq, hidden]; ``key_padding_mask`` bool [batch, seq] or None.
        With ``norm``, the layer norm that reads the result: ``(norm(out), out)`` in one op."""
        options = dict(causal=self.causal, key_padding_mask=key_padding_mask,
                       dropout_p=self.attention_dropout if self.training else 0.0)
        # a tensor-parallel layer's heads draw their dropout on the rank's own stream
        region = self.rng_fork() if self.rng_fork is not None and options["dropout_p"] > 0 else contextlib.nullcontext()
        if self.ops.packed_bias_grad:
            qkv = self.qkv(x, bias_grad_elsewhere=True)
            with region:
                context = self.ops.attention_packed(qkv, self.heads, bias=weight(self.qkv.bias), **options)
        else:
            qkv = self.qkv(x)
            with region:
                context = self.ops.attention_packed(qkv, self.heads, **options)
        return _residual_add(self.out_proj(context), weight(self.out_bias), residual, self.hidden_dropout,
                             self.training, self.ops, norm)


class FeedForward(nn.Module):
    """``residual + dropout(gelu(x W1 + b1) W2 + b2)``."""

    _read_through_weight = ("fc_in_bias", "fc_out_bias")

    def __init__(self, hidden: int, intermediate: int, hidden_dropout: float, gelu_approximate: str,
                 ops: OpSet, fc_in: nn.Module | None = None, fc_out: nn.Module | None = None):
        """``fc_in``, ``fc_out``: the two matmuls when the caller builds them (tensor-parallel ones:
        ``intermediate`` is then this rank's columns, the width of ``fc_in``'s output and of
        ``fc_in_bias``); by default dense ones."""
        super().__init__()
        self.hidden_dropout = hidden_dropout
        self.gelu_approximate = gelu_approximate
        self.ops = ops
        self.fc_in = Linear(hidden, intermediate, bias=False) if fc_in is None else fc_in
        self.fc_in_bias = nn.Parameter(torch.zeros(intermediate))
        self.fc_out = Linear(intermediate, hidden, bias=False) if fc_out is None else fc_out
        self.fc_out_bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                norm: LayerNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`SelfAttention.forward`, ``norm`` included."""
        h = self.ops.bias_gelu(self.fc_in(x), weight(self.fc_in_bias), self.gelu_approximate)
        return _residual_add(self.fc_out(h), weight(self.fc_out_bias), residual, self.hidden_dropout,
                             self.training, self.ops, norm)


class TransformerLayer(nn.Module):
    """One encoder/decoder layer, post-LN (original BERT) or pre-LN (GPT-2):

        post-LN:  x = LN1(x + Attn(x));      x = LN2(x + FFN(x))
        pre-LN:   x = x + Attn(LN1(x));      x = x + FFN(LN2(x))

    (each ``+`` is ``ops.bias_dropout_residual``, with dropout on the sublayer's output; a ``+``
    that a layer norm reads is one ``ops.dropout_add_layer_norm`` with it).

    ``chain_layer_norms`` (pre-LN only): whether :func:`run_layer_stack` may fuse this layer's
    last residual add with the next layer's first layer norm, so that this layer reads the next
    one's norm parameters. False keeps every read inside the layer, which FSDP2 (it unshards one
    layer's parameters for that layer's forward) and pipeline stages (a stage holds its own
    layers) need; the result is the same either way.
    """

    CHAINS_NORMS = True

    def __init__(self, hidden: int, heads: int, intermediate: int, hidden_dropout: float,
                 attention_dropout: float, eps: float, pre_ln: bool, causal: bool,
                 gelu_approximate: str, ops: OpSet, chain_layer_norms: bool = True,
                 attention: nn.Module | None = None, mlp: nn.Module | None = None):
        """``attention``, ``mlp``: the two sublayers when the caller builds them (tensor-parallel
        ones, :func:`dslab.models.tensor_parallel_layers.tensor_parallel_layer`), called as
        :class:`SelfAttention` and :class:`FeedForward` are; by default those two."""
        super().__init__()
        if not isinstance(chain_layer_norms, bool):
            raise ValueError(f"chain_layer_norms must be a bool, got {chain_layer_norms!r}")
        self.pre_ln = pre_ln
        self.chain_layer_norms = chain_layer_norms
        if attention is None:
            attention = SelfAttention(hidden, heads, attention_dropout, hidden_dropout, causal, ops)
        self.attention = attention
        self.attention_norm = LayerNorm(hidden, eps, ops)
        if mlp is None:
            mlp = FeedForward(hidden, intermediate, hidden_dropout, gelu_approximate, ops)
        self.mlp = mlp
        self.mlp_norm = LayerNorm(hidden, eps, ops)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                normed: torch.Tensor | None = None,
                next_norm: LayerNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream ``x``. Pre-LN only: ``normed``, ``attention_norm(x)``
        when the layer before computed it; ``next_norm``, the next layer's first layer norm, which
        the last residual add then computes with it: ``(next_norm(out), out)`` (see
        :func:`run_layer_stack`)."""
        if self.pre_ln:
            if normed is None:
                y, x = self.attention_norm.fork(x)
            else:
                y = normed
            y, x = self.attention(y, x, key_padding_mask, norm=self.mlp_norm)
            return self.mlp(y, x) if next_norm is None else self.mlp(y, x, norm=next_norm)
        if normed is not None or next_norm is not None:
            raise ValueError("normed= and next_norm= are for pre-LN layers; this layer is post-LN")
        x, _ = self.attention(x, x, key_padding_mask, norm=self.attention_norm)
        return self.mlp(x, x, norm=self.mlp_norm)[0]


def chains_into(layer: nn.Module, after: nn.Module | None) -> bool:
    """Whether ``layer``'s last residual add may compute ``after``'s first norm: two pre-norm
    layers of a class that chains (``CHAINS_NORMS``: :class:`TransformerLayer`, and
    :class:`dslab.models.llama.LlamaLayer` with its RMSNorms) that both allow it
    (``chain_layer_norms``)."""
    return all(getattr(type(m), "CHAINS_NORMS", False) and m.pre_ln and m.chain_layer_norms for m in (layer, after))


def run_layer_stack(layers: Iterable[nn.Module], x: torch.Tensor,
                    key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``x = layer(x, key_padding_mask)`` for each layer in turn, where two pre-LN
    :class:`TransformerLayer` follow each other the first one's last residual add and the second
    one's first layer norm run as one ``ops.dropout_add_layer_norm`` (the second layer gets the
    normalized stream as ``normed``), unless either layer has ``chain_layer_norms`` off: then
    each layer reads only its own parameters and the second one normalizes its input itself
    (``layer_norm_fork``). The result is the same stream either way."""
    layers = list(layers)
    normed = None
    for layer, after in zip(layers, [*layers[1:], None]):
        chained = chains_into(layer, after)
        extra = {} if normed is None else {"normed": normed}
        if chained:
            normed, x = layer(x, key_padding_mask, next_norm=after.attention_norm, **extra)
        else:
            x, normed = layer(x, key_padding_mask, **extra), None
    return x


def _run_segment(layers: list[nn.Module], after: nn.Module | None, key_padding_mask, x, normed):
    """:func:`run_layer_stack`'s loop over ``layers``, from ``x`` (and ``normed``, the first
    layer's normalized input when the layer before computed it), the last layer chaining into
    ``after`` (the next segment's first layer) when they chain; returns ``(x, normed)``."""
    for layer, nxt in zip(layers, [*layers[1:], after]):
        extra = {} if normed is None else {"normed": normed}
        if chains_into(layer, nxt):
            normed, x = layer(x, key_padding_mask, next_norm=nxt.attention_norm, **extra)
        else:
            x, normed = layer(x, key_padding_mask, **extra), None
    return x, normed


def run_checkpointed_stack(layers: Iterable[nn.Module], x: torch.Tensor, key_padding_mask: torch.Tensor | None,
                           every: int) -> torch.Tensor:
    """:func:`run_layer_stack` in segments of ``every`` layers, each one activation checkpoint
    (:func:`dslab.models.checkpoint.checkpoint`): a segment keeps its inputs (the stream, and the
    normalized stream when the segment before chained into it) and recomputes the rest in the
    backward, under the forward's random states. The result and the gradients are the same."""
    if every < 1:
        raise ValueError(f"checkpoint segments must hold >= 1 layer, got {every}")
    layers = list(layers)
    normed = None
    for start in range(0, len(layers), every):
        segment = layers[start:start + every]
        after = layers[start + every] if start + every < len(layers) else None
        x, normed = checkpoint(_run_segment, segment, after, key_padding_mask, x, normed)
    return x


def init_normal_(module: nn.Module, std: float) -> None:
    """BERT/GPT-2 initialisation: Linear and Embedding weights ~ N(0, std), Linear biases 0;
    LayerNorm and the separate bias parameters keep their construction values (1 and 0).
    Each module's parameters are gathered whole while it is initialised when they were built
    partitioned (``dslab.zero.Init``; rank 0's values are kept), one module at a time.
    Tensor-parallel layers draw their whole weight the same way and keep their shard, so a model
    split over ranks seeded alike starts from the slices of the dense model's weights."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            with GatheredParameters(list(m.parameters(recurse=False)), modifier_rank=0):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
        elif isinstance(m, TENSOR_PARALLEL_LAYERS):
            m.reset_parameters(functools.partial(nn.init.normal_, mean=0.0, std=std))


def scale_residual_init_(layers: nn.ModuleList, std: float, total_layers: int | None = None) -> None:
    """GPT-2's scaled init: the projections that write into the residual stream get
    ``std / sqrt(2 * n_layers)`` (Radford et al. 2019, section 2.3); ``n_layers`` is
    ``total_layers`` when ``layers`` are some of the model's (a pipeline layer), else their count."""
    scaled = std / math.sqrt(2 * (total_layers or len(layers)))
    for layer in layers:
        for projection in (layer.attention.out_proj, layer.mlp.fc_out):
            if isinstance(projection, TENSOR_PARALLEL_LAYERS):
                projection.reset_parameters(functools.partial(nn.init.normal_, mean=0.0, std=scaled))
                continue
            with GatheredParameters(projection.weight, modifier_rank=0):
                nn.init.normal_(projection.weight, mean=0.0, std=scaled)
