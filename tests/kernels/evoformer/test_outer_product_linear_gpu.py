"""outer_product_linear on the GPU at the Evoformer's sizes (C 32, c_z 128; N_res 256 initial
training, 384 the fine-tune crop, and an odd 77): Triton against the float64 reference, bf16 inputs
with fp32 master weights and fp32 inputs, each within twice the error of the same-precision PyTorch
path (the permuted copy and cuBLAS); every output deterministic. The same in bf16 with the outer
product mean's row scale ``1 / (count + eps)``, against the reference's separate fp32 multiply."""

import pytest
import torch

from dslab.kernels.evoformer.outer_product_linear import outer_product_linear, outer_product_linear_reference

pytestmark = pytest.mark.gpu


def _run(fn, x, w, b, dout, cast=None, row_scale=None):
    leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (x, w, b)]
    kwargs = {} if row_scale is None else {"row_scale": row_scale.to(cast or row_scale.dtype)}
    out = fn(*leaves, **kwargs)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(cast or dout.dtype))]


def _assert_within_reference_error(got, ref, exact, again):
    for name, a, r, ex, a2 in zip(["out", "dx", "dweight", "dbias"], got, ref, exact, again, strict=True):
        assert torch.equal(a, a2), f"{name} is not deterministic"
        err = (a.double() - ex).abs().max().item()
        ref_err = (r.double() - ex).abs().max().item()
        floor = 1e-5 * ex.abs().max().item()  # fp32 sums over up to 147,456 rows
        assert err <= 2 * ref_err + floor, f"{name}: error {err:.3g} vs the reference's {ref_err:.3g}"


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
    _assert_within_reference_error(got, ref, exact, again)


@pytest.mark.parametrize("res", [256, 77], ids=lambda r: f"R={r}")
def test_gpu_row_scale_matches_float64_reference(res):
    """bf16 x and dout, fp32 master weights and row scale ``1 / (count + 1e-3)`` with counts 1..32
    from a random MSA mask (factors 1/32 to 1): Triton's one rounding of the scaled output against
    the reference's F.linear in bf16, fp32 multiply and cast back."""
    batch, c, e, seqs = 1, 32, 128, 32
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(batch, res, c, res, c, device="cuda", generator=gen).bfloat16()
    w = torch.randn(e, c * c, device="cuda", generator=gen) / c
    b = torch.randn(e, device="cuda", generator=gen)
    dout = torch.randn(batch, res, res, e, device="cuda", generator=gen).bfloat16()
    mask = (torch.rand(batch, seqs, res, device="cuda", generator=gen) < 0.5).float()
    mask[:, 0] = 1.0
    scale = 1.0 / (mask.transpose(-1, -2) @ mask + 1e-3)
    assert scale.dtype == torch.float32 and scale.shape == (batch, res, res)
    got = _run(outer_product_linear, x, w, b, dout, row_scale=scale)
    again = _run(outer_product_linear, x, w, b, dout, row_scale=scale)
    ref = _run(outer_product_linear_reference, x, w, b, dout, row_scale=scale)
    exact = _run(outer_product_linear_reference, x, w, b, dout, cast=torch.float64, row_scale=scale)
    assert got[0].dtype == got[1].dtype == torch.bfloat16 and got[2].dtype == got[3].dtype == torch.float32
    assert got[1].is_contiguous() and got[1].shape == x.shape
    _assert_within_reference_error(got, ref, exact, again)
