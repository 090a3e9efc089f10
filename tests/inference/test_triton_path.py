"""The engine on dslab's Triton kernels (under TRITON_INTERPRET=1 on a CPU): flash attention for
the prompt, decode attention over the cache, the fused LayerNorm and bias+GELU, and the int8
weight-streaming GEMM, as a GPU runs them (eagerly: graphs need CUDA). The greedy tokens of a
left-padded batch equal the PyTorch-reference backend's, in fp32, bf16 and int8; fp32 logits agree
within 1e-4 (two summation orders; measured 2e-5)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_gpt2, prompts

import dslab
from dslab.kernels import kernel_backend
from dslab.kernels.dispatch import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="the Triton interpreter runs on CPU (TRITON_INTERPRET=1)")


@pytest.fixture(scope="module")
def model():
    return hf_gpt2()


@pytest.mark.parametrize("dtype,new_tokens", [(torch.float32, 4), (torch.bfloat16, 4), (torch.int8, 2)])
def test_triton_kernels_give_the_reference_tokens(model, dtype, new_tokens):
    ids, mask = prompts(3, 8, pads=[0, 3, 1])
    with kernel_backend("torch"):
        reference = dslab.init_inference(model, dtype=dtype, max_out_tokens=16)
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=new_tokens)
        expected_logits = reference(ids, attention_mask=mask) if dtype == torch.float32 else None
    with kernel_backend("triton"):
        engine = dslab.init_inference(model, dtype=dtype, max_out_tokens=16)
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=new_tokens), expected)
        if expected_logits is not None:
            err = ((engine(ids, attention_mask=mask) - expected_logits).abs() * mask[..., None]).max().item()
            assert err < 1e-4


def test_greedy_loop_with_eos_ids_on_the_triton_path(model):
    """The greedy loop's two-launch work between steps (kernels/decode/greedy_step.py) on the
    Triton path: a row that produces an eos id is padded from then on, generation stops once all
    have, and the output equals the reference backend's."""
    ids, mask = prompts(3, 8, pads=[0, 3, 1])
    with kernel_backend("torch"):
        reference = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=24)
        free = reference.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
        eos = int(free[0, 8 + 1])  # row 0's second new token
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    assert expected.shape[1] <= 8 + 6 and (expected[0, 8 + 2:] == 0).all()
    with kernel_backend("triton"):
        engine = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=24)
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=eos,
                                           pad_token_id=0), expected)
