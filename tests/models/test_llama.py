"""dslab's Llama against transformers' ``LlamaForCausalLM`` (random init, fp32, grouped-query
attention, Llama 3 rope scaling), for both kernel sets, tied and untied heads, a padded
vocabulary; training to the torch set's losses; the layer-stack variants; presets' parameter
counts; input and config checks."""

import dataclasses

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.models.llama import (
    LlamaConfig, LlamaForCausalLM, llama3_1b, llama3_3b, llama3_8b, llama_parameter_count, llama_tiny,
)

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 2, 19
TOL = dict(rtol=1e-4, atol=1e-5)


def _hf(config: LlamaConfig, seed=0):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.hf_kwargs(),
                                                                   attn_implementation="eager")).eval()
    with torch.no_grad():  # transformers initialises the RMSNorm weights to 1: make them random
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _batch(seed, batch=BATCH, seq=SEQ, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, 3:7] = -100
    return ids, labels


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
@pytest.mark.parametrize("tied,pad", [(True, 1), (False, 64)])
def test_matches_transformers(kernels, tied, pad):
    base = llama_tiny(tie_word_embeddings=tied)
    hf = _hf(base)
    model = LlamaForCausalLM.from_hf_state_dict(hf.state_dict(), dataclasses.replace(base, vocab_pad_multiple=pad),
                                                kernels=kernels).eval()
    ids, labels = _batch(seed=1)
    with torch.no_grad():
        out = hf(input_ids=ids, labels=labels)
        logits, loss = model(ids), model(ids, labels)
    assert logits.shape == (BATCH, SEQ, 1000)
    torch.testing.assert_close(logits, out.logits, **TOL)
    torch.testing.assert_close(loss, out.loss, **TOL)


def test_triton_interpreter_path_matches_transformers():
    """Every op of the dslab set on its Triton kernel (interpreted on CPU), fp32: RMSNorm with the
    residual add, rope, SwiGLU, the fused loss; attention takes the reference in fp32."""
    base = llama_tiny(layers=1)
    hf = _hf(base, seed=3)
    model = LlamaForCausalLM.from_hf_state_dict(hf.state_dict(), dataclasses.replace(base, vocab_pad_multiple=64),
                                                kernels="dslab").eval()
    ids, labels = _batch(seed=2, batch=1, seq=7)
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=labels).loss
        with kernel_backend("triton"):
            loss = model(ids, labels)
    torch.testing.assert_close(loss, ref, **TOL)


def test_triton_interpreter_path_in_bf16_is_within_twice_torch_error():
    """bf16 end to end, causal GQA attention on its Triton kernel too: the loss and every gradient
    of the dslab set within twice the torch set's bf16 error (both against the torch set in fp64),
    plus one bf16 ulp at the tensor's scale."""
    config = llama_tiny(layers=1)
    torch.manual_seed(0)
    state = LlamaForCausalLM(config, kernels="torch").state_dict()
    ids, labels = _batch(seed=12, batch=1, seq=8)

    def run(kernels, dtype, backend):
        model = LlamaForCausalLM(config, kernels=kernels).eval()
        model.load_state_dict(state)
        model.to(dtype)
        with kernel_backend(backend):
            loss = model(ids, labels)
            loss.backward()
        return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}

    exact, low = run("torch", torch.float64, "torch"), run("torch", torch.bfloat16, "torch")
    ours = run("dslab", torch.bfloat16, "triton")
    for name, ref in exact.items():
        err = (ours[name].double() - ref).abs().max().item()
        torch_err = (low[name].double() - ref).abs().max().item()
        floor = torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
        assert err <= 2 * torch_err + floor, f"{name}: {err:.3g} vs torch's {torch_err:.3g} (+{floor:.2g})"


def _train(kernels, config, steps, state, autocast=False, **model_overrides):
    model = LlamaForCausalLM(dataclasses.replace(config, **model_overrides), kernels=kernels)
    model.load_state_dict(state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        ids, labels = _batch(seed=100)  # one batch, learnt step by step
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


def test_dslab_set_trains_to_the_torch_sets_losses():
    config = llama_tiny(vocab_pad_multiple=64)
    torch.manual_seed(7)
    state = LlamaForCausalLM(config, kernels="torch").state_dict()
    ref, ref_model = _train("torch", config, 6, state)
    ours, model = _train("dslab", config, 6, state)
    assert ref[-1] < ref[0] - 0.1  # it learns
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-4, atol=1e-5)
    # Adam moves every weight by about lr per step (0.018 over the 6 steps here) whatever the size
    # of its gradient, so a gradient entry near 0 that the two sets round differently moves its
    # weight differently: 1% of the movement is allowed
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0.0, atol=2e-4, msg=name)


def test_trains_under_autocast_to_the_fp32_losses():
    config = llama_tiny()
    torch.manual_seed(8)
    state = LlamaForCausalLM(config, kernels="torch").state_dict()
    ref, _ = _train("torch", config, 3, state)
    for kernels in ("torch", "dslab"):
        losses, model = _train(kernels, config, 3, state, autocast=True)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=2e-2, atol=0.0)
        assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("overrides", [dict(chain_layer_norms=False), dict(checkpoint_layers=1),
                                       dict(checkpoint_layers=2, chain_layer_norms=False)], ids=str)
def test_layer_stack_variants_give_the_same_losses_and_gradients(overrides):
    config = llama_tiny(layers=3)
    torch.manual_seed(9)
    state = LlamaForCausalLM(config, kernels="dslab").state_dict()
    ids, labels = _batch(seed=4)
    grads = []
    for extra in ({}, overrides):
        model = LlamaForCausalLM(dataclasses.replace(config, **extra), kernels="dslab")
        model.load_state_dict(state)
        loss = model(ids, labels)
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[1][1], grads[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_to_hf_state_dict_loads_into_transformers():
    for tied, pad in ((True, 64), (False, 1)):
        config = llama_tiny(tie_word_embeddings=tied, vocab_pad_multiple=pad)
        torch.manual_seed(5)
        ours = LlamaForCausalLM(config, kernels="torch").eval()
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.hf_kwargs())).eval()
        hf.load_state_dict(ours.to_hf_state_dict())
        ids, _ = _batch(seed=6)
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), hf(ids).logits, **TOL)


def test_from_hf_state_dict_names_missing_keys_and_untied_heads():
    config = llama_tiny()
    state = _hf(config).state_dict()
    broken = {k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj"):
        LlamaForCausalLM.from_hf_state_dict(broken, config, kernels="torch")
    untied = dict(state, **{"lm_head.weight": state["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match="ties them"):
        LlamaForCausalLM.from_hf_state_dict(untied, config, kernels="torch")


def test_config_from_transformers_round_trips():
    for config in (llama_tiny(), llama3_1b(), llama3_8b(), llama_tiny(rope_scaling=None, kv_heads=4)):
        hf_config = transformers.LlamaConfig(**config.hf_kwargs())
        assert LlamaConfig.from_hf(hf_config) == config
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_hf(transformers.LlamaConfig(**{**llama_tiny().hf_kwargs(), "hidden_act": "gelu"}))


@pytest.mark.parametrize("preset,count", [(llama3_1b, 1_235_814_400), (llama3_3b, 3_212_749_824),
                                          (llama3_8b, 8_030_261_248)], ids=lambda x: getattr(x, "__name__", str(x)))
def test_preset_parameter_counts_match_transformers_on_meta(preset, count):
    config = preset()
    assert llama_parameter_count(config) == count
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.hf_kwargs()))
        ours = LlamaForCausalLM(config, kernels="torch")
    assert sum(p.numel() for p in hf.parameters()) == count
    assert sum(p.numel() for p in ours.parameters()) == count


def test_causal_and_padding_rows_get_no_gradient():
    config = llama_tiny(vocab_pad_multiple=64)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config, kernels="dslab").eval()
    ids, labels = _batch(seed=3)
    with torch.no_grad():
        full = model(ids)
        changed = ids.clone()
        changed[:, 10:] = (changed[:, 10:] + 1) % 1000
        torch.testing.assert_close(model(changed)[:, :10], full[:, :10], **TOL)
    model.train()
    model(ids, labels).backward()
    assert model.embed.weight.grad[1000:].abs().max() == 0
    assert all(p.grad is not None for p in model.parameters())


def test_bad_config_and_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        llama_tiny(kv_heads=3)
    with pytest.raises(ValueError, match="head_dim=33 must be even"):
        llama_tiny(head_dim=33)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        llama_tiny(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="head_dim=48"):
        LlamaForCausalLM(llama_tiny(head_dim=48), kernels="dslab")
    model = LlamaForCausalLM(llama_tiny(), kernels="torch")
    with pytest.raises(ValueError, match="max_positions"):
        model(torch.zeros(1, 257, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))
