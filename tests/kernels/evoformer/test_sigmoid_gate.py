"""sigmoid_gate: the Triton kernels (under the interpreter on CPU) against the PyTorch reference in
float64, in both output layouts, with and without biases and the row mask; fp32 master biases
with half inputs; the custom op under torch.compile; bad arguments."""

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.evoformer.sigmoid_gate import sigmoid_gate, sigmoid_gate_reference

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _inputs(shape, dtype, bias_dtype, biases, masked, channels_first, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=gen) * 2).to(dtype)
    x = torch.randn(shape, generator=gen).to(dtype)
    gb = torch.randn(shape[-1], generator=gen).to(bias_dtype) if "g" in biases else None
    xb = torch.randn(shape[-1], generator=gen).to(bias_dtype) if "x" in biases else None
    mask = (torch.rand(shape[:-1], generator=gen) > 0.3).to(dtype) if masked else None
    out_shape = (shape[0], shape[-1], *shape[1:-1]) if channels_first else shape
    dy = torch.randn(out_shape, generator=gen).to(dtype)
    return gate, x, gb, xb, mask, dy


def _run(fn, gate, x, gb, xb, mask, dy, channels_first, dtype=None):
    def leaf(t, cast):
        return None if t is None else t.detach().to(cast or t.dtype).requires_grad_()

    gate, x, gb, xb = leaf(gate, dtype), leaf(x, dtype), leaf(gb, dtype), leaf(xb, dtype)
    mask = None if mask is None else mask.to(dtype or mask.dtype)
    y = fn(gate, x, gb, xb, mask, channels_first=channels_first)
    wrt = [t for t in (gate, x, gb, xb) if t is not None]
    return [y.detach(), *torch.autograd.grad(y, wrt, dy.to(dtype or dy.dtype))]


CASES = [  # (shape, channels_first, biases, masked)
    ((37, 24), False, "gx", True),
    ((2, 5, 7, 20), True, "gx", True),
    ((2, 5, 7, 20), False, "g", False),
    ((3, 9, 33), True, "", False),
    ((1, 6, 6, 130), True, "x", True),
]


@pytest.mark.parametrize("shape,channels_first,biases,masked", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_float64_reference(shape, channels_first, biases, masked, dtype):
    inputs = _inputs(shape, dtype, dtype, biases, masked, channels_first)
    exact = _run(sigmoid_gate_reference, *inputs, channels_first, dtype=torch.float64)
    with kernel_backend("triton"):
        got = _run(sigmoid_gate, *inputs, channels_first)
    assert got[0].is_contiguous() and got[0].shape == exact[0].shape
    for i, (a, e) in enumerate(zip(got, exact)):
        assert a.dtype == dtype, i
        tol = TOL[dtype] * (shape[0] * 8 if i >= 3 else 1)  # bias gradients sum over rows
        torch.testing.assert_close(a.double(), e, rtol=TOL[dtype], atol=tol, msg=f"output {i}")


def test_fp32_master_biases_with_bf16_inputs_get_fp32_gradients():
    inputs = _inputs((2, 6, 5, 24), torch.bfloat16, torch.float32, "gx", True, True, seed=3)
    exact = _run(sigmoid_gate_reference, *inputs, True, dtype=torch.float64)
    with kernel_backend("triton"):
        got = _run(sigmoid_gate, *inputs, True)
    dgb, dxb = got[3], got[4]
    assert dgb.dtype == dxb.dtype == torch.float32 and got[0].dtype == torch.bfloat16
    # the bias gradients are fp32 sums of fp32 products: closer than a bf16 rounding
    torch.testing.assert_close(dgb.double(), exact[3], rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(dxb.double(), exact[4], rtol=1e-2, atol=2e-2)


def test_reads_column_slices_of_a_wider_projection_in_place():
    gen = torch.Generator().manual_seed(5)
    proj = torch.randn(3, 8, 40, generator=gen)
    gate, x = proj[..., :20], proj[..., 20:]
    bias = torch.randn(20, generator=gen)
    with kernel_backend("triton"):
        got = sigmoid_gate(gate, x, bias, None, None)
    torch.testing.assert_close(got, sigmoid_gate_reference(gate, x, bias, None, None), rtol=1e-6, atol=1e-6)


def test_non_contiguous_output_gradient_in_channels_first_layout():
    inputs = _inputs((1, 4, 6, 16), torch.float32, torch.float32, "gx", True, True, seed=7)
    gate, x, gb, xb, mask, dy = inputs
    dy_t = dy.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
    want = _run(sigmoid_gate_reference, gate, x, gb, xb, mask, dy, True)
    with kernel_backend("triton"):
        got = _run(sigmoid_gate, gate, x, gb, xb, mask, dy_t, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_custom_op_under_torch_compile_matches_eager():
    inputs = _inputs((2, 5, 5, 16), torch.float32, torch.float32, "gx", True, True, seed=9)
    compiled = torch.compile(sigmoid_gate, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        want = _run(sigmoid_gate, *inputs, True)
        got = _run(compiled, *inputs, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_reference_runs_off_triton():
    inputs = _inputs((4, 6), torch.float32, torch.float32, "gx", True, False)
    with kernel_backend("torch"):
        got = _run(sigmoid_gate, *inputs, False)
    want = _run(sigmoid_gate_reference, *inputs, False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(gate=torch.zeros(3, 5)), "gate must have x's shape"),
    (dict(gate=torch.zeros(3, 4, dtype=torch.float64)), "gate must have x's dtype"),
    (dict(gate_bias=torch.zeros(5)), r"gate_bias must have shape \(4,\)"),
    (dict(x_bias=torch.zeros(4, dtype=torch.float64)), "x_bias must be in x's dtype"),
    (dict(row_mask=torch.zeros(4)), "row_mask must have shape"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(gate=torch.zeros(3, 4), x=torch.zeros(3, 4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sigmoid_gate(**args)
