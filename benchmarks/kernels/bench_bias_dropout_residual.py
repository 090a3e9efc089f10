"""bias_dropout_residual against PyTorch's ``residual + F.dropout(x + bias, p)`` (bf16, p = 0.1,
the end of a BERT-large sublayer: 65536 tokens of width 1024).

Fewest bytes moved, for M rows of N elements of ``e`` bytes (the bias, O(N), counted too):
    forward:            read x, residual, write out                        3 * M * N * e
    forward + backward: forward, then read dout, write dx (dresidual = dout) 5 * M * N * e
dslab regenerates the mask from the seed in backward; PyTorch's dropout stores a mask (1 byte per
element, written and read), which these counts leave out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import Case  # benchmarks/kernels/ is on sys.path (run.py and conftest.py put it there)
from dslab.kernels.dropout.bias_dropout_residual import bias_dropout_residual

P = 0.1
SEED = 1234


def cases(device) -> list[Case]:
    device = torch.device(device)
    dtype, (m, n) = torch.bfloat16, (65536, 1024)
    e = torch.finfo(dtype).bits // 8
    shape = f"{m}x{n} bf16 p={P}"
    gen = torch.Generator(device=device).manual_seed(0)
    x, residual, dout = (torch.randn(m, n, device=device, dtype=dtype, generator=gen) for _ in range(3))
    bias = torch.randn(n, device=device, dtype=dtype, generator=gen)
    forward = Case(
        op="bias_dropout_residual forward",
        shape=shape,
        dslab=lambda: bias_dropout_residual(x, bias, residual, P, True, SEED),
        torch=lambda: residual + F.dropout(x + bias, P, training=True),
        bytes_moved=3 * m * n * e + n * e,
        notes="PyTorch: residual + F.dropout(x + bias), three kernels",
    )

    xg, bg, rg = (t.clone().requires_grad_() for t in (x, bias, residual))

    def dslab_train():
        out = bias_dropout_residual(xg, bg, rg, P, True, SEED)
        return torch.autograd.grad(out, (xg, bg, rg), dout)

    def torch_train():
        out = rg + F.dropout(xg + bg, P, training=True)
        return torch.autograd.grad(out, (xg, bg, rg), dout)

    train = Case(
        op="bias_dropout_residual forward+backward",
        shape=shape,
        dslab=dslab_train,
        torch=torch_train,
        bytes_moved=5 * m * n * e + 2 * n * e,
        notes="gradients of x, bias, residual",
    )
    return [forward, train]
