"""outer_product_linear, the outer product mean's projection read from the [B, R, C, R, C] product:
the Triton kernels (under the interpreter on CPU) against float64, with the low-precision PyTorch
reference's own error as the yardstick, at odd shapes whose row blocks cross residue boundaries;
fp32 master weights with bf16 inputs; autocast; the custom op under opcheck and torch.compile; the
flops profiler; bad arguments."""

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.outer_product_linear import outer_product_linear, outer_product_linear_reference


def _inputs(batch, res, c, e, dtype, weight_dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, res, c, res, c, generator=gen).to(dtype)
    w = (torch.randn(e, c * c, generator=gen) / c).to(weight_dtype)
    b = torch.randn(e, generator=gen).to(weight_dtype) if bias else None
    dout = torch.randn(batch, res, res, e, generator=gen).to(dtype)
    return x, w, b, dout


def _run(fn, x, w, b, dout, cast=None):
    leaves = [None if t is None else t.detach().to(cast or t.dtype).requires_grad_() for t in (x, w, b)]
    out = fn(*leaves)
    wrt = [t for t in leaves if t is not None]
    return [out.detach(), *torch.autograd.grad(out, wrt, dout.to(cast or dout.dtype))]


def _assert_within_reference_error(got, ref, exact, names):
    for name, a, r, e in zip(names, got, ref, exact, strict=True):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        err = (a.double() - e).abs().max().item()
        ref_err = (r.double() - e).abs().max().item()
        floor = 8 * torch.finfo(torch.float32).eps * e.abs().max().item()
        assert err <= 2 * ref_err + floor, f"{name}: error {err:.3g} vs the reference's {ref_err:.3g}"


SHAPES = [  # (B, R, C, E, bias): R not a multiple of the 16-row interpreter tile, C not always a power of 2
    (1, 5, 4, 3, True),
    (2, 7, 8, 12, False),
    (1, 19, 16, 12, True),
    (2, 7, 5, 3, True),
    (1, 6, 3, 20, True),
]


@pytest.mark.parametrize("batch,res,c,e,bias", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)], ids=str)
def test_triton_matches_float64_within_the_references_error(batch, res, c, e, bias, dtype, weight_dtype):
    inputs = _inputs(batch, res, c, e, dtype, weight_dtype, bias)
    with kernel_backend("triton"):
        got = _run(outer_product_linear, *inputs)
    ref = _run(outer_product_linear_reference, *inputs)
    exact = _run(outer_product_linear_reference, *inputs, cast=torch.float64)
    _assert_within_reference_error(got, ref, exact, ["out", "dx", "dweight", "dbias"][:len(got)])
    assert got[0].shape == (batch, res, res, e) and got[0].is_contiguous() and got[0].dtype == dtype
    assert got[1].is_contiguous() and got[1].dtype == dtype
    assert all(g.dtype == weight_dtype for g in got[2:])


def test_fp32_master_weights_get_fp32_sums():
    """With bf16 x, the weight and bias gradients are fp32 sums of exact bf16 products: far closer
    to float64 than one bf16 rounding."""
    x, w, b, dout = _inputs(2, 9, 8, 12, torch.bfloat16, torch.float32, True, seed=3)
    with kernel_backend("triton"):
        got = _run(outer_product_linear, x, w, b, dout)
    exact = _run(outer_product_linear_reference, x, w, b, dout, cast=torch.float64)
    for a, e in zip(got[2:], exact[2:]):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-5 * e.abs().max().item())


def test_non_contiguous_output_gradient_and_determinism():
    x, w, b, dout = _inputs(1, 11, 8, 12, torch.float32, torch.float32, True, seed=4)
    dout_t = dout.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    want = _run(outer_product_linear_reference, x, w, b, dout)
    with kernel_backend("triton"):
        first = _run(outer_product_linear, x, w, b, dout_t)
        second = _run(outer_product_linear, x, w, b, dout)
    for a, again, ref in zip(first, second, want):
        assert torch.equal(a, again)
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)


def test_reads_the_product_as_a_view_of_the_matmul():
    """x is the [B, R*C, R*C] product viewed in five dims, as in OuterProductMean; its gradient
    reaches the matmul's operands."""
    gen = torch.Generator().manual_seed(5)
    batch, seqs, res, c, e = 2, 4, 7, 4, 6
    a, b_ = (torch.randn(batch, seqs, res * c, generator=gen).requires_grad_() for _ in range(2))
    w, bias = torch.randn(e, c * c, generator=gen), torch.randn(e, generator=gen)

    def call(fn):
        outer = torch.matmul(a.transpose(-1, -2), b_).view(batch, res, c, res, c)
        out = fn(outer, w, bias)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), (a, b_))]

    with kernel_backend("triton"):
        got = call(outer_product_linear)
    for g, r in zip(got, call(outer_product_linear_reference)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-4)


def test_autocast_runs_in_the_autocast_dtype_and_returns_gradients_in_each_inputs_dtype():
    x, w, b, dout = _inputs(1, 7, 8, 12, torch.float32, torch.float32, True, seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with kernel_backend("triton"):
            got = _run(outer_product_linear, x, w, b, dout.bfloat16())
        ref = _run(outer_product_linear_reference, x, w, b, dout.bfloat16())
    exact = _run(outer_product_linear_reference, x, w, b, dout.bfloat16(), cast=torch.float64)
    assert got[0].dtype == torch.bfloat16 and [g.dtype for g in got[1:]] == [torch.float32] * 3
    _assert_within_reference_error(got, ref, exact, ["out", "dx", "dweight", "dbias"])


def test_custom_op_passes_opcheck_and_compiles():
    x, w, b, dout = _inputs(1, 6, 4, 5, torch.float32, torch.float32, True, seed=7)
    with kernel_backend("triton"):
        for bias in (b, None):
            args = (x.clone().requires_grad_(), w.clone().requires_grad_(),
                    None if bias is None else bias.clone().requires_grad_())
            torch.library.opcheck(torch.ops.dslab.outer_product_linear.default, args,
                                  test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
        compiled = torch.compile(outer_product_linear, backend="aot_eager", fullgraph=True)
        want = _run(outer_product_linear, x, w, b, dout)
        got = _run(compiled, x, w, b, dout)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


def test_reference_runs_off_triton():
    inputs = _inputs(1, 5, 4, 3, torch.float32, torch.float32, True)
    with kernel_backend("torch"):
        got = _run(outer_product_linear, *inputs)
    for a, e in zip(got, _run(outer_product_linear_reference, *inputs)):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_flops_profiler_counts_both_products():
    """dslab::outer_product_linear 2*B*R^2*C^2*E forward; its backward (dx and dW) twice that."""
    from torch import nn

    from dslab.profilers.flops import FlopsProfiler

    batch, res, c, e = 2, 5, 4, 3
    x, w, b, _ = _inputs(batch, res, c, e, torch.float32, torch.float32, True)

    class Projection(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = nn.Parameter(w), nn.Parameter(b)

        def forward(self, inputs):
            return outer_product_linear(inputs, self.weight, self.bias)

    model = Projection()
    profiler = FlopsProfiler(model)
    with kernel_backend("triton"):
        profiler.start_profile()
        model(x.requires_grad_()).sum().backward()
        profiler.stop_profile()
    records = profiler.records()
    forward = 2 * batch * res * res * c * c * e
    assert records["flops_by_op"]["dslab::outer_product_linear"] == {"figure": "matmul", "flops": forward}
    assert records["flops_by_op"]["dslab::outer_product_linear_backward"] == {"figure": "matmul",
                                                                              "flops": 2 * forward}
    assert (records["forward_flops"], records["backward_flops"]) == (forward, 2 * forward)
    assert records["uncounted_autograd_functions"] == []


@pytest.mark.parametrize("kwargs,match", [
    (dict(x=torch.zeros(2, 3, 4, 3)), r"x must be \[B, R, C, R, C\]"),
    (dict(x=torch.zeros(1, 3, 4, 5, 4)), r"x must be \[B, R, C, R, C\].*\(1, 3, 4, 5, 4\)"),
    (dict(x=torch.zeros(1, 3, 4, 3, 2)), r"x must be \[B, R, C, R, C\]"),
    (dict(weight=torch.zeros(6, 15)), r"weight must be \[E, C\*C\] = \[E, 16\]"),
    (dict(weight=torch.zeros(16)), r"weight must be \[E, C\*C\]"),
    (dict(bias=torch.zeros(5)), r"bias must have shape \(6,\)"),
    (dict(weight=torch.zeros(6, 16, dtype=torch.float64)), "weight must be in x's dtype"),
    (dict(bias=torch.zeros(6, dtype=torch.float16)), "bias must be in x's dtype"),
    (dict(x=torch.zeros(1, 3, 4, 3, 4, dtype=torch.int32)), "x must be a floating-point tensor"),
    (dict(weight=torch.zeros(6, 16, device="meta")), "weight must be on x's device"),
], ids=["x_rank", "x_residues", "x_channels", "weight_width", "weight_rank", "bias_shape", "weight_dtype",
        "bias_dtype", "x_dtype", "weight_device"])
def test_bad_arguments_name_the_argument(kwargs, match):
    args = dict(x=torch.zeros(1, 3, 4, 3, 4), weight=torch.zeros(6, 16), bias=torch.zeros(6))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        outer_product_linear(**args)
