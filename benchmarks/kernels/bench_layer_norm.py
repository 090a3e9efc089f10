"""layer_norm against ``torch.nn.functional.layer_norm`` (bf16, the shapes of a BERT-large or GPT-2
medium step: 65536 tokens of width 1024).

Fewest bytes moved, for M rows of N elements of ``e`` bytes (statistics and parameters, O(M + N),
are counted too):
    forward:            read x, write y                                    2 * M * N * e
    forward + backward: forward, then read x and dy, write dx              5 * M * N * e
    with the residual:  read x, r, write y, h; read h, dy, dh, write dx    8 * M * N * e
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import Case  # benchmarks/kernels/ is on sys.path (run.py and conftest.py put it there)
from dslab.kernels.norm.layer_norm import layer_norm


def _tensors(m: int, n: int, device, dtype, requires_grad: bool):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, n, device=device, dtype=dtype, generator=gen).requires_grad_(requires_grad)
    weight = (1 + 0.1 * torch.randn(n, device=device, generator=gen)).to(dtype).requires_grad_(requires_grad)
    bias = (0.1 * torch.randn(n, device=device, generator=gen)).to(dtype).requires_grad_(requires_grad)
    return x, weight, bias


def cases(device) -> list[Case]:
    device = torch.device(device)
    dtype, (m, n), eps = torch.bfloat16, (65536, 1024), 1e-5
    e = torch.finfo(dtype).bits // 8
    shape = f"{m}x{n} bf16"
    stats_and_params = 2 * m * 4 + 4 * n * e  # mean/rstd written and read; weight, bias, their grads

    x, weight, bias = _tensors(m, n, device, dtype, requires_grad=False)
    forward = [
        Case(
            op="layer_norm forward",
            shape=shape,
            dslab=lambda: layer_norm(x, weight, bias, eps),
            torch=lambda: F.layer_norm(x, (n,), weight, bias, eps),
            bytes_moved=2 * m * n * e + 2 * n * e,
            notes="PyTorch: F.layer_norm",
        )
    ]

    xg, wg, bg = _tensors(m, n, device, dtype, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=dtype)

    def dslab_train():
        y = layer_norm(xg, wg, bg, eps)
        return torch.autograd.grad(y, (xg, wg, bg), dy)

    def torch_train():
        y = F.layer_norm(xg, (n,), wg, bg, eps)
        return torch.autograd.grad(y, (xg, wg, bg), dy)

    rg = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    dh = torch.randn(m, n, device=device, dtype=dtype)

    def dslab_residual_train():
        y, h = layer_norm(xg, wg, bg, eps, residual=rg)
        return torch.autograd.grad((y, h), (xg, rg, wg, bg), (dy, dh))

    def torch_residual_train():
        h = xg + rg
        y = F.layer_norm(h, (n,), wg, bg, eps)
        return torch.autograd.grad((y, h), (xg, rg, wg, bg), (dy, dh))

    train = [
        Case(
            op="layer_norm forward+backward",
            shape=shape,
            dslab=dslab_train,
            torch=torch_train,
            bytes_moved=5 * m * n * e + stats_and_params,
            target=1.5,
            notes="PyTorch: F.layer_norm + autograd; gradients of x, weight, bias",
        ),
        Case(
            op="add + layer_norm forward+backward",
            shape=shape,
            dslab=dslab_residual_train,
            torch=torch_residual_train,
            bytes_moved=8 * m * n * e + stats_and_params,
            notes="residual stream h = x + r returned and differentiated; PyTorch: x + r, F.layer_norm",
        ),
    ]
    return forward + train
