"""decode_attention: the flash-decoding Triton kernels (under the interpreter on CPU) against the
fp32 reference and an fp64 one, at small odd shapes whose valid ranges leave whole splits masked;
masked cache positions never read; strided inputs; the custom op under opcheck and torch.compile;
forward-only; bad arguments."""

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels.decode.decode_attention import decode_attention

from dslab.kernels import kernel_backend
from dslab.kernels.decode import decode_attention_triton as triton_impl
from dslab.kernels.decode.decode_attention import decode_attention_reference
from dslab.kernels.dispatch import interpreting

needs_interpreter = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton kernels need a GPU or TRITON_INTERPRET=1"
)

BATCH, HEADS, S_MAX = 3, 2, 37
# Sequence 0 fills the cache, 1 is left-padded and stops mid-cache (the splits past position 30
# and before 20 are fully masked), 2 is empty (zeros out).
STARTS, ENDS = [0, 20, 5], [37, 30, 5]


def _inputs(head_dim, dtype, seed=0, bound_dtype=torch.int32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, head_dim, generator=gen).to(dtype)
    k = torch.randn(BATCH, HEADS, S_MAX, head_dim, generator=gen).to(dtype)
    v = torch.randn(BATCH, HEADS, S_MAX, head_dim, generator=gen).to(dtype)
    return q, k, v, torch.tensor(STARTS, dtype=bound_dtype), torch.tensor(ENDS, dtype=bound_dtype)


def _sdpa_low_precision(q, k, v, start, end):
    """PyTorch's own attention in the inputs' dtype (SDPA with a boolean mask), for the rows with a
    non-empty range: the baseline error a low-precision path is held to."""
    positions = torch.arange(k.shape[2])
    mask = (positions >= start[:, None]) & (positions < end[:, None])
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :])[:, :, 0]


def _relative_error(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


@needs_interpreter
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits,block_n", [(None, None), (1, 16), (3, 8)], ids=["planned", "one-split", "3x8"])
def test_triton_matches_fp64_reference(head_dim, dtype, splits, block_n):
    q, k, v, start, end = _inputs(head_dim, dtype)
    got = triton_impl.decode_attention(q, k, v, start, end, head_dim**-0.5, splits, block_n)
    assert got.dtype == dtype and got.shape == q.shape and not torch.isnan(got).any()
    exact = decode_attention_reference(q.double(), k.double(), v.double(), start, end)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # the empty range
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)
        return
    rows = slice(0, 2)
    baseline = _sdpa_low_precision(q[rows], k[rows], v[rows], start[rows], end[rows])
    limit = max(2 * _relative_error(baseline, exact[rows]), 1e-3)
    assert _relative_error(got[rows], exact[rows]) <= limit
    # And the module's own reference (fp32 math, output in the low dtype) to the output's rounding.
    reference = decode_attention_reference(q, k, v, start, end)
    torch.testing.assert_close(got.float(), reference.float(), rtol=1e-2, atol=1e-2)


@needs_interpreter
def test_splits_have_masked_ranges():
    """The planned splits at this shape are several, and some of them see no valid position."""
    splits, chunk = triton_impl.plan_splits(BATCH * HEADS, S_MAX, 16, torch.device("cpu"))
    assert splits >= 3 and chunk * (splits - 1) < S_MAX <= chunk * splits
    lo, hi = STARTS[1], ENDS[1]
    empty = [s for s in range(splits) if min(hi, (s + 1) * chunk) <= max(lo, s * chunk)]
    assert empty, "sequence 1 should leave a split fully masked"


@needs_interpreter
def test_masked_cache_positions_change_nothing():
    """NaN in every position outside the valid ranges changes nothing on the Triton path (a split's
    first block is read whole and masked in the arithmetic)."""
    q, k, v, start, end = _inputs(32, torch.float32, seed=1)
    positions = torch.arange(S_MAX)
    outside = ~((positions >= start[:, None]) & (positions < end[:, None]))  # [B, S]
    poisoned = [t.clone().masked_fill(outside[:, None, :, None], float("nan")) for t in (k, v)]
    with kernel_backend("triton"):
        clean = decode_attention(q, k, v, start, end)
        dirty = decode_attention(q, *poisoned, start, end)
    assert torch.equal(clean, dirty)


@needs_interpreter
def test_public_op_with_strided_views_and_int64_bounds():
    """q a slice of a fused projection, the caches one layer of a [layers, B, H, S, D] block, int64
    bounds, an explicit scale: the dispatched Triton path equals the reference."""
    gen = torch.Generator().manual_seed(2)
    head_dim, scale = 16, 0.3
    fused = torch.randn(BATCH, HEADS, 3 * head_dim, generator=gen)
    q = fused[:, :, head_dim:2 * head_dim]
    caches = torch.randn(2, 2, BATCH, HEADS, S_MAX, head_dim, generator=gen)
    k, v = caches[1, 0], caches[1, 1]
    start, end = torch.tensor(STARTS), torch.tensor(ENDS)
    with kernel_backend("triton"):
        got = decode_attention(q, k, v, start, end, scale)
    torch.testing.assert_close(got, decode_attention_reference(q, k, v, start, end, scale), rtol=1e-5, atol=1e-6)


def test_other_head_dims_take_the_reference():
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 3, 24, generator=gen), torch.randn(2, 3, 9, 24, generator=gen), torch.randn(2, 3, 9, 24)
    start, end = torch.tensor([0, 4]), torch.tensor([9, 6])
    with kernel_backend("triton" if interpreting() else "torch"):
        got = decode_attention(q, k, v, start, end)
    assert torch.equal(got, decode_attention_reference(q, k, v, start, end))
    # The reference is plain attention over the valid keys.
    expected = torch.softmax(q[1, :, None] @ k[1, :, 4:6].transpose(-1, -2) / 24**0.5, -1) @ v[1, :, 4:6]
    torch.testing.assert_close(got[1], expected[:, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_backward_raises_forward_only(backend):
    q, k, v, start, end = _inputs(16, torch.float32)
    q.requires_grad_()
    with kernel_backend(backend):
        out = decode_attention(q, k, v, start, end)
        with torch.no_grad():
            assert not decode_attention(q, k, v, start, end).requires_grad
    with pytest.raises(RuntimeError, match="decode_attention is forward-only"):
        out.sum().backward()


@needs_interpreter
def test_custom_op_opcheck_and_torch_compile():
    q, k, v, start, end = _inputs(16, torch.float32)
    torch.library.opcheck(torch.ops.dslab.decode_attention.default, (q, k, v, start, end, 0.25),
                          test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda *a: decode_attention(*a) * 2, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        got = compiled(q, k, v, start, end)
    torch.testing.assert_close(got, 2 * decode_attention_reference(q, k, v, start, end), rtol=1e-5, atol=1e-6)


@needs_interpreter
def test_flops_profiler_counts_the_attended_positions():
    from torch import nn

    from dslab.profilers.flops import FlopsProfiler

    q, k, v, start, end = _inputs(16, torch.float32)

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
        "figure": "matmul", "flops": 4 * HEADS * 16 * attended}


def test_bad_arguments_name_the_argument():
    q, k, v, start, end = _inputs(16, torch.float32)
    cases = [
        ((q[0], k, v, start, end), "q must be 3-D"),
        ((q.int(), k, v, start, end), "q must be a floating-point"),
        ((q, k[:, :1], v, start, end), r"k_cache must have shape \[B, H, S_max, D\]"),
        ((q, k, v[..., :8], start, end), "v_cache must have shape"),
        ((q, k, v.double(), start, end), "v_cache must have q's dtype"),
        ((q, k, v[:, :, :30], start, end), "v_cache must have k_cache's S_max"),
        ((q, k, v, start[:2], end), r"valid_start must have shape \(3,\)"),
        ((q, k, v, start, end.float()), "valid_end must be int32 or int64"),
        ((q, k, v, start, [37, 30, 5]), "valid_end must be a"),
        ((q, k, v, start.to("meta"), end), "valid_start must be on q's device"),
        ((q, k.to("meta"), v, start, end), "k_cache must be on q's device"),
        ((q, k, v, start, end, 0.0), "scale must be positive"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            decode_attention(*args)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits,block_n", [(3, 8), (5, 8), (2, 16)])
def test_the_fused_combine_gives_the_combine_kernels_output(dtype, splits, block_n, monkeypatch):
    """combine="fused": the split that arrives last combines its row in split order, so the output
    equals the two-launch path's to the bit, on fresh inputs over several calls (every row's
    counter is back at zero after each, as a CUDA-graph replay needs); one launch; under
    combine_mode too; a bad mode is refused by name."""
    for call in range(3):
        q, k, v, start, end = _inputs(32, dtype, seed=10 + call)
        want = triton_impl.decode_attention(q, k, v, start, end, 32**-0.5, splits, block_n, combine="kernel")
        got = triton_impl.decode_attention(q, k, v, start, end, 32**-0.5, splits, block_n, combine="fused")
        assert torch.equal(got, want), call
        assert torch.equal(got[2], torch.zeros_like(got[2]))  # the empty range
        assert int(triton_impl._counters(q.device)[:BATCH * HEADS].abs().sum()) == 0
    exact = decode_attention_reference(q.double(), k.double(), v.double(), start, end)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)
    combine_kernel = triton_impl._decode_combine_kernel

    class NotLaunched:
        def __getitem__(self, grid):
            raise AssertionError("the fused path launched the combine kernel")

    monkeypatch.setattr(triton_impl, "_decode_combine_kernel", NotLaunched())
    with triton_impl.combine_mode("fused"):
        assert torch.equal(triton_impl.decode_attention(q, k, v, start, end, 32**-0.5, splits, block_n), want)
    monkeypatch.setattr(triton_impl, "_decode_combine_kernel", combine_kernel)
    with pytest.raises(ValueError, match="combine"):
        triton_impl.decode_attention(q, k, v, start, end, 32**-0.5, splits, block_n, combine="atomic")
    with pytest.raises(ValueError, match="combine mode"):
        with triton_impl.combine_mode("atomic"):
            pass


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fused_combine_of_a_row_within_one_chunk(dtype, monkeypatch):
    """combine="fused" and a row whose valid range lies in one chunk (3 splits of 16 positions
    over 37): that chunk's split normalises and stores the row itself, and no split stores
    partials or counts (their buffers are poisoned with NaN, and the counters stay at zero). Rows
    that straddle chunks or are empty take the combine; every row equals the combine kernel's
    output bit for bit."""
    gen = torch.Generator().manual_seed(5)
    batch = 5
    q = torch.randn(batch, HEADS, 32, generator=gen).to(dtype)
    k = torch.randn(batch, HEADS, S_MAX, 32, generator=gen).to(dtype)
    v = torch.randn(batch, HEADS, S_MAX, 32, generator=gen).to(dtype)
    start = torch.tensor([0, 17, 10, 7, 32], dtype=torch.int32)  # chunk 0; chunk 1; straddles; empty; chunk 2
    end = torch.tensor([5, 30, 20, 7, 37], dtype=torch.int32)
    want = triton_impl.decode_attention(q, k, v, start, end, 32**-0.5, 3, 8, combine="kernel")
    real_empty = torch.empty

    made = []

    def poisoned(*shape, **kwargs):  # the partials' buffers start as NaN: what a split stores shows
        tensor = real_empty(*shape, **kwargs)
        made.append(tensor)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", poisoned)
    got = triton_impl.decode_attention(q, k, v, start, end, 32**-0.5, 3, 8, combine="fused")
    monkeypatch.setattr(torch, "empty", real_empty)
    assert torch.equal(got, want)
    m_part = next(t for t in made if t.shape == (batch * HEADS, 3))
    rows = m_part.view(batch, HEADS, 3)
    assert rows[[0, 1, 4]].isnan().all()  # alone in a chunk: nothing stored
    assert not rows[[2, 3]].isnan().any()  # straddling, and empty: the splits stored their partials
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    assert int(triton_impl._counters(q.device)[:batch * HEADS].abs().sum()) == 0
    exact = decode_attention_reference(q.double(), k.double(), v.double(), start, end)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), exact, **tolerance)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_short_cache_is_read_as_one_block_a_row(dtype, monkeypatch):
    """S_MAX = 37 positions of D = 32 fit one block of 64 positions: with no more rows than SMs, one
    program a row, one block
    (no loop, no partials), within rounding of the cache split over programs and combined, both
    at the fp64 reference's distance; without the rule (short_cache(False)) the plan is as for any
    cache. A cache longer than SHORT_CACHE_ELEMENTS a head is not one block."""
    launches = []
    kernel = triton_impl._decode_split_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append((grid, meta["BLOCK_N"], meta["SPLITS"], meta["ONE_BLOCK"]))
                return kernel[grid](*args, **meta)
            return launch

    q, k, v, start, end = (t[1:] for t in _inputs(32, dtype, seed=3))  # 4 rows (as many as the SMs): padded, empty
    exact = decode_attention_reference(q.double(), k.double(), v.double(), start, end)
    monkeypatch.setattr(triton_impl, "_decode_split_kernel", Recording())
    with kernel_backend("triton"):
        whole = decode_attention(q, k, v, start, end)
        split = triton_impl.decode_attention(q, k, v, start, end, 32 ** -0.5, splits=3, block_n=8)
        with triton_impl.short_cache(False):
            decode_attention(q, k, v, start, end)
    assert launches[0] == ((2 * HEADS, 1), 64, 1, True)
    assert launches[1] == ((2 * HEADS, 3), 8, 3, False)  # chunks of 2 blocks of 8
    assert launches[2][1] == triton_impl.block_size(32)  # without the rule: the planned blocks
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert _relative_error(whole, exact) < tolerance and _relative_error(split, exact) < tolerance
    torch.testing.assert_close(whole[1], torch.zeros_like(whole[1]))  # the empty row
    cpu = torch.device("cpu")  # the interpreter's stand-in SMs
    assert triton_impl.short_block(37, 32, BATCH * HEADS, cpu) is None  # more rows than SMs
    assert triton_impl.short_block(37, 32, triton_impl.INTERPRETER_SMS, cpu) == 64
    assert triton_impl.short_block(257, 64, 1, cpu) is None
    assert triton_impl.short_block(160, 64, 1, cpu) == 256 and triton_impl.short_block(160, 128, 1, cpu) is None
