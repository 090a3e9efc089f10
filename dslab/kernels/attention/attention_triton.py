"""Triton flash attention: shared pieces, the forward kernel and the dropout-mask debug kernel.

Layout: q ``[batch, heads, seq_q, head_dim]``, k and v ``[batch, kv_heads, seq_k, head_dim]``, each
with a unit stride on the last dimension (any other strides are passed to the kernels).
``kv_heads`` divides ``heads`` (grouped-query attention; equal for plain multi-head attention):
query head ``h`` reads kv head ``h // KV_GROUP``, ``KV_GROUP = heads // kv_heads`` a constexpr of
the kernels, so k and v are never copied per query head and ``KV_GROUP = 1`` compiles to the
kernels without grouping. The softmax
runs online over key blocks (Dao et al. 2022, "FlashAttention", Algorithm 1; FlashAttention-2 loop
order): a program owns ``BLOCK_M`` query rows of one (batch, head), keeps the running row maximum
``m``, the running normaliser ``l`` and the output accumulator in fp32 registers, and never writes
a ``seq_q x seq_k`` tensor. Scores are turned into base-2 exponents once, ``s * scale * log2(e)``,
so each probability is one FMA and one ``exp2``.

The forward saves ``lse = m + log2(l)`` per row (base-2 units, fp32, ``[batch, heads, seq_q]``) for
the backward in :mod:`dslab.kernels.attention.attention_triton_bwd`. A row whose keys are all masked has
``l = 0``: its output is 0 and its ``lse`` is ``+inf`` so that the backward's recomputed
probabilities ``exp2(s - lse)`` are exactly 0 there.

Memory traffic of the forward, per (batch, head): q and o once, k and v once per query block
(``ceil(seq_q / BLOCK_M)`` times, mostly from L2; with grouping, the programs of a group's query
heads, adjacent in the grid, read the same k and v), lse ``4 * seq_q`` bytes.

Dropout keeps a probability when its 16-bit draw is at least ``p * 2**16``: a Philox-4x32-10 call
keyed by a 64-bit seed, with counter ``(key index // 8, query index, batch * heads + head, 0)``,
gives the draws of 8 adjacent keys (:func:`_dropout_keep`), so the rate the kernels apply is ``p``
rounded to a multiple of ``2**-16`` (:func:`kernel_dropout_p`; FlashAttention-2 rounds to
``1/256``). The backward regenerates the same draws, so no mask is stored. The seed is an int64
``[1]`` tensor on the device that the kernels load (``SEED``), not a host scalar, so a captured
CUDA graph picks up the value written on each replay.

Host side: every launch of the forward and backward goes through :class:`CachedLaunch`, which
skips Triton's per-call Python once a call's key has been seen. At BERT's seq 128 the whole
fwd+bwd is ~0.1 ms of GPU time, less than the host takes to issue it through Triton's own path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from dslab.kernels._launch import launch_hooks_active
from dslab.kernels.dispatch import interpreting

LOG2_E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    """``acc + a @ b`` in fp32. ``DOT_FP32`` upcasts the operands first: the Triton interpreter
    multiplies bf16 operands as raw integers, and a bf16 x bf16 product is exact in fp32, so this
    gives the tensor-core result (up to summation order)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


#: Each keep draw is 16 bits of a Philox output, so the kernels' dropout rate is a multiple of
#: ``1 / DROPOUT_LEVELS`` (:func:`kernel_dropout_p`).
DROPOUT_LEVELS = 65536
#: Keys per Philox call: its four 32-bit outputs give eight 16-bit draws for eight adjacent keys.
DROPOUT_GROUP = 8


def kernel_dropout_p(dropout_p: float) -> float:
    """The dropout rate the kernels apply for ``dropout_p``: rounded to the nearest multiple of
    ``2**-16`` (at most ``1 - 2**-16``), and used for both the draws and the ``1 / (1 - p)``
    rescaling, so that the expected output is exact."""
    levels = min(round(dropout_p * DROPOUT_LEVELS), DROPOUT_LEVELS - 1)
    return levels / DROPOUT_LEVELS


# What a kernel does for the dropout mask of a tile (its KEEP_MODE constexpr).
KEEP_DRAW = 0  # draw it from Philox
KEEP_DRAW_STORE = 1  # draw it and store its bits (the forward, for the backward to load)
KEEP_LOAD = 2  # load the bits the forward stored


@triton.jit
def _dropout_bits(seed, bh, offs_m, groups, dropout_p):
    """uint8 ``[len(offs_m), len(groups)]``: bit ``j`` of byte ``(i, g)`` keeps query ``offs_m[i]``'s
    probability of key ``8 * groups[g] + j`` in flattened head ``bh``.

    One Philox-4x32-10 call per query and group of 8 keys, counter ``(group, query, bh, 0)``: its
    four 32-bit outputs split into eight 16-bit draws (draw ``2w`` the low half of output ``w``,
    ``2w + 1`` the high half), and key ``j`` of the group is kept when draw ``j`` is at least
    ``dropout_p * 2**16`` (``dropout_p`` is a multiple of ``2**-16``: :func:`kernel_dropout_p`).
    A key's draw depends only on (seed, bh, query, key), never on the tile sizes, so the forward,
    both backward roles and the debug kernel agree.
    """
    zero = offs_m[:, None] * 0 + groups[None, :] * 0
    r0, r1, r2, r3 = tl.philox(seed, groups[None, :] + zero, offs_m[:, None] + zero, zero + bh, zero)
    threshold = tl.cast(dropout_p * 65536.0, tl.uint32)
    bits = ((r0 & 0xFFFF) >= threshold).to(tl.uint8)
    bits |= ((r0 >> 16) >= threshold).to(tl.uint8) << 1
    bits |= ((r1 & 0xFFFF) >= threshold).to(tl.uint8) << 2
    bits |= ((r1 >> 16) >= threshold).to(tl.uint8) << 3
    bits |= ((r2 & 0xFFFF) >= threshold).to(tl.uint8) << 4
    bits |= ((r2 >> 16) >= threshold).to(tl.uint8) << 5
    bits |= ((r3 & 0xFFFF) >= threshold).to(tl.uint8) << 6
    bits |= ((r3 >> 16) >= threshold).to(tl.uint8) << 7
    return bits


@triton.jit
def _expand_bits(bits, BLOCK_N: tl.constexpr):
    """The bool keep-mask ``[rows, BLOCK_N]`` of :func:`_dropout_bits`' bytes ``[rows, BLOCK_N // 8]``
    (key ``8 g + j`` from bit ``j`` of byte ``g``). The joins nest so that the flattened index of
    bit ``j`` is ``j``: the innermost join pairs bits ``j`` and ``j + 4``, the next ``j`` and
    ``j + 2``, the outermost ``j`` and ``j + 1``."""
    b = bits.to(tl.int8)
    pair0 = tl.join(b & 1, (b >> 4) & 1)
    pair2 = tl.join((b >> 2) & 1, (b >> 6) & 1)
    pair1 = tl.join((b >> 1) & 1, (b >> 5) & 1)
    pair3 = tl.join((b >> 3) & 1, (b >> 7) & 1)
    keep = tl.join(tl.join(pair0, pair2), tl.join(pair1, pair3))
    return tl.reshape(keep, (bits.shape[0], BLOCK_N)) != 0


@triton.jit
def _keep_from_rows(bits, BLOCK_N: tl.constexpr):
    """The keep-mask of :func:`_expand_bits` for ``BLOCK_N <= 64``, built without moving the bits
    between threads tile by tile: each row's bytes are first packed into one 64-bit word (key ``n``
    at bit ``n``), a ``[rows]`` vector; every element of the mask then shifts its row's word, in
    whatever layout the mask's consumer has (the scores' MMA layout)."""
    g = tl.arange(0, BLOCK_N // 8)
    # The bytes occupy disjoint bits, so their sum is their OR.
    row = tl.sum(bits.to(tl.uint64) << (g * 8).to(tl.uint64)[None, :], axis=1)
    n = tl.arange(0, BLOCK_N).to(tl.uint64)
    return ((row[:, None] >> n[None, :]) & 1) != 0


@triton.jit
def _dropout_keep(seed, bh, offs_m, start_n, dropout_p, keep_base, n_groups, keep_rows,
                  KEEP_MODE: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Keep-mask ``[len(offs_m), BLOCK_N]`` for queries ``offs_m`` and keys ``start_n +
    arange(BLOCK_N)`` (``start_n`` a multiple of 8), drawn (``KEEP_DRAW``), drawn and its bits
    stored (``KEEP_DRAW_STORE``) or loaded (``KEEP_LOAD``) at ``keep_base``: the head's uint8
    ``[keep_rows, n_groups]`` bits, ``n_groups = ceil(seq_k / 8)``. Bits outside it are neither
    stored nor loaded (loaded as dropped: such positions carry no probability). ``TRANSPOSED``
    returns the mask as ``[BLOCK_N, len(offs_m)]``."""
    groups = start_n // 8 + tl.arange(0, BLOCK_N // 8)
    if KEEP_MODE == 0:
        bits = _dropout_bits(seed, bh, offs_m, groups, dropout_p)
    else:
        ptrs = keep_base + offs_m[:, None] * n_groups + groups[None, :]
        inside = (offs_m < keep_rows)[:, None] & (groups < n_groups)[None, :]
        if KEEP_MODE == 1:
            bits = _dropout_bits(seed, bh, offs_m, groups, dropout_p)
            tl.store(ptrs, bits, mask=inside)
        else:
            bits = tl.load(ptrs, mask=inside, other=0)
    # Query-major tiles (the forward, the dQ role) take the row words; key-major ones (the dK/dV
    # roles) keep the byte expansion, which measured faster there (H100, GPT-2 124M backward:
    # 416 us against 466 us with per-query words).
    if TRANSPOSED:
        return tl.trans(_expand_bits(bits, BLOCK_N))
    elif BLOCK_N <= 64:
        return _keep_from_rows(bits, BLOCK_N)
    else:
        return _expand_bits(bits, BLOCK_N)


@triton.jit
def _fwd_key_loop(
    acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_ks, stride_vs,
    offs_m, offs_d, seq_k, bh, qk_scale, dropout_p, seed, keep_base, n_groups, keep_rows, start, end,
    BOUNDARY: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, KEEP_MODE: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Fold key blocks ``[start, end)`` into the running (acc, l, m). ``BOUNDARY`` blocks may hold
    keys past ``seq_k`` or (causal) above the diagonal and are masked; the others are not."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d[None, :]
        if BOUNDARY:
            key_valid = offs_n < seq_k
            k = tl.load(k_ptrs, mask=key_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=key_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_FP32)
        if BOUNDARY:
            visible = key_valid[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(visible, s, float("-inf"))
        if HAS_KPM:
            if BOUNDARY:
                pad = tl.load(kpm_base + offs_n, mask=key_valid, other=1)
            else:
                pad = tl.load(kpm_base + offs_n)
            s = tl.where(pad[None, :] != 0, float("-inf"), s)
        # m starts finite (-1e30), so a block whose scores are all -inf gives p = 0 and alpha = 1.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, bh, offs_m, start_n, dropout_p, keep_base, n_groups, keep_rows,
                                 KEEP_MODE, BLOCK_N, False)
            p = tl.where(keep, p, 0.0)
        acc = _dot(p.to(v.dtype), v, acc, DOT_FP32)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_fwd_kernel(
    Q, K, V, O, LSE, KPM, SEED, KEEP,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_kpm_b,
    num_heads, seq_q, seq_k, seq_q_bucket, seq_k_bucket,
    qk_scale, dropout_p,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, KEEP_MODE: tl.constexpr, DOT_FP32: tl.constexpr, KV_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid ``(ceil(seq_q / BLOCK_M), batch * heads)``, ``heads`` (``num_heads``) counting the query
    heads; query head ``h`` reads kv head ``h // KV_GROUP``. ``seq_*_bucket`` only key the autotuner.

    Causal programs run from the last query block (most key blocks) to the first, so the long
    ones start early and the tail of the grid is short. Key blocks wholly above the diagonal are
    never visited; those wholly below it run without masks; the few crossing it (or ``seq_k``)
    run the masked loop.
    """
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    kv_h = h // KV_GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_m < seq_q

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0)
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh
    kpm_base = KPM + b * stride_kpm_b
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    else:
        seed = 0
    n_groups = tl.cdiv(seq_k, 8)
    keep_base = KEEP + bh.to(tl.int64) * seq_q * n_groups
    keep_rows = seq_q

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        # Keys below start_m are visible to every row of the block.
        full_end = tl.minimum(start_m, seq_k) // BLOCK_N * BLOCK_N
        end = tl.minimum(start_m + BLOCK_M, seq_k)
    else:
        full_end = seq_k // BLOCK_N * BLOCK_N
        end = seq_k
    acc, l_i, m_i = _fwd_key_loop(
        acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_ks, stride_vs,
        offs_m, offs_d, seq_k, bh, qk_scale, dropout_p, seed, keep_base, n_groups, keep_rows, 0, full_end,
        False, CAUSAL, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, BLOCK_M, BLOCK_N,
    )
    acc, l_i, m_i = _fwd_key_loop(
        acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_ks, stride_vs,
        offs_m, offs_d, seq_k, bh, qk_scale, dropout_p, seed, keep_base, n_groups, keep_rows, full_end, end,
        True, CAUSAL, HAS_KPM, HAS_DROPOUT, KEEP_MODE, DOT_FP32, BLOCK_M, BLOCK_N,
    )

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    inv_l = 1.0 / l_safe
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_valid[:, None])
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))
    tl.store(LSE + bh.to(tl.int64) * seq_q + offs_m, lse, mask=row_valid)


@triton.jit
def _dropout_mask_kernel(OUT, SEED, seq_q, seq_k, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes the keep-mask the kernels use, as uint8 ``[batch * heads, seq_q, seq_k]``.
    Grid ``(ceil(seq_q / BLOCK_M), ceil(seq_k / BLOCK_N), batch * heads)``."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    start_n = tl.program_id(1) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    bh = tl.program_id(2)
    seed = tl.load(SEED)
    keep = _dropout_keep(seed, bh, offs_m, start_n, dropout_p, OUT, 0, 0, 0, BLOCK_N, False)
    ptrs = OUT + bh.to(tl.int64) * seq_q * seq_k + offs_m[:, None] * seq_k + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < seq_q) & (offs_n[None, :] < seq_k))


# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried per head dim; on an H100 (bench_attention's four
# shapes, benchmarks/kernels/attention_sweep.py) (64, 64, 4, 3) won at every shape and head dim.
# At head dim 128 three of those four spill registers on an H200 (benchmarks/register_audit.py:
# 36-456 bytes a thread); (64, 64, 8, 3), the same tile on 8 warps, spills nothing.
_FWD_TILES = {
    32: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4)],
    64: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4), (128, 64, 4, 3)],
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 8, 3)],
}
# The interpreter gets one small config: several key blocks and a diagonal at test sizes.
_FWD_INTERPRET_TILE = (32, 16, 4, 1)
_AUTOTUNE_KEY = ["seq_q_bucket", "seq_k_bucket", "CAUSAL", "HAS_KPM", "HAS_DROPOUT", "KV_GROUP"]


def fwd_configs(head_dim: int) -> list[triton.Config]:
    """The forward's autotune candidates for ``head_dim`` (one config under the interpreter)."""
    tiles = [_FWD_INTERPRET_TILE] if interpreting() else _FWD_TILES[head_dim]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tiles
    ]


@functools.cache
def _fwd_kernel_for(head_dim: int):
    return triton.autotune(configs=fwd_configs(head_dim), key=_AUTOTUNE_KEY)(_attention_fwd_kernel)


@functools.cache
def fwd_launcher(head_dim: int) -> "CachedLaunch":
    """The forward for ``head_dim``, autotuned and launched through :class:`CachedLaunch`."""
    return CachedLaunch(_fwd_kernel_for(head_dim))


_LAUNCH_CACHE_SIZE = 256
_INT32 = (-(2**31), 2**31 - 1)


class CachedLaunch:
    """An autotuned Triton kernel, launched without Triton's per-call Python once a call's key has
    been seen.

    Triton's launch path (autotuner, heuristics, argument binding, specialisation, cache key) was
    measured at ~80 us of host time per launch on a lent H100 host (torch 2.11, triton 3.6), while
    calling the compiled kernel's launcher directly took ~13 us; at BERT's seq 128 the whole
    fwd+bwd runs in ~0.1 ms on the GPU, so Triton's path made it host-bound.

    A call passes the kernel's arguments in signature order as four groups: ``tensors``
    (pointers), ``ints`` (specialised integers), ``scalars`` (floats and ``do_not_specialize``
    integers) and the constexpr ``flags`` (a dict, the same names in the same order on every call);
    the autotuned config and ``heuristics`` (the rules given to ``triton.heuristics``) supply the
    remaining constexprs, which come last. The key is the current device, the ints and flags by
    value, each tensor's dtype and 16-byte alignment and each scalar's type and 32/64-bit width:
    everything Triton specialises a compiled kernel and its autotune key on. The first call with a
    key goes through Triton; its compiled kernel and constexpr values are then kept (up to
    ``_LAUNCH_CACHE_SIZE`` keys, then the cache starts over) and later calls launch them directly.
    CPU tensors (the interpreter), calls while a launch hook is installed and Triton versions whose
    compiled kernels lack this launcher interface always go through Triton.

    The grid is not kept: every call computes its own, ``grid(meta)`` with the kept constexprs.
    It depends on the batch, which no int of the key holds (the strides of ``[batch, heads, seq,
    dim]`` tensors, and of packed ``[batch, seq, 3 * hidden]`` views, do not depend on it): a grid
    kept from a batch-32 call launched 32 batches' programs for batch 1, whose stores ran past
    its outputs into whatever memory lay beyond, and too few programs for a larger batch.
    """

    instances: list["CachedLaunch"] = []

    def __init__(self, autotuned, heuristics: dict | None = None):
        self.autotuned = autotuned
        self.heuristics = heuristics or {}
        self.entries: dict = {}
        self.enabled = True
        CachedLaunch.instances.append(self)

    def __call__(self, grid, tensors: tuple, ints: tuple, scalars: tuple, flags: dict) -> None:
        """Launch over ``grid(meta) -> (x, y)``, ``meta`` holding the chosen config's block sizes."""
        if not (self.enabled and tensors[0].is_cuda):
            self.autotuned[grid](*tensors, *ints, *scalars, **flags)
            return
        device = torch.cuda.current_device()
        low, high = _INT32
        key = (
            device, ints, *flags.values(), *[(t.dtype, t.data_ptr() & 15) for t in tensors],
            *[type(s) if type(s) is not int else low <= s <= high for s in scalars],
        )
        entry = self.entries.get(key)
        if entry is None or launch_hooks_active():
            kernel = self.autotuned[grid](*tensors, *ints, *scalars, **flags)
            if entry is None and not interpreting():
                self._remember(key, kernel, (*tensors, *ints, *scalars), flags)
            return
        run, function, metadata, constexprs, tail, stream = entry
        grid_x, grid_y = grid(constexprs)
        run(grid_x, grid_y, 1, stream(device), function, metadata, None, None, None,
            *tensors, *ints, *scalars, *tail)

    def _remember(self, key, kernel, runtime_args: tuple, flags: dict) -> None:
        jit = self.autotuned
        while not isinstance(jit, JITFunction):
            jit = jit.fn
        values = dict(zip(jit.arg_names, runtime_args))
        values.update(flags)
        values.update(self.autotuned.best_config.kwargs)
        for name, rule in self.heuristics.items():
            values[name] = rule(values)
        constexprs = {name: values[name] for name in jit.arg_names[len(runtime_args):]}
        tail = tuple(constexprs.values())
        try:
            entry = (kernel.run, kernel.function, kernel.packed_metadata, constexprs, tail,
                     triton.runtime.driver.active.get_current_stream)
        except AttributeError:  # a Triton without this launcher interface
            self.enabled = False
            return
        if len(self.entries) >= _LAUNCH_CACHE_SIZE:
            self.entries.clear()
        self.entries[key] = entry


def clear_launch_caches() -> None:
    """Empty every :class:`CachedLaunch`'s cache (the autotuners keep their choices), so the next
    call of each key goes through Triton's launch path again."""
    for launcher in CachedLaunch.instances:
        launcher.entries.clear()


def seq_bucket(n: int) -> int:
    """Autotune bucket for a sequence length: the next power of two (at least 16)."""
    return max(16, 1 << (n - 1).bit_length()) if n > 0 else 16


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def empty_rows_like(t: torch.Tensor) -> torch.Tensor:
    """An output laid out like ``t`` (so a ``[batch, seq, heads, dim]`` view stays one) when ``t``'s
    last dimension is contiguous, else a contiguous one. The fake kernels use this too."""
    if t.stride(-1) == 1:
        return torch.empty_like(t)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def dot_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels must upcast dot operands (bf16 under the interpreter; see ``_dot``)."""
    return interpreting() and dtype == torch.bfloat16


def seed_or_standin(seed: torch.Tensor | None, dropout_p: float, standin: torch.Tensor) -> torch.Tensor:
    """The ``SEED`` pointer of a launch: ``seed`` when dropout applies, else ``standin`` (not read)."""
    if dropout_p > 0.0:
        assert seed is not None and seed.dtype == torch.int64 and seed.numel() == 1
        return seed
    return standin


def padding_as_bytes(key_padding_mask: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The mask as a uint8 view the kernels read (``like`` stands in when there is none) and its batch stride."""
    if key_padding_mask is None:
        return like, 0
    mask = unit_last_stride(key_padding_mask).view(torch.uint8)
    return mask, mask.stride(0)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    scale: float,
    out: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward. Returns ``out`` and the fp32 base-2 ``lse`` ``[batch, heads, seq_q]``.
    k and v may have fewer heads than q, a divisor of q's (grouped-query attention, see the module
    docstring).
    ``seed``: int64 ``[1]`` on q's device, read by the kernel (None without dropout). ``out``: a
    ``[batch, heads, seq_q, head_dim]`` tensor (any strides, unit last) to write into, else one laid
    out by :func:`empty_rows_like`. ``keep``: with dropout, a :func:`empty_keep_bits` buffer the
    kernel stores the mask's bits in, for the backward to load instead of drawing them again.
    Inputs are already validated."""
    if out is None:
        out = empty_rows_like(q)
    dropout_p = kernel_dropout_p(dropout_p)
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    kpm, stride_kpm_b = padding_as_bytes(key_padding_mask, q)
    store_keep = keep is not None and dropout_p > 0.0
    fwd_launcher(head_dim)(
        lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * heads),
        (q, k, v, out, lse, kpm, seed_or_standin(seed, dropout_p, lse), keep if store_keep else lse),
        (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], stride_kpm_b,
         heads, seq_q, seq_k, seq_bucket(seq_q), seq_bucket(seq_k)),
        (scale * LOG2_E, dropout_p),
        dict(HEAD_DIM=head_dim, CAUSAL=causal, HAS_KPM=key_padding_mask is not None,
             HAS_DROPOUT=dropout_p > 0.0, KEEP_MODE=KEEP_DRAW_STORE if store_keep else KEEP_DRAW,
             DOT_FP32=dot_fp32(q.dtype), KV_GROUP=heads // k.shape[1]),
    )
    return out, lse


def empty_keep_bits(q: torch.Tensor, seq_k: int) -> torch.Tensor:
    """The buffer the forward stores its dropout mask in for the backward: uint8
    ``[batch * heads, seq_q, ceil(seq_k / 8)]``, a bit per probability (1/16 of a bf16 score
    matrix). Causal forwards leave the bits above the diagonal unwritten; no kernel reads them."""
    batch, heads, seq_q, _ = q.shape
    return torch.empty((batch * heads, seq_q, triton.cdiv(seq_k, 8)), dtype=torch.uint8, device=q.device)


def dropout_keep_mask(
    seed: torch.Tensor, batch: int, heads: int, seq_q: int, seq_k: int, dropout_p: float
) -> torch.Tensor:
    """The bool keep-mask ``[batch, heads, seq_q, seq_k]`` the Triton kernels apply for ``seed``
    (int64 ``[1]``, read on its device, where the mask is made; True = kept). Materialises the full
    mask: for tests at small shapes."""
    out = torch.empty((batch * heads, seq_q, seq_k), dtype=torch.uint8, device=seed.device)
    block = 64
    grid = (triton.cdiv(seq_q, block), triton.cdiv(seq_k, block), batch * heads)
    _dropout_mask_kernel[grid](out, seed, seq_q, seq_k, kernel_dropout_p(dropout_p), BLOCK_M=block, BLOCK_N=block)
    return out.view(batch, heads, seq_q, seq_k).bool()
