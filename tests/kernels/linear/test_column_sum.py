"""column_sum and the linear built on it: the Triton kernel (under the interpreter on CPU) against
fp64 sums, and linear's gradients against F.linear's, with fp32 master weights and bf16 inputs."""

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels import kernel_backend
from dslab.kernels.linear.column_sum import column_sum, column_sum_reference, linear


@pytest.mark.parametrize("shape", [(37, 24), (1000, 130), (5, 3)], ids=str)
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)], ids=str)
def test_triton_column_sum_matches_fp64(shape, dtype, out_dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    with kernel_backend("triton"):
        got = column_sum(x, out_dtype)
    exact = x.double().sum(0)
    assert got.dtype == out_dtype and got.shape == (shape[1],)
    tol = 1e-5 * shape[0] if out_dtype == torch.float32 else 1e-2 * shape[0] ** 0.5
    torch.testing.assert_close(got.double(), exact, rtol=1e-5 if out_dtype == torch.float32 else 1e-2, atol=tol)
    torch.testing.assert_close(column_sum_reference(x, out_dtype).double(), got.double(), rtol=1e-2, atol=tol)


def test_column_sum_reads_strided_rows_and_refuses_non_matrices():
    x = torch.randn(20, 30)[:, 5:25]
    with kernel_backend("triton"):
        torch.testing.assert_close(column_sum(x), x.sum(0), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="x must be a matrix"):
        column_sum(torch.zeros(2, 3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_gradients_match_f_linear(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 11, 24, generator=gen).to(dtype)
    w, b = torch.randn(17, 24, generator=gen).to(dtype), torch.randn(17, generator=gen).to(dtype)
    dy = torch.randn(3, 11, 17, generator=gen).to(dtype)
    results = []
    for fn in (linear, F.linear):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with kernel_backend("triton"):
            y = fn(*leaves)
        results.append([y.detach(), *torch.autograd.grad(y, leaves, dy)])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in zip(*results):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
