"""The fused decode step (dslab.inference.fused_decode) against the op-by-op step on the same
caches: logits of consecutive tokens and the KV cache entries they write, for a left-padded
batch, on the PyTorch reference and on the Triton kernels (interpreter), in fp32, bf16 and int8.
Also: when the engine falls back to the op-by-op step, and that greedy generation is unchanged."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_gpt2, prompts

import dslab
from dslab.inference.fused_decode import unfused_reason
from dslab.kernels import kernel_backend
from dslab.kernels.dispatch import interpreting

# Two steps: the second reads the cache entries the first wrote.
STEPS = 2
# Two layers (layer 0 gathers the embeddings, layer 1 reads the residual stream), two heads of 32
# (the smallest head dim prefill attention takes), hidden 64 (two K blocks of the interpreter's 32),
# an MLP of 80 (fc_out's K of 80 ends in a partial K block), a vocabulary of 100 (the head's 128
# padded rows cut back to 100): few interpreted programs per Triton launch.
HIDDEN, HEADS, INNER, VOCAB = 64, 2, 80, 100


@pytest.fixture(scope="module")
def model():
    return hf_gpt2(n_embd=HIDDEN, n_head=HEADS, n_inner=INNER, vocab_size=VOCAB)


def _steps(engine, ids, mask, fused: bool):
    """Logits of STEPS decode steps after the prompt, and the cache, with the step fused or not."""
    module = engine.module
    module.fused_decode = fused
    runner = engine._runner
    runner.release()
    slot = runner.slot(ids.shape[0])
    valid_start = (mask == 0).sum(dim=1).to(torch.int32)
    with torch.no_grad():
        logits = module.prefill(ids, mask, slot.cache)
        tokens = logits.argmax(-1)
        slot.start(tokens, ids.shape[1], valid_start)
        out = []
        for _ in range(STEPS):
            step = runner.step(slot)[:ids.shape[0]].clone()
            out.append(step)
            slot.tokens[:ids.shape[0]].copy_(step.argmax(-1))
    cache = [t.clone() for t in (*slot.cache.keys, *slot.cache.values)]
    module.fused_decode = True
    return torch.stack(out), cache, slot.write_pos.clone()


def compare_steps(model, dtype):
    """fp32: the fused step's logits and cache entries equal the op-by-op step's within 1e-5
    (1e-4 on Triton: other summation orders). bf16 and int8 round differently (bias and GELU on
    the fp32 accumulator; int8 multiplied before its scale): both steps are held to the fp32 step,
    and the fused one may be off by at most twice the op-by-op step's own error."""
    engine = dslab.init_inference(model, dtype=dtype, max_out_tokens=16)
    engine.module.fused_decode_rows = 4  # the batch of 3 (bucket 4) fused too
    ids, mask = (t.to(engine.device) for t in prompts(3, 8, vocab=VOCAB, pads=[0, 3, 1]))
    assert unfused_reason(engine.module, 4) is None
    fused, fused_cache, pos_f = _steps(engine, ids, mask, True)
    plain, plain_cache, pos_p = _steps(engine, ids, mask, False)
    assert torch.equal(pos_f, pos_p)
    if dtype == torch.float32:
        tol = dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fused, plain, **tol)
        last = int(pos_f.max())  # the rows' caches up to the last position written (bucket rows past 3 are filler)
        for got, want in zip(fused_cache, plain_cache):
            torch.testing.assert_close(got[:3, :, :last], want[:3, :, :last], **tol)
        return
    with kernel_backend("torch"):  # the fp32 yardstick on PyTorch's ops (the interpreter adds nothing to it)
        exact, _, _ = _steps(dslab.init_inference(model, dtype=torch.float32, max_out_tokens=16), ids, mask, False)
    fused_err = (fused.float() - exact).abs().max().item()
    plain_err = (plain.float() - exact).abs().max().item()
    assert 0 < plain_err and fused_err <= 2 * plain_err, (fused_err, plain_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_fused_step_matches_the_op_by_op_step_on_the_reference(model, dtype):
    with kernel_backend("torch"):
        compare_steps(model, dtype)


@pytest.mark.skipif(not interpreting(), reason="the Triton interpreter runs on CPU (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_fused_step_matches_the_op_by_op_step_on_triton(model, dtype):
    with kernel_backend("triton"):
        compare_steps(model, dtype)


def test_greedy_tokens_equal_with_and_without_fusion(model):
    ids, mask = prompts(3, 8, vocab=VOCAB, pads=[0, 3, 1])
    engine = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=24)
    engine.module.fused_decode_rows = 4
    fused = engine.generate(ids, attention_mask=mask, max_new_tokens=8)
    engine.module.fused_decode = False
    engine.release_cuda_graphs()
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), fused)


def test_when_the_step_is_not_fused(model):
    engine = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=16)
    module = engine.module
    assert unfused_reason(module, 1) is None and unfused_reason(module, 8) is None
    assert unfused_reason(module, 16) == "16 rows > fused_decode_rows (8)"
    module.fused_decode_rows = 1000
    assert unfused_reason(module, 64) is None
    assert unfused_reason(module, 65) == "65 rows > fused_decode_rows (64)"
    grouped = dslab.init_inference(model, dtype=torch.int8, max_out_tokens=16,
                                   quant={"weight": {"q_groups": 2}})
    assert unfused_reason(grouped.module, 1) == "int8 weights with group scales"
    from torch.utils.flop_counter import FlopCounterMode  # a dispatch mode, as the flops profiler's
    with FlopCounterMode(display=False):
        assert "dispatch mode" in unfused_reason(module, 1)
    module.fused_decode = False
    assert unfused_reason(module, 1) == "fused_decode is off"
