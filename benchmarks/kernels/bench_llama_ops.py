"""The Llama block's elementwise ops against what a PyTorch user writes, bf16, at Llama-3.2-1B's
training shapes (micro-batch 8 x seq 2048 = 16384 tokens, hidden 2048, 32 query heads over 8
key/value heads of 64, SwiGLU width 8192):

- ``rms_norm`` with the residual add: ``F.rms_norm(x + r)`` (the add, then the norm) against one
  kernel writing ``h = x + r`` and the norm of it. Fewest bytes: read x, r, write h, y
  (forward, 4 M N e); forward + backward: that, then read dy, dh, h, write dx (8 M N e).
- ``swiglu``: ``F.silu(gate) * up`` on the fused gate/up projection's output against one kernel.
  Fewest bytes: read [M, 2I], write [M, I] (3 M I e); with the backward, read x and dy, write dx
  (3 + 5 = 8 M I e).
- ``rope``: q and k rotated from the packed qkv projection (transformers' ``rotate_half`` form
  with the tables cast to bf16) against one launch rotating both. Fewest bytes: read and write q
  and k (2 (Hq + Hkv) D e per token); with the backward, the same again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import Case  # benchmarks/kernels/ is on sys.path (run.py and conftest.py put it there)
from dslab.kernels.activation.swiglu import swiglu
from dslab.kernels.attention.rope import apply_rope, rope_inv_freq, rope_tables
from dslab.kernels.norm.rms_norm import rms_norm

TOKENS, BATCH, SEQ, HIDDEN, WIDTH, HEADS, KV_HEADS, HEAD_DIM = 16384, 8, 2048, 2048, 8192, 32, 8, 64


def _torch_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)

    def rotate(x):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(q), rotate(k)


def cases(device) -> list[Case]:
    device = torch.device(device)
    dtype = torch.bfloat16
    e = 2
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, grad=False):
        t = torch.randn(*shape, device=device, dtype=dtype, generator=gen)
        return t.requires_grad_() if grad else t

    m, n = TOKENS, HIDDEN
    x, r, w = randn(m, n, grad=True), randn(m, n, grad=True), randn(n, grad=True)
    dy, dh = randn(m, n), randn(m, n)

    def torch_norm():
        h = x + r
        return F.rms_norm(h, (n,), w, 1e-5), h

    norm_shape = f"{m}x{n} bf16"
    out = [
        Case(op="rms_norm + residual forward", shape=norm_shape, dslab=lambda: rms_norm(x, w, 1e-5, r),
             torch=torch_norm, bytes_moved=4 * m * n * e, notes="PyTorch: x + r, then F.rms_norm"),
        Case(op="rms_norm + residual forward+backward", shape=norm_shape,
             dslab=lambda: torch.autograd.grad(rms_norm(x, w, 1e-5, r), (x, r, w), (dy, dh)),
             torch=lambda: torch.autograd.grad(torch_norm(), (x, r, w), (dy, dh)), bytes_moved=8 * m * n * e,
             notes="gradients of x, residual and weight"),
    ]

    gate_up = randn(m, 2 * WIDTH, grad=True)
    dswi = randn(m, WIDTH)

    def torch_swiglu():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    swi_shape = f"{m}x{2 * WIDTH} bf16"
    out += [
        Case(op="swiglu forward", shape=swi_shape, dslab=lambda: swiglu(gate_up), torch=torch_swiglu,
             bytes_moved=3 * m * WIDTH * e, notes="PyTorch: F.silu(gate) * up, two kernels"),
        Case(op="swiglu forward+backward", shape=swi_shape,
             dslab=lambda: torch.autograd.grad(swiglu(gate_up), gate_up, dswi),
             torch=lambda: torch.autograd.grad(torch_swiglu(), gate_up, dswi), bytes_moved=8 * m * WIDTH * e,
             notes="PyTorch saves silu(gate); dslab recomputes it"),
    ]

    qkv = randn(BATCH, SEQ, HEADS + 2 * KV_HEADS, HEAD_DIM, grad=True)
    q, k = qkv[:, :, :HEADS], qkv[:, :, HEADS:HEADS + KV_HEADS]

    def split():
        # Views taken in the call, as a model's attention does: a view's backward runs on the
        # stream its forward ran on, so views made once here, on the default stream, would put
        # their backward there during a CUDA-graph capture on another stream and fail it.
        return qkv[:, :, :HEADS], qkv[:, :, HEADS:HEADS + KV_HEADS]
    inv_freq = rope_inv_freq(HEAD_DIM, 500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cos, sin = rope_tables(torch.arange(SEQ, device=device), inv_freq.to(device))
    dq, dk = randn(BATCH, SEQ, HEADS, HEAD_DIM), randn(BATCH, SEQ, KV_HEADS, HEAD_DIM)
    rotated = BATCH * SEQ * (HEADS + KV_HEADS) * HEAD_DIM
    rope_shape = f"{BATCH}x{SEQ} q{HEADS} k{KV_HEADS} d{HEAD_DIM} bf16"
    out += [
        Case(op="rope q+k forward", shape=rope_shape, dslab=lambda: apply_rope(q, k, cos, sin),
             torch=lambda: _torch_rope(q, k, cos, sin), bytes_moved=2 * rotated * e,
             notes="PyTorch: transformers' rotate_half form, ~10 kernels"),
        Case(op="rope q+k forward+backward", shape=rope_shape,
             dslab=lambda: torch.autograd.grad(apply_rope(*split(), cos, sin), qkv, (dq, dk)),
             torch=lambda: torch.autograd.grad(_torch_rope(*split(), cos, sin), qkv, (dq, dk)),
             bytes_moved=4 * rotated * e, notes="the gradient lands in the packed qkv's q and k columns"),
    ]
    return out
