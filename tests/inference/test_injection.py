"""Injection: every model dslab has a policy for gives the source model's outputs in fp32, on
fresh random weights and inputs (tolerance 2e-5 absolute on values of order 1: fp32 rounding of
two different op orders, measured ~5e-7); a model without a policy runs unchanged with a warning;
the flops profiler counts the injected model; the memory records and checkpoint loading."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_models import HEADS, HIDDEN, LAYERS, VOCAB, dslab_bert, dslab_gpt2, hf_bert, hf_gpt2, prompts

import dslab
from dslab.inference.modules import InferenceLinear, InferenceTransformer

ATOL = 2e-5


def _close(ours, theirs, mask=None):
    ours, theirs = ours.float(), theirs.float()
    if mask is not None:  # outputs at padding positions are not defined the same way
        ours, theirs = ours * mask[..., None], theirs * mask[..., None]
    err = (ours - theirs).abs().max().item()
    assert err <= ATOL, f"max |error| {err:.3g} > {ATOL}"


def test_init_inference_is_exported():
    assert dslab.init_inference is dslab.inference.init_inference


def test_hf_gpt2_logits_with_and_without_left_padding():
    model = hf_gpt2()
    engine = dslab.init_inference(model, dtype=torch.float32)
    assert engine.injected and engine.policy == "transformers.GPT2LMHeadModel"
    assert isinstance(engine.module, InferenceTransformer)
    assert not any("transformers" in type(m).__module__ for m in engine.module.modules())
    qkv = engine.module.layers[0].qkv
    assert isinstance(qkv, InferenceLinear) and qkv.weight.shape == (3 * HIDDEN, HIDDEN)  # one fused QKV GEMM
    ids, mask = prompts(3, 12, pads=[0, 4, 9])
    with torch.no_grad():
        plain = model(ids).logits
        # transformers' forward numbers positions 0..S-1 unless told; generate derives them from the mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        padded = model(ids, attention_mask=mask, position_ids=positions).logits
    _close(engine(ids), plain)
    _close(engine(ids, attention_mask=mask), padded, mask)


def test_an_odd_vocabulary_is_padded_for_the_head_and_cut_from_the_logits():
    """GPT-2's 50257 rows would put the head GEMM on cuBLAS's unaligned kernels: the embeddings
    (tied head) and BERT's decoder bias are padded to a multiple of 64 rows, the logits cut back."""
    model = hf_gpt2(vocab_size=250)
    engine = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=24)
    assert engine.module.word_embeddings.shape == (256, HIDDEN) and engine.module.lm_head is engine.module.word_embeddings
    ids, mask = prompts(2, 9, vocab=250, pads=[0, 3])
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
    logits = engine(ids, attention_mask=mask)
    assert logits.shape == (2, 9, 250)
    _close(logits, expected, mask)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=6), want)
    assert torch.equal(engine.generate(ids[:1], max_new_tokens=6), want[:1])  # batch 1: the fused step's head
    mlm = hf_bert("BertForMaskedLM", vocab_size=250)
    engine = dslab.init_inference(mlm, dtype=torch.float32)
    with torch.no_grad():
        expected = mlm(ids).logits
    _close(engine(ids), expected)


def test_dslab_gpt2_logits():
    model = dslab_gpt2()
    engine = dslab.init_inference(model, dtype=torch.float32)
    assert engine.policy == "dslab.GPT2LMHeadModel"
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids)
    out = engine(ids)
    assert out.shape == (2, 20, model.config.vocab_size)  # padding rows of the embedding cut off
    _close(out, expected)


def test_hf_bert_model_and_masked_lm():
    ids, mask = prompts(3, 14, seed=5)
    mask[1, 10:] = 0  # BERT pads on the right
    types = torch.zeros_like(ids)
    types[:, 7:] = 1
    model = hf_bert("BertModel")
    engine = dslab.init_inference(model, dtype=torch.float32)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, token_type_ids=types)
    hidden, pooled = engine(ids, attention_mask=mask, token_type_ids=types)
    _close(hidden, expected.last_hidden_state, mask)
    _close(pooled, expected.pooler_output)
    mlm = hf_bert("BertForMaskedLM", seed=1)
    engine = dslab.init_inference(mlm, dtype=torch.float32)
    assert engine.policy == "transformers.BertForMaskedLM"
    with torch.no_grad():
        expected = mlm(ids, attention_mask=mask, token_type_ids=types).logits
    logits = engine(ids, attention_mask=mask, token_type_ids=types)
    assert logits.shape == (3, 14, VOCAB)
    _close(logits, expected, mask)
    with pytest.raises(ValueError, match="causal language model"):
        engine.generate(ids, max_new_tokens=2)


def test_dslab_bert_logits():
    model = dslab_bert()
    engine = dslab.init_inference(model, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0
    with torch.no_grad():
        mlm, nsp = model(ids, attention_mask=mask)
    ours_mlm, ours_nsp = engine(ids, attention_mask=mask)
    _close(ours_mlm, mlm, mask)
    _close(ours_nsp, nsp)


def test_half_precision_tracks_fp32():
    model = hf_gpt2(initializer_range=0.02)
    ids, _ = prompts(2, 16)
    reference = dslab.init_inference(model, dtype=torch.float32)(ids)
    for dtype in (torch.bfloat16, torch.float16):
        engine = dslab.init_inference(model, dtype=dtype)
        out = engine(ids)
        assert out.dtype == dtype and engine.module.word_embeddings.dtype == dtype
        # bf16 keeps 8 bits of mantissa: logits of order 1 are off by a few 1e-2 after two layers
        assert (out.float() - reference).abs().max().item() < 0.06


def test_unsupported_model_runs_unchanged_with_a_warning():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    with pytest.warns(UserWarning, match="no injection policy for torch.nn.modules.container.Sequential"):
        engine = dslab.init_inference(model, dtype=torch.float32)
    assert not engine.injected and engine.module is model
    x = torch.randn(3, 8)
    assert torch.equal(engine(x), model(x).detach())
    with pytest.raises(ValueError, match="has no generate"):
        engine.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=1)
    with pytest.raises(ValueError, match="dtype=torch.int8 quantises the layers dslab injects"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dslab.init_inference(torch.nn.Linear(4, 4), dtype=torch.int8)


def test_unsupported_setting_of_a_known_class_says_why():
    model = hf_gpt2(activation_function="relu")
    with pytest.warns(UserWarning, match="activation_function='relu'"):
        engine = dslab.init_inference(model, dtype=torch.float32)
    assert not engine.injected


def test_without_kernel_injection_the_model_runs_unchanged():
    model = hf_gpt2()
    engine = dslab.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=False)
    assert engine.module is model and not engine.injected
    ids, mask = prompts(1, 6)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert out.shape == (1, 9)


def test_flops_profiler_counts_the_injected_model():
    from dslab.profiling.flops_profiler import get_model_profile

    engine = dslab.init_inference(hf_gpt2(), dtype=torch.float32)
    batch, seq = 2, 16
    ids, _ = prompts(batch, seq)
    flops, macs, params = get_model_profile(engine.module, kwargs={"input_ids": ids}, print_profile=False,
                                            as_string=False)
    linear = LAYERS * 12 * HIDDEN * HIDDEN + VOCAB * HIDDEN  # QKV, out, MLP (4x) per layer; the LM head
    attention = LAYERS * 2 * (2 * batch * HEADS * seq * seq * (HIDDEN // HEADS))  # q k^T and p v
    assert flops == 2 * batch * seq * linear + attention
    assert params == sum(p.numel() for p in engine.module.parameters())


def test_memory_records_count_weights_and_kv_cache():
    engine = dslab.init_inference(hf_gpt2(), dtype=torch.float32, max_out_tokens=40)
    records = engine.memory_records()
    params = {p.data_ptr(): p.numel() * 4 for p in engine.module.parameters()}  # the tied head counts once
    assert records["weights_bytes"] == sum(params.values()) and records["kv_cache_bytes"] == 0
    ids, mask = prompts(3, 5, pads=[0, 2, 0])
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    records = engine.memory_records()
    cache = records["kv_caches"][0]
    assert (cache["batch"], cache["max_seq"]) == (4, 40)  # batch 3 runs in the bucket of 4
    assert records["kv_cache_bytes"] == 2 * LAYERS * 4 * HEADS * 40 * (HIDDEN // HEADS) * 4


def test_checkpoint_loads_before_injection(tmp_path):
    source, target = hf_gpt2(seed=0), hf_gpt2(seed=7)
    path = tmp_path / "weights.pt"
    torch.save({k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}, path)
    ids, _ = prompts(1, 8)
    with torch.no_grad():
        expected = source(ids).logits
    engine = dslab.init_inference(target, dtype=torch.float32, checkpoint=str(path))
    _close(engine(ids), expected)
    (tmp_path / "ckpt.json").write_text('{"type": "ds_model", "version": 0.0, "checkpoints": "weights.pt"}')
    engine = dslab.init_inference(hf_gpt2(seed=9), dtype=torch.float32, checkpoint=str(tmp_path / "ckpt.json"))
    _close(engine(ids), expected)
    with pytest.raises(ValueError, match="does not exist"):
        dslab.init_inference(hf_gpt2(), checkpoint=str(tmp_path / "missing.pt"))
    torch.save({"transformer.wte.weight": torch.zeros(3, 3)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="bad.pt does not fit GPT2LMHeadModel"):
        dslab.init_inference(hf_gpt2(), checkpoint=str(tmp_path / "bad.pt"))
    with pytest.raises(ValueError, match="Megatron"):
        dslab.init_inference(hf_gpt2(), checkpoint={"type": "Megatron", "checkpoints": ["a.pt"]})
