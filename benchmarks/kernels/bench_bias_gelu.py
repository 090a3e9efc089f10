"""bias_gelu against PyTorch's unfused ``F.gelu(x + bias)`` (two kernels), bf16, the MLP of a
BERT-large step: 65536 tokens, FFN width 4096.

Fewest bytes moved, for M rows of N elements of ``e`` bytes (the bias, O(N), counted too):
    forward:            read x, write y                          2 * M * N * e
    forward + backward: forward, then read x and dy, write dx    5 * M * N * e
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import Case  # benchmarks/kernels/ is on sys.path (run.py and conftest.py put it there)
from dslab.kernels.activation.bias_gelu import bias_gelu


def cases(device) -> list[Case]:
    device = torch.device(device)
    dtype, (m, n) = torch.bfloat16, (65536, 4096)
    e = torch.finfo(dtype).bits // 8
    shape = f"{m}x{n} bf16"
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, n, device=device, dtype=dtype, generator=gen)
    bias = torch.randn(n, device=device, dtype=dtype, generator=gen)
    forward = [
        Case(
            op=f"bias_gelu forward ({approximate})",
            shape=shape,
            dslab=lambda approximate=approximate: bias_gelu(x, bias, approximate),
            torch=lambda approximate=approximate: F.gelu(x + bias, approximate=approximate),
            bytes_moved=2 * m * n * e + n * e,
            target=2.5 if approximate == "none" else None,
            notes="PyTorch: F.gelu(x + bias), two kernels",
        )
        for approximate in ("none", "tanh")
    ]

    xg = x.clone().requires_grad_()
    bg = bias.clone().requires_grad_()
    dy = torch.randn(m, n, device=device, dtype=dtype, generator=gen)

    def dslab_train():
        return torch.autograd.grad(bias_gelu(xg, bg, "none"), (xg, bg), dy)

    def torch_train():
        return torch.autograd.grad(F.gelu(xg + bg), (xg, bg), dy)

    train = Case(
        op="bias_gelu forward+backward (none)",
        shape=shape,
        dslab=dslab_train,
        torch=torch_train,
        bytes_moved=5 * m * n * e + 2 * n * e,
        notes="gradients of x and bias; PyTorch saves x + bias, dslab recomputes it",
    )
    return [*forward, train]
