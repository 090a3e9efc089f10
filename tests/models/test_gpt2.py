"""GPT-2 against HuggingFace's ``GPT2LMHeadModel`` (random init, fp32, eager attention), for both
kernel sets and with a padded vocabulary; plus tied weights, parameter counts, gradients,
causality and input checks."""

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.models.gpt2 import (
    GPT2Config, GPT2LMHeadModel, gpt2_124m, gpt2_355m, gpt2_774m, gpt2_1558m, gpt2_tiny,
)

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 3, 20
TOL = dict(rtol=1e-4, atol=1e-5)


def _config(**overrides) -> GPT2Config:
    return gpt2_tiny(dropout=0.0, **overrides)


@pytest.fixture(scope="module")
def hf_model():
    cfg = _config()
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.hidden, n_layer=cfg.layers,
        n_head=cfg.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=cfg.layer_norm_epsilon, bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():  # HF initialises LayerNorm to (1, 0) and biases to 0: make them random
        for name, p in model.named_parameters():
            if ".ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _batch(seed, batch=BATCH, seq=SEQ, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, 5:9] = -100
    return ids, labels


def _hf_outputs(hf_model, ids, labels):
    with torch.no_grad():
        out = hf_model(input_ids=ids, labels=labels)
    return out.logits, out.loss


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
@pytest.mark.parametrize("pad", [1, 64])
def test_matches_huggingface(hf_model, kernels, pad):
    config = _config(vocab_pad_multiple=pad)
    model = GPT2LMHeadModel.from_hf_state_dict(hf_model.state_dict(), config, kernels=kernels).eval()
    assert model.wte.weight.shape[0] == (1000 if pad == 1 else 1024)
    ids, labels = _batch(seed=1)
    hf_logits, hf_loss = _hf_outputs(hf_model, ids, labels)
    with torch.no_grad():
        logits, loss = model(ids), model(ids, labels)
    assert logits.shape == (BATCH, SEQ, 1000)
    torch.testing.assert_close(logits, hf_logits, **TOL)
    torch.testing.assert_close(loss, hf_loss, **TOL)


def test_triton_interpreter_path_matches_huggingface(hf_model):
    """The dslab set with every op forced onto its Triton kernel (interpreted on CPU), fp32, with
    a padded vocabulary (the loss kernel reads strided logits rows)."""
    config = _config(vocab_pad_multiple=64)
    model = GPT2LMHeadModel.from_hf_state_dict(hf_model.state_dict(), config, kernels="dslab").eval()
    ids, labels = _batch(seed=2, batch=2, seq=8)
    _, hf_loss = _hf_outputs(hf_model, ids, labels)
    with kernel_backend("triton"), torch.no_grad():
        loss = model(ids, labels)
    torch.testing.assert_close(loss, hf_loss, **TOL)


def test_triton_interpreter_path_in_bf16_is_within_twice_torch_error():
    """bf16 end to end (causal attention too takes its Triton kernel): the loss and every
    gradient of the dslab set stay within twice the error of the torch set in bf16, both measured
    against the torch set in fp64, plus one bf16 ulp at the tensor's scale."""
    torch.manual_seed(0)
    state = GPT2LMHeadModel(_config(), kernels="torch").state_dict()
    ids, labels = _batch(seed=12, batch=2, seq=8)

    def run(kernels, dtype, backend):
        model = GPT2LMHeadModel(_config(), kernels=kernels).eval()
        model.load_state_dict(state)
        model.to(dtype)
        with kernel_backend(backend):
            loss = model(ids, labels)
            loss.backward()
        return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}

    exact, low, ours = run("torch", torch.float64, "torch"), run("torch", torch.bfloat16, "torch"), \
        run("dslab", torch.bfloat16, "triton")
    for name, ref in exact.items():
        err = (ours[name].double() - ref).abs().max().item()
        torch_err = (low[name].double() - ref).abs().max().item()
        floor = torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
        assert err <= 2 * torch_err + floor, f"{name}: {err:.3g} vs torch's {torch_err:.3g} (+{floor:.2g})"


@pytest.mark.parametrize("pad", [1, 64])
def test_to_hf_state_dict_loads_into_huggingface(hf_model, pad):
    torch.manual_seed(5)
    ours = GPT2LMHeadModel(_config(vocab_pad_multiple=pad), kernels="torch").eval()
    hf = transformers.GPT2LMHeadModel(hf_model.config).eval()
    hf.load_state_dict(ours.to_hf_state_dict(), strict=True)
    ids, labels = _batch(seed=3)
    hf_logits, hf_loss = _hf_outputs(hf, ids, labels)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_logits, **TOL)
        torch.testing.assert_close(ours(ids, labels), hf_loss, **TOL)


def test_from_hf_rejects_a_foreign_or_untied_state_dict(hf_model):
    state = dict(hf_model.state_dict())
    del state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match="transformer.h.1.mlp.c_fc.bias"):
        GPT2LMHeadModel.from_hf_state_dict(state, _config(), kernels="torch")
    state = dict(hf_model.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] * 2
    with pytest.raises(ValueError, match="ties"):
        GPT2LMHeadModel.from_hf_state_dict(state, _config(), kernels="torch")


def test_config_from_hf(hf_model):
    config = GPT2Config.from_hf(hf_model.config)
    assert config == _config(initializer_range=hf_model.config.initializer_range)


def test_lm_head_is_tied_to_wte():
    model = GPT2LMHeadModel(_config(), kernels="torch")
    assert model.lm_head_weight is model.wte.weight
    assert [n for n, p in model.named_parameters() if p is model.wte.weight] == ["wte.weight"]


def test_parameter_count_matches_huggingface(hf_model):
    ours = GPT2LMHeadModel(_config(), kernels="torch")
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf_model.parameters())


@pytest.mark.parametrize(("preset", "count"), [
    (gpt2_124m, 124_439_808), (gpt2_355m, 354_823_168), (gpt2_774m, 774_030_080), (gpt2_1558m, 1_557_611_200),
])
def test_full_size_parameter_counts_on_meta(preset, count):
    with torch.device("meta"):
        model = GPT2LMHeadModel(preset(), kernels="dslab")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == count


def test_padded_vocab_size():
    assert gpt2_124m(vocab_pad_multiple=64).padded_vocab_size == 50304
    assert gpt2_124m().padded_vocab_size == 50257
    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_124m(vocab_pad_multiple=64), kernels="torch")
    assert sum(p.numel() for p in model.parameters()) == 124_439_808 + 47 * 768


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
def test_gradients_reach_every_parameter(kernels):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(), kernels=kernels).train()
    ids, labels = _batch(seed=4)
    loss = model(ids, labels)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_padding_rows_get_no_gradient():
    model = GPT2LMHeadModel(_config(vocab_pad_multiple=64), kernels="dslab")
    ids, labels = _batch(seed=5)
    model(ids, labels).backward()
    assert model.wte.weight.grad[1000:].abs().sum() == 0
    assert model.wte.weight.grad[:1000].abs().sum() > 0


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
def test_causal(kernels):
    model = GPT2LMHeadModel(_config(), kernels=kernels).eval()
    ids, _ = _batch(seed=6)
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 1000
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
def test_dropout_is_reproducible_from_the_torch_seed(kernels):
    model = GPT2LMHeadModel(gpt2_tiny(), kernels=kernels).train()
    ids, labels = _batch(seed=7)

    def loss(seed):
        torch.manual_seed(seed)
        return model(ids, labels)

    assert torch.equal(loss(1), loss(1))
    assert not torch.equal(loss(1), loss(2))


def test_bad_config_and_inputs_raise_value_error():
    with pytest.raises(ValueError, match="heads=3"):
        gpt2_tiny(heads=3)
    with pytest.raises(ValueError, match="vocab_pad_multiple"):
        gpt2_tiny(vocab_pad_multiple=0)
    with pytest.raises(ValueError, match="kernels"):
        GPT2LMHeadModel(gpt2_tiny(), kernels="triton")
    with pytest.raises(ValueError, match="head dim"):
        GPT2LMHeadModel(gpt2_tiny(heads=8), kernels="dslab")
    model = GPT2LMHeadModel(gpt2_tiny(), kernels="torch")
    with pytest.raises(ValueError, match="n_positions"):
        model(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
def test_trains_under_autocast(kernels):
    """The engine's mixed precision: bf16 autocast over fp32 parameters."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config(), kernels=kernels)
    ids, labels = _batch(seed=8)
    with torch.no_grad():
        fp32_loss = model(ids, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels)
    loss.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, fp32_loss, rtol=2e-2, atol=0.0)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
