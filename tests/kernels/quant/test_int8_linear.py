"""quantize_int8 / dequantize_int8 round trips and their zero rows and groups; row-major int8 from a
transposed weight; int8_linear's Triton kernel (under the interpreter on CPU, with and without
split-K) against an fp64 reference and PyTorch's own low-precision linear; the prefill path; the
custom op under opcheck and torch.compile; forward-only; bad arguments."""

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels.quant.int8_linear import dequantize_int8, int8_linear, quantize_int8

from dslab.kernels import kernel_backend
from dslab.kernels.dispatch import interpreting
from dslab.kernels.quant import int8_linear_triton as triton_impl
from dslab.kernels.quant.int8_linear import SKINNY_MAX_ROWS, int8_linear_reference

needs_interpreter = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton kernels need a GPU or TRITON_INTERPRET=1"
)

N, K = 45, 96


def _weights(group_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen)  # rows of different ranges
    qweight, scale = quantize_int8(w, group_size)
    return w, qweight, scale, torch.randn(N, generator=gen)


def _relative_error(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("group_size", [None, 32, 96], ids=["per-channel", "g32", "g96"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_round_trip_within_half_a_step(group_size, dtype):
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(N, K, generator=gen) * 3).to(dtype)
    w[4] = 0.0  # an all-zero row
    w[7, 32:64] = 0.0  # an all-zero group (for g32)
    qweight, scale = quantize_int8(w, group_size)
    groups = 1 if group_size is None else K // group_size
    assert qweight.dtype == torch.int8 and qweight.shape == (N, K)
    assert scale.dtype == torch.float32 and scale.shape == ((N,) if group_size is None else (N, groups))
    assert qweight.min() >= -127 and qweight.max() <= 127
    per_element = scale.view(N, groups, 1).expand(N, groups, K // groups).reshape(N, K)
    # Every non-zero row / group uses the full range: its largest |w| maps to 127.
    peak = qweight.view(N, groups, -1).abs().amax(dim=2)
    assert torch.all((peak == 127) | (scale.view(N, groups) == 0))
    deq = dequantize_int8(qweight, scale, group_size)
    assert deq.dtype == torch.float32
    # Half a quantisation step, plus the fp32 rounding of w / scale and of q * scale (two ulps of w).
    assert torch.all((w.float() - deq).abs() <= per_element / 2 + 2**-22 * w.float().abs())
    assert torch.equal(deq[4], torch.zeros(K)) and scale.view(N, -1)[4].eq(0).all()
    if group_size == 32:
        assert torch.equal(deq[7, 32:64], torch.zeros(32)) and scale[7, 1] == 0
    assert dequantize_int8(qweight, scale, group_size, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("group_size", [None, 32], ids=["per-channel", "g32"])
def test_quantize_gives_row_major_int8_for_a_transposed_weight(group_size):
    """A weight stored ``[in, out]`` and passed as its ``.t()`` (transformers' Conv1D) quantises to
    the same values as its contiguous copy, laid out row-major: the Triton path would otherwise
    copy it on every call."""
    gen = torch.Generator().manual_seed(5)
    stored = torch.randn(K, N, generator=gen).to(torch.bfloat16)  # [in, out]
    weight = stored.t()
    assert weight.stride() == (1, N)
    qweight, scale = quantize_int8(weight, group_size)
    expected_q, expected_scale = quantize_int8(weight.contiguous(), group_size)
    assert qweight.is_contiguous() and scale.is_contiguous()
    assert torch.equal(qweight, expected_q) and torch.equal(scale, expected_scale)


@needs_interpreter
# g32: each K step of the interpreter's 32 in one group; g48: groups change inside steps.
@pytest.mark.parametrize("group_size", [None, 32, 48], ids=["per-channel", "g32", "g48"])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_matches_reference(group_size, rows, dtype):
    _, qweight, scale, bias = _weights(group_size)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
    exact = int8_linear_reference(x.double(), qweight, scale, bias.double(), group_size)
    low_bias = bias.to(dtype)
    results = [triton_impl.int8_linear(x, qweight, scale, low_bias, group_size, split_k) for split_k in (1, 3)]
    with kernel_backend("triton"):
        results.append(int8_linear(x, qweight, scale, bias, group_size))  # planned split-K, bias cast
    for got in results:
        assert got.dtype == dtype and got.shape == (rows, N)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
        else:
            # PyTorch's own low-precision linear on the same dequantised weights, against fp64.
            baseline = F.linear(x, dequantize_int8(qweight, scale, group_size, dtype), low_bias)
            assert _relative_error(got, exact) <= max(2 * _relative_error(baseline, exact), 1e-3)
    # Split-K sums its partials in a fixed order: the same inputs give the same bits.
    assert torch.equal(results[1], triton_impl.int8_linear(x, qweight, scale, low_bias, group_size, 3))


@needs_interpreter
def test_planned_split_k_splits_skinny_shapes():
    block_n, block_k = triton_impl.block_sizes()
    split_k, k_per_split = triton_impl.plan_split_k(1, N, K, 16, block_n, block_k, torch.device("cpu"))
    assert split_k > 1 and k_per_split % block_k == 0 and (split_k - 1) * k_per_split < K <= split_k * k_per_split


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_leading_dims_and_the_prefill_path(backend):
    """x [2, 3, K] gives [2, 3, N]; above SKINNY_MAX_ROWS rows the dequantise + F.linear path runs
    on every backend and equals the reference exactly."""
    _, qweight, scale, bias = _weights(32)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, K, generator=gen)
    with kernel_backend(backend):
        y = int8_linear(x, qweight, scale, bias, 32)
        assert y.shape == (2, 3, N)
        torch.testing.assert_close(y, int8_linear_reference(x, qweight, scale, bias, 32), rtol=1e-5, atol=1e-5)
        tall = torch.randn(SKINNY_MAX_ROWS + 6, K, generator=gen)
        assert torch.equal(int8_linear(tall, qweight, scale, None, 32),
                           int8_linear_reference(tall, qweight, scale, None, 32))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_backward_raises_forward_only(backend):
    _, qweight, scale, bias = _weights(None)
    x = torch.randn(2, K, requires_grad=True)
    with kernel_backend(backend):
        y = int8_linear(x, qweight, scale, bias)
    with pytest.raises(RuntimeError, match="int8_linear is forward-only"):
        y.sum().backward()


@needs_interpreter
def test_custom_op_opcheck_and_torch_compile():
    _, qweight, scale, bias = _weights(32)
    x = torch.randn(3, K)
    torch.library.opcheck(torch.ops.dslab.int8_linear.default, (x, qweight, scale, bias, 32),
                          test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda x: torch.relu(int8_linear(x, qweight, scale, bias, 32)), backend="aot_eager",
                             fullgraph=True)
    with kernel_backend("triton"):
        got = compiled(x)
    want = torch.relu(int8_linear_reference(x, qweight, scale, bias, 32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_flops_profiler_counts_two_m_n_k():
    from torch import nn

    from dslab.profilers.flops import FlopsProfiler

    _, qweight, scale, bias = _weights(None)

    class Layer(nn.Module):
        def forward(self, x):
            return int8_linear(x, qweight, scale, bias)

    model = Layer()
    profiler = FlopsProfiler(model)
    with kernel_backend("triton"), torch.no_grad():
        profiler.start_profile()
        model(torch.randn(5, K))
        profiler.stop_profile()
    assert profiler.records()["flops_by_op"]["dslab::int8_linear"] == {"figure": "matmul", "flops": 2 * 5 * N * K}


def test_bad_arguments_name_the_argument():
    w, qweight, scale, bias = _weights(None)
    _, _, group_scale, _ = _weights(32)
    x = torch.randn(2, K)
    quantize_cases = [
        ((w[0],), "weight must be a matrix"),
        ((qweight,), "weight must be a floating-point"),
        ((w, 36), "group_size 36 must divide weight's K = 96"),
        ((w, 0), "group_size must be a positive int"),
        ((w, True), "group_size must be a positive int"),
        ((torch.full((2, 4), float("inf")),), "weight must be finite"),
    ]
    for args, message in quantize_cases:
        with pytest.raises(ValueError, match=message):
            quantize_int8(*args)
    linear_cases = [
        ((x, qweight.float(), scale), "qweight must be an int8 matrix"),
        ((x, qweight, scale, None, 32), r"scale must have shape \(45, 3\) .*group_size=32"),
        ((x, qweight, group_scale), r"scale must have shape \(45,\) .*per output channel"),
        ((x, qweight, scale.double()), "scale must be float32"),
        ((x, qweight, scale.to("meta")), "scale must be on qweight's device"),
        ((x, qweight, group_scale, None, 36), "group_size 36 must divide qweight's K = 96"),
        ((x[:, :90], qweight, scale), "x's last dimension 90 must equal qweight's K = 96"),
        ((x.long(), qweight, scale), "x must be a floating-point"),
        ((x, qweight, scale, bias[:5]), r"bias must have shape \(45,\)"),
        ((x, qweight, scale, bias.to("meta")), "bias must be on x's device"),
    ]
    for args, message in linear_cases:
        with pytest.raises(ValueError, match=message):
            int8_linear(*args)
    with pytest.raises(ValueError, match=r"scale must have shape \(45,\)"):
        dequantize_int8(qweight, group_scale)
