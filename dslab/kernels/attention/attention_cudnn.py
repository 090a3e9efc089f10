"""Causal self-attention on cuDNN's fused attention (through PyTorch's
``scaled_dot_product_attention`` with its cuDNN backend), where that measured faster than
dslab's Triton kernels: from a packed projection (:func:`attention_packed`), and from separate q, k
and v with fewer key/value heads than query heads or as many (:func:`attention`).

:func:`dslab.kernels.attention.attention_packed.attention_packed` hands a call here when
:func:`eligible` says so, :func:`dslab.kernels.attention.attention.attention` when
:func:`eligible_split` does: a CUDA device of compute capability 9.x (Hopper), bf16 or fp16, causal, no key padding
mask, head dim 64 or 128, no seed passed in (the dropout mask then comes from torch's generator,
as in ``F.dropout``; with a seed the Triton kernels run, whose mask is a function of it), torch's
deterministic algorithms off, the ``auto`` kernel backend (``triton`` forces dslab's kernels, as
:mod:`dslab.kernels.dispatch` says) and PyTorch able to run cuDNN attention on these inputs.

Why: GPT-2 124M (causal, head dim 64, seq 1024, micro-batch 16, dropout 0.1) on an H200,
the whole training step with its CUDA graphs, dslab's Triton attention against this path in one
process: 33.03 against 32.31 ms/step (5 trials). Per layer, cuDNN's backward (~290 us with
dropout) is what wins: the Triton backward takes ~410 us, ~355 without dropout; the forwards are
~190 (cuDNN) and ~225 us (Triton) with dropout, ~90 us each without.

Grouped-query attention (Llama-3.2-1B's layer: 32 query heads over 8 key/value heads, head dim 64,
seq 2048, micro-batch 8, no dropout; ``benchmarks/profile_arms.py suites/llama --case 1b`` on an
H200, 2026-12-01): dslab's Triton kernels took 428 us forward and 1,817 us backward a layer,
cuDNN's (reading the 8 key/value heads without repeating them, as ``torch.compile`` runs the
model) 405 and 1,324: 8.3 ms of the 236 ms training step.

q, k and v are strided views of qkv (no copy in); the output's heads are merged with a view
where cuDNN lays it out as ``[batch, seq, heads, head_dim]``. The backward's dq, dk, dv are
packed into qkv's gradient by one Triton kernel (:func:`gather_packed`) that also adds up the
column sums of what it writes: the gradient of ``bias``, the projection's bias already inside
qkv, with the key block's exactly 0 as on dslab's other paths (softmax ignores a shift of all of
a query's scores). Autograd's own packing followed by a column sum read the ``[tokens, 3 *
hidden]`` gradient once more: 193 against 72 us per GPT-2 124M layer on an H200, and the step
32.75 -> 32.37 ms with the first, slower tile of this kernel.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dslab.kernels._grid import column_sums
from dslab.kernels.dispatch import backend

HEAD_DIMS = (64, 128)
_DTYPES = (torch.bfloat16, torch.float16)


def _sdpa_backend():
    from torch.nn.attention import SDPBackend

    return SDPBackend.CUDNN_ATTENTION


def _cudnn_can_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, causal: bool,
                   enable_gqa: bool = False) -> bool:
    params_type = getattr(torch.backends.cuda, "SDPAParams", None)
    can_use = getattr(torch.backends.cuda, "can_use_cudnn_attention", None)
    if params_type is None or can_use is None or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    try:
        params = params_type(q, k, v, None, dropout_p, causal, enable_gqa)
    except TypeError:  # an SDPAParams of another signature
        return False
    return bool(can_use(params, False))


def _split(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, seq, width = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, heads, width // (3 * heads)).unbind(2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def ineligible_reason(*, is_cuda: bool, dtype: torch.dtype, head_dim: int, causal: bool, has_padding_mask: bool,
                      has_seed: bool, kernel_backend: str, deterministic: bool,
                      capability: tuple[int, int] | None) -> str | None:
    """Why a call with these properties stays on dslab's Triton kernels, or None when it may come
    here (:func:`eligible` then asks PyTorch whether cuDNN can run the inputs)."""
    if not is_cuda:
        return "not a CUDA tensor"
    if kernel_backend != "auto":
        return f"kernel backend {kernel_backend!r} (only 'auto' picks cuDNN)"
    if capability is None or capability[0] != 9:
        return f"compute capability {capability} (measured faster on 9.x only)"
    if dtype not in _DTYPES:
        return f"dtype {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim}"
    if not causal:
        return "not causal"
    if has_padding_mask:
        return "a key padding mask"
    if has_seed:
        return "a dropout seed passed in"
    if deterministic:
        return "torch's deterministic algorithms are on"
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def eligible(qkv: torch.Tensor, heads: int, causal: bool, key_padding_mask: Optional[torch.Tensor],
             dropout_p: float, seed) -> bool:
    """Whether :func:`attention_packed` should run this call (module docstring), for inputs that
    :func:`dslab.kernels.attention.attention_packed.attention_packed` has validated."""
    reason = ineligible_reason(
        is_cuda=qkv.is_cuda, dtype=qkv.dtype, head_dim=qkv.shape[-1] // (3 * heads), causal=bool(causal),
        has_padding_mask=key_padding_mask is not None, has_seed=seed is not None, kernel_backend=backend(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        capability=_capability(qkv.device.index) if qkv.is_cuda else None,
    )
    if reason is not None or qkv.numel() == 0:
        return False
    q, k, v = _split(qkv, heads)
    return _cudnn_can_run(q, k, v, dropout_p, causal)


def eligible_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   key_padding_mask: Optional[torch.Tensor], dropout_p: float, seed) -> bool:
    """Whether :func:`attention` should run this call of q ``[B, Hq, Sq, D]``, k and v ``[B, Hkv,
    Sk, D]`` (module docstring), for inputs that :func:`dslab.kernels.attention.attention.attention`
    has validated. Only a call that autograd will differentiate: cuDNN's lead is in the backward
    (the forwards are within 6%), and a forward alone (the inference engine's prefill) stays on
    dslab's kernels."""
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return False
    reason = ineligible_reason(
        is_cuda=q.is_cuda, dtype=q.dtype, head_dim=q.shape[-1], causal=bool(causal),
        has_padding_mask=key_padding_mask is not None, has_seed=seed is not None, kernel_backend=backend(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        capability=_capability(q.device.index) if q.is_cuda else None,
    )
    if reason is not None or q.numel() == 0 or k.shape[2] == 0:
        return False
    return _cudnn_can_run(q, k, v, dropout_p, causal, enable_gqa=k.shape[1] != q.shape[1])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, scale: float) -> torch.Tensor:
    """Causal attention of q ``[B, Hq, Sq, D]`` over k, v ``[B, Hkv, Sk, D]`` (query head ``h`` on
    key/value head ``h // (Hq // Hkv)``) -> ``[B, Hq, Sq, D]`` on cuDNN, the contract of
    :func:`dslab.kernels.attention.attention.attention`."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_sdpa_backend()):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])


@triton.jit
def _gather_kernel(DQ, DK, DV, OUT, PARTIALS, rows, seq, heads, stride_b, stride_h, stride_s,
                   ROWS_PER_PROGRAM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                   HAS_SUMS: tl.constexpr, STAGES: tl.constexpr):
    """Grid ``(row programs, 3 * heads)``: program ``(p, j)`` copies head ``j % heads`` of part
    ``j // heads`` (dq, dk, dv) for rows ``[p * ROWS_PER_PROGRAM, ...)`` of the ``[batch * seq]``
    tokens into the packed ``OUT [rows, 3 * heads * HEAD_DIM]`` and, with ``HAS_SUMS``, writes its
    rows' fp32 column sums to ``PARTIALS [row programs, 3 * heads * HEAD_DIM]``."""
    pid_r = tl.program_id(0)
    j = tl.program_id(1)
    part = j // heads
    h = j % heads
    if part == 0:
        src = DQ
    elif part == 1:
        src = DK
    else:
        src = DV
    width = 3 * heads * HEAD_DIM
    cols = j * HEAD_DIM + tl.arange(0, HEAD_DIM)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    first = pid_r * ROWS_PER_PROGRAM
    for start in tl.range(first, first + ROWS_PER_PROGRAM, BLOCK_R, num_stages=STAGES):
        r = start + tl.arange(0, BLOCK_R)
        inside = r < rows
        b = (r // seq).to(tl.int64)
        s = (r % seq).to(tl.int64)
        offs = b * stride_b + h * stride_h + s * stride_s
        tile = tl.load(src + offs[:, None] + d[None, :], mask=inside[:, None], other=0.0)
        tl.store(OUT + r.to(tl.int64)[:, None] * width + cols[None, :], tile, mask=inside[:, None])
        if HAS_SUMS:
            acc += tl.sum(tile.to(tl.float32), axis=0)
    if HAS_SUMS:
        tl.store(PARTIALS + pid_r * width + cols, acc)


def gather_packed(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, bias_dtype: torch.dtype | None = None,
                  block_r: int = 64, max_programs: int = 512, num_warps: int = 4, num_stages: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the packed ``[batch, seq, 3 * heads * head_dim]`` gradient of dq, dk, dv ``[batch, heads,
    seq, head_dim]`` (any strides, unit last); with ``bias_dtype``, its column sums in that dtype
    with the key block 0, else None). One Triton launch reads each gradient once and writes the
    packed one; a second adds the per-program fp32 partial sums in a fixed order. The tile
    (``block_r`` rows of one head, at most ``max_programs`` row programs) measured best of eight
    on an H200 at GPT-2 124M's layer ([16, 12, 1024, 64] gradients laid out as cuDNN writes them):
    72 us, against 113 for a plain copy of the same bytes through ``torch.cat``."""
    batch, heads, seq, head_dim = dq.shape
    grads = [g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv)]
    if len({g.stride() for g in grads}) != 1:
        grads = [g.contiguous() for g in grads]
    rows, width = batch * seq, 3 * heads * head_dim
    out = torch.empty((batch, seq, width), dtype=dq.dtype, device=dq.device)
    programs = max(1, min(triton.cdiv(rows, block_r), max_programs if dq.is_cuda else 2))
    per_program = triton.cdiv(triton.cdiv(rows, programs), block_r) * block_r
    programs = triton.cdiv(rows, per_program)
    sums = bias_dtype is not None
    partials = torch.empty((programs, width) if sums else (1,), dtype=torch.float32, device=dq.device)
    stride_b, stride_h, stride_s, _ = grads[0].stride()
    _gather_kernel[(programs, 3 * heads)](
        *grads, out, partials, rows, seq, heads, stride_b, stride_h, stride_s,
        ROWS_PER_PROGRAM=per_program, HEAD_DIM=head_dim, BLOCK_R=block_r, HAS_SUMS=sums, STAGES=num_stages,
        num_warps=num_warps)
    if not sums:
        return out, None
    (grad_bias,) = column_sums(partials.unsqueeze(0), (bias_dtype,))
    grad_bias[width // 3:2 * width // 3] = 0
    return out, grad_bias


class _SplitPacked(torch.autograd.Function):
    """q, k, v ``[batch, heads, seq, head_dim]`` as views of qkv; the backward packs their
    gradients with :func:`gather_packed`, which also sums the bias's gradient."""

    @staticmethod
    def forward(ctx, qkv, bias, heads):
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return _split(qkv, heads)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk, dv):
        reference = next(g for g in (dq, dk, dv) if g is not None)
        grads = [g if g is not None else torch.zeros_like(reference) for g in (dq, dk, dv)]
        grad_qkv, grad_bias = gather_packed(*grads, ctx.bias_dtype)
        return grad_qkv, grad_bias, None


def attention_packed(qkv: torch.Tensor, heads: int, dropout_p: float, scale: float,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal self-attention over qkv ``[B, S, 3 * hidden]`` -> ``[B, S, hidden]`` on cuDNN, the
    contract of :func:`dslab.kernels.attention.attention_packed.attention_packed`."""
    from torch.nn.attention import sdpa_kernel

    batch, seq, width = qkv.shape
    q, k, v = _SplitPacked.apply(qkv, bias, heads)
    with sdpa_kernel(_sdpa_backend()):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(batch, seq, width // 3)
