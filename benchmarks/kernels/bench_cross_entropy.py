"""softmax_cross_entropy against ``F.cross_entropy`` on fp32-upcast logits (the usual way to get an
fp32 loss from bf16 logits), forward and backward at GPT-2's padded vocabulary: 16384 tokens of
50304 classes in bf16.

Fewest bytes moved, for N rows of V logits of ``e`` bytes:
    forward:  read the logits                                  N * V * e
    backward: read the logits again, write the gradient        2 * N * V * e
plus O(N) for targets, lse and row losses: 3 * N * V * e in all (4.9 GB, ~1.2 ms at 4.2 TB/s).
Peak extra memory of one call is recorded: dslab allocates the bf16 gradient and a few [N]
vectors; PyTorch also makes the fp32 copy of the logits, its log-softmax and their gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import Case  # benchmarks/kernels/ is on sys.path (run.py and conftest.py put it there)
from dslab.kernels import kernel_backend
from dslab.kernels.loss.cross_entropy import softmax_cross_entropy


def cases(device) -> list[Case]:
    device = torch.device(device)
    n_rows, vocab, dtype = 16384, 50304, torch.bfloat16
    e = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (2 * torch.randn(n_rows, vocab, device=device, generator=gen)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (n_rows,), device=device, generator=gen)
    target[::50] = -100  # a few ignored (padding) positions, as in a real batch

    def dslab_train():
        with kernel_backend("triton"):
            loss = softmax_cross_entropy(logits, target)
        return torch.autograd.grad(loss, logits)

    def torch_train():
        loss = F.cross_entropy(logits.float(), target)
        return torch.autograd.grad(loss, logits)

    return [
        Case(
            op="cross_entropy fwd+bwd",
            shape=f"{n_rows}x{vocab} bf16",
            dslab=dslab_train,
            torch=torch_train,
            bytes_moved=3 * n_rows * vocab * e + n_rows * (8 + 4 + 4),
            target=4.0,
            check_memory=True,
            notes="PyTorch: F.cross_entropy(logits.float(), target) + autograd; mean over non-ignored rows",
        )
    ]
