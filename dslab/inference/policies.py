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
transformers ``LlamaForCausalLM``           logits ``[batch, seq, vocab]`` (:class:`LlamaSpec`)
transformers ``MistralForCausalLM``         logits ``[batch, seq, vocab]`` (:class:`LlamaSpec`)
transformers ``Qwen2ForCausalLM``           logits ``[batch, seq, vocab]`` (:class:`LlamaSpec`)
==========================================  =========================================================

The Llama layout (Llama, Mistral, Qwen2 share it: RMSNorm, rotary positions, grouped-query
attention with ``num_key_value_heads`` key/value heads, a gated SiLU MLP, no position
embeddings) is read into a :class:`LlamaSpec`: q, k and v stacked into one ``[(heads + 2 *
kv_heads) * head_dim, hidden]`` matrix (``head_dim`` is the config's, which may differ from
``hidden / heads``), gate and up into one ``[2 * intermediate, hidden]`` matrix (gate rows first),
the biases where the model has them (Qwen2's q/k/v; Llama's ``attention_bias`` and ``mlp_bias``),
and the rotary frequencies (:func:`dslab.kernels.attention.rope.rope_inv_freq` of the config's
``rope_theta`` and rope scaling). Refused, with the reason: ``hidden_act`` other than SiLU, rope
types other than default, linear and llama3 (or a partial rotary factor), heads that do not group
over the key/value heads. A sliding window (Mistral's ``sliding_window``, Qwen2's sliding layers)
of W keys masks nothing while a sequence holds at most W positions (left padding included): the
spec's ``max_positions`` is cut to W when W is smaller, so the engine runs exactly the model's
attention and refuses longer sequences, and says so in its notes.

transformers is never imported here: its classes are recognised by name and module. A model of
one of these classes whose settings the inference modules cannot run (a GPT-2 with a ReLU MLP, a
BERT with relative positions) has no policy either, and :func:`find_policy` says why.

Sources: transformers' ``modeling_gpt2.py`` (``Conv1D`` stores ``[in, out]``; ``c_attn`` is q, k, v
along ``out``), ``modeling_bert.py``, ``modeling_llama.py``, ``modeling_mistral.py``,
``modeling_qwen2.py`` and ``modeling_rope_utils.py``; dslab's :mod:`dslab.models.gpt2` and
:mod:`dslab.models.bert`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from dslab.kernels.attention.rope import ROPE_TYPES, rope_inv_freq

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
SUPPORTED = ("transformers GPT2LMHeadModel, BertModel, BertForMaskedLM, LlamaForCausalLM, MistralForCausalLM and "
             "Qwen2ForCausalLM; dslab GPT2LMHeadModel and BertForPreTraining")


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
    notes: list[str] = field(default_factory=list)  # what the engine should report about the injection

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: one per query head (multi-head attention)."""
        return self.heads


@dataclass
class LlamaLayerSpec:
    """One Llama-layout layer's weights, ``[out, in]`` matrices (biases None where the model has
    none)."""

    qkv_weight: torch.Tensor          # [(heads + 2 * kv_heads) * head_dim, hidden]: q rows, then k, then v
    qkv_bias: torch.Tensor | None     # [(heads + 2 * kv_heads) * head_dim]
    out_weight: torch.Tensor          # [hidden, heads * head_dim]
    out_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor      # [2 * intermediate, hidden]: gate rows, then up rows
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor         # [hidden, intermediate]
    down_bias: torch.Tensor | None
    attention_norm: torch.Tensor      # RMSNorm weight [hidden] before attention
    mlp_norm: torch.Tensor            # RMSNorm weight [hidden] before the MLP


@dataclass
class LlamaSpec:
    """A Llama-layout causal language model (see the module docstring); ``forward`` returns
    logits."""

    source: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_positions: int
    vocab_size: int
    eps: float                        # the RMSNorms' epsilon
    rope_type: str                    # "default", "linear" or "llama3"
    rope_inv_freq: torch.Tensor       # fp32 [head_dim // 2]: rotation frequencies, scaling applied
    word_embeddings: torch.Tensor
    layers: list[LlamaLayerSpec]
    final_norm: torch.Tensor
    lm_head: torch.Tensor             # [vocab, hidden]: the word embeddings themselves when tied
    notes: list[str] = field(default_factory=list)
    family: str = "llama"
    causal: bool = True
    outputs: str = "logits"


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


# --- transformers Llama, Mistral, Qwen2 ------------------------------------------------------------

SILUS = ("silu", "swish")


def _rope_parameters(config) -> dict:
    """The config's rope settings as one dict with ``rope_type`` and ``rope_theta``:
    ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    params = getattr(config, "rope_parameters", None)
    params = dict(params if params is not None else getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if any(isinstance(value, dict) for value in params.values()):
        raise Unsupported(f"rope parameters per layer type ({sorted(params)}); dslab takes one rope for all layers")
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    return params


def _rope_frequencies(config, head_dim: int) -> tuple[str, torch.Tensor]:
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise Unsupported(f"rope_type={rope_type!r} (dslab runs {', '.join(ROPE_TYPES)} rotary positions)")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise Unsupported(f"partial_rotary_factor={params['partial_rotary_factor']} (dslab rotates whole heads)")
    try:
        return rope_type, rope_inv_freq(head_dim, params["rope_theta"], params)
    except ValueError as err:
        raise Unsupported(f"rope parameters {params}: {err}") from None


def _sliding_window(config) -> int | None:
    """The attention window of the model's sliding layers (None when no layer slides)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _bias(linear: nn.Module) -> torch.Tensor | None:
    return linear.bias.detach() if linear.bias is not None else None


def _stacked_bias(*linears: nn.Module) -> torch.Tensor | None:
    """The linears' biases stacked in order; None when none has one (zeros for those without)."""
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat([linear.bias.detach() if linear.bias is not None else
                      linear.weight.new_zeros(linear.weight.shape[0]) for linear in linears])


def _hf_llama(name: str):
    def extract(model: nn.Module) -> LlamaSpec:
        config = model.config
        if config.hidden_act not in SILUS:
            raise Unsupported(f"hidden_act={config.hidden_act!r} (dslab's Llama MLP runs SiLU only)")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        if heads % kv_heads:
            raise Unsupported(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope_type, inv_freq = _rope_frequencies(config, head_dim)
        max_positions, notes = config.max_position_embeddings, []
        window = _sliding_window(config)
        if window is not None and window < max_positions:
            notes.append(f"{name}: sliding_window={window} < max_position_embeddings={max_positions}; dslab runs "
                         f"sequences of up to {window} positions, where the window masks no key")
            max_positions = window
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(LlamaLayerSpec(
                qkv_weight=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
                qkv_bias=_stacked_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                out_weight=attn.o_proj.weight.detach(), out_bias=_bias(attn.o_proj),
                gate_up_weight=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                gate_up_bias=_stacked_bias(mlp.gate_proj, mlp.up_proj),
                down_weight=mlp.down_proj.weight.detach(), down_bias=_bias(mlp.down_proj),
                attention_norm=layer.input_layernorm.weight.detach(),
                mlp_norm=layer.post_attention_layernorm.weight.detach(),
            ))
        return LlamaSpec(
            source=name, hidden=config.hidden_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            intermediate=config.intermediate_size, max_positions=max_positions, vocab_size=config.vocab_size,
            eps=config.rms_norm_eps, rope_type=rope_type, rope_inv_freq=inv_freq,
            word_embeddings=model.model.embed_tokens.weight.detach(), layers=layers,
            final_norm=model.model.norm.weight.detach(), lm_head=model.lm_head.weight.detach(), notes=notes,
        )

    return extract


@dataclass(frozen=True)
class Policy:
    """One model class: its name, how to recognise it, its layer class and how to read it."""

    name: str
    class_name: str
    module_prefix: str
    layer_class_of: object  # model -> the class of its transformer layers
    extract: object         # model -> ModelSpec or LlamaSpec (raises Unsupported)

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
    *(Policy(f"transformers.{name}", name, "transformers.", lambda m: type(m.model.layers[0]),
             _hf_llama(f"transformers.{name}"))
      for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")),
)


def find_policy(model: nn.Module, injection_policy: dict | None = None) -> tuple[Policy, ModelSpec | LlamaSpec]:
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


def _expected_shapes(spec: ModelSpec | LlamaSpec) -> dict[str, tuple[int, ...]]:
    h, i = spec.hidden, spec.intermediate
    if isinstance(spec, LlamaSpec):
        qkv, attn = (spec.heads + 2 * spec.kv_heads) * spec.head_dim, spec.heads * spec.head_dim
        return {"qkv_weight": (qkv, h), "qkv_bias": (qkv,), "out_weight": (h, attn), "out_bias": (h,),
                "gate_up_weight": (2 * i, h), "gate_up_bias": (2 * i,), "down_weight": (h, i), "down_bias": (h,),
                "attention_norm": (h,), "mlp_norm": (h,)}
    return {"qkv_weight": (3 * h, h), "out_weight": (h, h), "fc_in_weight": (i, h), "fc_out_weight": (h, i)}


def check_shapes(spec: ModelSpec | LlamaSpec) -> None:
    """Internal consistency of an extracted spec (shapes agree with the dims)."""
    expected = _expected_shapes(spec)
    for index, layer in enumerate(spec.layers):
        for name, shape in expected.items():
            tensor = getattr(layer, name)
            if tensor is None:
                continue
            got = tuple(tensor.shape)
            if got != shape:
                raise ValueError(f"{spec.source} layer {index}: {name} has shape {got}, expected {shape}")
    if not math.isfinite(spec.eps) or spec.eps < 0:
        raise ValueError(f"{spec.source}: layer norm epsilon {spec.eps} is not a finite non-negative number")
