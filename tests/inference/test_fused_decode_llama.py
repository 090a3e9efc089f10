"""The fused Llama-layout decode step (dslab.inference.fused_decode_llama) against the op-by-op
step from the same caches: logits of consecutive tokens and the KV cache entries they write, at
batch 1 and at a left-padded batch of 3, on the PyTorch reference and on the Triton kernels
(interpreter), in fp32, bf16 and int8; on transformers' Llama (untied head, biases on every
projection, Llama-3 rope scaling) and Qwen2 (tied embeddings, q/k/v biases), both with
grouped-query attention (4 query heads over 2 key/value heads). Also: greedy generation with and without fusion, against transformers, and when the
engine falls back to the op-by-op step."""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import hf_llama, prompts

import dslab
import dslab.inference.llama_modules as llama_modules
from dslab.inference.fused_decode_llama import unfused_reason
from dslab.kernels import kernel_backend
from dslab.kernels.dispatch import interpreting

# Three steps: the later ones read the cache entries the earlier ones wrote.
STEPS = 3
# Hidden 32 (one K block of the interpreter's 32) under 4 query heads of 32 (q is 128 wide, as
# Mistral's head_dim allows; 32 is the smallest head dim the engine's attention takes) over 2
# key/value heads, an MLP of 40 (down's K of 40 ends in a partial block, o_proj's 128 is four), a
# vocabulary of 60 (the head's 64 padded rows cut back to 60): few interpreted programs per
# Triton launch, each slow under the interpreter.
SHAPE = dict(hidden_size=32, head_dim=32, intermediate_size=40, vocab_size=60)
VOCAB = SHAPE["vocab_size"]
PADS = {1: [0], 3: [0, 3, 1]}
FAMILIES = ["llama", "qwen2"]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
OVERRIDES = {"llama": dict(attention_bias=True, mlp_bias=True, rope_scaling=LLAMA3, rope_theta=500000.0),
             "qwen2": dict(tie_word_embeddings=True)}


@functools.cache
def tiny(family: str):
    """Llama with an untied head, biases on every projection and Llama-3 rope scaling, or Qwen2
    with tied embeddings and q/k/v biases. Initialised at 0.3 (not tiny_models' 0.15, where a
    model this narrow repeats one token): greedy outputs vary, with top-2 logit gaps >= 0.03 on
    the generate test's prompts, far above fp32 rounding."""
    return hf_llama(family, initializer_range=0.3, **SHAPE, **OVERRIDES[family])


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny(request.param)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused steps ``decode_step`` runs."""
    calls = []
    real = llama_modules.fused_decode_step

    def counted(*args):
        calls.append(args[1].shape[0])
        return real(*args)

    monkeypatch.setattr(llama_modules, "fused_decode_step", counted)
    return calls


def _prefilled(engine, batch):
    """A decode slot of ``batch`` rows after the prompts (prefilled on the PyTorch reference, so
    that every variant starts from the same cache)."""
    ids, mask = (t.to(engine.device) for t in prompts(batch, 8, vocab=VOCAB, pads=PADS[batch]))
    runner = engine._runner
    runner.release()
    slot = runner.slot(batch)
    valid_start = (mask == 0).sum(dim=1).to(torch.int32)
    with torch.no_grad(), kernel_backend("torch"):
        logits = engine.module.prefill(ids, mask, slot.cache)
    slot.start(logits.argmax(-1), ids.shape[1], valid_start)
    return runner, slot


def _steps(engine, batch, fused: bool, steps: int = STEPS):
    """Logits of ``steps`` decode steps after the prompt, the caches, and the last write positions."""
    module = engine.module
    module.fused_decode = fused
    runner, slot = _prefilled(engine, batch)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            step = runner.step(slot)[:batch].float().clone()
            out.append(step)
            slot.tokens[:batch].copy_(step.argmax(-1))
    cache = [t[:batch].clone() for t in (*slot.cache.keys, *slot.cache.values)]
    module.fused_decode = True
    return torch.stack(out), cache, slot.write_pos[:batch].clone()


def compare_steps(model, dtype, batch, fused_calls, fp32_tolerance, steps=STEPS):
    """The fused step (on the backend in force) against the op-by-op step on PyTorch's ops (its
    Triton kernels are held to those in test_llama_injection.py). fp32: logits and new cache
    entries equal within ``fp32_tolerance`` (1e-5 on the reference, 1e-4 on Triton: other
    summation orders). bf16 and int8 round differently (bias, rope and SwiGLU on the fp32
    accumulator; int8 multiplied before its scale): both steps are held to the fp32 step, and the
    fused one may be off by at most twice the op-by-op step's own error."""
    engine = dslab.init_inference(model, dtype=dtype, max_out_tokens=16)
    engine.module.fused_decode_rows = 4  # the batch of 3 (bucket 4) fused too
    assert unfused_reason(engine.module, 4) is None
    fused, fused_cache, pos_f = _steps(engine, batch, True, steps)
    eager = engine.device.type == "cpu"  # on a GPU the steps replay the CUDA graph of one call
    assert len(fused_calls) == steps if eager else len(fused_calls) > 0
    calls = len(fused_calls)
    with kernel_backend("torch"):
        plain, plain_cache, pos_p = _steps(engine, batch, False, steps)
    assert len(fused_calls) == calls  # the op-by-op variant ran op by op
    assert torch.equal(pos_f, pos_p)
    if dtype == torch.float32:
        tol = dict(rtol=fp32_tolerance, atol=fp32_tolerance)
        torch.testing.assert_close(fused, plain, **tol)
        last = int(pos_f.max()) + 1  # every position written so far (later ones are zeros in both)
        for got, want in zip(fused_cache, plain_cache):
            torch.testing.assert_close(got[:, :, :last], want[:, :, :last], **tol)
        return
    with kernel_backend("torch"):  # the fp32 yardstick on PyTorch's ops
        exact, _, _ = _steps(dslab.init_inference(model, dtype=torch.float32, max_out_tokens=16), batch, False, steps)
    fused_err = (fused - exact).abs().max().item()
    plain_err = (plain - exact).abs().max().item()
    assert 0 < plain_err and fused_err <= 2 * plain_err, (fused_err, plain_err)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_fused_step_matches_the_op_by_op_step_on_the_reference(model, dtype, batch, fused_calls):
    with kernel_backend("torch"):
        compare_steps(model, dtype, batch, fused_calls, 1e-5)


@pytest.mark.skipif(not interpreting(), reason="the Triton interpreter runs on CPU (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("family,dtype,batch", [("llama", torch.float32, 1), ("qwen2", torch.float32, 3),
                                                ("qwen2", torch.bfloat16, 1), ("llama", torch.int8, 3)])
def test_fused_step_matches_the_op_by_op_step_on_triton(family, dtype, batch, fused_calls):
    """Two steps each (the interpreter is slow); the batch-1 path and the tensor-core path, each
    model in fp32 and in one 16-bit case."""
    with kernel_backend("triton"):
        compare_steps(tiny(family), dtype, batch, fused_calls, 1e-4, steps=2)


def test_greedy_tokens_equal_with_and_without_fusion_and_transformers(model, fused_calls):
    engine = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=24)
    engine.module.fused_decode_rows = 4
    for batch in (1, 3):
        ids, mask = prompts(batch, 8, vocab=VOCAB, pads=PADS[batch], seed=4)
        calls = len(fused_calls)
        fused = engine.generate(ids, attention_mask=mask, max_new_tokens=8)
        assert len(fused_calls) == calls + 7  # every token after the prompt's first
        engine.module.fused_decode = False
        engine.release_cuda_graphs()
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), fused)
        engine.module.fused_decode = True
        engine.release_cuda_graphs()
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(fused, expected)
        assert len(set(fused[:, 8:].flatten().tolist())) >= 4  # varied continuations, not one token repeated


def test_when_the_step_is_not_fused(model):
    engine = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=16)
    module = engine.module
    assert (module.fused_decode, module.fused_decode_rows) == (True, 1)
    assert unfused_reason(module, 1) is None
    assert unfused_reason(module, 2) == "2 rows > fused_decode_rows (1)"
    module.fused_decode_rows = 1000
    assert unfused_reason(module, 64) is None
    assert unfused_reason(module, 65) == "65 rows > fused_decode_rows (64)"
    grouped = dslab.init_inference(model, dtype=torch.int8, max_out_tokens=16,
                                   quant={"weight": {"group_size": 8}})
    assert unfused_reason(grouped.module, 1) == "int8 weights with group scales"
    from torch.utils.flop_counter import FlopCounterMode  # a dispatch mode, as the flops profiler's
    with FlopCounterMode(display=False):
        assert "dispatch mode" in unfused_reason(module, 1)
    module.fused_decode = False
    assert unfused_reason(module, 1) == "fused_decode is off"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_fused_step_matches_the_op_by_op_step_on_a_gpu(dtype, batch, fused_calls):
    """The same comparison on a GPU: the kernel's block_config launches, replayed from CUDA graphs."""
    model = hf_llama("llama", initializer_range=0.3, **SHAPE, **OVERRIDES["llama"]).cuda()
    compare_steps(model, dtype, batch, fused_calls, 1e-4)
