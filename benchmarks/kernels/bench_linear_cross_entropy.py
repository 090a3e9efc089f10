"""linear_cross_entropy (the LM head and its loss in one op) against what a PyTorch user writes:
``F.linear`` over the padded vocabulary, the slice ``[:, :vocab]``, ``F.cross_entropy`` on its fp32
upcast, and autograd. GPT-2's training shape: 16384 tokens, hidden 768, 50257 classes padded to
50304 head rows, bf16 hidden states and head, one row in 50 ignored. Each call runs the forward
and ``torch.autograd.grad`` for the hidden states and the head.

FLOPs, the rule used (not counted from the executed kernels): the three matmuls both arms run at
the padded width, ``2 * N * Vp * H`` each: the logits forward, then ``d hidden = dlogits @ W`` and
``d W = dlogits^T @ hidden`` backward, ``6 * N * Vp * H`` in all (3.8 TFLOP here). The softmax's
elementwise work is not counted. The matmuls are most of the time of either arm, so the TFLOP/s
figure is read against the matmul peak.

No bytes figure: the fewest bytes an implementation must move is its inputs and the two
gradients (about 0.2 GB), since the logits need never leave the chip; neither arm comes near that
floor, so GB/s against the copy bandwidth would say nothing. What the fusion saves is traffic over
the ``[N, Vp]`` logits: PyTorch reads and writes them (and fp32 copies) in the cross-entropy's
forward and backward, then zero-fills a padded gradient and copies the sliced one into it; dslab's
one kernel reads the logits twice and overwrites them with their gradient.

Peak extra memory of one call is recorded: dslab's is the bf16 ``[N, Vp]`` buffer and the two
gradients; PyTorch's also holds the fp32 copy of the logits, its log-softmax and their gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import Case  # benchmarks/kernels/ is on sys.path (run.py and conftest.py put it there)
from dslab.kernels import kernel_backend
from dslab.kernels.loss.linear_cross_entropy import linear_cross_entropy


def cases(device) -> list[Case]:
    device = torch.device(device)
    n_rows, hidden_size, padded, vocab, dtype = 16384, 768, 50304, 50257, torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n_rows, hidden_size, device=device, generator=gen).to(dtype).requires_grad_()
    weight = (0.02 * torch.randn(padded, hidden_size, device=device, generator=gen)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (n_rows,), device=device, generator=gen)
    target[::50] = -100  # a few ignored (padding) positions, as in a real batch

    def dslab_train():
        with kernel_backend("triton"):
            loss = linear_cross_entropy(hidden, weight, target, vocab)
        return torch.autograd.grad(loss, (hidden, weight))

    def torch_train():
        logits = F.linear(hidden, weight)[:, :vocab]
        loss = F.cross_entropy(logits.float(), target)
        return torch.autograd.grad(loss, (hidden, weight))

    return [
        Case(
            op="linear_cross_entropy fwd+bwd",
            shape=f"{n_rows}x{hidden_size} -> {vocab}/{padded} bf16",
            dslab=dslab_train,
            torch=torch_train,
            flops=6 * n_rows * padded * hidden_size,
            target=1.3,
            check_memory=True,
            notes="PyTorch: F.linear + [:, :vocab] + F.cross_entropy(logits.float()) + autograd for hidden and W",
        )
    ]
