"""Triton kernels for :mod:`dslab.kernels.moe.moe_gating` and the host code that launches them.

Logits are ``[T, E]`` with unit stride along E (E <= 128, padded to ``BLOCK_E``, a power of two);
math is fp32. The forward is two launches, neither waiting on the host:

1. ``_gating_rows_kernel``, one program per *segment* of consecutive tokens (about 128 segments on
   a GPU, so that the second launch's prefix sums stay small), looping over row tiles of
   ``BLOCK_T`` tokens. Per row: softmax, the first choice (argmax of the logits, lowest index on
   ties), for k=2 the second (argmax of ``logits + noise`` with the first masked out) and the
   gate weights. Per choice c it also ranks each token among the segment's earlier tokens with the
   same expert (a cumulative sum of the tile's one-hot rows plus the counts carried from the
   segment's earlier tiles), writes that *local* rank into ``position``, and at the end writes
   the segment's per-expert counts ``segment_counts[c, segment, :]``.
   Reads T*E logits (and T*E fp32 noise), writes T*E fp32 probs and 3*T*k int32/fp32 outputs.
2. ``_gating_positions_kernel``, one program per (choice, segment) in choice-major order: its
   offset per expert is the sum of the counts of all (choice, segment) pairs before it
   (``segment_counts`` rows, at most k * 128 rows of E ints), which it adds to the local ranks of
   its tokens; the last program also writes ``expert_counts``. Reads and writes T*k int32
   positions, reads T*k int32 indices.

The backward, one launch over row tiles, forms d probs (the incoming gradient plus the gate
weights' gradient scattered onto the chosen experts) and returns
``d logits = p * (dp - sum_e p_e dp_e)``. Reads T*E fp32 probs and T*E fp32 d probs, writes T*E
d logits in the logits' dtype.

Gate-weight gradient for k=2, with ``s = p_a + p_b``, ``d = max(s, eps)`` and ``g_c = p_c / d``:
``d p_j += (dg_j - sum_c dg_c g_c) / d`` for j in {a, b}. The clamp never binds for finite logits
(``p_a`` is the largest of E <= 128 probabilities, so ``s >= 1/128``), so the gradient always
flows through the denominator, as ``torch.clamp``'s does where ``s >= eps``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import device_guard as _device_guard
from dslab.kernels._grid import unit_stride_rows as _rows
from dslab.kernels._triton_compat import cast_rounding as _cast
from dslab.kernels.dispatch import interpreting

EPS = float(torch.finfo(torch.float32).eps)
MAX_EXPERTS = 128
# Segments of the forward: about one program per SM of an H100 (132). Under the interpreter a few,
# so that the CPU tests' segments span several tiles.
_GPU_SEGMENTS, _INTERPRETER_SEGMENTS = 128, 4
_TILE_ELEMENTS = 2048  # logits per row tile: 16 fp32 values a thread with 4 warps


@triton.jit
def _argmax_lowest(z, cols, BLOCK_E: tl.constexpr):
    """Per row of ``z`` [BLOCK_T, BLOCK_E]: the lowest column holding the row's maximum, which is
    ``torch.argmax``'s rule for ties."""
    top = tl.max(z, axis=1)
    return tl.min(tl.where(z == top[:, None], cols[None, :], BLOCK_E), axis=1)


@triton.jit
def _rank_in_tile(hit, seen):
    """For one-hot rows ``hit`` [BLOCK_T, BLOCK_E] (a row may be all False): each row's rank among
    the rows with the same expert, counting ``seen`` [BLOCK_E] earlier ones; 0 for empty rows."""
    before = tl.cumsum(hit.to(tl.int32), axis=0) - 1 + seen[None, :]
    return tl.sum(tl.where(hit, before, 0), axis=1)


@triton.jit
def _gating_rows_kernel(
    LOGITS, NOISE, PROBS, INDEX, GATE, POSITION, SEGMENT_COUNTS,
    T, E, stride_logits, stride_noise, tiles_per_segment, n_segments,
    K: tl.constexpr, HAS_NOISE: tl.constexpr, EPS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    segment = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    seen_first = tl.zeros([BLOCK_E], dtype=tl.int32)
    seen_second = tl.zeros([BLOCK_E], dtype=tl.int32)
    for tile in range(tiles_per_segment):
        rows = (segment * tiles_per_segment + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(LOGITS + rows64[:, None] * stride_logits + cols[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)
        # Rows past T hold zeros rather than -inf, so that their (unstored) softmax stays finite.
        x = tl.where(row_ok[:, None], x, 0.0)
        row_max = tl.max(x, axis=1)
        num = tl.exp(x - row_max[:, None])
        probs = num / tl.sum(num, axis=1)[:, None]
        tl.store(PROBS + rows64[:, None] * E + cols[None, :], probs, mask=mask)

        first = _argmax_lowest(x, cols, BLOCK_E)
        is_first = cols[None, :] == first[:, None]
        prob_first = tl.sum(tl.where(is_first, probs, 0.0), axis=1)
        hit_first = is_first & row_ok[:, None]
        tl.store(INDEX + rows64 * K, first, mask=row_ok)
        tl.store(POSITION + rows64 * K, _rank_in_tile(hit_first, seen_first), mask=row_ok)
        seen_first += tl.sum(hit_first.to(tl.int32), axis=0)
        if K == 1:
            tl.store(GATE + rows64, prob_first, mask=row_ok)
        else:
            z = x
            if HAS_NOISE:
                z += tl.load(NOISE + rows64[:, None] * stride_noise + cols[None, :], mask=mask, other=0.0)
            z = tl.where(is_first | (cols >= E)[None, :], float("-inf"), z)
            second = _argmax_lowest(z, cols, BLOCK_E)
            is_second = cols[None, :] == second[:, None]
            prob_second = tl.sum(tl.where(is_second, probs, 0.0), axis=1)
            denom = tl.maximum(prob_first + prob_second, EPS)
            hit_second = is_second & row_ok[:, None]
            tl.store(INDEX + rows64 * 2 + 1, second, mask=row_ok)
            tl.store(POSITION + rows64 * 2 + 1, _rank_in_tile(hit_second, seen_second), mask=row_ok)
            seen_second += tl.sum(hit_second.to(tl.int32), axis=0)
            tl.store(GATE + rows64 * 2, prob_first / denom, mask=row_ok)
            tl.store(GATE + rows64 * 2 + 1, prob_second / denom, mask=row_ok)
    tl.store(SEGMENT_COUNTS + segment * BLOCK_E + cols, seen_first)
    if K == 2:
        tl.store(SEGMENT_COUNTS + (n_segments + segment) * BLOCK_E + cols, seen_second)


@triton.jit
def _gating_positions_kernel(
    INDEX, POSITION, SEGMENT_COUNTS, COUNTS, T, E, tiles_per_segment, n_segments,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Program q = choice * n_segments + segment: the rows of SEGMENT_COUNTS before q are exactly
    # the (choice, segment) pairs that precede it in choice-major order.
    q = tl.program_id(0)
    choice = q // n_segments
    segment = q % n_segments
    cols = tl.arange(0, BLOCK_E)
    offset = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, q, BLOCK_S):
        earlier = start + tl.arange(0, BLOCK_S)
        counts = tl.load(SEGMENT_COUNTS + earlier[:, None] * BLOCK_E + cols[None, :],
                         mask=(earlier < q)[:, None], other=0)
        offset += tl.sum(counts, axis=0)
    for tile in range(tiles_per_segment):
        rows = (segment * tiles_per_segment + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        at = rows.to(tl.int64) * K + choice
        expert = tl.load(INDEX + at, mask=row_ok, other=0)
        local = tl.load(POSITION + at, mask=row_ok, other=0)
        base = tl.sum(tl.where(expert[:, None] == cols[None, :], offset[None, :], 0), axis=1)
        tl.store(POSITION + at, local + base, mask=row_ok)
    if q == K * n_segments - 1:
        total = offset + tl.load(SEGMENT_COUNTS + q * BLOCK_E + cols)
        tl.store(COUNTS + cols, total, mask=cols < E)


@triton.jit
def _gating_backward_kernel(
    DPROBS, DGATE, PROBS, INDEX, DLOGITS, T, E, stride_dprobs, stride_dlogits,
    K: tl.constexpr, HAS_DPROBS: tl.constexpr, HAS_DGATE: tl.constexpr, EPS: tl.constexpr,
    BF16_BY_HAND: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols < E)[None, :]
    rows64 = rows.to(tl.int64)
    p = tl.load(PROBS + rows64[:, None] * E + cols[None, :], mask=mask, other=0.0)
    if HAS_DPROBS:
        dp = tl.load(DPROBS + rows64[:, None] * stride_dprobs + cols[None, :], mask=mask, other=0.0)
    else:
        dp = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_DGATE:
        first = tl.load(INDEX + rows64 * K, mask=row_ok, other=0)
        dg_first = tl.load(DGATE + rows64 * K, mask=row_ok, other=0.0)
        is_first = cols[None, :] == first[:, None]
        if K == 1:
            dp += tl.where(is_first, dg_first[:, None], 0.0)
        else:
            second = tl.load(INDEX + rows64 * 2 + 1, mask=row_ok, other=0)
            dg_second = tl.load(DGATE + rows64 * 2 + 1, mask=row_ok, other=0.0)
            is_second = cols[None, :] == second[:, None]
            p_first = tl.sum(tl.where(is_first, p, 0.0), axis=1)
            p_second = tl.sum(tl.where(is_second, p, 0.0), axis=1)
            denom = tl.maximum(p_first + p_second, EPS)
            through_denom = (dg_first * p_first + dg_second * p_second) / denom
            dp += tl.where(is_first, ((dg_first - through_denom) / denom)[:, None], 0.0)
            dp += tl.where(is_second, ((dg_second - through_denom) / denom)[:, None], 0.0)
    dlogits = p * (dp - tl.sum(p * dp, axis=1)[:, None])
    tl.store(DLOGITS + rows64[:, None] * stride_dlogits + cols[None, :],
             _cast(dlogits, DLOGITS.dtype.element_ty, BF16_BY_HAND), mask=mask)


def _config(t: int, e: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_E, tiles_per_segment, n_segments) for ``T`` tokens of ``E`` experts."""
    block_e = max(2, triton.next_power_of_2(e))
    block_t = max(1, _TILE_ELEMENTS // block_e)
    tiles = triton.cdiv(t, block_t)
    target = _INTERPRETER_SEGMENTS if interpreting() else _GPU_SEGMENTS
    tiles_per_segment = triton.cdiv(tiles, target)
    return block_t, block_e, tiles_per_segment, triton.cdiv(tiles, tiles_per_segment)


def forward(
    logits: torch.Tensor, k: int, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs, expert_index, gate_weight, position, expert_counts) for ``logits`` [T, E]."""
    t, e = logits.shape
    assert k in (1, 2) and k <= e <= MAX_EXPERTS
    device = logits.device
    logits = _rows(logits)
    noise = _rows(noise) if noise is not None else None
    probs = torch.empty((t, e), dtype=torch.float32, device=device)
    index = torch.empty((t, k), dtype=torch.int32, device=device)
    gate = torch.empty((t, k), dtype=torch.float32, device=device)
    position = torch.empty((t, k), dtype=torch.int32, device=device)
    if t == 0:
        return probs, index, gate, position, torch.zeros(e, dtype=torch.int32, device=device)
    counts = torch.empty(e, dtype=torch.int32, device=device)
    block_t, block_e, tiles_per_segment, n_segments = _config(t, e)
    segment_counts = torch.empty((k, n_segments, block_e), dtype=torch.int32, device=device)
    with _device_guard(logits):
        _gating_rows_kernel[(n_segments,)](
            logits, noise, probs, index, gate, position, segment_counts,
            t, e, logits.stride(0), noise.stride(0) if noise is not None else 0,
            tiles_per_segment, n_segments,
            K=k, HAS_NOISE=noise is not None, EPS=EPS, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4,
        )
        _gating_positions_kernel[(k * n_segments,)](
            index, position, segment_counts, counts, t, e, tiles_per_segment, n_segments,
            K=k, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_S=max(1, _TILE_ELEMENTS // block_e), num_warps=4,
        )
    return probs, index, gate, position, counts


def backward(
    dprobs: torch.Tensor | None, dgate: torch.Tensor | None, probs: torch.Tensor,
    index: torch.Tensor, logits_dtype: torch.dtype,
) -> torch.Tensor:
    """d logits [T, E] in ``logits_dtype`` from d probs [T, E] and d gate_weight [T, k] (either
    may be None: no gradient reached it)."""
    t, e = probs.shape
    k = index.shape[1]
    dlogits = torch.empty((t, e), dtype=logits_dtype, device=probs.device)
    if t == 0:
        return dlogits
    probs, index = probs.contiguous(), index.contiguous()
    dprobs = _rows(dprobs.float()) if dprobs is not None else None
    dgate = dgate.float().contiguous() if dgate is not None else None
    block_t, block_e, _, _ = _config(t, e)
    with _device_guard(probs):
        _gating_backward_kernel[(triton.cdiv(t, block_t),)](
            dprobs, dgate, probs, index, dlogits, t, e,
            dprobs.stride(0) if dprobs is not None else 0, dlogits.stride(0),
            K=k, HAS_DPROBS=dprobs is not None, HAS_DGATE=dgate is not None, EPS=EPS,
            BF16_BY_HAND=interpreting() and logits_dtype == torch.bfloat16,
            BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4,
        )
    return dlogits
