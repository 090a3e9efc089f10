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
