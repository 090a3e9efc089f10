"""outer_product_linear, the outer product mean's projection read from the [B, R, C, R, C] product:
the Triton kernels (under the interpreter on CPU) against float64, with the low-precision PyTorch
reference's own error as the yardstick, at odd shapes whose row blocks cross residue boundaries;
fp32 master weights with bf16 inputs; autocast; the custom op under opcheck and torch.compile; the
flops profiler; bad arguments. The row scale (the outer product mean's ``1 / (count + eps)``) the
same way, plus row by row where its factors span 0 to 1000, and exactly once in every gradient."""

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.evoformer.outer_product_linear import outer_product_linear, outer_product_linear_reference


def _inputs(batch, res, c, e, dtype, weight_dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, res, c, res, c, generator=gen).to(dtype)
    w = (torch.randn(e, c * c, generator=gen) / c).to(weight_dtype)
    b = torch.randn(e, generator=gen).to(weight_dtype) if bias else None
    dout = torch.randn(batch, res, res, e, generator=gen).to(dtype)
    return x, w, b, dout


def _run(fn, x, w, b, dout, cast=None, row_scale=None):
    leaves = [None if t is None else t.detach().to(cast or t.dtype).requires_grad_() for t in (x, w, b)]
    kwargs = {} if row_scale is None else {"row_scale": row_scale.to(cast or row_scale.dtype)}
    out = fn(*leaves, **kwargs)
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


def _row_scale(batch, res, seqs, seed, empty_pairs=False, zeros=True):
    """``1 / (count + 1e-3)`` ``[B, R, R]`` in fp32 from a random MSA mask ``[B, S, R]``, as the
    outer product mean computes it: counts 1..S with the first sequence unmasked, 0..S (factors
    up to 1000) with ``empty_pairs`` (some residues masked in every sequence). ``zeros``: the
    pairs of the last residue get an exact 0."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, seqs, res, generator=gen) < 0.6).float()
    mask[:, 0] = 1.0
    if empty_pairs:
        mask[:, :, ::3] = 0.0
    count = mask.transpose(-1, -2) @ mask
    scale = 1.0 / (count + 1e-3)
    if zeros:
        scale[:, -1, :] = 0.0
        scale[:, :, -1] = 0.0
    return scale


def _by_row(t):
    """out ``[B, R, R, E]`` or dx ``[B, R, C, R, C]`` as ``[B * R * R, -1]``, one GEMM row each."""
    if t.dim() == 5:
        t = t.transpose(2, 3)
    return t.reshape(t.shape[0] * t.shape[1] * t.shape[2], -1)


ROW_SCALE_SHAPES = [  # (B, R, C, E, bias)
    (2, 5, 3, 7, True),
    (2, 5, 3, 7, False),
    (2, 9, 4, 5, True),  # 162 rows: two weight-gradient splits
]


@pytest.mark.parametrize("batch,res,c,e,bias", ROW_SCALE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype,weight_dtype,scale_dtype", [
    (torch.float32, torch.float32, torch.float32), (torch.bfloat16, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16)], ids=str)
def test_row_scale_matches_float64_within_the_references_error(batch, res, c, e, bias, dtype, weight_dtype,
                                                               scale_dtype):
    """Counts 1..6 (factors 1/6 to 1) and zeros: a scale ignored, or applied twice backward, moves
    the rows of counts 2..6 by factors of 2 to 6, and the zero rows off 0."""
    inputs = _inputs(batch, res, c, e, dtype, weight_dtype, bias, seed=10)
    scale = _row_scale(batch, res, 6, seed=11).to(scale_dtype)
    with kernel_backend("triton"):
        got = _run(outer_product_linear, *inputs, row_scale=scale)
    ref = _run(outer_product_linear_reference, *inputs, row_scale=scale)
    exact = _run(outer_product_linear_reference, *inputs, cast=torch.float64, row_scale=scale)
    _assert_within_reference_error(got, ref, exact, ["out", "dx", "dweight", "dbias"][:len(got)])
    assert got[0].shape == (batch, res, res, e) and got[0].is_contiguous() and got[0].dtype == dtype
    assert got[1].is_contiguous() and got[1].dtype == dtype
    assert all(g.dtype == weight_dtype for g in got[2:])
    if dtype == torch.float32:
        for a, r in zip(got, ref):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())


@pytest.mark.parametrize("batch,res,c,e", [(2, 5, 3, 7), (2, 9, 4, 5)], ids=str)
def test_row_scale_from_empty_pairs_holds_row_by_row(batch, res, c, e):
    """fp32, counts 0..5 (factors 1/5 to 1000) and zeros: out and dx rows each within 1e-5 of
    their own largest entry (rows scaled by 0 exactly 0), the weight and bias sums over all rows
    within 1e-5 of the largest sum."""
    x, w, b, dout = _inputs(batch, res, c, e, torch.float32, torch.float32, True, seed=12)
    scale = _row_scale(batch, res, 5, seed=13, empty_pairs=True)
    assert scale.max() > 900 and (scale == 0).any() and scale[scale > 0].min() < 0.25
    with kernel_backend("triton"):
        got = _run(outer_product_linear, x, w, b, dout, row_scale=scale)
    exact = _run(outer_product_linear_reference, x, w, b, dout, cast=torch.float64, row_scale=scale)
    for name, a, ex in zip(["out", "dx"], got, exact):
        err = (_by_row(a).double() - _by_row(ex)).abs().amax(1)
        size = _by_row(ex).abs().amax(1)
        bad = torch.nonzero(err > 1e-5 * size).flatten().tolist()
        assert not bad, f"{name}: rows {bad} off by more than 1e-5 of their largest entry"
    zero_rows = _by_row(got[0])[scale.flatten() == 0]
    assert zero_rows.numel() > 0 and not zero_rows.any()
    for a, ex in zip(got[2:], exact[2:]):
        torch.testing.assert_close(a.double(), ex, rtol=1e-5, atol=1e-5 * ex.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_scale_applies_exactly_once_to_every_output(dtype):
    """A power-of-two factor scales exactly: with row_scale 1/4 everywhere, out, dx, dweight and
    dbias are exactly 1/4 of the unscaled ones (1 if the scale were ignored, 1/16 if applied
    twice)."""
    x, w, b, dout = _inputs(2, 5, 3, 7, dtype, torch.float32, True, seed=14)
    with kernel_backend("triton"):
        plain = _run(outer_product_linear, x, w, b, dout)
        scaled = _run(outer_product_linear, x, w, b, dout, row_scale=torch.full((2, 5, 5), 0.25))
    for name, a, p in zip(["out", "dx", "dweight", "dbias"], scaled, plain, strict=True):
        assert torch.equal(a, p * 0.25), name


def test_row_scale_under_autocast_with_fp32_weights():
    x, w, b, dout = _inputs(2, 5, 3, 7, torch.float32, torch.float32, True, seed=15)
    scale = _row_scale(2, 5, 6, seed=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with kernel_backend("triton"):
            got = _run(outer_product_linear, x, w, b, dout.bfloat16(), row_scale=scale)
        ref = _run(outer_product_linear_reference, x, w, b, dout.bfloat16(), row_scale=scale)
    exact = _run(outer_product_linear_reference, x.bfloat16(), w, b, dout.bfloat16(), cast=torch.float64,
                 row_scale=scale)
    assert got[0].dtype == ref[0].dtype == torch.bfloat16
    assert [g.dtype for g in got[1:]] == [torch.float32] * 3
    _assert_within_reference_error(got, ref, exact, ["out", "dx", "dweight", "dbias"])


def test_row_scale_is_a_constant():
    """No gradient flows to row_scale: one that requires grad is refused while grad is enabled,
    and taken as it is under no_grad."""
    x, w, b, _ = _inputs(1, 5, 3, 7, torch.float32, torch.float32, True, seed=17)
    scale = _row_scale(1, 5, 4, seed=18).requires_grad_()
    for backend in ("triton", "torch"):
        with kernel_backend(backend):
            with pytest.raises(ValueError, match="row_scale is a constant"):
                outer_product_linear(x, w, b, row_scale=scale)
            with torch.no_grad():
                got = outer_product_linear(x, w, b, row_scale=scale)
            torch.testing.assert_close(got, outer_product_linear_reference(x, w, b, scale.detach()),
                                       rtol=1e-5, atol=1e-5)


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


def test_custom_op_with_row_scale_passes_opcheck_and_compiles():
    x, w, b, dout = _inputs(2, 5, 3, 7, torch.float32, torch.float32, True, seed=8)
    scale = _row_scale(2, 5, 6, seed=9)
    with kernel_backend("triton"):
        for bias in (b, None):
            args = (x.clone().requires_grad_(), w.clone().requires_grad_(),
                    None if bias is None else bias.clone().requires_grad_(), scale)
            torch.library.opcheck(torch.ops.dslab.outer_product_linear.default, args,
                                  test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
        compiled = torch.compile(outer_product_linear, backend="aot_eager", fullgraph=True)
        want = _run(outer_product_linear, x, w, b, dout, row_scale=scale)
        got = _run(compiled, x, w, b, dout, row_scale=scale)
    for a, e, r in zip(got, want, _run(outer_product_linear_reference, x, w, b, dout, row_scale=scale)):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())


@pytest.mark.parametrize("with_scale", [False, True], ids=["plain", "row_scale"])
def test_reference_runs_off_triton(with_scale):
    inputs = _inputs(1, 5, 4, 3, torch.float32, torch.float32, True)
    scale = _row_scale(1, 5, 4, seed=1) if with_scale else None
    with kernel_backend("torch"):
        got = _run(outer_product_linear, *inputs, row_scale=scale)
    for a, e in zip(got, _run(outer_product_linear_reference, *inputs, row_scale=scale)):
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
    (dict(row_scale=torch.zeros(1, 3, 4)), r"row_scale must be \[B, R, R\] = \[1, 3, 3\].*\(1, 3, 4\)"),
    (dict(row_scale=torch.zeros(3, 3)), r"row_scale must be \[B, R, R\] = \[1, 3, 3\]"),
    (dict(row_scale=torch.zeros(1, 3, 3, 1)), r"row_scale must be \[B, R, R\] = \[1, 3, 3\]"),
    (dict(row_scale=torch.zeros(1, 3, 3, dtype=torch.float64)), "row_scale must be in x's dtype"),
    (dict(row_scale=torch.zeros(1, 3, 3, device="meta")), "row_scale must be on x's device"),
], ids=["x_rank", "x_residues", "x_channels", "weight_width", "weight_rank", "bias_shape", "weight_dtype",
        "bias_dtype", "x_dtype", "weight_device", "row_scale_shape", "row_scale_rank", "row_scale_broadcast",
        "row_scale_dtype", "row_scale_device"])
def test_bad_arguments_name_the_argument(kwargs, match):
    args = dict(x=torch.zeros(1, 3, 4, 3, 4), weight=torch.zeros(6, 16), bias=torch.zeros(6), row_scale=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        outer_product_linear(**args)
