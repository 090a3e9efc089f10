"""swiglu: the Triton kernels (under the interpreter on CPU) against the PyTorch reference.

Errors are measured against the reference in float64 and must stay within twice PyTorch's own
error in the same precision, plus a floor of one unit in the last place at the output's scale.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.kernels import kernel_backend
from dslab.kernels.activation.swiglu import TRITON_DTYPES, swiglu, swiglu_reference
from dslab.kernels.dispatch import interpreting
from dslab.profilers.flops import FlopsProfiler

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# The fp32 path's sigmoid(g) = 1 / (1 + exp(-g)) saturates through exp overflowing to inf, which
# the interpreter (numpy) reports.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _assert_within_torch_error(name, actual, torch_low, exact):
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item()
    torch_err = (torch_low.double() - exact).abs().max().item()
    floor = torch.finfo(actual.dtype).eps * exact.abs().max().item()
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _inputs(shape, dtype, seed=0):
    """x [..., 2I] (gate and up columns) and dy [..., I]."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    dy = torch.randn((*shape[:-1], shape[-1] // 2), generator=gen).to(dtype)
    return x, dy


def _run(fn, x, dy, dtype=None):
    """Output and input gradient of ``fn`` on a leaf copy of x (cast to ``dtype``)."""
    dtype = dtype or x.dtype
    x = x.detach().to(dtype).requires_grad_()
    y = fn(x)
    return [y.detach(), *torch.autograd.grad(y, [x], dy.to(dtype))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 74), (29, 130)], ids=str)
def test_triton_matches_float64_reference(dtype, shape):
    x, dy = _inputs(shape, dtype)
    exact = _run(swiglu_reference, x, dy, dtype=torch.float64)
    low = _run(swiglu_reference, x, dy)
    with kernel_backend("triton"):
        got = _run(swiglu, x, dy)
    for name, a, lo, ex in zip(["y", "dx"], got, low, exact):
        assert a.dtype == dtype and a.shape == lo.shape
        _assert_within_torch_error(name, a, lo, ex)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_gate_magnitudes_stay_finite_and_within_torch_error(dtype):
    """g out to +-90: exp(-g) overflows fp32 (the precise sigmoid saturates through inf) and the
    16-bit path's clamped one-exponential sigmoid is exercised in both tails."""
    half = 40
    gate = torch.linspace(-90, 90, 24 * half).reshape(24, half)
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([gate, torch.randn(24, half, generator=gen) * 2], dim=1).to(dtype)
    dy = torch.randn(24, half, generator=gen).to(dtype)
    exact = _run(swiglu_reference, x, dy, dtype=torch.float64)
    low = _run(swiglu_reference, x, dy)
    with kernel_backend("triton"):
        got = _run(swiglu, x, dy)
    for name, a, lo, ex in zip(["y", "dx"], got, low, exact):
        assert torch.isfinite(a).all(), name
        _assert_within_torch_error(name, a, lo, ex)


@pytest.mark.parametrize("leading", [(23,), (3, 5)], ids=str)
def test_strided_rows_are_read_in_place(leading):
    """x is a column slice [.., 10 : 10 + 2I] of a wider projection output: row stride > 2I."""
    half = 37
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn((*leading, 3 * half), generator=gen) * 3
    dy = torch.randn((*leading, half), generator=gen)
    x = wide[..., 10:10 + 2 * half]
    assert x.stride(-2) == 3 * half and x.stride(-1) == 1
    exact = _run(swiglu_reference, x, dy, dtype=torch.float64)
    with kernel_backend("triton"):
        got = _run(swiglu, x, dy)
        wide_leaf = wide.clone().requires_grad_()
        swiglu(wide_leaf[..., 10:10 + 2 * half]).backward(dy)
    for a, ex in zip(got, exact):
        torch.testing.assert_close(a.double(), ex, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wide_leaf.grad[..., 10:10 + 2 * half].double(), exact[1], rtol=1e-5, atol=1e-6)
    assert not wide_leaf.grad[..., :10].any() and not wide_leaf.grad[..., 10 + 2 * half:].any()


def test_matches_transformers_llama_mlp_in_fp32():
    """The fused [gate_proj; up_proj] matmul followed by swiglu and down_proj is LlamaMLP."""
    transformers = pytest.importorskip("transformers")
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=24, intermediate_size=37, hidden_act="silu", num_attention_heads=2, num_key_value_heads=2
    )
    mlp = LlamaMLP(config)
    fused_weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
    hidden = torch.randn(3, 5, 24)
    dout = torch.randn(3, 5, 24)

    x = F.linear(hidden, fused_weight)
    gate, up = mlp.gate_proj(hidden).detach(), mlp.up_proj(hidden).detach()
    with kernel_backend("triton"):
        torch.testing.assert_close(swiglu(x), ACT2FN["silu"](gate) * up)

    def fused_mlp(hidden):
        return mlp.down_proj(swiglu(F.linear(hidden, fused_weight)))

    expected = _run(mlp, hidden, dout)
    with kernel_backend("triton"):
        got = _run(fused_mlp, hidden, dout)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_torch_backend_and_cpu_auto_run_the_reference():
    x, _ = _inputs((4, 16), torch.float32)
    expected = F.silu(x[:, :8]) * x[:, 8:]
    for name in ("torch", "auto"):
        with kernel_backend(name):
            assert torch.equal(swiglu(x), expected)


def test_float64_runs_the_reference_under_the_triton_backend():
    assert torch.float64 not in TRITON_DTYPES
    x, _ = _inputs((5, 6), torch.float64)
    with kernel_backend("triton"):
        assert torch.equal(swiglu(x), swiglu_reference(x))


def test_empty_rows_and_columns():
    with kernel_backend("triton"):
        for shape in [(0, 10), (4, 0), (2, 0, 6)]:
            x = torch.randn(shape, requires_grad=True)
            y = swiglu(x)
            assert y.shape == (*shape[:-1], shape[-1] // 2)
            y.sum().backward()
            assert x.grad.shape == x.shape


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.ones(3, 7), "even"),
        (torch.ones(3, 8, dtype=torch.int32), "dtype"),
        (torch.ones(3, 8, dtype=torch.bool), "dtype"),
        (torch.tensor(1.0), "dimension"),
    ],
    ids=["odd-width", "int32", "bool", "scalar"],
)
def test_bad_arguments_raise_value_error(x, match):
    for backend in ("torch", "triton"):
        with kernel_backend(backend), pytest.raises(ValueError, match=match):
            swiglu(x)
    with pytest.raises(ValueError, match=match):
        swiglu_reference(x)


def test_custom_op_passes_opcheck():
    x, _ = _inputs((7, 66), torch.float32)
    torch.library.opcheck(torch.ops.dslab.swiglu.default, (x.requires_grad_(),))
    strided = torch.randn(5, 90)[:, 4:70]
    torch.library.opcheck(torch.ops.dslab.swiglu.default, (strided.requires_grad_(),))


def test_torch_compile_traces_the_custom_op():
    x, dy = _inputs((6, 80), torch.float32)

    def mlp_act(x):
        return swiglu(x) * 2

    compiled = torch.compile(mlp_act, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager = _run(mlp_act, x, dy)
        got = _run(compiled, x, dy)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)


class _Call(nn.Module):
    def forward(self, x):
        return swiglu(x)


@pytest.mark.skipif(not (interpreting() or torch.cuda.is_available()), reason="needs a GPU or TRITON_INTERPRET=1")
def test_flops_profiler_counts_the_custom_ops_as_the_reference():
    """dslab::swiglu 2 and dslab::swiglu_backward 8 per output element, elementwise; the same
    elementwise figure as the reference's aten ops (silu, mul; mul, mul and silu_backward, which
    the profiler decomposes into six pointwise ops)."""
    rows, half = 6, 37
    x = torch.randn(rows, 2 * half)
    figures = {}
    for backend in ("triton", "torch"):
        x = x.detach().requires_grad_()  # a fresh leaf: no gradient accumulation counted
        model = _Call()
        profiler = FlopsProfiler(model)
        with kernel_backend(backend):
            profiler.start_profile()
            model(x).sum().backward()
            profiler.stop_profile()
        records = profiler.records()
        assert records["total_flops"] == 0
        figures[backend] = profiler.get_elementwise_flops()
        if backend == "triton":
            assert records["flops_by_op"]["dslab::swiglu"] == {"figure": "elementwise", "flops": 2 * rows * half}
            assert records["flops_by_op"]["dslab::swiglu_backward"]["flops"] == 8 * rows * half
    assert figures["triton"] == figures["torch"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, dtype",
    [((16384, 2 * 11008), torch.bfloat16), ((4096, 2 * 14336), torch.float16),
     ((4096, 2 * 11008), torch.float32), ((4097, 2 * 1000), torch.bfloat16)],
    ids=str,
)
def test_gpu_real_sizes(shape, dtype):
    x, dy = (t.cuda() for t in _inputs(shape, dtype))
    exact = _run(swiglu_reference, x, dy, dtype=torch.float64)
    low = _run(swiglu_reference, x, dy)
    got = _run(swiglu, x, dy)
    for name, a, lo, ex in zip(["y", "dx"], got, low, exact):
        _assert_within_torch_error(name, a, lo, ex)
