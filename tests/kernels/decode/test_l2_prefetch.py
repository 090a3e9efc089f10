"""The L2 prefetch a decode kernel may issue for a later kernel's bytes
(:mod:`dslab.kernels.decode.l2_prefetch`): its launch arguments and their checks on CPU; on a GPU,
decode attention with a prefetch gives the same bits as without (a hint changes no result) while
asking for every byte range the fused Llama step asks for. The PTX (the instruction, before the
wait) is checked in test_dependent_launch_ptx.py."""

from __future__ import annotations

import pytest
import torch

from dslab.kernels.decode.decode_attention import decode_attention
from dslab.kernels.decode.l2_prefetch import prefetch_args


def test_prefetch_arguments():
    launch = torch.zeros(4)
    weights = torch.zeros(100, 37, dtype=torch.bfloat16)
    assert prefetch_args(None, False, launch) == (launch, 0, False)
    pointer, nbytes, flag = prefetch_args(weights, False, launch)
    assert pointer is weights and flag and nbytes == 100 * 37 * 2 // 16 * 16  # whole 16-byte units
    assert prefetch_args(weights, True, launch)[2] is False  # the interpreter has no inline assembly
    assert prefetch_args(weights[:0], False, launch)[2] is False
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_args(weights[:, :5], False, launch)
    with pytest.raises(ValueError, match="16-byte aligned"):
        prefetch_args(weights.view(-1)[1:], False, launch)


def test_decode_attention_checks_the_prefetch_device():
    q = torch.randn(1, 4, 16)
    cache = torch.randn(1, 2, 8, 16)
    bounds = torch.tensor([0]), torch.tensor([5])
    with pytest.raises(ValueError, match="prefetch must be a tensor on q's device"):
        decode_attention(q, cache, cache, *bounds, prefetch=[1, 2])
    # the reference path takes the hint and ignores it
    torch.testing.assert_close(decode_attention(q, cache, cache, *bounds, prefetch=torch.zeros(64)),
                               decode_attention(q, cache, cache, *bounds))


@pytest.mark.gpu
@pytest.mark.parametrize("megabytes", [0.001, 1, 16, 40])
def test_a_prefetching_launch_gives_the_same_bits(megabytes):
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 32, 64, **bf16)
    keys, values = torch.randn(1, 8, 160, 64, **bf16), torch.randn(1, 8, 160, 64, **bf16)
    start, end = torch.tensor([0], device="cuda"), torch.tensor([97], device="cuda")
    weights = torch.randn(int(megabytes * 2 ** 20) // 2 + 7, **bf16)  # not a whole number of chunks
    plain = decode_attention(q, keys, values, start, end)
    prefetching = decode_attention(q, keys, values, start, end, prefetch=weights)
    torch.cuda.synchronize()
    assert torch.equal(plain, prefetching)
