"""The inference kernels on a CUDA GPU at GPT-2 1.5B decode sizes: decode_attention (25 heads of
64, caches of 160 and 2048 positions, batch 1 and 32) and int8_linear (the 1600-wide model's
projections for 1 and 32 rows), against float64 references; CUDA-graph capture and replay without
a host synchronisation.

    python3 -m pytest -q -m gpu tests/kernels/decode/test_inference_kernels_gpu.py

Errors are relative Frobenius errors against float64 and must stay within twice PyTorch's own
error in the same precision (SDPA over the masked cache; ``F.linear`` on the dequantised weights),
plus a floor of an eighth of the output dtype's unit in the last place (STYLE.md #4).
"""

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels.decode.decode_attention import decode_attention

from dslab.kernels.quant.int8_linear import dequantize_int8, int8_linear, quantize_int8

from dslab.kernels import kernel_backend
from dslab.kernels.decode.decode_attention import decode_attention_reference
from dslab.kernels.quant.int8_linear import int8_linear_reference

pytestmark = pytest.mark.gpu

HEADS, HEAD_DIM, HIDDEN = 25, 64, 1600


def _relative_error(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


def _assert_within_torch_error(name, got, torch_low, exact, contraction=1):
    """Within twice PyTorch's error plus a floor: for fp32, the rounding a length-``contraction``
    dot product may gather in another summation order (split-K partials) than cuBLAS's,
    eps * sqrt(length); for 16-bit results an eighth of an ulp (their output rounding dominates)."""
    err, torch_err = _relative_error(got, exact), _relative_error(torch_low, exact)
    eps = torch.finfo(got.dtype).eps
    floor = eps * contraction ** 0.5 if got.dtype == torch.float32 else eps / 8
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _cache_inputs(batch, s_max, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", generator=gen).to(dtype)
    k = torch.randn(batch, HEADS, s_max, HEAD_DIM, device="cuda", generator=gen).to(dtype)
    v = torch.randn(batch, HEADS, s_max, HEAD_DIM, device="cuda", generator=gen).to(dtype)
    return q, k, v


def _ranges(batch, s_max, seed):
    """Left-padded ranges: sequence 0 fills the cache, the others start after random padding and
    end anywhere after it; with a batch, one sequence is empty."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, s_max // 2, (batch,), generator=gen)
    end = start + 1 + (torch.rand(batch, generator=gen) * (s_max - start - 1)).long()
    start[0], end[0] = 0, s_max
    if batch > 1:
        end[1] = start[1]
    return start.to(torch.int32).cuda(), end.to(torch.int32).cuda()


def _sdpa(q, k, v, start, end):
    positions = torch.arange(k.shape[2], device=q.device)
    mask = (positions >= start[:, None]) & (positions < end[:, None])
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :])[:, :, 0]


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("s_max", [160, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decode_attention_at_gpt2_xl_sizes(batch, s_max, dtype):
    q, k, v = _cache_inputs(batch, s_max, dtype, seed=batch + s_max)
    start, end = _ranges(batch, s_max, seed=s_max)
    with kernel_backend("triton"):
        got = decode_attention(q, k, v, start, end)
    exact = decode_attention_reference(q.double(), k.double(), v.double(), start, end)
    assert got.dtype == dtype and torch.isfinite(got).all()
    rows = [b for b in range(batch) if end[b] > start[b]]
    if batch > 1:
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    _assert_within_torch_error(f"B={batch} S={s_max}", got[rows], _sdpa(q, k, v, start, end)[rows], exact[rows])


def test_decode_attention_fp32():
    q, k, v = _cache_inputs(4, 300, torch.float32, seed=5)
    start, end = _ranges(4, 300, seed=5)
    with kernel_backend("triton"):
        got = decode_attention(q, k, v, start, end)
    torch.testing.assert_close(got.double(), decode_attention_reference(q.double(), k.double(), v.double(), start,
                                                                        end), rtol=1e-5, atol=1e-6)


def test_decode_attention_graph_replays_follow_the_device_lengths():
    """Captured once, replayed after writing new bounds into the same tensors (as a decode loop
    does each step): each replay attends over the new ranges, and nothing synchronises."""
    q, k, v = _cache_inputs(1, 2048, torch.bfloat16, seed=7)
    start = torch.zeros(1, dtype=torch.int32, device="cuda")
    end = torch.full((1,), 33, dtype=torch.int32, device="cuda")
    with kernel_backend("triton"):
        decode_attention(q, k, v, start, end)  # compile outside the capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = decode_attention(q, k, v, start, end)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for length in (33, 34, 160, 2048):
        end.fill_(length)
        graph.replay()
        want = decode_attention_reference(q, k, v, start, end)
        torch.testing.assert_close(captured.float(), want.float(), rtol=2e-2, atol=2e-2)


# (rows, N, K): the QKV, attention-out, MLP-up and MLP-down projections of GPT-2 1.5B.
LINEAR_SHAPES = [(1, 3 * HIDDEN, HIDDEN), (1, HIDDEN, HIDDEN), (1, 4 * HIDDEN, HIDDEN), (1, HIDDEN, 4 * HIDDEN),
                 (32, 4 * HIDDEN, HIDDEN), (32, HIDDEN, 4 * HIDDEN),
                 (5, 1000, 1592)]  # and N, K no multiple of a block (K takes per-channel and g8 only)


@pytest.mark.parametrize("rows,n,k", LINEAR_SHAPES, ids=str)
# g128 (K = 6400 only: 128 does not divide 1600) loads one scale per column per K step of 128;
# g64 and g8 gather a scale per element of the step.
@pytest.mark.parametrize("group_size", [None, 128, 64, 8], ids=["per-channel", "g128", "g64", "g8"])
def test_int8_linear_at_gpt2_xl_sizes(rows, n, k, group_size):
    if group_size and k % group_size:
        pytest.skip(f"group_size {group_size} does not divide K = {k}")
    gen = torch.Generator(device="cuda").manual_seed(rows + n + k)
    weight = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    qweight, scale = quantize_int8(weight, group_size)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    bias = (torch.randn(n, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    with kernel_backend("triton"):
        got = int8_linear(x, qweight, scale, bias, group_size)
        again = int8_linear(x, qweight, scale, bias, group_size)
    assert torch.equal(got, again), "split-K must be deterministic"
    exact = int8_linear_reference(x.double(), qweight, scale, bias.double(), group_size)
    torch_low = F.linear(x, dequantize_int8(qweight, scale, group_size, torch.bfloat16), bias)
    _assert_within_torch_error(f"{rows}x{n}x{k}", got, torch_low, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_int8_linear_other_dtypes(dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    qweight, scale = quantize_int8(torch.randn(4 * HIDDEN, HIDDEN, device="cuda", generator=gen), 64)
    x = torch.randn(3, HIDDEN, device="cuda", generator=gen).to(dtype)
    with kernel_backend("triton"):
        got = int8_linear(x, qweight, scale, None, 64)
    exact = int8_linear_reference(x.double(), qweight, scale, None, 64)
    torch_low = F.linear(x, dequantize_int8(qweight, scale, 64, dtype))
    _assert_within_torch_error(str(dtype), got, torch_low, exact, contraction=HIDDEN)


def test_int8_linear_graph_capture_without_sync():
    gen = torch.Generator(device="cuda").manual_seed(4)
    qweight, scale = quantize_int8(torch.randn(4 * HIDDEN, HIDDEN, device="cuda", generator=gen), 64)
    x = torch.randn(1, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    with kernel_backend("triton"):
        eager = int8_linear(x, qweight, scale, None, 64)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = int8_linear(x, qweight, scale, None, 64)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    assert torch.equal(captured, eager)
    x.copy_(torch.randn(1, HIDDEN, device="cuda", generator=gen))
    graph.replay()
    assert torch.equal(captured, int8_linear(x, qweight, scale, None, 64))


@pytest.mark.parametrize("batch, s_max", [(1, 2048), (3, 160)])  # 96 rows: several splits on 132 SMs
def test_decode_attention_fused_combine_replays_as_the_combine_kernel(batch, s_max):
    """decode attention's fused combine (the last split of a row combines it) captured in a CUDA
    graph and replayed over growing valid lengths: bit for bit the two-launch path's output every
    time, so the per-row counters are back at zero after each replay."""
    from dslab.kernels.decode import decode_attention_triton as triton_impl

    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(batch, 32, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(batch, 8, s_max, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    start = torch.zeros(batch, dtype=torch.int32, device="cuda")
    end = torch.full((batch,), 17, dtype=torch.int32, device="cuda")
    splits, _ = triton_impl.plan_splits(batch * 32, s_max, triton_impl.block_size(HEAD_DIM), q.device)
    assert splits > 1
    fused = lambda: triton_impl.decode_attention(q, k, v, start, end, HEAD_DIM**-0.5, combine="fused")  # noqa: E731
    fused()  # compiled outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = fused()
    torch.cuda.current_stream().wait_stream(stream)
    for length in (17, 100, s_max // 2, s_max):
        end.fill_(length)
        graph.replay()
        want = triton_impl.decode_attention(q, k, v, start, end, HEAD_DIM**-0.5, combine="kernel")
        assert torch.equal(out, want), length
    torch.cuda.synchronize()
    assert int(triton_impl._counters(q.device)[:batch * 32].abs().sum()) == 0
