"""sigmoid_gate on the GPU at the Evoformer's pair size (R 256, c 128) and its MSA size: Triton
against the float64 reference in both layouts, bf16 inputs with fp32 master biases."""

import pytest
import torch

from dslab.kernels.evoformer.sigmoid_gate import sigmoid_gate, sigmoid_gate_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape,channels_first", [((1, 256, 256, 128), True), ((1, 256, 256, 128), False),
                                                  ((2, 128, 256, 256), False), ((2, 67, 45, 40), True)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_matches_reference(shape, channels_first, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(shape, device="cuda", generator=gen).to(dtype).requires_grad_()
    x = torch.randn(shape, device="cuda", generator=gen).to(dtype).requires_grad_()
    gb = torch.randn(shape[-1], device="cuda", generator=gen).requires_grad_()
    xb = torch.randn(shape[-1], device="cuda", generator=gen).requires_grad_()
    mask = (torch.rand(shape[:-1], device="cuda", generator=gen) > 0.2).to(dtype)
    y = sigmoid_gate(gate, x, gb, xb, mask, channels_first=channels_first)
    dy = torch.randn(y.shape, device="cuda", generator=gen).to(dtype)
    got = [y, *torch.autograd.grad(y, (gate, x, gb, xb), dy)]
    leaves = [t.detach().double().requires_grad_() for t in (gate, x, gb, xb)]
    ref = sigmoid_gate_reference(*leaves, mask.double(), channels_first=channels_first)
    want = [ref, *torch.autograd.grad(ref, leaves, dy.double())]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    rows = y.numel() // shape[-1]
    for i, (a, b) in enumerate(zip(got, want)):
        scale = rows ** 0.5 if i >= 3 else 1.0  # bias gradients: sums over every row
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * scale, msg=f"output {i}")
    assert got[3].dtype == got[4].dtype == torch.float32
