"""Triton flash attention backward (FlashAttention-2, Dao 2023, Algorithm 2).

With ``P = softmax(S)`` rebuilt from the saved base-2 ``lse`` as ``P = exp2(S * scale * log2 e - lse)``,
dropout keep-mask ``Z`` and ``Pd = P * Z / (1 - p)``:

    dV = Pd^T dO          dPd = dO V^T          dP = dPd * Z / (1 - p)
    dS = P * (dP - delta)  with delta = rowsum(dO * O)   (equal to rowsum(dP * P))
    dQ = scale * dS K      dK = scale * dS^T Q

One kernel, ``_attention_bwd_kernel``, whose programs take one of two roles (their code is in
:mod:`dslab.kernels.attention.attention_triton_bwd_roles`). A dQ program owns ``BLOCK_M2`` query rows,
computes their ``delta`` from O and dO and accumulates dQ over key blocks (S, dP, dQ: three matmuls
per tile). A dK/dV program owns ``BLOCK_N1`` keys and accumulates dK, dV over query blocks (S^T, dV,
dP^T, dK: four matmuls per tile). With both roles S and dP are computed twice (seven matmuls per
tile instead of five) so that no two programs add into the same dQ rows. The launches
(``backward_roles``):

- ``FUSED`` (``seq_k <= FUSED_MAX_SEQ_K``, one key block, e.g. BERT's seq 128): one launch, a
  program per (batch, head) holding all keys; it computes delta from O and dO in its loop and
  writes each query block's complete dQ as it goes (a fifth matmul per tile, no dQ programs).
- ``BOTH`` (small problems, ``BOTH_MAX_WORK``, where host time per launch matters): one launch,
  dK/dV programs and dQ programs side by side; the dK/dV programs recompute delta from O and dO.
- ``ATOMIC`` (large problems): dK/dV programs that also compute their tiles' dQ (five matmuls per
  tile) and add it into an fp32 accumulator, between :mod:`dslab.kernels.attention.attention_triton_dq`'s
  launch that computes delta and zeroes the accumulator and its launch that scales and rounds it
  into dQ. The adds' order varies from run to run, so dQ's last bits may too.
- ``DQ_ONLY`` then ``DKDV_ONLY`` (large problems with ``torch.use_deterministic_algorithms``): the
  dQ launch stores delta, the dK/dV launch reads it; each launch has its own tiles and warps.

Grouped-query attention (k, v with ``kv_heads`` heads, ``KV_GROUP = heads // kv_heads`` query
heads per kv head): dQ programs are per query head as above, reading their kv head's k and v; a
dK/dV program owns a key block of one kv head and walks the query blocks of each of its group's
query heads in turn, so dK and dV are the group's sums, added in head order in registers (no
partial buffers). FUSED, ATOMIC and DKDV_ONLY launches have a row of programs per (batch, kv head);
BOTH keeps a row per (batch, query head) for its dQ programs and deals each kv head's key blocks
out over its group's rows. With ``KV_GROUP == 1`` every launch is the one without grouping.

Every plan but ``ATOMIC`` is deterministic. Causal blocks above the diagonal are skipped; blocks
crossing it run a masked loop, the rest an unmasked one. Fully masked query rows have
``lse = +inf``, so their P, dS and dQ are exactly 0.

Memory traffic per (batch, head), BOTH and DQ_ONLY + DKDV_ONLY: q, k, v, o, dO read and dq, dk,
dv written once from DRAM; the dK/dV programs re-read q, dO, lse and delta (BOTH: O instead of
delta) once per key block and the dQ programs re-read k, v once per query block (mostly from L2).
ATOMIC reads k and v once and adds ``seq_q * head_dim`` fp32 values per key block into the
accumulator (in L2)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dslab.kernels.attention.attention_triton import (
    LOG2_E,
    CachedLaunch,
    KEEP_DRAW,
    KEEP_LOAD,
    empty_rows_like,
    kernel_dropout_p,
    padding_as_bytes,
    seed_or_standin,
    seq_bucket,
    unit_last_stride,
)
from dslab.kernels.attention import attention_triton_dq
from dslab.kernels.attention.attention_triton_bwd_roles import _dkdv_role, _dq_role
from dslab.kernels.attention.attention_triton_dq import DB_SLOT_ROWS, bias_partials
from dslab.kernels.dispatch import interpreting, launches_graphed

# What the programs of one backward launch do (the kernel's ROLES constexpr).
DQ_ONLY = 1  # dQ of a query block, storing delta for a later DKDV_ONLY launch
DKDV_ONLY = 2  # dK, dV of a key block, reading delta
BOTH = 3  # programs [0, n_key_blocks) do dK, dV (recomputing delta from O), the rest dQ
FUSED = 4  # one key block covers seq_k: dK, dV and every query block's complete dQ
ATOMIC = 5  # dK, dV of a key block, reading delta, adding its dQ tiles into an fp32 accumulator


@triton.jit
def _attention_bwd_kernel(
    Q, K, V, O, DO, DQ, DK, DV, LSE, DELTA, KPM, SEED, KEEP, DB,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    stride_dkb, stride_dkh, stride_dks,
    stride_dvb, stride_dvh, stride_dvs,
    stride_kpm_b, stride_db_slot, stride_db_b,
    num_heads, seq_q, seq_k, seq_q_bucket, seq_k_bucket,
    qk_scale, sm_scale, dropout_p,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, KEEP_MODE: tl.constexpr,
    DOT_FP32: tl.constexpr, ROLES: tl.constexpr, HAS_DB: tl.constexpr, DB_SLOT: tl.constexpr, EVEN_N: tl.constexpr,
    KV_GROUP: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr,
    BLOCK_N2: tl.constexpr,
):
    """Grid ``(programs, batch * heads)`` for ``DQ_ONLY`` and ``BOTH``, ``(programs, batch *
    kv_heads)`` for the others (``kv_heads = num_heads // KV_GROUP``, ``num_heads`` counting the
    query heads); ``seq_*_bucket`` only key the autotuner. ``ROLES`` (one of ``DQ_ONLY``,
    ``DKDV_ONLY``, ``BOTH``, ``FUSED``, ``ATOMIC``, as ints) says what program ``pid`` does; for
    ``ATOMIC``, ``DQ`` and its strides are the fp32 accumulator's. dK/dV programs go from the first
    key block (most causal work) up; dQ programs from the last query block (most causal work)
    down. In a ``BOTH`` launch with ``KV_GROUP > 1`` the dK/dV programs of a kv head's key blocks
    are spread over its group's rows of the grid: program ``pid`` of query head ``h`` takes key
    block ``pid * KV_GROUP + h % KV_GROUP``. With dropout, ``KEEP_MODE`` says where the mask comes
    from: ``KEEP`` holds the bits the forward stored (``KEEP_LOAD``), or the draws are made again
    from ``SEED``, the forward's int64 ``[1]`` seed tensor (``KEEP_DRAW``). ``HAS_DB`` (only with
    ``KV_GROUP == 1``): each program also writes the column sums of the dQ, dK, dV rows it wrote
    into ``DB``, fp32 ``[slots, batch, 3 * heads * HEAD_DIM]`` (row strides ``stride_db_slot``,
    ``stride_db_b``; :func:`~dslab.kernels.attention.attention_triton_dq.bias_partials`), slot
    ``first row // DB_SLOT``."""
    tl.static_assert(BLOCK_N1 % BLOCK_M1 == 0)
    tl.static_assert(BLOCK_M2 % BLOCK_N2 == 0)
    tl.static_assert(not HAS_DB or ROLES == 1 or BLOCK_N1 % DB_SLOT == 0)
    tl.static_assert(not HAS_DB or ROLES == 2 or ROLES >= 4 or BLOCK_M2 % DB_SLOT == 0)
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    if HAS_DROPOUT and KEEP_MODE == 0:
        seed = tl.load(SEED)
    else:
        seed = 0
    n_groups = tl.cdiv(seq_k, 8)
    keep_base = KEEP + bh.to(tl.int64) * seq_q * n_groups  # query head bh's (dK/dV roles: unused when grouped)
    keep_rows = seq_q
    if ROLES == 1:
        _dq_role(
            Q, K, V, O, DO, DQ, LSE, DELTA, KPM, DB, stride_db_slot, stride_db_b,
            stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
            stride_kpm_b, num_heads, seq_q, seq_k, qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups, keep_rows, pid, bh,
            HEAD_DIM, CAUSAL, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, True, HAS_DB, DB_SLOT, KV_GROUP,
            BLOCK_M2, BLOCK_N2,
        )
    elif ROLES == 3:
        n_key_blocks = tl.cdiv(seq_k, BLOCK_N1)
        if KV_GROUP == 1:
            n_dkdv = n_key_blocks
            pid_n = pid
            bh_kv = bh
        else:
            n_dkdv = tl.cdiv(n_key_blocks, KV_GROUP)
            pid_n = pid * KV_GROUP + bh % KV_GROUP  # heads_q is a multiple of KV_GROUP
            bh_kv = bh // KV_GROUP
        if pid >= n_dkdv:
            _dq_role(
                Q, K, V, O, DO, DQ, LSE, DELTA, KPM, DB, stride_db_slot, stride_db_b,
                stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh,
                stride_dqs, stride_kpm_b, num_heads, seq_q, seq_k, qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups,
                keep_rows, pid - n_dkdv, bh,
                HEAD_DIM, CAUSAL, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, False, HAS_DB, DB_SLOT, KV_GROUP,
                BLOCK_M2, BLOCK_N2,
            )
        elif KV_GROUP == 1 or pid_n < n_key_blocks:  # a constexpr True (a plain else) without grouping
            _dkdv_role(
                Q, K, V, O, DO, DQ, DK, DV, LSE, DELTA, KPM, KEEP, DB, stride_db_slot, stride_db_b,
                stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh,
                stride_dqs, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
                stride_kpm_b, num_heads, seq_q, seq_k, qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups, keep_rows,
                pid_n, bh_kv,
                HEAD_DIM, CAUSAL, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, False, True, EVEN_N, HAS_DB, DB_SLOT,
                False, KV_GROUP, BLOCK_M1, BLOCK_N1,
            )
    else:
        _dkdv_role(
            Q, K, V, O, DO, DQ, DK, DV, LSE, DELTA, KPM, KEEP, DB, stride_db_slot, stride_db_b,
            stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
            stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
            stride_kpm_b, num_heads, seq_q, seq_k, qk_scale, sm_scale, dropout_p, seed, keep_base, n_groups, keep_rows, pid, bh,
            HEAD_DIM, CAUSAL, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, ROLES >= 4, ROLES == 4, EVEN_N, HAS_DB, DB_SLOT,
            ROLES == 5, KV_GROUP, BLOCK_M1, BLOCK_N1,
        )


# Tiles per head dim, picked from the H100 sweep (benchmarks/kernels/attention_sweep.py; every
# winner there used 4 warps). At head dim 128 every one of those spills registers on an H200
# (benchmarks/register_audit.py: 280 bytes to 5 KB a thread), so each plan's list there ends with an
# 8-warp tile that spills nothing. DQ_ONLY launches: (BLOCK_M2, BLOCK_N2, num_warps, num_stages).
_DQ_TILES = {
    32: [(64, 64, 4, 3), (64, 32, 4, 4), (128, 64, 8, 2)],
    64: [(64, 64, 4, 3), (64, 32, 4, 4), (128, 64, 8, 2)],
    128: [(64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 8, 3)],
}
# DKDV_ONLY launches: (BLOCK_M1, BLOCK_N1, num_warps, num_stages).
_DKDV_TILES = {
    32: [(32, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3)],
    64: [(32, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3)],
    128: [(64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 3), (32, 64, 8, 3)],
}
# BOTH launches: (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages).
_BOTH_TILES = {
    32: [(32, 128, 64, 64, 4, 3), (32, 64, 64, 64, 4, 3), (64, 64, 64, 32, 4, 3)],
    64: [(32, 128, 64, 64, 4, 3), (32, 64, 64, 64, 4, 3), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 3)],
    128: [(64, 64, 64, 32, 4, 2), (32, 64, 64, 32, 4, 3), (64, 64, 64, 64, 4, 2), (32, 32, 64, 32, 8, 3)],
}
# ATOMIC launches: (BLOCK_M1, BLOCK_N1, num_warps, num_stages).
_ATOMIC_TILES = {
    32: [(32, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2)],
    64: [(32, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2)],
    128: [(64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2), (32, 32, 8, 3)],
}
# FUSED launches: (BLOCK_M1, num_warps, num_stages); BLOCK_N1 covers seq_k.
_FUSED_TILES = {
    32: [(32, 4, 3), (32, 8, 2), (64, 8, 2)],
    64: [(32, 4, 3), (32, 8, 2), (64, 8, 2)],
    128: [(32, 8, 2), (64, 8, 1), (16, 8, 2)],
}
# Interpreter tiles (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2); BLOCK_N1 is also the FUSED limit.
_BWD_INTERPRET_TILE = (16, 32, 32, 16)
FUSED_MAX_SEQ_K = 128
FUSED_MAX_SEQ_Q = 512  # beyond this, the FUSED path needs FUSED_MIN_PROGRAMS (batch, head) pairs
FUSED_MIN_PROGRAMS = 256
# Above this much work (batch * heads * seq_q * seq_k * head_dim, halved when causal) the backward
# is two launches (DQ_ONLY, DKDV_ONLY), each with its own tiles; at or below it, one BOTH launch,
# which saves a launch and an allocation (~20 us of host time on a lent H100 host) but runs longer
# on the GPU (shared warps and stages, delta recomputed in the dK/dV programs): +7% at BERT-large
# seq 512 (2**32, host-bound there), +24% at GPT-2 seq 1024 causal (1.5 * 2**32).
BOTH_MAX_WORK = 2**32
# Inside a CUDA graph capture the saved launch and allocation cost nothing at replay, so the split
# runs from far less work: on an H200 (dropout 0.1, tile timings of the autotuners) BOTH took at 247 us for GPT-2
# 1.5B's layer (batch 4, 25 heads, seq 1024 causal: 1.56 * 2**31) where DQ_ONLY + DKDV_ONLY take
# 161 + 238 us for 192 (batch, head) pairs at the same sequence (124M's layer), ~208 us per 100.
BOTH_MAX_WORK_CAPTURED = 2**30
# Where the two launches would run, the ATOMIC plan runs instead from this much work on, unless
# torch's deterministic algorithms are on. The backward alone, replayed in a CUDA graph on an H100
# (dropout 0.1, bias sums), ATOMIC against DQ_ONLY + DKDV_ONLY per layer: 256 against 268 us at
# BERT-large seq 512, 420 against 423 at GPT-2 124M, 235 against 242 at GPT-2 1.5B.
ATOMIC_MIN_WORK = 0
_AUTOTUNE_KEY = ["seq_q_bucket", "seq_k_bucket", "CAUSAL", "HAS_KPM", "HAS_DROPOUT", "KV_GROUP"]


def fused_block_n(seq_k: int, seq_q: int, batch_heads: int, interpret: bool | None = None,
                  kv_group: int = 1) -> int | None:
    """BLOCK_N1 of the FUSED path, or None when another path runs: FUSED has one program per
    (batch, kv head), each over the ``seq_q`` rows of its ``kv_group`` query heads
    (``batch_heads`` counts query heads), so long query sequences over few heads go elsewhere.
    ``interpret`` is :func:`interpreting`, when the caller has it."""
    if interpret is None:
        interpret = interpreting()
    limit = _BWD_INTERPRET_TILE[1] if interpret else FUSED_MAX_SEQ_K
    rows, programs = seq_q * kv_group, batch_heads // kv_group
    if seq_k > limit or (rows > FUSED_MAX_SEQ_Q and programs < FUSED_MIN_PROGRAMS):
        return None
    return limit if interpret else max(64, seq_bucket(seq_k))


def backward_roles(
    batch_heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool, interpret: bool | None = None,
    capturing: bool = False, deterministic: bool | None = None, kv_group: int = 1,
) -> tuple[int, ...]:
    """The launches of one backward, in order: ``(FUSED,)``, ``(BOTH,)``, ``(ATOMIC,)`` (between
    :mod:`dslab.kernels.attention.attention_triton_dq`'s two small launches) or ``(DQ_ONLY, DKDV_ONLY)``.
    ``batch_heads`` counts query heads, ``kv_group`` query heads share a kv head.
    ``capturing``: the launches go into a CUDA graph (or rehearse one:
    :func:`dslab.kernels.dispatch.launches_graphed`), where the split's extra launch costs no host
    time (:data:`BOTH_MAX_WORK_CAPTURED`). ``deterministic`` (default: whether torch's
    deterministic algorithms are on) rules out ``ATOMIC``."""
    if fused_block_n(seq_k, seq_q, batch_heads, interpret, kv_group) is not None:
        return (FUSED,)
    work = batch_heads * seq_q * seq_k * head_dim // (2 if causal else 1)
    limit = BOTH_MAX_WORK_CAPTURED if capturing else BOTH_MAX_WORK
    if work <= limit:
        return (BOTH,)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return (ATOMIC,) if work >= ATOMIC_MIN_WORK and not deterministic else (DQ_ONLY, DKDV_ONLY)


def bwd_configs(head_dim: int, roles: int, block_n1: int | None = None) -> list[triton.Config]:
    """Autotune candidates of a ``roles`` launch (``block_n1`` for FUSED); one under the interpreter."""
    if interpreting():
        bm1, bn1, bm2, bn2 = _BWD_INTERPRET_TILE
        tiles = [(bm1, block_n1 or bn1, bm2, bn2, 4, 1)]
    elif roles == DQ_ONLY:
        tiles = [(16, 16, bm2, bn2, w, s) for bm2, bn2, w, s in _DQ_TILES[head_dim]]
    elif roles in (DKDV_ONLY, ATOMIC):
        table = _DKDV_TILES if roles == DKDV_ONLY else _ATOMIC_TILES
        tiles = [(bm1, bn1, 16, 16, w, s) for bm1, bn1, w, s in table[head_dim]]
    elif roles == BOTH:
        tiles = _BOTH_TILES[head_dim]
    else:
        tiles = [(bm1, block_n1, 16, 16, w, s) for bm1, w, s in _FUSED_TILES[head_dim] if block_n1 % bm1 == 0]
    return [
        triton.Config({"BLOCK_M1": bm1, "BLOCK_N1": bn1, "BLOCK_M2": bm2, "BLOCK_N2": bn2}, num_warps=w, num_stages=s)
        for bm1, bn1, bm2, bn2, w, s in tiles
    ]


def _even_n(args) -> bool:
    return args["seq_k"] % args["BLOCK_N1"] == 0


@functools.cache
def bwd_kernel_for(head_dim: int, roles: int, block_n1: int | None = None):
    """The autotuned backward kernel of a ``roles`` launch for ``head_dim`` (``block_n1`` for FUSED)."""
    heuristics = triton.heuristics({"EVEN_N": _even_n})
    # ATOMIC adds into DQ (the accumulator): zeroed before each tuning run and before the call after.
    reset = ["DQ"] if roles == ATOMIC else None
    return triton.autotune(configs=bwd_configs(head_dim, roles, block_n1), key=_AUTOTUNE_KEY, reset_to_zero=reset)(
        heuristics(_attention_bwd_kernel)
    )


@functools.cache
def _launcher(head_dim: int, roles: int, block_n1: int | None) -> CachedLaunch:
    return CachedLaunch(bwd_kernel_for(head_dim, roles, block_n1), heuristics={"EVEN_N": _even_n})


def reset_kernels() -> None:
    """Forget the autotuned backward kernels and their launch caches, so that changed tile tables
    (tests swap ``_BWD_INTERPRET_TILE``) take effect."""
    bwd_kernel_for.cache_clear()
    _launcher.cache_clear()
    attention_triton_dq.reset_kernels()


def _grid(roles: int, seq_q: int, seq_k: int, batch_heads: int, kv_group: int):
    """The launch grid of ``roles`` over ``batch_heads`` (batch times query heads); see the kernel."""
    if roles == DQ_ONLY:
        return lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M2"]), batch_heads)
    if roles == BOTH:
        return lambda meta: (
            triton.cdiv(triton.cdiv(seq_k, meta["BLOCK_N1"]), kv_group) + triton.cdiv(seq_q, meta["BLOCK_M2"]),
            batch_heads,
        )
    return lambda meta: (triton.cdiv(seq_k, meta["BLOCK_N1"]), batch_heads // kv_group)


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    scale: float,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    keep: torch.Tensor | None = None,
    bias_sums: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Launch the backward; returns dq, dk, dv. Every tensor is ``[batch, heads, seq, head_dim]``
    (k, v, dk, dv with ``kv_heads``, a divisor of q's heads: grouped-query attention, query head
    ``h`` reading kv head ``h // (heads // kv_heads)``, dk and dv summed over each group's query heads)
    with any strides (``grad_out`` and ``out`` too: a ``[batch, seq, heads * head_dim]`` buffer
    viewed as heads is read in place); a last dimension that is not unit-stride is copied first.
    ``seed``: the forward's int64 ``[1]`` tensor (None without dropout). ``grads``: (dq, dk, dv)
    views to write into (unit last stride), e.g. of one packed ``[batch, seq, 3 * hidden]``
    gradient; else they are allocated laid out like q, k, v (see ``empty_rows_like``). ``keep``: the
    dropout bits the forward stored (:func:`attention_triton.empty_keep_bits`); without it the
    kernels draw the mask again from ``seed``. ``bias_sums``: also return, fourth, the fp32
    ``[rows, 3 * heads * head_dim]`` partial column sums of dq, dk, dv (heads in order within each
    of the three; :func:`~dslab.kernels.attention.attention_triton_dq.bias_partials`), whose sum over rows
    is the gradient of a bias added to packed q, k, v (as many heads in all three); the programs add
    up their own rows, so no kernel reads the gradients again."""
    if grads is None:
        dq, dk, dv = empty_rows_like(q), empty_rows_like(k), empty_rows_like(v)
    else:
        dq, dk, dv = grads
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    out, grad_out = unit_last_stride(out), unit_last_stride(grad_out)
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    batch_heads = batch * heads
    kv_group = heads // k.shape[1]
    assert not (bias_sums and kv_group != 1), "bias sums need as many k, v heads as q heads"
    kpm, stride_kpm_b = padding_as_bytes(key_padding_mask, q)
    dropout_p = kernel_dropout_p(dropout_p)
    interpret = interpreting()
    capturing = q.is_cuda and launches_graphed()
    roles = backward_roles(batch_heads, seq_q, seq_k, head_dim, causal, interpret, capturing, kv_group=kv_group)
    block_n1 = fused_block_n(seq_k, seq_q, batch_heads, interpret, kv_group) if roles == (FUSED,) else None
    dq_target = dq
    if roles[0] == DQ_ONLY:
        delta = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    elif roles[0] == ATOMIC:
        delta, dq = attention_triton_dq.prepare_dq(out, grad_out)  # dq: the fp32 accumulator
    else:
        delta = lse  # not read: these launches compute delta from O and dO
    load_keep = keep is not None and dropout_p > 0.0
    partials = bias_partials(batch, heads, head_dim, seq_q, seq_k, roles == (FUSED,), q.device) if bias_sums else lse
    tensors = (q, k, v, out, grad_out, dq, dk, dv, lse, delta, kpm, seed_or_standin(seed, dropout_p, lse),
               keep if load_keep else lse, partials)
    db_strides = partials.stride()[:2] if bias_sums else (0, 0)
    ints = (
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *grad_out.stride()[:3],
        *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], stride_kpm_b, *db_strides,
        heads, seq_q, seq_k, seq_bucket(seq_q), seq_bucket(seq_k),
    )
    scalars = (scale * LOG2_E, scale, dropout_p)
    dot_in_fp32 = interpret and q.dtype == torch.bfloat16  # see attention_triton.dot_fp32
    for role in roles:
        flags = dict(
            HEAD_DIM=head_dim, CAUSAL=causal, HAS_KPM=key_padding_mask is not None,
            HAS_DROPOUT=dropout_p > 0.0, KEEP_MODE=KEEP_LOAD if load_keep else KEEP_DRAW,
            DOT_FP32=dot_in_fp32, ROLES=role, HAS_DB=bias_sums, DB_SLOT=DB_SLOT_ROWS, KV_GROUP=kv_group,
        )
        grid = _grid(role, seq_q, seq_k, batch_heads, kv_group)
        _launcher(head_dim, role, block_n1)(grid, tensors, ints, scalars, flags)
    if roles[0] == ATOMIC:
        attention_triton_dq.finish_dq(dq, dq_target, scale, partials if bias_sums else None)
        dq = dq_target
    if bias_sums:
        return dq, dk, dv, partials.view(-1, partials.shape[-1])
    return dq, dk, dv
