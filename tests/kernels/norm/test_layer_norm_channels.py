"""layer_norm_channels_first: the Triton kernels (under the interpreter on CPU) against the PyTorch
reference, ``F.layer_norm`` over ``x.movedim(1, -1)``.

Errors are measured against the reference in float64 on the same (rounded) inputs and must stay
within twice PyTorch's own error in the test's precision, plus a floor of one unit in the last place
at the output's scale. Also: no affine, strided inputs and output gradients, deterministic
parameter gradients, empty inputs, the custom ops (opcheck, torch.compile), the flops profiler's
count and bad arguments.
"""

import pytest
import torch
import torch.nn as nn

from dslab.kernels import kernel_backend
from dslab.kernels.norm.layer_norm_channels import (
    MAX_CHANNELS, layer_norm_channels_first, layer_norm_channels_first_reference,
)

# (x dtype, weight/bias dtype): fp32 master weights with half inputs, as under autocast.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float16, torch.float32)]
SHAPES = [(2, 12, 7, 5), (1, 33, 19, 19), (2, 128, 3)]


def _assert_within_torch_error(name, actual, torch_low, exact):
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item()
    torch_err = (torch_low.double() - exact).abs().max().item()
    floor = torch.finfo(actual.dtype).eps * exact.abs().max().item()
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _inputs(shape, dtype, param_dtype, affine="both", seed=0):
    """(x, weight, bias) and dy (y's shape, channels last), fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    w = (1 + 0.3 * torch.randn(c, generator=gen)).to(param_dtype) if affine in ("both", "weight") else None
    b = (0.3 * torch.randn(c, generator=gen)).to(param_dtype) if affine in ("both", "bias") else None
    dy = torch.randn(shape[0], *shape[2:], c, generator=gen).to(dtype)
    return [x, w, b], dy


def _run(fn, tensors, dy, dtype=None):
    """``fn(x, weight, bias, eps)`` and its gradients on leaf copies of ``tensors`` (cast to
    ``dtype`` when given, the parameters included)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() if t is not None else None for t in tensors]
    x, w, b = leaves
    y = fn(x, w, b, 1e-5)
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(y, wrt, dy.to(y.dtype))
    return y.detach(), list(grads)


@pytest.mark.parametrize("dtype,param_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_float64_reference(shape, dtype, param_dtype):
    tensors, dy = _inputs(shape, dtype, param_dtype)
    exact_y, exact_grads = _run(layer_norm_channels_first_reference, tensors, dy, dtype=torch.float64)
    torch_y, torch_grads = _run(layer_norm_channels_first_reference, tensors, dy)
    with kernel_backend("triton"):
        y, grads = _run(layer_norm_channels_first, tensors, dy)
    assert y.dtype == dtype and y.shape == (shape[0], *shape[2:], shape[1]) and y.is_contiguous()
    _assert_within_torch_error("y", y, torch_y, exact_y)
    for name, grad, low, exact, want in zip(["dx", "dweight", "dbias"], grads, torch_grads, exact_grads,
                                            [dtype, param_dtype, param_dtype]):
        assert grad.dtype == want, name
        _assert_within_torch_error(name, grad, low, exact)
    assert grads[0].shape == shape and grads[0].is_contiguous()
    if param_dtype == torch.float32:
        # fp32 sums of the products of the (rounded) inputs: much closer than PyTorch's mixed-dtype
        # CPU backward, whose parameter gradients pass through the input's precision.
        for name, grad, exact in zip(["dweight", "dbias"], grads[1:], exact_grads[1:]):
            torch.testing.assert_close(grad.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item(),
                                       msg=lambda s, name=name: f"{name}: {s}")


@pytest.mark.parametrize("affine", ["weight", "bias", "none"])
def test_without_bias_or_affine(affine):
    tensors, dy = _inputs((2, 20, 6, 7), torch.float32, torch.float32, affine, seed=1)
    exact_y, exact_grads = _run(layer_norm_channels_first_reference, tensors, dy, dtype=torch.float64)
    with kernel_backend("triton"):
        y, grads = _run(layer_norm_channels_first, tensors, dy)
    assert len(grads) == len(exact_grads) == (1 if affine == "none" else 2)
    for out, exact in zip([y, *grads], [exact_y, *exact_grads]):
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_bf16_without_affine():
    tensors, dy = _inputs((1, 33, 19, 19), torch.bfloat16, torch.float32, "none", seed=2)
    exact_y, exact_grads = _run(layer_norm_channels_first_reference, tensors, dy, dtype=torch.float64)
    torch_y, torch_grads = _run(layer_norm_channels_first_reference, tensors, dy)
    with kernel_backend("triton"):
        y, grads = _run(layer_norm_channels_first, tensors, dy)
    _assert_within_torch_error("y", y, torch_y, exact_y)
    _assert_within_torch_error("dx", grads[0], torch_grads[0], exact_grads[0])


def test_strided_input_and_output_gradient():
    # x a channels-last tensor seen channels first (a copy is made), dy with transposed strides.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 11, 24, generator=gen).permute(0, 3, 1, 2)  # [B, C=24, 9, 11], not contiguous
    w, b = torch.randn(24, generator=gen), torch.randn(24, generator=gen)
    dy = torch.randn(2, 11, 9, 24, generator=gen).transpose(1, 2)  # [B, 9, 11, C], other strides
    exact_y, exact_grads = _run(layer_norm_channels_first_reference, [x, w, b], dy, dtype=torch.float64)
    with kernel_backend("triton"):
        y, grads = _run(layer_norm_channels_first, [x, w, b], dy)
    for out, exact in zip([y, *grads], [exact_y, *exact_grads]):
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_weight_gradient_is_deterministic():
    tensors, dy = _inputs((2, 48, 13, 13), torch.bfloat16, torch.float32)
    with kernel_backend("triton"):
        first = _run(layer_norm_channels_first, tensors, dy)[1]
        second = _run(layer_norm_channels_first, tensors, dy)[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(0, 12, 3), (2, 12, 0, 4)], ids=str)
def test_empty_inputs(shape):
    tensors, dy = _inputs(shape, torch.float32, torch.float32)
    with kernel_backend("triton"):
        y, (dx, dw, db) = _run(layer_norm_channels_first, tensors, dy)
    assert y.shape == (shape[0], *shape[2:], shape[1]) and dx.shape == shape
    assert torch.equal(dw, torch.zeros(12)) and torch.equal(db, torch.zeros(12))


def test_torch_backend_and_cpu_auto_run_the_reference():
    x, w, b = torch.randn(2, 16, 5, 3), torch.randn(16), torch.randn(16)
    expected = nn.functional.layer_norm(x.permute(0, 2, 3, 1), (16,), w, b, 1e-5)
    for name in ("torch", "auto"):
        with kernel_backend(name):
            y = layer_norm_channels_first(x, w, b)
        assert torch.equal(y, expected) and y.is_contiguous()


def test_matches_the_permuted_layer_norm_module():
    """What the triangle multiplication replaced: ``nn.LayerNorm(c)(x.permute(0, 2, 3, 1))``."""
    torch.manual_seed(4)
    norm = nn.LayerNorm(12)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    x = torch.randn(2, 12, 6, 6)
    with kernel_backend("triton"):
        y = layer_norm_channels_first(x, norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(y, norm(x.permute(0, 2, 3, 1)), rtol=1e-5, atol=1e-5)


def _bad(**kwargs):
    args = dict(x=torch.ones(2, 8, 3, 3), weight=torch.ones(8), bias=torch.zeros(8), eps=1e-5)
    return args | kwargs


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (_bad(x=torch.ones(2, 8)), "rank >= 3"),
        (_bad(x=torch.ones(2, 8, 3, dtype=torch.int32)), "x must be a floating-point"),
        (_bad(x=torch.ones(1, MAX_CHANNELS + 1, 2), weight=None, bias=None), "channel dimension"),
        (_bad(weight=torch.ones(7)), r"weight must have shape \(8,\)"),
        (_bad(bias=torch.ones(8, 1)), r"bias must have shape \(8,\)"),
        (_bad(weight=torch.ones(8, dtype=torch.float64)), "weight must be in x's dtype"),
        (_bad(weight=torch.ones(8, dtype=torch.bfloat16)), "weight must be in x's dtype"),
        (_bad(x=torch.ones(2, 8, 3, dtype=torch.bfloat16), bias=torch.ones(8, dtype=torch.bfloat16)),
         "bias must have weight's dtype"),
        (_bad(weight=torch.ones(8, device="meta")), "weight must be on x's device"),
        (_bad(eps=-1.0), "eps"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        layer_norm_channels_first(**kwargs)


def test_custom_ops_pass_opcheck():
    (x, w, b), dy = _inputs((2, 12, 5, 3), torch.float32, torch.float32)
    x3 = x.reshape(2, 12, 15)
    x3, w, b = (t.requires_grad_() for t in (x3, w, b))
    torch.library.opcheck(torch.ops.dslab.layer_norm_channels_first.default, (x3, w, b, 1e-5))
    torch.library.opcheck(torch.ops.dslab.layer_norm_channels_first.default, (x3, None, None, 1e-5))
    y, mean, rstd = torch.ops.dslab.layer_norm_channels_first(x3.detach(), w.detach(), b.detach(), 1e-5)
    dy3 = dy.reshape(2, 15, 12)
    torch.library.opcheck(torch.ops.dslab.layer_norm_channels_first_backward.default,
                          (dy3, x3.detach(), w.detach(), None, mean, rstd))


def test_torch_compile_traces_the_custom_ops():
    tensors, dy = _inputs((2, 20, 4, 5), torch.float32, torch.float32)

    def block(x, w, b, eps):
        return layer_norm_channels_first(x * 2, w, b, eps) + 1

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager_y, eager_grads = _run(block, tensors, dy)
        y, grads = _run(compiled, tensors, dy)
    for a, b in zip([y, *grads], [eager_y, *eager_grads]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("affine", ["both", "none"])
def test_flops_profiler_prices_the_custom_ops_like_aten_layer_norm(affine):
    """5 / 10 flops per element with weight and bias, 4 / 6 without: the elementwise figure, the
    same as the reference's aten::native_layer_norm(_backward)."""
    from dslab.profilers.flops import FlopsProfiler

    class Call(nn.Module):
        def forward(self, x, w, b):
            return layer_norm_channels_first(x, w, b)

    tensors, _ = _inputs((2, 12, 5, 3), torch.float32, torch.float32, affine)
    numel = tensors[0].numel()
    forward, backward = (5, 10) if affine == "both" else (4, 6)
    counts = {}
    for name in ("triton", "torch"):
        x, w, b = (t.clone().requires_grad_() if t is not None else None for t in tensors)
        model = Call()
        profiler = FlopsProfiler(model)
        profiler.start_profile()
        with kernel_backend(name):
            model(x, w, b).sum().backward()
        profiler.stop_profile()
        counts[name] = profiler.records()
    ops = counts["triton"]["flops_by_op"]
    assert ops["dslab::layer_norm_channels_first"] == {"figure": "elementwise", "flops": forward * numel}
    assert ops["dslab::layer_norm_channels_first_backward"]["flops"] == backward * numel
    assert counts["triton"]["total_flops"] == 0
    ref_ops = counts["torch"]["flops_by_op"]
    assert ref_ops["aten::native_layer_norm"]["flops"] == forward * numel
    assert ref_ops["aten::native_layer_norm_backward"]["flops"] == backward * numel
