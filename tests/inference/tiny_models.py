"""Tiny models with random weights for the inference tests (no downloads): transformers' GPT-2,
BERT and Llama-layout models (Llama, Mistral, Qwen2) built from small configs, and dslab's own
GPT-2 and BERT. Seeded, so every call gives the
same weights. Head dim 32 (4 heads of 128), the smallest dslab's attention takes."""

from __future__ import annotations

import torch

VOCAB = 256
HIDDEN = 128
HEADS = 4
LAYERS = 2
POSITIONS = 64
# GPT-2's 0.02 makes a 2-layer random model repeat one token forever; 0.3 gives varied greedy
# outputs whose top-2 logit gaps (>= 2e-3 on these inputs) are far above fp32 rounding (~1e-6).
VARIED_INIT = 0.3


def hf_gpt2(seed: int = 0, initializer_range: float = VARIED_INIT, **overrides):
    import transformers

    config = transformers.GPT2Config(**{**dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                                 n_positions=POSITIONS, initializer_range=initializer_range,
                                                 bos_token_id=0, eos_token_id=1), **overrides})
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


def hf_bert_config(**overrides):
    import transformers

    return transformers.BertConfig(**{**dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                             num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
                                             max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
                                             attention_probs_dropout_prob=0.0), **overrides})


def hf_bert(cls_name: str = "BertModel", seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, cls_name)(hf_bert_config(**overrides)).eval()


def dslab_gpt2(seed: int = 0, initializer_range: float = VARIED_INIT, **overrides):
    from dslab.models import GPT2LMHeadModel, gpt2_tiny

    torch.manual_seed(seed)
    config = gpt2_tiny(dropout=0.0, vocab_pad_multiple=64, initializer_range=initializer_range, **overrides)
    return GPT2LMHeadModel(config, kernels="torch").eval()


def dslab_bert(seed: int = 0, **overrides):
    from dslab.models import BertForPreTraining, bert_tiny

    torch.manual_seed(seed)
    return BertForPreTraining(bert_tiny(hidden_dropout=0.0, attention_dropout=0.0, **overrides), kernels="torch").eval()


LLAMA_VOCAB = 300
LLAMA_KV_HEADS = 2
LLAMA_INTERMEDIATE = 160
LLAMA_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def hf_llama_config(family: str = "llama", **overrides):
    """A tiny config of transformers' Llama, Mistral or Qwen2: grouped-query attention (4 query
    heads over 2 key/value heads of 32), an MLP of 160, vocabulary 300, 64 positions."""
    import transformers

    defaults = dict(vocab_size=LLAMA_VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=LLAMA_KV_HEADS, head_dim=HIDDEN // HEADS, intermediate_size=LLAMA_INTERMEDIATE,
                    max_position_embeddings=POSITIONS, bos_token_id=0, eos_token_id=1, pad_token_id=0,
                    initializer_range=VARIED_INIT / 2)
    if family == "mistral":
        defaults["sliding_window"] = None
    return getattr(transformers, LLAMA_CLASSES[family][0])(**{**defaults, **overrides})


def hf_llama(family: str = "llama", seed: int = 0, **overrides):
    """transformers' ``LlamaForCausalLM`` (or Mistral's, Qwen2's) of :func:`hf_llama_config`, with
    random weights from ``seed`` (norm weights randomised too, so that they matter)."""
    import transformers

    config = hf_llama_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, LLAMA_CLASSES[family][1])(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model


def prompts(batch: int, seq: int, vocab: int = VOCAB, seed: int = 1, pads: list[int] | None = None):
    """``(input_ids, attention_mask)``: random ids and a left-padding mask with ``pads[b]`` pad
    positions in row b (pad ids are 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads or []):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask
