"""layer_norm_channels_first on the GPU at the triangle multiplication's size (B 1, c 128, N_res 256
and 384), bf16 input with fp32 master weights (as under autocast) and fp32 input: Triton against
the reference upcast to fp32 and to float64. The error against float64 must stay within twice that
of PyTorch in the same dtypes, plus one rounding (for the fp32 parameter gradients, a rounding per
square root of the positions summed); Triton must also stay that close to the fp32 reference.
Deterministic parameter gradients; the custom op under torch.compile."""

import pytest
import torch

from dslab.kernels.norm.layer_norm_channels import layer_norm_channels_first, layer_norm_channels_first_reference

pytestmark = pytest.mark.gpu


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    c = shape[1]
    x = (torch.randn(shape, device="cuda", generator=gen) * 2 + 0.5).to(dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(c, device="cuda", generator=gen)).requires_grad_()
    b = (0.3 * torch.randn(c, device="cuda", generator=gen)).requires_grad_()
    dy = torch.randn(shape[0], *shape[2:], c, device="cuda", generator=gen).to(dtype)
    return x, w, b, dy


def _run(fn, x, w, b, dy, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, w, b)]
    y = fn(*leaves, 1e-5)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy.to(y.dtype))]


@pytest.mark.parametrize("res", [256, 384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_matches_reference(res, dtype):
    x, w, b, dy = _inputs((1, 128, res, res), dtype)
    got = _run(layer_norm_channels_first, x, w, b, dy)
    low = _run(layer_norm_channels_first_reference, x, w, b, dy, dtype=dtype)  # PyTorch wholly in x's dtype
    fp32 = _run(layer_norm_channels_first_reference, x, w, b, dy, dtype=torch.float32)
    exact = _run(layer_norm_channels_first_reference, x, w, b, dy, dtype=torch.float64)
    mixed = _run(layer_norm_channels_first_reference, x, w, b, dy)  # x's dtype, fp32 parameters
    assert mixed[0].dtype == dtype and mixed[2].dtype == torch.float32
    assert got[0].dtype == got[1].dtype == dtype and got[2].dtype == got[3].dtype == torch.float32
    assert got[0].shape == (1, res, res, 128) and got[0].is_contiguous() and got[1].is_contiguous()
    for i, (name, a, base, ref, e) in enumerate(zip(["y", "dx", "dweight", "dbias"], got, low, fp32, exact)):
        e = e.double()
        terms = res * res if i >= 2 else 1
        floor = torch.finfo(a.dtype).eps * e.abs().max().item() * terms ** 0.5
        tol = 2 * (base.double() - e).abs().max().item() + floor
        err = (a.double() - e).abs().max().item()
        assert err <= tol, f"{name}: error {err:.3g} vs float64, allowed {tol:.3g}"
        fp32_err = (a.double() - ref.double()).abs().max().item()
        fp32_tol = tol + (ref.double() - e).abs().max().item()
        assert fp32_err <= fp32_tol, f"{name}: {fp32_err:.3g} from the fp32 reference, allowed {fp32_tol:.3g}"


def test_gpu_parameter_gradients_are_deterministic():
    x, w, b, dy = _inputs((1, 128, 256, 256), torch.bfloat16, seed=1)
    first = _run(layer_norm_channels_first, x, w, b, dy)
    second = _run(layer_norm_channels_first, x, w, b, dy)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


def test_gpu_torch_compile_matches_eager():
    x, w, b, dy = _inputs((2, 128, 67, 45), torch.bfloat16, seed=2)
    compiled = torch.compile(layer_norm_channels_first, fullgraph=True)
    want = _run(layer_norm_channels_first, x, w, b, dy)
    got = _run(compiled, x, w, b, dy)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
