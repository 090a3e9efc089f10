"""Injection policies: where a model keeps each weight of its transformer, read into one layout.

A policy recognises one model class and returns a :class:`ModelSpec`: the embeddings, each
layer's weights in ``nn.Linear``'s ``[out, in]`` layout (q, k and v stacked into one
``[3 * hidden, hidden]`` matrix, heads in order within each block), the norms and the heads,
plus what the model's forward returns. The tensors are the model's own (no copies); the
inference modules (:mod:`dslab.inference.modules`) cast, slice and quantise them.

Policies, by class (a subclass matches too):

==========================================  =========================================================
model                                       engine output (``engine(input_ids, attention_mask)``)
==========================================  =========================================================
transformers ``GPT2LMHeadModel``            logits ``[batch, seq, vocab]``
transformers ``BertModel``                  ``(last_hidden_state, pooler_output or None)``
transformers ``BertForMaskedLM``            MLM logits ``[batch, seq, vocab]``
dslab ``GPT2LMHeadModel``                   logits ``[batch, seq, vocab]``
dslab ``BertForPreTraining``                ``(mlm_logits, nsp_logits)``
==========================================  =========================================================

transformers is never imported here: its classes are recognised by name and module. A model of
one of these classes whose settings the inference modules cannot run (a GPT-2 with a ReLU MLP, a
BERT with relative positions) has no policy either, and :func:`find_policy` says why.

Sources: transformers' ``modeling_gpt2.py`` (``Conv1D`` stores ``[in, out]``; ``c_attn`` is q, k, v
along ``out``) and ``modeling_bert.py``; dslab's :mod:`dslab.models.gpt2` and
:mod:`dslab.models.bert`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
SUPPORTED = ("transformers GPT2LMHeadModel, BertModel and BertForMaskedLM; dslab GPT2LMHeadModel and "
             "BertForPreTraining")


@dataclass
class LayerSpec:
    """One transformer layer's weights, ``[out, in]`` matrices."""

    qkv_weight: torch.Tensor      # [3 * hidden, hidden]: q rows, then k, then v
    qkv_bias: torch.Tensor        # [3 * hidden]
    out_weight: torch.Tensor      # [hidden, hidden]
    out_bias: torch.Tensor
    fc_in_weight: torch.Tensor    # [intermediate, hidden]
    fc_in_bias: torch.Tensor
    fc_out_weight: torch.Tensor   # [hidden, intermediate]
    fc_out_bias: torch.Tensor
    attention_norm: tuple[torch.Tensor, torch.Tensor]  # (weight, bias): pre-LN before attention, post-LN after it
    mlp_norm: tuple[torch.Tensor, torch.Tensor]
    attention_scale: float


@dataclass
class ModelSpec:
    """A whole model in the inference modules' terms (see the module docstring)."""

    family: str                   # "gpt2" (causal, pre-LN) or "bert" (bidirectional)
    source: str                   # the policy's name, for messages and reports
    hidden: int
    heads: int
    intermediate: int
    max_positions: int
    vocab_size: int               # logits columns (the embedding matrix may have padding rows)
    eps: float
    pre_ln: bool
    causal: bool
    gelu: str                     # "tanh" or "none" (erf)
    word_embeddings: torch.Tensor
    position_embeddings: torch.Tensor
    layers: list[LayerSpec]
    outputs: str                  # "logits", "hidden_pooled" or "mlm_nsp"
    token_type_embeddings: torch.Tensor | None = None
    embedding_norm: tuple[torch.Tensor, torch.Tensor] | None = None
    final_norm: tuple[torch.Tensor, torch.Tensor] | None = None
    lm_head: torch.Tensor | None = None            # [vocab(+pad), hidden], GPT-2's (tied or not)
    mlm: dict[str, torch.Tensor] = field(default_factory=dict)  # dense_weight/bias, norm_weight/bias, decoder_bias
    pooler: tuple[torch.Tensor, torch.Tensor] | None = None
    nsp: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Unsupported(Exception):
    """The model has no policy here; the message says why."""


def _is_class(model: nn.Module, name: str, module_prefix: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith(module_prefix) for c in type(model).__mro__)


def _t(conv1d_weight: torch.Tensor) -> torch.Tensor:
    """transformers' Conv1D ``[in, out]`` weight as ``[out, in]``."""
    return conv1d_weight.detach().t()


def _pair(norm) -> tuple[torch.Tensor, torch.Tensor]:
    return norm.weight.detach(), norm.bias.detach()


# --- transformers GPT-2 --------------------------------------------------------------------------


def _hf_gpt2(model: nn.Module) -> ModelSpec:
    config = model.config
    if config.activation_function not in (*TANH_GELUS, "gelu"):
        raise Unsupported(f"activation_function={config.activation_function!r} (dslab runs GELU only)")
    if getattr(config, "add_cross_attention", False):
        raise Unsupported("add_cross_attention=True (a GPT-2 decoder with cross attention)")
    hidden, heads = config.n_embd, config.n_head
    head_dim = hidden // heads
    tr = model.transformer
    layers = []
    for index, block in enumerate(tr.h):
        scale = head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(index + 1)
        layers.append(LayerSpec(
            qkv_weight=_t(block.attn.c_attn.weight), qkv_bias=block.attn.c_attn.bias.detach(),
            out_weight=_t(block.attn.c_proj.weight), out_bias=block.attn.c_proj.bias.detach(),
            fc_in_weight=_t(block.mlp.c_fc.weight), fc_in_bias=block.mlp.c_fc.bias.detach(),
            fc_out_weight=_t(block.mlp.c_proj.weight), fc_out_bias=block.mlp.c_proj.bias.detach(),
            attention_norm=_pair(block.ln_1), mlp_norm=_pair(block.ln_2), attention_scale=scale,
        ))
    return ModelSpec(
        family="gpt2", source="transformers.GPT2LMHeadModel", hidden=hidden, heads=heads,
        intermediate=config.n_inner or 4 * hidden, max_positions=config.n_positions, vocab_size=config.vocab_size,
        eps=config.layer_norm_epsilon, pre_ln=True, causal=True,
        gelu="none" if config.activation_function == "gelu" else "tanh",
        word_embeddings=tr.wte.weight.detach(), position_embeddings=tr.wpe.weight.detach(), layers=layers,
        outputs="logits", final_norm=_pair(tr.ln_f), lm_head=model.lm_head.weight.detach(),
    )


# --- transformers BERT ---------------------------------------------------------------------------


def _hf_bert_encoder(bert: nn.Module, source: str, outputs: str) -> ModelSpec:
    config = bert.config
    if config.hidden_act not in ("gelu", *TANH_GELUS):
        raise Unsupported(f"hidden_act={config.hidden_act!r} (dslab runs GELU only)")
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise Unsupported(f"position_embedding_type={config.position_embedding_type!r} (absolute positions only)")
    if getattr(config, "is_decoder", False):
        raise Unsupported("is_decoder=True (dslab injects BERT as an encoder)")
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    layers = []
    for layer in bert.encoder.layer:
        attn = layer.attention.self
        layers.append(LayerSpec(
            qkv_weight=torch.cat([attn.query.weight, attn.key.weight, attn.value.weight]).detach(),
            qkv_bias=torch.cat([attn.query.bias, attn.key.bias, attn.value.bias]).detach(),
            out_weight=layer.attention.output.dense.weight.detach(),
            out_bias=layer.attention.output.dense.bias.detach(),
            fc_in_weight=layer.intermediate.dense.weight.detach(), fc_in_bias=layer.intermediate.dense.bias.detach(),
            fc_out_weight=layer.output.dense.weight.detach(), fc_out_bias=layer.output.dense.bias.detach(),
            attention_norm=_pair(layer.attention.output.LayerNorm), mlp_norm=_pair(layer.output.LayerNorm),
            attention_scale=head_dim ** -0.5,
        ))
    emb = bert.embeddings
    pooler = getattr(bert, "pooler", None)
    return ModelSpec(
        family="bert", source=source, hidden=config.hidden_size, heads=heads, intermediate=config.intermediate_size,
        max_positions=config.max_position_embeddings, vocab_size=config.vocab_size, eps=config.layer_norm_eps,
        pre_ln=False, causal=False, gelu="none" if config.hidden_act == "gelu" else "tanh",
        word_embeddings=emb.word_embeddings.weight.detach(), position_embeddings=emb.position_embeddings.weight.detach(),
        token_type_embeddings=emb.token_type_embeddings.weight.detach(), embedding_norm=_pair(emb.LayerNorm),
        layers=layers, outputs=outputs,
        pooler=(pooler.dense.weight.detach(), pooler.dense.bias.detach()) if pooler is not None else None,
    )


def _hf_bert_model(model: nn.Module) -> ModelSpec:
    return _hf_bert_encoder(model, "transformers.BertModel", "hidden_pooled")


def _hf_bert_mlm(model: nn.Module) -> ModelSpec:
    spec = _hf_bert_encoder(model.bert, "transformers.BertForMaskedLM", "logits")
    predictions = model.cls.predictions
    transform = predictions.transform
    decoder = predictions.decoder
    spec.lm_head = decoder.weight.detach()
    spec.mlm = {"dense_weight": transform.dense.weight.detach(), "dense_bias": transform.dense.bias.detach(),
                "norm_weight": transform.LayerNorm.weight.detach(), "norm_bias": transform.LayerNorm.bias.detach(),
                "decoder_bias": (decoder.bias if decoder.bias is not None else predictions.bias).detach()}
    spec.pooler = None
    return spec


# --- dslab's models ------------------------------------------------------------------------------


def _dslab_layers(model: nn.Module, heads: int, hidden: int) -> list[LayerSpec]:
    scale = (hidden // heads) ** -0.5
    layers = []
    for layer in model.layers:
        attn, mlp = layer.attention, layer.mlp
        layers.append(LayerSpec(
            qkv_weight=attn.qkv.weight.detach(), qkv_bias=attn.qkv.bias.detach(),
            out_weight=attn.out_proj.weight.detach(), out_bias=attn.out_bias.detach(),
            fc_in_weight=mlp.fc_in.weight.detach(), fc_in_bias=mlp.fc_in_bias.detach(),
            fc_out_weight=mlp.fc_out.weight.detach(), fc_out_bias=mlp.fc_out_bias.detach(),
            attention_norm=_pair(layer.attention_norm), mlp_norm=_pair(layer.mlp_norm), attention_scale=scale,
        ))
    return layers


def _dslab_gpt2(model: nn.Module) -> ModelSpec:
    c = model.config
    return ModelSpec(
        family="gpt2", source="dslab.GPT2LMHeadModel", hidden=c.hidden, heads=c.heads, intermediate=c.intermediate,
        max_positions=c.n_positions, vocab_size=c.vocab_size, eps=c.layer_norm_epsilon, pre_ln=True, causal=True,
        gelu="tanh", word_embeddings=model.wte.weight.detach(), position_embeddings=model.wpe.weight.detach(),
        layers=_dslab_layers(model, c.heads, c.hidden), outputs="logits", final_norm=_pair(model.final_norm),
        lm_head=model.lm_head_weight.detach(),
    )


def _dslab_bert(model: nn.Module) -> ModelSpec:
    c = model.config
    emb = model.embeddings
    return ModelSpec(
        family="bert", source="dslab.BertForPreTraining", hidden=c.hidden, heads=c.heads,
        intermediate=c.intermediate, max_positions=c.max_position, vocab_size=c.vocab_size, eps=c.layer_norm_eps,
        pre_ln=c.pre_ln, causal=False, gelu="none", word_embeddings=emb.word_embeddings.weight.detach(),
        position_embeddings=emb.position_embeddings.weight.detach(),
        token_type_embeddings=emb.token_type_embeddings.weight.detach(), embedding_norm=_pair(emb.norm),
        layers=_dslab_layers(model, c.heads, c.hidden), outputs="mlm_nsp",
        final_norm=_pair(model.final_norm) if model.final_norm is not None else None,
        lm_head=model.mlm_decoder_weight.detach(),
        mlm={"dense_weight": model.mlm_dense.weight.detach(), "dense_bias": model.mlm_dense_bias.detach(),
             "norm_weight": model.mlm_norm.weight.detach(), "norm_bias": model.mlm_norm.bias.detach(),
             "decoder_bias": model.mlm_bias.detach()},
        pooler=(model.pooler.weight.detach(), model.pooler.bias.detach()),
        nsp=(model.nsp_classifier.weight.detach(), model.nsp_classifier.bias.detach()),
    )


@dataclass(frozen=True)
class Policy:
    """One model class: its name, how to recognise it, its layer class and how to read it."""

    name: str
    class_name: str
    module_prefix: str
    layer_class_of: object  # model -> the class of its transformer layers
    extract: object         # model -> ModelSpec (raises Unsupported)

    def matches(self, model: nn.Module) -> bool:
        return _is_class(model, self.class_name, self.module_prefix)


# Order matters: the first match wins (BertForMaskedLM is not a BertModel, but be explicit).
POLICIES = (
    Policy("transformers.GPT2LMHeadModel", "GPT2LMHeadModel", "transformers.", lambda m: type(m.transformer.h[0]),
           _hf_gpt2),
    Policy("transformers.BertForMaskedLM", "BertForMaskedLM", "transformers.",
           lambda m: type(m.bert.encoder.layer[0]), _hf_bert_mlm),
    Policy("transformers.BertModel", "BertModel", "transformers.", lambda m: type(m.encoder.layer[0]),
           _hf_bert_model),
    Policy("dslab.GPT2LMHeadModel", "GPT2LMHeadModel", "dslab.models.gpt2", lambda m: type(m.layers[0]), _dslab_gpt2),
    Policy("dslab.BertForPreTraining", "BertForPreTraining", "dslab.models.bert", lambda m: type(m.layers[0]),
           _dslab_bert),
)


def find_policy(model: nn.Module, injection_policy: dict | None = None) -> tuple[Policy, ModelSpec]:
    """The policy of ``model`` and its spec; :class:`Unsupported` saying why there is none.

    ``injection_policy`` (DeepSpeed's ``{LayerClass: (linear names...)}``) may be given for a
    model dslab injects; its key must then be that model's layer class, since dslab's policies
    already know which linear layers to reduce after. ValueError otherwise."""
    for policy in POLICIES:
        if not policy.matches(model):
            continue
        if injection_policy:
            layer_class = policy.layer_class_of(model)
            for key in injection_policy:
                if key is not layer_class:
                    raise ValueError(f"injection_policy names {getattr(key, '__name__', key)!r}, but the layers of "
                                     f"{policy.name} are {layer_class.__name__}; dslab's policy for it already says "
                                     f"which linear layers are reduced across ranks")
        return policy, policy.extract(model)
    raise Unsupported(f"no injection policy for {type(model).__module__}.{type(model).__name__} "
                      f"(dslab injects {SUPPORTED})")


def check_shapes(spec: ModelSpec) -> None:
    """Internal consistency of an extracted spec (shapes agree with the dims)."""
    h, i = spec.hidden, spec.intermediate
    for index, layer in enumerate(spec.layers):
        expected = {"qkv_weight": (3 * h, h), "out_weight": (h, h), "fc_in_weight": (i, h), "fc_out_weight": (h, i)}
        for name, shape in expected.items():
            got = tuple(getattr(layer, name).shape)
            if got != shape:
                raise ValueError(f"{spec.source} layer {index}: {name} has shape {got}, expected {shape}")
    if not math.isfinite(spec.eps) or spec.eps < 0:
        raise ValueError(f"{spec.source}: layer norm epsilon {spec.eps} is not a finite non-negative number")
