"""Flash-decoding Triton kernels for :mod:`dslab.kernels.decode.decode_attention`.

One query per (sequence, head) has too little work for one program when the batch is small and
the cache long (batch 1 with 25 heads would use 25 of an H100's 132 SMs), so the cache positions
are split over ``splits`` programs per (b, h) (flash-decoding, Dao et al. 2023):

1. ``_decode_split_kernel``, grid ``(B * H, splits)``: split s covers the positions
   ``[s * chunk, (s + 1) * chunk)`` intersected with ``[valid_start[b], valid_end[b])`` (read from
   device memory), walks them in blocks of ``BLOCK_N`` with an online softmax in fp32 (base 2, the
   scale folded into q) and writes its running max ``m``, its sum ``l`` and its unnormalised output
   ``acc`` [D] in fp32. A split whose range is empty writes ``m = -inf, l = 0, acc = 0``: it
   contributes nothing. The split's first block is requested together with q and the bounds (one
   round trip to memory where three would follow each other), so it is read whole (within
   ``s_max``) and masked in the arithmetic; later blocks read only their valid positions. Reads
   about ``2 * L_s * D`` cache elements for the ``L_s`` valid positions of the split; writes
   ``D + 2`` floats.
2. ``_decode_combine_kernel``, grid ``(B * H,)``: ``out = sum_s 2^(m_s - M) acc_s / sum_s
   2^(m_s - M) l_s`` with ``M = max_s m_s``; an all-empty row (M = -inf) gives zeros, never NaN.
   Reads ``splits * (D + 2)`` floats, writes D elements of out.

With one split the first kernel normalises and writes ``out`` itself (one launch). With
``combine="fused"`` the combine runs inside the split kernel, also one launch: each split stores
its partials and bumps its row's counter (an atomic with acquire-release order, so its stores are
visible to whoever reads the count), and the split that arrives last combines the row's partials
in split order (the same sums as the combine kernel, whoever finished when) and resets the
counter for the next launch, CUDA-graph replays included; a row whose valid range lies inside one
split's chunk is normalised and stored by that split alone (no partials, no counter). A decode
step then launches one attention kernel per layer, not two. The fused combine is the default
(:func:`combine_mode` has the measurements); ``combine="kernel"`` launches the combine kernel.

Under programmatic dependent launch (:func:`dslab.kernels.dispatch.dependent_launch`) both kernels
wait for the kernel before them (``gdc_wait``) before their first access, then let the next one
launch: what they save is the launch latency between kernels, not any overlap of their own reads.

Grouped-query attention (caches ``[B, H_kv, S_max, D]`` with ``H_kv`` dividing ``H``): row
``b * H + h`` of the grid reads kv head ``h // KV_GROUP``, ``KV_GROUP = H // H_kv`` a constexpr,
so the cache is read in place (the group's programs, adjacent in the grid, share its rows through
L2) and ``KV_GROUP = 1`` compiles to the kernel without grouping. Partials and the combine are per
query head, as without grouping.

``splits`` and ``chunk`` depend only on the shapes and the device (:func:`plan_splits`), never on
the valid lengths, so one CUDA graph serves every decode step; a step reads only the valid part of
the cache, splits past ``valid_end`` return at once. A short cache (:data:`SHORT_CACHE_ELEMENTS`)
with no more rows than SMs is one split of one block: each row's program reads its whole cache in
one round trip and normalises its output itself (a batch-1 decode step's attention then has no
partials, no counter and no loop).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from dslab.kernels._grid import device_guard
from dslab.kernels._triton_compat import cast_rounding
from dslab.kernels.dispatch import dependent_launch, interpreting

LOG2_E = 1.4426950408889634
#: Upper bound on the splits of one (b, h): the combine kernel holds them all in one block.
MAX_SPLITS = 64
#: Programs to aim for per streaming multiprocessor: short programs, several resident per SM.
PROGRAMS_PER_SM = 4
#: Stand-in SM count under the interpreter, so that CPU tests exercise several splits.
INTERPRETER_SMS = 4


@triton.jit
def _combine_row(M_PART, L_PART, ACC_PART, OUT, bh, heads, stride_ob, stride_oh,
                 HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                 BF16_BY_HAND: tl.constexpr, CACHE_GLOBAL: tl.constexpr):
    """Row ``bh``'s output from its splits' partials (module docstring, step 2); ``CACHE_GLOBAL``
    reads them past L1 (``.cg``), as the fused combine must: other programs wrote them. The splits
    are added one after another in split order, so the sums do not depend on how a launch's
    warps would lay out a reduction: the fused combine (the split kernel's warps) and the combine
    kernel (its own) give the same bits."""
    b = bh // heads
    h = bh % heads
    splits = tl.arange(0, BLOCK_SPLITS)
    in_range = splits < SPLITS
    dims = tl.arange(0, HEAD_DIM)
    row = bh * SPLITS
    if CACHE_GLOBAL:
        m = tl.load(M_PART + row + splits, mask=in_range, other=float("-inf"), cache_modifier=".cg")
    else:
        m = tl.load(M_PART + row + splits, mask=in_range, other=float("-inf"))
    m_max = tl.max(m, axis=0)  # a maximum is exact in any order
    # All splits empty: M = -inf, and -inf - (-inf) would be NaN; 2^(-inf - 0) = 0 for each split.
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    numerator = tl.zeros((HEAD_DIM,), tl.float32)
    denominator = tl.zeros((1,), tl.float32)
    one = tl.arange(0, 1)
    for s in tl.static_range(SPLITS):
        part = row + s
        if CACHE_GLOBAL:
            m_s = tl.load(M_PART + part + one, cache_modifier=".cg")
            l_s = tl.load(L_PART + part + one, cache_modifier=".cg")
            acc_s = tl.load(ACC_PART + part.to(tl.int64) * HEAD_DIM + dims, cache_modifier=".cg")
        else:
            m_s = tl.load(M_PART + part + one)
            l_s = tl.load(L_PART + part + one)
            acc_s = tl.load(ACC_PART + part.to(tl.int64) * HEAD_DIM + dims)
        weight = tl.exp2(m_s - m_ref)
        numerator += acc_s * weight
        denominator += l_s * weight
    out = numerator / tl.where(denominator > 0.0, denominator, 1.0)
    tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + dims,
             cast_rounding(out, OUT.dtype.element_ty, BF16_BY_HAND))


@triton.jit
def _attend_block(q, k, v, positions, lo, hi, m, l, acc):
    """The online softmax over one block of cache positions: ``k``/``v`` ``[BLOCK_N, D]`` as loaded,
    the positions outside ``[lo, hi)`` masked (score -inf, value row 0: whatever bits a masked row
    holds, it adds nothing and no NaN). A block without a valid position leaves ``m, l, acc`` as
    they are (its maximum is -inf: the exponents use 0 instead, and every ``p`` is 0)."""
    valid = (positions >= lo) & (positions < hi)
    scores = tl.where(valid, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))  # base-2 logits
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(scores - m_ref)
    v = tl.where(valid[:, None], v.to(tl.float32), 0.0)
    acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    l = l * alpha + tl.sum(p, axis=0)
    return m_new, l, acc


@triton.jit
def _decode_split_kernel(
    Q, K, V, START, END, OUT, M_PART, L_PART, ACC_PART, COUNTERS,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, heads, s_max, chunk, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    KV_GROUP: tl.constexpr, FUSED_COMBINE: tl.constexpr = False, BLOCK_SPLITS: tl.constexpr = 1,
    ONE_BLOCK: tl.constexpr = False, USE_GDC: tl.constexpr = False,
):
    if USE_GDC:  # a programmatic dependent launch: wait for the kernel before it before any access
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    kv_h = h // KV_GROUP
    dims = tl.arange(0, HEAD_DIM)
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
    # The split's first block is requested with q and the bounds, not after them: one round trip to
    # memory, not three. It is read within the cache (positions below s_max) whatever the bounds, and
    # its positions outside them are masked in the arithmetic (a cache row never written may hold
    # any bits: its score is -inf and its value row 0, never NaN).
    first = split * chunk  # a multiple of BLOCK_N
    positions = first + tl.arange(0, BLOCK_N)
    inside = (positions < s_max)[:, None]
    k_first = tl.load(k_base + positions.to(tl.int64)[:, None] * stride_ks + dims[None, :], mask=inside, other=0.0)
    v_first = tl.load(v_base + positions.to(tl.int64)[:, None] * stride_vs + dims[None, :], mask=inside, other=0.0)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h * stride_qh + dims).to(tl.float32) * qk_scale
    start = tl.load(START + b).to(tl.int32)
    end = tl.load(END + b).to(tl.int32)
    lo = tl.maximum(start, first)
    hi = tl.minimum(tl.minimum(end, first + chunk), s_max)
    m = tl.full((1,), float("-inf"), tl.float32)
    l = tl.zeros((1,), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    m, l, acc = _attend_block(q, k_first, v_first, positions, lo, hi, m, l, acc)
    if not ONE_BLOCK:
        # the chunk's later blocks (its positions below hi), their loads masked to the valid positions
        for block_start in range(first + BLOCK_N, hi, BLOCK_N):
            positions = block_start + tl.arange(0, BLOCK_N)
            valid = ((positions >= lo) & (positions < hi))[:, None]
            k = tl.load(k_base + positions.to(tl.int64)[:, None] * stride_ks + dims[None, :], mask=valid, other=0.0)
            v = tl.load(v_base + positions.to(tl.int64)[:, None] * stride_vs + dims[None, :], mask=valid, other=0.0)
            m, l, acc = _attend_block(q, k, v, positions, lo, hi, m, l, acc)
    if SPLITS == 1:
        out = acc / tl.where(l > 0.0, l, 1.0)  # an empty range: acc = 0, out = 0
        tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + dims,
                 cast_rounding(out, OUT.dtype.element_ty, BF16_BY_HAND))
    else:
        # Fused combine, a row whose valid range lies in one chunk (every split of the row reads the
        # same bounds, so all agree): its split normalises and stores the output itself, the others
        # have nothing to do, and no partial, counter or combine is touched. The bits are the
        # combine's: one non-empty split combines to acc * 2^0 / (l * 2^0) plus zeros.
        alone = False
        if FUSED_COMBINE:
            alone = (end > start) & (start // chunk == (end - 1) // chunk)
        if alone:
            if lo < hi:
                out = acc / l
                tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + dims,
                         cast_rounding(out, OUT.dtype.element_ty, BF16_BY_HAND))
        else:
            part = bh * SPLITS + split
            one = tl.arange(0, 1)
            tl.store(M_PART + part + one, m)
            tl.store(L_PART + part + one, l)
            tl.store(ACC_PART + part.to(tl.int64) * HEAD_DIM + dims, acc)
            if FUSED_COMBINE:
                arrived = tl.atomic_add(COUNTERS + bh, 1)  # acq_rel: the stores above are visible to the last
                if arrived == SPLITS - 1:
                    _combine_row(M_PART, L_PART, ACC_PART, OUT, bh, heads, stride_ob, stride_oh, HEAD_DIM, SPLITS,
                                 BLOCK_SPLITS, BF16_BY_HAND, True)
                    tl.atomic_xchg(COUNTERS + bh, 0)


@triton.jit
def _decode_combine_kernel(
    M_PART, L_PART, ACC_PART, OUT, heads, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _combine_row(M_PART, L_PART, ACC_PART, OUT, tl.program_id(0), heads, stride_ob, stride_oh, HEAD_DIM, SPLITS,
                 BLOCK_SPLITS, BF16_BY_HAND, False)


#: How a launch with several splits combines them (module docstring).
COMBINE_MODES = ("kernel", "fused")
_combine_mode = "fused"


@contextlib.contextmanager
def combine_mode(mode: str):
    """Launch decode attention with ``combine=mode`` inside the block (``"fused"`` outside any: the
    decode benchmarks time both, ``benchmarks/decode_profile.py --attention-combine``). On an H200
    (2026-12-01, with a row inside one chunk normalised by its split alone), the fused step ran
    faster with ``"fused"`` in all six cases timed: Llama-3.2-1B 0.8565 -> 0.8437 ms at batch 1
    (dependent launches), 1.6713 -> 1.6317 at batch 8; GPT-2 124M 0.2497 -> 0.2409 and 0.4561 ->
    0.4385; GPT-2 1.5B 1.4937 -> 1.4572 and 2.6322 -> 2.5166. (Before that shortcut, at batch 1,
    it had been 0.988x as fast as the combine kernel.)"""
    global _combine_mode
    if mode not in COMBINE_MODES:
        raise ValueError(f"decode attention combine mode must be 'kernel' or 'fused', got {mode!r}")
    previous, _combine_mode = _combine_mode, mode
    try:
        yield
    finally:
        _combine_mode = previous


#: Rows (B * H) the fused combine keeps counters for per device; a launch of more rows combines
#: in its own kernel.
COUNTERS = 1 << 16
_counter_buffers: dict = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The fused combine's per-row arrival counters on ``device`` (zero between launches: the
    last split of a row resets its own)."""
    key = (device.type, device.index)
    if key not in _counter_buffers:
        _counter_buffers[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counter_buffers[key]


#: A cache of up to this many elements a head (S_max rounded up to a power of two, times D) is read
#: as one block by one program a row, when the rows are no more than the SMs: one round trip to
#: memory, no split to combine. (Such a program is 4 to 16 warps of about 110 registers, one an SM
#: at the widest: at batch 32 on an H200 its 1024 rows ran in waves and the token took 1.620 ms
#: against 1.485 split.)
SHORT_CACHE_ELEMENTS = 16384
_short_cache = True


@contextlib.contextmanager
def short_cache(enabled: bool):
    """Plan short caches as one block a row (:data:`SHORT_CACHE_ELEMENTS`) inside the block, or as
    any other cache (split over programs, then combined) when ``enabled`` is False: the decode
    benchmarks time both (``benchmarks/decode_profile.py --short-cache``)."""
    global _short_cache
    previous, _short_cache = _short_cache, enabled
    try:
        yield
    finally:
        _short_cache = previous


def short_block(s_max: int, head_dim: int, rows: int, device: torch.device) -> int | None:
    """The one block (positions, a power of two) that reads a whole cache of ``s_max`` positions
    when it is short (:data:`SHORT_CACHE_ELEMENTS`) and the ``rows`` (batch x heads) are no more
    than ``device``'s SMs, else None."""
    block = triton.next_power_of_2(max(s_max, 1))
    short = block * head_dim <= SHORT_CACHE_ELEMENTS and rows <= _multiprocessors(device)
    return block if _short_cache and short else None


def block_size(head_dim: int) -> int:
    """Cache positions per loop step: 4096 elements of k (8 KB in bf16), at most 128 positions."""
    return min(128, 4096 // head_dim)


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(batch_heads: int, s_max: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """``(splits, chunk)``: enough programs for ``PROGRAMS_PER_SM`` per SM over the ``batch_heads``
    rows, no split shorter than one block, at most :data:`MAX_SPLITS`; ``chunk`` (a multiple of
    ``block_n``) positions per split, ``splits * chunk >= s_max``. Depends on shapes only."""
    blocks = triton.cdiv(s_max, block_n)
    wanted = triton.cdiv(PROGRAMS_PER_SM * _multiprocessors(device), batch_heads)
    splits = max(1, min(blocks, wanted, MAX_SPLITS))
    chunk = triton.cdiv(blocks, splits) * block_n
    return triton.cdiv(s_max, chunk), chunk


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid_start: torch.Tensor,
    valid_end: torch.Tensor,
    scale: float,
    splits: int | None = None,
    block_n: int | None = None,
    combine: str | None = None,
) -> torch.Tensor:
    """Launch the kernels; inputs already validated (q [B, H, D] with any strides, caches
    [B, H_kv, S_max, D] with unit stride along D and H_kv dividing H, bounds [B] on q's device). ``splits`` and
    ``block_n`` override :func:`plan_splits` and :func:`block_size` (tests). ``combine``: ``"kernel"``
    (a combine launch after the splits) or ``"fused"`` (the last split of a row combines it;
    module docstring); None: :func:`combine_mode`'s."""
    combine = combine or _combine_mode
    if combine not in COMBINE_MODES:
        raise ValueError(f"decode_attention: combine must be 'kernel' or 'fused', got {combine!r}")
    batch, heads, head_dim = q.shape
    s_max = k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride(-1) != 1:
        v_cache = v_cache.contiguous()
    whole = short_block(s_max, head_dim, batch * heads, q.device) if splits is None and block_n is None else None
    block_n = whole or block_n or block_size(head_dim)
    if whole is not None:  # a short cache: one block, one program a row
        splits, chunk = 1, whole
    elif splits is None:
        splits, chunk = plan_splits(batch * heads, s_max, block_n, q.device)
    else:
        chunk = triton.cdiv(triton.cdiv(s_max, splits), block_n) * block_n
        splits = triton.cdiv(s_max, chunk)
    out = torch.empty((batch, heads, head_dim), dtype=q.dtype, device=q.device)
    bf16_by_hand = interpreting() and q.dtype == torch.bfloat16
    if splits > 1:
        m_part = torch.empty((batch * heads, splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((batch * heads, splits, head_dim), dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = acc_part = out  # not read or written with one split
    # 16 elements of each of k and v a thread in a short cache's one block, 4 to 16 warps
    num_warps = (max(4, min(16, head_dim * block_n // 1024)) if whole is not None
                 else 4 if head_dim * block_n >= 4096 else 2)
    dependent = dict(launch_pdl=True, USE_GDC=True) if dependent_launch(q.device, batch) else {}
    fused = combine == "fused" and splits > 1 and batch * heads <= COUNTERS
    counters = _counters(q.device) if fused else m_part
    with device_guard(q):
        _decode_split_kernel[(batch * heads, splits)](
            q, k_cache, v_cache, valid_start, valid_end, out, m_part, l_part, acc_part, counters,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
            heads, s_max, chunk, scale * LOG2_E,
            HEAD_DIM=head_dim, BLOCK_N=block_n, SPLITS=splits, BF16_BY_HAND=bf16_by_hand,
            KV_GROUP=heads // k_cache.shape[1], FUSED_COMBINE=fused, BLOCK_SPLITS=triton.next_power_of_2(splits),
            ONE_BLOCK=chunk == block_n, num_warps=num_warps, **dependent,
        )
        if splits > 1 and not fused:
            _decode_combine_kernel[(batch * heads,)](
                m_part, l_part, acc_part, out, heads, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, SPLITS=splits, BLOCK_SPLITS=triton.next_power_of_2(splits),
                BF16_BY_HAND=bf16_by_hand, num_warps=1 if head_dim <= 32 else 2, **dependent,
            )
    return out
