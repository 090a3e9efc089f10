"""Conversion between HuggingFace ``transformers`` state dicts and dslab's models' state dicts.

Pure functions over ``{name: tensor}`` dicts (no import of ``transformers`` or of the models).

BERT (``BertForPreTraining``): HF keeps separate ``query``/``key``/``value`` ``[hidden, hidden]``
projections; dslab stacks them into one ``qkv`` ``[3 * hidden, hidden]`` (rows q, then k, then v).
HF's ``cls.predictions.decoder.weight`` and ``.bias`` are tied to the word embeddings and to
``cls.predictions.bias``; dslab stores each once.

GPT-2 (``GPT2LMHeadModel``): HF's ``Conv1D`` stores ``weight`` as ``[in, out]`` (``y = x W + b``),
the transpose of ``nn.Linear``'s ``[out, in]``; ``c_attn`` is already q, k, v stacked along ``out``.
``lm_head.weight`` is tied to ``wte``. dslab's ``wte`` may have extra (padding) rows beyond HF's
vocabulary: they are filled with zeros on the way in and dropped on the way out.

Every ``*_from_hf`` raises ValueError naming the keys that are missing or unexpected, and when a
tied copy differs from its original.
"""

from __future__ import annotations

import torch

# Buffers some transformers versions put into state dicts; they hold no weights.
_BERT_BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
_GPT2_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def _bert_pairs(layers: int) -> list[tuple[str, str]]:
    """(dslab name, HF name) for every tensor that maps one to one."""
    pairs = [
        ("embeddings.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
        ("embeddings.position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
        ("embeddings.token_type_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"),
        ("embeddings.norm.weight", "bert.embeddings.LayerNorm.weight"),
        ("embeddings.norm.bias", "bert.embeddings.LayerNorm.bias"),
        ("pooler.weight", "bert.pooler.dense.weight"),
        ("pooler.bias", "bert.pooler.dense.bias"),
        ("nsp_classifier.weight", "cls.seq_relationship.weight"),
        ("nsp_classifier.bias", "cls.seq_relationship.bias"),
        ("mlm_dense.weight", "cls.predictions.transform.dense.weight"),
        ("mlm_dense_bias", "cls.predictions.transform.dense.bias"),
        ("mlm_norm.weight", "cls.predictions.transform.LayerNorm.weight"),
        ("mlm_norm.bias", "cls.predictions.transform.LayerNorm.bias"),
        ("mlm_bias", "cls.predictions.bias"),
    ]
    for i in range(layers):
        ours, hf = f"layers.{i}.", f"bert.encoder.layer.{i}."
        pairs += [
            (ours + "attention.out_proj.weight", hf + "attention.output.dense.weight"),
            (ours + "attention.out_bias", hf + "attention.output.dense.bias"),
            (ours + "attention_norm.weight", hf + "attention.output.LayerNorm.weight"),
            (ours + "attention_norm.bias", hf + "attention.output.LayerNorm.bias"),
            (ours + "mlp.fc_in.weight", hf + "intermediate.dense.weight"),
            (ours + "mlp.fc_in_bias", hf + "intermediate.dense.bias"),
            (ours + "mlp.fc_out.weight", hf + "output.dense.weight"),
            (ours + "mlp.fc_out_bias", hf + "output.dense.bias"),
            (ours + "mlp_norm.weight", hf + "output.LayerNorm.weight"),
            (ours + "mlp_norm.bias", hf + "output.LayerNorm.bias"),
        ]
    return pairs


def _check_keys(state_dict: dict, expected: set[str], ignorable, what: str) -> None:
    keys = {k for k in state_dict if not ignorable(k)}
    missing, unexpected = sorted(expected - keys), sorted(keys - expected)
    if missing or unexpected:
        raise ValueError(f"state_dict is not a {what} state dict: missing keys {missing}, unexpected keys {unexpected}")


def _check_tied(state_dict: dict, copy: str, original: str) -> None:
    if copy in state_dict and not torch.equal(state_dict[copy], state_dict[original]):
        raise ValueError(f"state_dict[{copy!r}] differs from {original!r}: dslab's model ties them")


def bert_from_hf(state_dict: dict, layers: int) -> dict[str, torch.Tensor]:
    """dslab ``BertForPreTraining`` state dict of a HF ``BertForPreTraining`` one with ``layers`` layers."""
    pairs = _bert_pairs(layers)
    qkv_parts = [f"bert.encoder.layer.{i}.attention.self.{p}.{w}"
                 for i in range(layers) for p in ("query", "key", "value") for w in ("weight", "bias")]
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    _check_keys(state_dict, {hf for _, hf in pairs} | set(qkv_parts),
                lambda k: k in _BERT_BUFFERS or k in tied, "HuggingFace BertForPreTraining")
    _check_tied(state_dict, "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")
    _check_tied(state_dict, "cls.predictions.decoder.bias", "cls.predictions.bias")
    ours = {mine: state_dict[hf] for mine, hf in pairs}
    for i in range(layers):
        attn = f"bert.encoder.layer.{i}.attention.self."
        for w in ("weight", "bias"):
            ours[f"layers.{i}.attention.qkv.{w}"] = torch.cat(
                [state_dict[f"{attn}{p}.{w}"] for p in ("query", "key", "value")], dim=0
            )
    return ours


def bert_to_hf(state_dict: dict, layers: int) -> dict[str, torch.Tensor]:
    """HF ``BertForPreTraining`` state dict (tied copies included) of a dslab post-LN one."""
    hf = {theirs: state_dict[mine] for mine, theirs in _bert_pairs(layers)}
    for i in range(layers):
        attn = f"bert.encoder.layer.{i}.attention.self."
        for w in ("weight", "bias"):
            q, k, v = state_dict[f"layers.{i}.attention.qkv.{w}"].chunk(3, dim=0)
            hf[attn + "query." + w], hf[attn + "key." + w], hf[attn + "value." + w] = q, k, v
    hf["cls.predictions.decoder.weight"] = hf["bert.embeddings.word_embeddings.weight"]
    hf["cls.predictions.decoder.bias"] = hf["cls.predictions.bias"]
    return hf


def _gpt2_pairs(layers: int) -> list[tuple[str, str, bool]]:
    """(dslab name, HF name, transposed) for every tensor except ``wte``."""
    pairs = [
        ("wpe.weight", "transformer.wpe.weight", False),
        ("final_norm.weight", "transformer.ln_f.weight", False),
        ("final_norm.bias", "transformer.ln_f.bias", False),
    ]
    for i in range(layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        pairs += [
            (ours + "attention_norm.weight", hf + "ln_1.weight", False),
            (ours + "attention_norm.bias", hf + "ln_1.bias", False),
            (ours + "attention.qkv.weight", hf + "attn.c_attn.weight", True),
            (ours + "attention.qkv.bias", hf + "attn.c_attn.bias", False),
            (ours + "attention.out_proj.weight", hf + "attn.c_proj.weight", True),
            (ours + "attention.out_bias", hf + "attn.c_proj.bias", False),
            (ours + "mlp_norm.weight", hf + "ln_2.weight", False),
            (ours + "mlp_norm.bias", hf + "ln_2.bias", False),
            (ours + "mlp.fc_in.weight", hf + "mlp.c_fc.weight", True),
            (ours + "mlp.fc_in_bias", hf + "mlp.c_fc.bias", False),
            (ours + "mlp.fc_out.weight", hf + "mlp.c_proj.weight", True),
            (ours + "mlp.fc_out_bias", hf + "mlp.c_proj.bias", False),
        ]
    return pairs


def gpt2_from_hf(state_dict: dict, layers: int, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """dslab ``GPT2LMHeadModel`` state dict of a HF ``GPT2LMHeadModel`` one; ``wte`` gets zero rows
    up to ``padded_vocab_size``."""
    pairs = _gpt2_pairs(layers)
    _check_keys(state_dict, {hf for _, hf, _ in pairs} | {"transformer.wte.weight"},
                lambda k: k == "lm_head.weight" or k.endswith(_GPT2_BUFFER_SUFFIXES), "HuggingFace GPT2LMHeadModel")
    _check_tied(state_dict, "lm_head.weight", "transformer.wte.weight")
    ours = {mine: (state_dict[hf].t().contiguous() if transposed else state_dict[hf]) for mine, hf, transposed in pairs}
    wte = state_dict["transformer.wte.weight"]
    if wte.shape[0] > padded_vocab_size:
        raise ValueError(f"transformer.wte.weight has {wte.shape[0]} rows > the model's {padded_vocab_size}")
    ours["wte.weight"] = torch.cat([wte, wte.new_zeros(padded_vocab_size - wte.shape[0], wte.shape[1])])
    return ours


def gpt2_to_hf(state_dict: dict, layers: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """HF ``GPT2LMHeadModel`` state dict (with the tied ``lm_head.weight``) of a dslab one; ``wte``
    is cut to its first ``vocab_size`` rows."""
    hf = {theirs: (state_dict[mine].t().contiguous() if transposed else state_dict[mine])
          for mine, theirs, transposed in _gpt2_pairs(layers)}
    hf["transformer.wte.weight"] = state_dict["wte.weight"][:vocab_size]
    hf["lm_head.weight"] = hf["transformer.wte.weight"]
    return hf


# Llama (``LlamaForCausalLM``, and Mistral's and Qwen2's models without biases): HF keeps q, k, v
# and gate, up as separate ``[out, in]`` matrices; dslab stacks q, k, v into ``qkv`` and gate, up
# into ``gate_up``. A tied head (``tie_word_embeddings``) is stored once, as the embedding; the
# embedding (and an untied head) may have padding rows beyond HF's vocabulary.
_LLAMA_BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)


def _llama_pairs(layers: int) -> list[tuple[str, str]]:
    """(dslab name, HF name) for every tensor that maps one to one."""
    pairs = [("final_norm.weight", "model.norm.weight")]
    for i in range(layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        pairs += [
            (ours + "attention_norm.weight", hf + "input_layernorm.weight"),
            (ours + "attention.o_proj.weight", hf + "self_attn.o_proj.weight"),
            (ours + "mlp_norm.weight", hf + "post_attention_layernorm.weight"),
            (ours + "mlp.down.weight", hf + "mlp.down_proj.weight"),
        ]
    return pairs


def _pad_rows(t: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    if t.shape[0] > rows:
        raise ValueError(f"{name} has {t.shape[0]} rows > the model's {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def llama_from_hf(state_dict: dict, config) -> dict[str, torch.Tensor]:
    """dslab ``LlamaForCausalLM`` state dict of a HF ``LlamaForCausalLM`` one (``config``: a
    :class:`dslab.models.llama.LlamaConfig`); the embedding (and an untied head) get zero rows up
    to ``config.padded_vocab_size``."""
    layers, tied = config.layers, config.tie_word_embeddings
    pairs = _llama_pairs(layers)
    fused = {f"model.layers.{i}.{part}.weight" for i in range(layers)
             for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    expected = {hf for _, hf in pairs} | fused | {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
    _check_keys(state_dict, expected, lambda k: (tied and k == "lm_head.weight") or k.endswith(_LLAMA_BUFFER_SUFFIXES),
                "HuggingFace LlamaForCausalLM")
    if tied:
        _check_tied(state_dict, "lm_head.weight", "model.embed_tokens.weight")
    ours = {mine: state_dict[hf] for mine, hf in pairs}
    for i in range(layers):
        hf = f"model.layers.{i}."
        ours[f"layers.{i}.attention.qkv.weight"] = torch.cat(
            [state_dict[hf + f"self_attn.{p}_proj.weight"] for p in ("q", "k", "v")])
        ours[f"layers.{i}.mlp.gate_up.weight"] = torch.cat(
            [state_dict[hf + f"mlp.{p}_proj.weight"] for p in ("gate", "up")])
    rows = config.padded_vocab_size
    ours["embed.weight"] = _pad_rows(state_dict["model.embed_tokens.weight"], rows, "model.embed_tokens.weight")
    if not tied:
        ours["lm_head.weight"] = _pad_rows(state_dict["lm_head.weight"], rows, "lm_head.weight")
    return ours


def llama_to_hf(state_dict: dict, config) -> dict[str, torch.Tensor]:
    """HF ``LlamaForCausalLM`` state dict of a dslab one (a tied head as ``lm_head.weight`` equal to
    the embedding); the padding rows are dropped."""
    hf = {theirs: state_dict[mine] for mine, theirs in _llama_pairs(config.layers)}
    q_rows, kv_rows = config.heads * config.head_dim, config.kv_heads * config.head_dim
    for i in range(config.layers):
        prefix = f"model.layers.{i}."
        q, k, v = state_dict[f"layers.{i}.attention.qkv.weight"].split([q_rows, kv_rows, kv_rows])
        hf[prefix + "self_attn.q_proj.weight"], hf[prefix + "self_attn.k_proj.weight"] = q, k
        hf[prefix + "self_attn.v_proj.weight"] = v
        gate, up = state_dict[f"layers.{i}.mlp.gate_up.weight"].chunk(2)
        hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"] = gate, up
    vocab = config.vocab_size
    hf["model.embed_tokens.weight"] = state_dict["embed.weight"][:vocab]
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"] if config.tie_word_embeddings \
        else state_dict["lm_head.weight"][:vocab]
    return hf
