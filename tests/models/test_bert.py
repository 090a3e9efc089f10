"""BERT for pretraining against HuggingFace's ``BertForPreTraining`` (random init, fp32, eager
attention, inputs with padding), for both kernel sets; plus its structure: tied weights,
parameter counts, gradients, pre-LN, dropout and input checks."""

import dataclasses

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.models.bert import BertConfig, BertForPreTraining, bert_base, bert_large, bert_tiny, key_padding_mask_of

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 3, 24
TOL = dict(rtol=1e-4, atol=1e-5)


def _config(**overrides) -> BertConfig:
    return bert_tiny(hidden_dropout=0.0, attention_dropout=0.0, **overrides)


@pytest.fixture(scope="module")
def hf_model():
    cfg = _config()
    torch.manual_seed(0)
    hf_cfg = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, intermediate_size=cfg.intermediate,
        max_position_embeddings=cfg.max_position, type_vocab_size=cfg.type_vocab,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=cfg.layer_norm_eps,
        attn_implementation="eager",
    )
    model = transformers.BertForPreTraining(hf_cfg).eval()
    with torch.no_grad():  # HF initialises LayerNorm to (1, 0) and biases to 0: make them random
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _batch(seed, batch=BATCH, seq=SEQ, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    types = torch.randint(0, 2, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 6:] = 0
    mask[-1, seq // 3:] = 0
    labels = torch.full((batch, seq), -100)
    picked = torch.rand(batch, seq, generator=g) < 0.3
    picked[0, 1] = True
    labels[picked] = ids[picked]
    nsp = torch.randint(0, 2, (batch,), generator=g)
    return ids, types, mask, labels, nsp


def _hf_outputs(hf_model, ids, types, mask, labels, nsp):
    with torch.no_grad():
        out = hf_model(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels,
                       next_sentence_label=nsp)
    return out.prediction_logits, out.seq_relationship_logits, out.loss


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
@pytest.mark.parametrize("sparse_mlm", [False, True])
def test_matches_huggingface(hf_model, kernels, sparse_mlm):
    model = BertForPreTraining.from_hf_state_dict(
        hf_model.state_dict(), _config(sparse_mlm=sparse_mlm), kernels=kernels
    ).eval()
    ids, types, mask, labels, nsp = _batch(seed=1)
    hf_mlm, hf_nsp, hf_loss = _hf_outputs(hf_model, ids, types, mask, labels, nsp)
    with torch.no_grad():
        mlm_logits, nsp_logits = model(ids, types, mask)
        loss = model(ids, types, mask, masked_lm_labels=labels, next_sentence_label=nsp)
    torch.testing.assert_close(mlm_logits, hf_mlm, **TOL)
    torch.testing.assert_close(nsp_logits, hf_nsp, **TOL)
    torch.testing.assert_close(loss, hf_loss, **TOL)


def test_triton_interpreter_path_matches_huggingface(hf_model):
    """The dslab set with every op forced onto its Triton kernel (interpreted on CPU), fp32."""
    model = BertForPreTraining.from_hf_state_dict(hf_model.state_dict(), _config(), kernels="dslab").eval()
    ids, types, mask, labels, nsp = _batch(seed=2, batch=2, seq=8)
    mask[1, 5:] = 0
    _, _, hf_loss = _hf_outputs(hf_model, ids, types, mask, labels, nsp)
    with kernel_backend("triton"), torch.no_grad():
        loss = model(ids, types, mask, masked_lm_labels=labels, next_sentence_label=nsp)
    torch.testing.assert_close(loss, hf_loss, **TOL)


def test_triton_interpreter_path_in_bf16_is_within_twice_torch_error():
    """bf16 end to end (attention too takes its Triton kernel, with padding): the loss and every
    gradient of the dslab set stay within twice the error of the torch set in bf16, both measured
    against the torch set in fp64, plus one bf16 ulp at the tensor's scale."""
    torch.manual_seed(0)
    state = BertForPreTraining(_config(), kernels="torch").state_dict()
    ids, types, mask, labels, nsp = _batch(seed=12, batch=2, seq=8)
    mask[1, 5:] = 0

    def run(kernels, dtype, backend):
        model = BertForPreTraining(_config(), kernels=kernels).eval()
        model.load_state_dict(state)
        model.to(dtype)
        with kernel_backend(backend):
            loss = model(ids, types, mask, masked_lm_labels=labels, next_sentence_label=nsp)
            loss.backward()
        return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}

    exact, low, ours = run("torch", torch.float64, "torch"), run("torch", torch.bfloat16, "torch"), \
        run("dslab", torch.bfloat16, "triton")
    for name, ref in exact.items():
        err = (ours[name].double() - ref).abs().max().item()
        torch_err = (low[name].double() - ref).abs().max().item()
        floor = torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
        assert err <= 2 * torch_err + floor, f"{name}: {err:.3g} vs torch's {torch_err:.3g} (+{floor:.2g})"


def test_to_hf_state_dict_loads_into_huggingface(hf_model):
    torch.manual_seed(5)
    ours = BertForPreTraining(_config(), kernels="torch").eval()
    hf = transformers.BertForPreTraining(hf_model.config).eval()
    hf.load_state_dict(ours.to_hf_state_dict(), strict=True)
    ids, types, mask, labels, nsp = _batch(seed=3)
    hf_mlm, hf_nsp, hf_loss = _hf_outputs(hf, ids, types, mask, labels, nsp)
    with torch.no_grad():
        mlm_logits, _ = ours(ids, types, mask)
        loss = ours(ids, types, mask, masked_lm_labels=labels, next_sentence_label=nsp)
    torch.testing.assert_close(mlm_logits, hf_mlm, **TOL)
    torch.testing.assert_close(loss, hf_loss, **TOL)


def test_from_hf_rejects_a_foreign_or_untied_state_dict(hf_model):
    state = dict(hf_model.state_dict())
    del state["bert.pooler.dense.bias"]
    with pytest.raises(ValueError, match="bert.pooler.dense.bias"):
        BertForPreTraining.from_hf_state_dict(state, _config(), kernels="torch")
    state = dict(hf_model.state_dict())
    state["cls.predictions.decoder.weight"] = state["cls.predictions.decoder.weight"] + 1
    with pytest.raises(ValueError, match="ties"):
        BertForPreTraining.from_hf_state_dict(state, _config(), kernels="torch")
    with pytest.raises(ValueError, match="pre_ln"):
        BertForPreTraining.from_hf_state_dict(hf_model.state_dict(), _config(pre_ln=True), kernels="torch")


def test_config_from_hf(hf_model):
    assert BertConfig.from_hf(hf_model.config) == dataclasses.replace(
        _config(), initializer_range=hf_model.config.initializer_range
    )


def test_parameter_count_matches_huggingface(hf_model):
    ours = BertForPreTraining(_config(), kernels="torch")
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf_model.parameters())


def _bert_parameter_count(c: BertConfig) -> int:
    h, i, v = c.hidden, c.intermediate, c.vocab_size
    embeddings = (v + c.max_position + c.type_vocab) * h + 2 * h
    layer = (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    heads = (h * h + h) + (2 * h + 2) + (h * h + h + 2 * h + v)  # pooler, NSP, MLM transform + bias
    return embeddings + c.layers * layer + heads


@pytest.mark.parametrize(("preset", "count"), [(bert_large, 336_232_258), (bert_base, 110_111_042)])
def test_full_size_parameter_counts_on_meta(preset, count):
    with torch.device("meta"):
        model = BertForPreTraining(preset(), kernels="dslab")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == count == _bert_parameter_count(preset())


def test_decoder_is_tied_to_word_embeddings():
    model = BertForPreTraining(_config(), kernels="torch")
    assert model.mlm_decoder_weight is model.embeddings.word_embeddings.weight
    names = [n for n, p in model.named_parameters() if p is model.mlm_decoder_weight]
    assert names == ["embeddings.word_embeddings.weight"]


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
@pytest.mark.parametrize("pre_ln", [False, True])
def test_gradients_reach_every_parameter(kernels, pre_ln):
    torch.manual_seed(0)
    model = BertForPreTraining(bert_tiny(pre_ln=pre_ln), kernels=kernels).train()
    ids, types, mask, labels, nsp = _batch(seed=4)
    loss = model(ids, types, mask, masked_lm_labels=labels, next_sentence_label=nsp)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_pre_ln_differs_from_post_ln():
    torch.manual_seed(0)
    post = BertForPreTraining(_config(), kernels="torch").eval()
    pre = BertForPreTraining(_config(pre_ln=True), kernels="torch").eval()
    assert pre.final_norm is not None and post.final_norm is None
    pre.load_state_dict({**post.state_dict(), **{f"final_norm.{k}": v for k, v in pre.final_norm.state_dict().items()}})
    ids, types, mask, _, _ = _batch(seed=6)
    with torch.no_grad():
        assert not torch.allclose(pre(ids, types, mask)[0], post(ids, types, mask)[0])


def test_sparse_mlm_gives_the_dense_loss_and_gradients():
    torch.manual_seed(0)
    dense = BertForPreTraining(_config(sparse_mlm=False), kernels="dslab")
    sparse = BertForPreTraining(_config(), kernels="dslab")
    sparse.load_state_dict(dense.state_dict())
    ids, types, mask, labels, nsp = _batch(seed=7)
    losses = [m(ids, types, mask, masked_lm_labels=labels, next_sentence_label=nsp) for m in (dense, sparse)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], **TOL)
    for (name, a), b in zip(dense.named_parameters(), sparse.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_mask_of_all_ones_is_no_mask():
    assert key_padding_mask_of(torch.ones(2, 5, dtype=torch.long)) is None
    mask = key_padding_mask_of(torch.tensor([[1, 1, 0]]))
    assert mask.tolist() == [[False, False, True]]
    model = BertForPreTraining(_config(), kernels="torch").eval()
    ids, types, _, _, _ = _batch(seed=8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, types, torch.ones_like(ids))[0], model(ids, types)[0])


def test_padded_keys_do_not_affect_real_tokens():
    model = BertForPreTraining(_config(), kernels="dslab").eval()
    ids, types, mask, _, _ = _batch(seed=9)
    changed = ids.clone()
    changed[mask == 0] = (changed[mask == 0] + 1) % 1000
    with torch.no_grad():
        a, b = model(ids, types, mask)[0], model(changed, types, mask)[0]
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], **TOL)


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
def test_dropout_is_reproducible_from_the_torch_seed(kernels):
    model = BertForPreTraining(bert_tiny(), kernels=kernels).train()
    ids, types, mask, labels, nsp = _batch(seed=10)

    def loss(seed):
        torch.manual_seed(seed)
        return model(ids, types, mask, masked_lm_labels=labels, next_sentence_label=nsp)

    assert torch.equal(loss(1), loss(1))
    assert not torch.equal(loss(1), loss(2))


def test_losses_given_one_label_at_a_time():
    model = BertForPreTraining(_config(), kernels="torch").eval()
    ids, types, mask, labels, nsp = _batch(seed=11)
    with torch.no_grad():
        both = model(ids, types, mask, masked_lm_labels=labels, next_sentence_label=nsp)
        mlm = model(ids, types, mask, masked_lm_labels=labels)
        nsp_only = model(ids, types, mask, next_sentence_label=nsp)
    torch.testing.assert_close(both, mlm + nsp_only)


def test_bad_config_and_inputs_raise_value_error():
    with pytest.raises(ValueError, match="heads=5"):
        bert_tiny(heads=5)
    with pytest.raises(ValueError, match="hidden_dropout"):
        bert_tiny(hidden_dropout=1.5)
    config = bert_tiny()
    config.layers = 0  # as a suite's model_options would set it, after construction
    with pytest.raises(ValueError, match="layers"):
        BertForPreTraining(config)
    with pytest.raises(ValueError, match="kernels"):
        BertForPreTraining(bert_tiny(), kernels="cuda")
    with pytest.raises(ValueError, match="head dim"):
        BertForPreTraining(bert_tiny(hidden=64), kernels="dslab")
    model = BertForPreTraining(bert_tiny(), kernels="torch")
    with pytest.raises(ValueError, match="max_position"):
        model(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.ones(2, 7))


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
def test_trains_under_autocast(kernels):
    """The engine's mixed precision: bf16 autocast over fp32 parameters."""
    torch.manual_seed(0)
    model = BertForPreTraining(_config(), kernels=kernels)
    ids, types, mask, labels, nsp = _batch(seed=13)
    with torch.no_grad():
        fp32_loss = model(ids, types, mask, masked_lm_labels=labels, next_sentence_label=nsp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, types, mask, masked_lm_labels=labels, next_sentence_label=nsp)
    loss.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, fp32_loss, rtol=2e-2, atol=0.0)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
