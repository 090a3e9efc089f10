"""Triton kernels for :mod:`dslab.kernels.quant.int8_linear`: a weight-streaming GEMM for decode's
skinny matmuls, ``y [M, N] = x [M, K] @ dequant(qweight [N, K], scale).T + bias``, M <= 64.

``_int8_matmul_kernel``, grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), split_k)``: each program
loads its ``[BLOCK_K, BLOCK_N]`` int8 weight tiles (1 byte a weight, read once per M tile, and
decode has one M tile), converts them to x's dtype in registers and accumulates ``tl.dot`` in
fp32 over its share of K:

- per output channel, the int8 values convert exactly (|q| <= 127 fits fp16 and bf16) and the
  scale multiplies the fp32 accumulator once per column after the K loop;
- per group, each weight tile is dequantised in fp32 with its group's scale (``scale[n, k //
  group_size]``) and rounded to x's dtype inside the K loop: the same weights the reference
  builds. When ``group_size`` is a multiple of ``BLOCK_K`` (128, 256, ... on the GPU) a K step lies
  in one group and its scales are one ``[BLOCK_N]`` load; otherwise they are a ``[BLOCK_K,
  BLOCK_N]`` gather from the small scale matrix (cached).

Split-K: when the output tiles alone would leave the device mostly idle (M = 1 and N = 1600 are
25 tiles of 64 columns for 132 SMs), K is split into ``split_k`` ranges of whole ``BLOCK_K``
steps; each writes an fp32 ``[M, N]`` partial and ``_split_k_sum_kernel`` adds them in split
order, adds the bias and casts: deterministic (no atomics). With one split the matmul kernel
finishes the output itself. Memory traffic: ``N * K`` weight bytes, the scales, ``split_k * M *
K`` elements of x (each split re-reads only its K range: ``M * K`` in all), ``2 * split_k * M * N``
fp32 partial floats (written then read) and ``M * N`` outputs.

Block sizes are fixed (no autotuning, which would benchmark inside a CUDA-graph capture):
``BLOCK_N = 64``, ``BLOCK_K = 128``, ``BLOCK_M`` the next power of two of M, at least 16 (the
smallest ``tl.dot`` tile). Under the interpreter the N and K blocks are 16 and 32, so that small
test shapes take several K steps and split K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import device_guard
from dslab.kernels._triton_compat import cast_rounding
from dslab.kernels.dispatch import interpreting

BLOCK_N, BLOCK_K = 64, 128
INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K = 16, 32
#: Programs to aim for per streaming multiprocessor before splitting K further.
PROGRAMS_PER_SM = 2
#: Stand-in SM count under the interpreter, so that CPU tests exercise split-K.
INTERPRETER_SMS = 4
MAX_SPLIT_K = 16


@triton.jit
def _int8_matmul_kernel(
    X, W, SCALE, BIAS, Y, PARTIAL, M, N, K, stride_xm, stride_ym, k_per_split, groups_per_row,
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        q = tl.load(W + cols.to(tl.int64)[None, :] * K + ks[:, None], mask=w_mask, other=0)  # [BLOCK_K, BLOCK_N]
        if GROUP_SIZE > 0:
            if GROUP_SIZE % BLOCK_K == 0:  # the step lies in one group: one scale per column
                s = tl.load(SCALE + cols * groups_per_row + k0 // GROUP_SIZE, mask=col_mask, other=0.0)[None, :]
            else:  # groups change inside the step: a scale per element, gathered
                s = tl.load(SCALE + cols[None, :] * groups_per_row + (ks // GROUP_SIZE)[:, None], mask=w_mask,
                            other=0.0)
            w = cast_rounding(q.to(tl.float32) * s, X.dtype.element_ty, BF16_BY_HAND)
        elif DOT_FP32:  # exact either way; the interpreter's int8 -> bf16 conversion is not
            w = q.to(tl.float32)
        else:
            w = q.to(X.dtype.element_ty)
        if DOT_FP32:  # the interpreter multiplies bf16 operands as integers: upcast (exact products)
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if GROUP_SIZE == 0:
        acc = acc * tl.load(SCALE + cols, mask=col_mask, other=0.0)[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :],
                 cast_rounding(acc, Y.dtype.element_ty, BF16_BY_HAND), mask=out_mask)
    else:
        base = PARTIAL + split.to(tl.int64) * M * N
        tl.store(base + rows.to(tl.int64)[:, None] * N + cols[None, :], acc, mask=out_mask)


@triton.jit
def _split_k_sum_kernel(PARTIAL, BIAS, Y, M, N, stride_ym, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """Y[m, n] = sum_s PARTIAL[s, m, n] (in split order) + BIAS[n], over a flat block of M * N."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(PARTIAL + s * M * N + offsets, mask=mask, other=0.0)
    cols = offsets % N
    if HAS_BIAS:
        total += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
    rows = offsets // N
    tl.store(Y + rows.to(tl.int64) * stride_ym + cols, cast_rounding(total, Y.dtype.element_ty, BF16_BY_HAND),
             mask=mask)


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_sizes() -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)``: the GPU's, or the interpreter's smaller ones."""
    return (INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K) if interpreting() else (BLOCK_N, BLOCK_K)


def plan_split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int,
                 device: torch.device) -> tuple[int, int]:
    """``(split_k, k_per_split)``: split K (in whole ``block_k`` steps, at most
    :data:`MAX_SPLIT_K`) until the grid has ``PROGRAMS_PER_SM`` programs per SM; ``k_per_split``
    is a multiple of ``block_k`` and ``split_k * k_per_split >= k``."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    wanted = triton.cdiv(PROGRAMS_PER_SM * _multiprocessors(device), tiles)
    split_k = max(1, min(steps, wanted, MAX_SPLIT_K))
    k_per_split = triton.cdiv(steps, split_k) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                group_size: int | None, split_k: int | None = None) -> torch.Tensor:
    """y [M, N] in x's dtype for x [M, K] (fp32/fp16/bf16), qweight int8 [N, K], scale fp32 [N]
    or [N, K // group_size], bias [N] in x's dtype or None; inputs already validated, M, N, K > 0.
    ``split_k`` overrides :func:`plan_split_k` (tests). qweight and scale are read row-major; a
    non-contiguous one is copied first, on every call (see :func:`dslab.kernels.quant.int8_linear.int8_linear`)."""
    m, k = x.shape
    n = qweight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    qweight, scale = qweight.contiguous(), scale.contiguous()
    block_m = max(16, triton.next_power_of_2(m))
    block_n, block_k = block_sizes()
    if split_k is None:
        split_k, k_per_split = plan_split_k(m, n, k, block_m, block_n, block_k, x.device)
    else:
        k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
        split_k = triton.cdiv(k, k_per_split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else y
    bf16_by_hand = interpreting() and x.dtype == torch.bfloat16
    strict_fp32 = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    with device_guard(x):
        _int8_matmul_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)](
            x, qweight, scale, bias if bias is not None else scale, y, partial, m, n, k, x.stride(0), y.stride(0),
            k_per_split, k // group_size if group_size else 1,
            GROUP_SIZE=group_size or 0, HAS_BIAS=bias is not None, SPLIT_K=split_k,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_FP32=bf16_by_hand, PRECISION="ieee" if strict_fp32 else "tf32", BF16_BY_HAND=bf16_by_hand,
            num_warps=4, num_stages=4,
        )
        if split_k > 1:
            block = 1024
            _split_k_sum_kernel[(triton.cdiv(m * n, block),)](
                partial, bias if bias is not None else scale, y, m, n, y.stride(0),
                SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block, BF16_BY_HAND=bf16_by_hand,
            )
    return y
