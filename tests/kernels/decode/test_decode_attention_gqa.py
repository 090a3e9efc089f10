"""decode_attention with grouped-query caches: q ``[B, H, D]`` over k_cache, v_cache ``[B, H_kv,
S_max, D]``, query head ``h`` reading kv head ``h // (H // H_kv)`` (transformers' ``repeat_kv``).

The flash-decoding Triton kernels (under the interpreter on CPU) against the float64 reference at
small odd shapes with ragged valid ranges (a full one, a left-padded one stopping mid-cache, an
empty one), several splits; the same bits as multi-head decoding over caches repeated to q's
heads; the custom op under opcheck and torch.compile; the flops profiler's count per query head;
bad head counts."""

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.decode import decode_attention_triton as triton_impl
from dslab.kernels.decode.decode_attention import decode_attention, decode_attention_reference
from dslab.kernels.dispatch import interpreting

needs_interpreter = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton kernels need a GPU or TRITON_INTERPRET=1"
)

BATCH, S_MAX, HEAD_DIM = 3, 37, 32
STARTS, ENDS = [0, 20, 5], [37, 30, 5]  # full, left-padded and stopping mid-cache, empty


def _inputs(heads, kv_heads, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(BATCH, kv_heads, S_MAX, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(BATCH, kv_heads, S_MAX, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v, torch.tensor(STARTS, dtype=torch.int32), torch.tensor(ENDS, dtype=torch.int32)


def _repeat_kv(cache, group):
    batch, kv_heads, s_max, dim = cache.shape
    return cache[:, :, None].expand(batch, kv_heads, group, s_max, dim).reshape(batch, kv_heads * group, s_max, dim)


def test_reference_is_decoding_over_repeated_caches():
    q, k, v, start, end = _inputs(6, 2, torch.float64)
    expected = decode_attention_reference(q, _repeat_kv(k, 3), _repeat_kv(v, 3), start, end)
    assert torch.equal(decode_attention_reference(q, k, v, start, end), expected)
    # Query head 4 reads kv head 1: plain attention over sequence 1's valid keys.
    scores = k[1, 1, 20:30] @ q[1, 4] / HEAD_DIM**0.5
    torch.testing.assert_close(expected[1, 4], torch.softmax(scores, 0) @ v[1, 1, 20:30])


@needs_interpreter
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits,block_n", [(None, None), (3, 8)], ids=["planned", "3x8"])
def test_triton_matches_fp64_reference(heads, kv_heads, dtype, splits, block_n):
    q, k, v, start, end = _inputs(heads, kv_heads, dtype)
    got = triton_impl.decode_attention(q, k, v, start, end, HEAD_DIM**-0.5, splits, block_n)
    assert got.dtype == dtype and got.shape == q.shape and not torch.isnan(got).any()
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # the empty range
    exact = decode_attention_reference(q.double(), k.double(), v.double(), start, end)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)
    else:  # the reference's fp32 math rounded to the low dtype, against the same exact value
        rows = slice(0, 2)
        low = decode_attention_reference(q, k, v, start, end)
        limit = max(2 * (low[rows].double() - exact[rows]).abs().max().item(), 1e-3)
        assert (got[rows].double() - exact[rows]).abs().max().item() <= limit


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 3])
def test_same_bits_as_multi_head_decoding_over_repeated_caches(splits):
    """Each query head's program reads its kv head's rows, the values the repeated cache holds
    there: the outputs are bitwise those of multi-head decoding. The caches are one layer of a
    [layers, 2, B, H_kv, S_max, D] block (strided), and NaN outside the valid ranges is never read."""
    q, k, v, start, end = _inputs(6, 2, torch.bfloat16, seed=1)
    positions = torch.arange(S_MAX)
    outside = ~((positions >= start[:, None]) & (positions < end[:, None]))
    block = torch.empty((2, 2, BATCH, 2, S_MAX, HEAD_DIM), dtype=torch.bfloat16)
    block[1, 0], block[1, 1] = (t.masked_fill(outside[:, None, :, None], float("nan")) for t in (k, v))
    grouped = triton_impl.decode_attention(q, block[1, 0], block[1, 1], start, end, 0.2, splits, 8)
    repeated = triton_impl.decode_attention(q, _repeat_kv(k, 3), _repeat_kv(v, 3), start, end, 0.2, splits, 8)
    assert torch.equal(grouped, repeated)


@needs_interpreter
def test_public_op_custom_op_and_torch_compile():
    q, k, v, start, end = _inputs(4, 1, torch.float32, seed=2)
    expected = decode_attention_reference(q, k, v, start, end)
    torch.library.opcheck(torch.ops.dslab.decode_attention.default, (q, k, v, start, end, HEAD_DIM**-0.5),
                          test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda *a: decode_attention(*a) * 2, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager = decode_attention(q, k, v, start, end)
        traced = compiled(q, k, v, start, end)
    torch._dynamo.reset()
    torch.testing.assert_close(eager, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(traced, 2 * expected, rtol=1e-5, atol=1e-6)


@needs_interpreter
def test_flops_profiler_counts_query_heads():
    """4 * H * D per attended position with H q's heads (the dot products run per query head)."""
    from torch import nn

    from dslab.profilers.flops import FlopsProfiler

    heads = 6
    q, k, v, start, end = _inputs(heads, 2, torch.float32, seed=3)

    class Decode(nn.Module):
        def forward(self, q):
            return decode_attention(q, k, v, start, end)

    model = Decode()
    profiler = FlopsProfiler(model)
    with kernel_backend("triton"), torch.no_grad():
        profiler.start_profile()
        model(q)
        profiler.stop_profile()
    attended = sum(e - s for s, e in zip(STARTS, ENDS))
    assert profiler.records()["flops_by_op"]["dslab::decode_attention"] == {
        "figure": "matmul", "flops": 4 * heads * HEAD_DIM * attended}


@pytest.mark.parametrize("heads,k_heads,v_heads,match", [
    (6, 4, 4, "q has 6 heads and k_cache, v_cache have 4"),
    (4, 0, 0, "q has 4 heads and k_cache, v_cache have 0"),
    (4, 2, 1, r"k_cache must have shape \[B, H, S_max, D\] with the same H \(H_kv\) as v_cache"),
])
def test_heads_that_do_not_divide_raise_value_error(heads, k_heads, v_heads, match):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(BATCH, heads, HEAD_DIM, generator=gen)
    k = torch.randn(BATCH, k_heads, S_MAX, HEAD_DIM, generator=gen)
    v = torch.randn(BATCH, v_heads, S_MAX, HEAD_DIM, generator=gen)
    start, end = torch.tensor(STARTS), torch.tensor(ENDS)
    with pytest.raises(ValueError, match=match):
        decode_attention(q, k, v, start, end)
