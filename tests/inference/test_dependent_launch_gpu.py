"""On a Hopper GPU: programmatic dependent launch of the decode kernels
(``DSLAB_DEPENDENT_LAUNCH=1``, :func:`dslab.kernels.dispatch.dependent_launch`) gives bit for bit
the tokens and logits of ordinary launches. A dependent launch starts while the kernel before it
runs and must wait before touching what that kernel writes: a kernel that read too early would give
different numbers, at random. So the check repeats: a chain of decode_linear launches (residual
adds, RMSNorm; at one row the persistent row kernel, at three the tile kernel with its split-K
partials and counters; the next launch reading the last one's output)
replayed from a CUDA graph many times, and greedy generation of GPT-2 and Llama layouts (the fused
step, attention's split and combine kernels) under graphs, against the same without dependent
launch."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_gpt2, hf_llama, prompts

import dslab
import dslab.kernels.decode.decode_linear_triton as linear_triton
import dslab.kernels.decode.decode_row_triton as row_triton
from dslab.kernels.decode.decode_linear import decode_linear
from dslab.kernels.dispatch import dependent_launch, dependent_launches

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hopper():
    with dependent_launches(True):
        if not dependent_launch(torch.device("cuda")):
            pytest.skip("programmatic dependent launch needs compute capability 9.0 and Triton's gdc_wait")


def _chain(x, weights, norms):
    """Launches that each read the previous one's output: ``h = down(rms(up(h) ...))``."""
    residual = x
    h = x
    for (up, down), norm in zip(weights, norms):
        y, residual = decode_linear(h, up, residual=residual, rms_norm=(norm, 1e-5), return_sum=True)
        h = decode_linear(y, down)
    return h + residual


@pytest.mark.parametrize("rows", [1, 3])  # the persistent one-row kernel; the tile kernel (split K)
def test_a_chain_of_dependent_launches_replays_to_the_ordinary_launches_result(rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, wide, layers = 2048, 8192, 6
    weights = [(torch.randn(wide, hidden, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02,
                torch.randn(hidden, wide, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02)
               for _ in range(layers)]
    norms = [torch.rand(hidden, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(layers)]
    x = torch.randn(rows, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    launched = []
    real = {module: module.launch for module in (linear_triton, row_triton)}

    def spy(module):
        def launch(*args):
            launched.append((module.__name__.rsplit(".", 1)[1], args[-1]))
            return real[module](*args)
        return launch

    results = {}
    for dependent in (False, True):
        with dependent_launches(dependent):
            for module in real:
                module.launch = spy(module)
            try:
                static = x.clone()
                _chain(static, weights, norms)  # compiles
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = _chain(static, weights, norms)
            finally:
                for module, launch in real.items():
                    module.launch = launch
        outputs = []
        for i in range(50):
            static.copy_(x * (1 + i % 3))
            graph.replay()
            outputs.append(out.clone())
        torch.cuda.synchronize()
        results[dependent] = outputs
    # a warm-up chain and a capture of each, every launch by the kernel of its row count
    kernel = "decode_row_triton" if rows == 1 else "decode_linear_triton"
    assert launched.count((kernel, True)) == launched.count((kernel, False)) == 2 * 2 * layers
    assert len(launched) == 2 * 2 * 2 * layers
    for ordinary, dependent in zip(results[False], results[True]):
        assert torch.equal(ordinary, dependent)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_generation_is_unchanged(family):
    model = (hf_gpt2() if family == "gpt2" else hf_llama()).cuda()
    ids, mask = (t.cuda() for t in prompts(1, 12))
    run = dict(attention_mask=mask, max_new_tokens=32, eos_token_id=None, pad_token_id=0,
               output_scores=True, return_dict_in_generate=True)
    outputs = {}
    for dependent in (False, True):
        with dependent_launches(dependent):
            engine = dslab.init_inference(model, dtype=torch.bfloat16, max_out_tokens=64)
            first = engine.generate(ids, **run)
            again = engine.generate(ids, **run)  # graph replays
        assert torch.equal(first.sequences, again.sequences)
        outputs[dependent] = first
    assert torch.equal(outputs[False].sequences, outputs[True].sequences)
    for ordinary, dependent in zip(outputs[False].scores, outputs[True].scores):
        assert torch.equal(ordinary, dependent)
