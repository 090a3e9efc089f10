"""outer_product_linear on the GPU at the Evoformer's sizes (C 32, c_z 128; N_res 256 initial
training, 384 the fine-tune crop, and an odd 77): Triton against the float64 reference, bf16 inputs
with fp32 master weights and fp32 inputs, each within twice the error of the same-precision PyTorch
path (the permuted copy and cuBLAS); every output deterministic."""

import pytest
import torch

from dslab.kernels.outer_product_linear import outer_product_linear, outer_product_linear_reference

pytestmark = pytest.mark.gpu


def _run(fn, x, w, b, dout, cast=None):
    leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (x, w, b)]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(cast or dout.dtype))]


@pytest.mark.parametrize("res", [256, 384, 77], ids=lambda r: f"R={r}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_matches_float64_reference(res, dtype):
    batch, c, e = 1, 32, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, res, c, res, c, device="cuda", generator=gen).to(dtype)
    w = torch.randn(e, c * c, device="cuda", generator=gen) / c
    b = torch.randn(e, device="cuda", generator=gen)
    dout = torch.randn(batch, res, res, e, device="cuda", generator=gen).to(dtype)
    got = _run(outer_product_linear, x, w, b, dout)
    again = _run(outer_product_linear, x, w, b, dout)
    ref = _run(outer_product_linear_reference, x, w, b, dout)
    exact = _run(outer_product_linear_reference, x, w, b, dout, cast=torch.float64)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == got[3].dtype == torch.float32
    assert got[1].is_contiguous() and got[1].shape == x.shape
    for name, a, r, ex, a2 in zip(["out", "dx", "dweight", "dbias"], got, ref, exact, again):
        assert torch.equal(a, a2), f"{name} is not deterministic"
        err = (a.double() - ex).abs().max().item()
        ref_err = (r.double() - ex).abs().max().item()
        floor = 1e-5 * ex.abs().max().item()  # fp32 sums over up to 147,456 rows
        assert err <= 2 * ref_err + floor, f"{name}: error {err:.3g} vs the reference's {ref_err:.3g}"
