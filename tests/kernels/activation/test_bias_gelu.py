"""bias_gelu: the Triton kernels (under the interpreter on CPU) against the PyTorch reference.

Errors are measured against the reference in float64 and must stay within twice PyTorch's own
error in the same precision, plus a floor of one unit in the last place at the output's scale.
"""

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dslab.kernels import kernel_backend
from dslab.kernels.activation.bias_gelu import bias_gelu, bias_gelu_reference
from dslab.kernels.activation.bias_gelu_triton import _erf_rational

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# The tanh form's sigmoid(s) = 1 / (1 + exp(-s)) saturates through exp overflowing to inf, which
# the interpreter (numpy) reports.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _assert_within_torch_error(name, actual, torch_low, exact):
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item()
    torch_err = (torch_low.double() - exact).abs().max().item()
    floor = torch.finfo(actual.dtype).eps * exact.abs().max().item()
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _inputs(shape, dtype, with_bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    bias = torch.randn(shape[-1], generator=gen).to(dtype) if with_bias else None
    dy = torch.randn(shape, generator=gen).to(dtype)
    return x, bias, dy


def _run(fn, x, bias, dy, approximate, dtype=None):
    """Output and gradients of ``fn`` on leaf copies of x and bias (cast to ``dtype``)."""
    dtype = dtype or x.dtype
    x = x.detach().to(dtype).requires_grad_()
    bias = bias.detach().to(dtype).requires_grad_() if bias is not None else None
    y = fn(x, bias, approximate)
    wrt = [x] if bias is None else [x, bias]
    return [y.detach(), *torch.autograd.grad(y, wrt, dy.to(dtype))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 129), (3, 5, 200)], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_triton_matches_float64_reference(dtype, shape, approximate):
    x, bias, dy = _inputs(shape, dtype)
    exact = _run(bias_gelu_reference, x, bias, dy, approximate, dtype=torch.float64)
    low = _run(bias_gelu_reference, x, bias, dy, approximate)
    with kernel_backend("triton"):
        got = _run(bias_gelu, x, bias, dy, approximate)
    for name, a, lo, ex in zip(["y", "dx", "dbias"], got, low, exact):
        assert a.dtype == dtype and a.shape == lo.shape
        _assert_within_torch_error(name, a, lo, ex)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_without_bias_large_magnitudes_and_strided_rows(approximate):
    wide = torch.linspace(-30, 30, 300 * 2 * 70).reshape(300, 140)
    x = wide[:, :70]  # row stride 140, read in place; tails of gelu and gelu' included
    dy = torch.randn(300, 70)
    exact = _run(bias_gelu_reference, x, None, dy, approximate, dtype=torch.float64)
    with kernel_backend("triton"):
        got = _run(bias_gelu, x, None, dy, approximate)
    assert len(got) == 2
    for a, ex in zip(got, exact):
        torch.testing.assert_close(a.double(), ex, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_16_bit_tails_stay_finite_and_within_torch_error(dtype, approximate):
    """The 16-bit path's one-exponential sigmoid clamps its exponent: inputs out to +-60 (exp(-s)
    beyond fp32's range without the clamp) give finite values within PyTorch's error."""
    x = torch.linspace(-60, 60, 64 * 96).reshape(64, 96).to(dtype)
    bias = torch.zeros(96, dtype=dtype)
    dy = torch.randn(64, 96, generator=torch.Generator().manual_seed(5)).to(dtype)
    exact = _run(bias_gelu_reference, x, bias, dy, approximate, dtype=torch.float64)
    low = _run(bias_gelu_reference, x, bias, dy, approximate)
    with kernel_backend("triton"):
        got = _run(bias_gelu, x, bias, dy, approximate)
    for name, a, lo, ex in zip(["y", "dx", "dbias"], got, low, exact):
        assert torch.isfinite(a).all(), name
        _assert_within_torch_error(name, a, lo, ex)


def test_bias_gradient_with_many_row_tiles_is_deterministic():
    # 700 rows of 24: 6 row tiles of 128 rows looped over by 4 interpreter programs.
    x, bias, dy = _inputs((700, 24), torch.float32, seed=3)
    exact = _run(bias_gelu_reference, x, bias, dy, "none", dtype=torch.float64)
    with kernel_backend("triton"):
        first = _run(bias_gelu, x, bias, dy, "none")
        second = _run(bias_gelu, x, bias, dy, "none")
    for a, b, ex in zip(first, second, exact):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), ex, rtol=1e-5, atol=1e-5)


@triton.jit
def _erf_rational_kernel(X, Y, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, _erf_rational(tl.load(X + offs), False))


def test_rational_erf_of_the_16_bit_path_is_within_3e_6():
    x = torch.linspace(-7, 7, 64 * 1024)
    y = torch.empty_like(x)
    _erf_rational_kernel[(64,)](x, y, BLOCK=1024)
    assert (y.double() - torch.erf(x.double())).abs().max().item() < 3e-6


def test_torch_backend_and_cpu_auto_run_the_reference():
    x, bias, _ = _inputs((4, 16), torch.float32)
    expected = F.gelu(x + bias, approximate="tanh")
    for name in ("torch", "auto"):
        with kernel_backend(name):
            assert torch.equal(bias_gelu(x, bias, "tanh"), expected)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.ones(3, 8), torch.ones(8), "erf"), "approximate"),
        ((torch.ones(3, 8), torch.ones(7), "none"), "bias"),
        ((torch.ones(3, 8), torch.ones(8, dtype=torch.float64), "none"), "bias"),
    ],
)
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        bias_gelu(*args)


@pytest.mark.parametrize("with_bias", [True, False])
def test_custom_op_passes_opcheck(with_bias):
    x, bias, _ = _inputs((7, 33), torch.float32, with_bias)
    bias = bias.requires_grad_() if bias is not None else None
    torch.library.opcheck(torch.ops.dslab.bias_gelu.default, (x.requires_grad_(), bias, "tanh"))


def test_torch_compile_traces_the_custom_op():
    x, bias, dy = _inputs((6, 40), torch.float32)

    def mlp_act(x, bias, approximate):
        return bias_gelu(x, bias, approximate) * 2

    compiled = torch.compile(mlp_act, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager = _run(mlp_act, x, bias, dy, "tanh")
        got = _run(compiled, x, bias, dy, "tanh")
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, dtype",
    [((65536, 4096), torch.bfloat16), ((8192, 4096), torch.float16), ((8192, 4096), torch.float32),
     ((4096, 1000), torch.bfloat16)],
    ids=str,
)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gpu_real_sizes(shape, dtype, approximate):
    x, bias, dy = (t.cuda() for t in _inputs(shape, dtype))
    exact = _run(bias_gelu_reference, x, bias, dy, approximate, dtype=torch.float64)
    low = _run(bias_gelu_reference, x, bias, dy, approximate)
    got = _run(bias_gelu, x, bias, dy, approximate)
    for name, a, lo, ex in zip(["y", "dx", "dbias"], got, low, exact):
        _assert_within_torch_error(name, a, lo, ex)
    again = _run(bias_gelu, x, bias, dy, approximate)
    assert torch.equal(got[2], again[2]), "bias gradient differs between two identical runs"
