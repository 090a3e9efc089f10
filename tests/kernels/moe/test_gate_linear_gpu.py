"""gate_linear on a CUDA GPU at the mixture-of-experts anchor (16,384 tokens, hidden 1024, 8
experts), against float64 products, within twice the error of the upcast-and-cuBLAS reference.

    python3 -m pytest -q -m gpu tests/kernels/moe/test_gate_linear_gpu.py
"""

import pytest
import torch

from dslab.kernels.moe.gate_linear import gate_linear, gate_linear_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_anchor(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16384, 1024, device="cuda", generator=gen).to(dtype)
    w = torch.randn(8, 1024, device="cuda", generator=gen) / 32
    dl = torch.randn(16384, 8, device="cuda", generator=gen)
    results = []
    for fn in (gate_linear, gate_linear_reference):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        logits = fn(xs, ws)
        results.append([logits.detach(), *torch.autograd.grad(logits, (xs, ws), dl)])
    xd, wd = x.double(), w.double()
    exact = [xd @ wd.T, dl.double() @ wd, dl.double().T @ xd]
    for name, got, ref, ex in zip(["logits", "dx", "dw"], *results, exact):
        assert got.dtype == ref.dtype, name
        err = (got.double() - ex).abs().max().item()
        ref_err = (ref.double() - ex).abs().max().item()
        floor = 4 * torch.finfo(got.dtype).eps * ex.abs().max().item()
        assert err <= 2 * ref_err + floor, f"{name}: {err:.3g} vs the reference's {ref_err:.3g}"
