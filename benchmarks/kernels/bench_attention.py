"""Attention forward+backward: dslab's Triton flash attention against PyTorch SDPA (flash backend).

Shapes (bf16, q/k/v ``[batch, heads, seq, head_dim]``, self-attention):

- BERT-large seq 128: batch 64, 16 heads, dim 64; target 1.0x SDPA.
- BERT-large seq 512: batch 16, 16 heads, dim 64; target 1.0x.
- GPT-2 seq 1024, causal: batch 16, 12 heads, dim 64; target 1.0x.
- head dim 128, seq 4096, causal: batch 4, 16 heads; target 0.9x.
- The three training shapes again with dropout 0.1 on the probabilities, as the BERT and GPT-2
  suites train; PyTorch runs SDPA with its own backend choice there (what a training loop gets),
  target 1.0x.

Each call runs the forward and ``torch.autograd.grad`` for q, k, v (no ``.grad`` accumulation).

FLOPs, the rule used (not counted from the executed kernels): the forward does two matmuls per
(query, key) pair, ``4 * b * h * sq * sk * d``, halved for causal; the backward is counted as 2.5x
the forward (five matmuls: S or P recomputation, dV, dP, dK, dQ), so fwd+bwd = 3.5x the forward.
dslab's general backward recomputes S and dP in its dQ programs (seven matmuls), so its executed
FLOPs are higher than this count; the count is the same for both arms.

Bytes: the fewest a fused fwd+bwd must move: q, k, v read and out written by the forward; q, k,
v, out, dout read and dq, dk, dv written by the backward (lse and delta ignored).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import Case  # benchmarks/kernels/ is on sys.path (run.py and conftest.py put it there)
from dslab.kernels.attention.attention import attention
from dslab.kernels.dispatch import kernel_backend

SHAPES = [
    # (label, batch, heads, seq, head_dim, causal, target, dropout_p)
    ("BERT-large seq 128", 64, 16, 128, 64, False, 1.0, 0.0),
    ("BERT-large seq 512", 16, 16, 512, 64, False, 1.0, 0.0),
    ("GPT-2 seq 1024 causal", 16, 12, 1024, 64, True, 1.0, 0.0),
    ("dim 128 seq 4096 causal", 4, 16, 4096, 128, True, 0.9, 0.0),
    ("BERT-large seq 128 dropout", 64, 16, 128, 64, False, 1.0, 0.1),
    ("BERT-large seq 512 dropout", 16, 16, 512, 64, False, 1.0, 0.1),
    ("GPT-2 seq 1024 causal dropout", 16, 12, 1024, 64, True, 1.0, 0.1),
]


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool) -> int:
    """fwd+bwd FLOPs by the rule in the module docstring."""
    forward = 4 * batch * heads * seq_q * seq_k * head_dim
    if causal:
        forward //= 2
    return int(forward * 3.5)


def _case(device, label, batch, heads, seq, head_dim, causal, target, dropout_p) -> Case:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=device).manual_seed(0)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (
        torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(3)
    )
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)

    def run_dslab():
        with kernel_backend("triton"):  # the Triton kernels, not attention_cudnn's path for causal calls
            out = attention(q, k, v, causal=causal, dropout_p=dropout_p)
        return torch.autograd.grad(out, (q, k, v), grad)

    def run_torch():
        if dropout_p:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p)
        else:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.autograd.grad(out, (q, k, v), grad)

    tensor_bytes = q.numel() * q.element_size()
    return Case(
        op="attention fwd+bwd",
        shape=f"{label}: b{batch} h{heads} s{seq} d{head_dim}" + (" causal" if causal else "")
        + (f" p{dropout_p:g}" if dropout_p else ""),
        dslab=run_dslab,
        torch=run_torch,
        bytes_moved=12 * tensor_bytes,
        flops=attention_flops(batch, heads, seq, seq, head_dim, causal),
        target=target,
        check_memory=True,
        notes=("bf16; torch = SDPA (its own backend choice) with dropout" if dropout_p else
               "bf16; torch = SDPA with SDPBackend.FLASH_ATTENTION") + "; flops = 3.5 x forward rule",
    )


def cases(device) -> list[Case]:
    """The attention shapes of the module docstring on ``device`` (a CUDA device)."""
    device = torch.device(device)
    return [_case(device, *shape) for shape in SHAPES]
