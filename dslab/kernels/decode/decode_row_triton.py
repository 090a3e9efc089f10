"""The batch-1 kernel of :mod:`dslab.kernels.decode.decode_linear`: a persistent weight stream for
one row, with the same prologue and epilogues as :mod:`dslab.kernels.decode.decode_linear_triton`.

``_decode_row_kernel``, grid ``(programs,)`` with ``programs = min(tiles, programs per SM x SMs)``
(:func:`row_config`): program ``p`` owns the output tiles ``p, p + programs, p + 2 programs, ...``
of ``BLOCK_N`` weight rows (pairs of rows for a paired launch: SwiGLU, rotary QKV) and streams them
one after another, the next tile's weights requested before the current tile is reduced and
stored, so a program always has a tile in flight. The large launches run as many programs as the
SMs hold at once (:data:`RESIDENT`: the grid is set from the compiled kernel's registers, one wave
of programs each streaming many tiles), the others a few programs an SM:

- the prologue runs once a program, not once a tile: with K in one block (``SINGLE_BLOCK``, up to
  :data:`MAX_ROW_BLOCK_K`), ``a = x (+ residual)``, the norm's statistics and ``h`` stay in
  registers for all of the program's tiles; with K in several blocks the statistics are computed
  once and ``h``'s blocks are recomputed per tile from L2-resident rows;
- a tile's epilogue operands (int8 scales, biases, rotary tables, cache positions) are requested
  with its first instructions, so their latency passes while its sums are reduced;
- under programmatic dependent launch (``USE_GDC``) a program requests its first tile, waits for
  the kernel before it, and lets the next kernel launch at once: the next kernel's programs, as
  SM room frees, request their own first tiles while this kernel streams.

Measured on an H200 (``benchmarks/decode_chain_bench.py``: Llama-3.2-1B's 65 batch-1 projections
as the fused step launches them, 2.47 GB of bf16 weights, one CUDA graph, 2026-12-01): the
tile-per-program kernel streamed them in 771 us (76% of copy bandwidth) and 791 us with dependent
launch; this kernel in 802 us alone and 722 us with dependent launch (81%), which is how the
batch-1 step runs it (:func:`dslab.kernels.dispatch.dependent_launch`). No split K at one row:
whole rows of up to 8192 weights make enough tiles at every width worth streaming.

The products are elementwise ``[BLOCK_N, BLOCK_K]`` multiplies in fp32 summed once a tile (a
tensor-core tile would be 15/16 padding at one row); int8 weights convert exactly and their
per-channel scale multiplies the sum.
"""

from __future__ import annotations

import contextlib

import triton
import triton.language as tl

from dslab.kernels.decode.decode_linear_epilogues import finish_with, operands
from dslab.kernels.decode.decode_linear_triton import (_multiply, _prologue, _row_bases, _row_rms, _row_stats,
                                                      _single_block_h)

#: Widest K block of a row: a whole row up to this many elements is one block (``SINGLE_BLOCK``).
MAX_ROW_BLOCK_K = 8192
#: (BLOCK_N, BLOCK_K, num_warps, programs per SM) that benchmarks/decode_linear_bench.py sweeps at one row
#: (BLOCK_K 0: the whole row up to MAX_ROW_BLOCK_K).
ROW_SWEEP = [(4, 0, 8, 4), (4, 0, 4, 4), (2, 0, 4, 8), (2, 0, 8, 2), (4, 0, 8, 8), (8, 0, 8, 2), (1, 0, 8, 4),
             (2, 0, 16, 2), (4, 1024, 8, 4), (2, 2048, 8, 4)]
#: ``programs per SM`` in a configuration: as many programs as an SM holds at once, from the
#: compiled kernel's registers, warps and shared memory (:func:`resident_per_sm`): one wave.
RESIDENT = 0
#: The interpreter's blocks and programs: several K blocks, several tiles a program in CPU tests.
INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K, INTERPRETER_PROGRAMS = 16, 32, 2


@triton.jit
def _weight_tile(W, tile, offs, ks, K, n_cols, span, BLOCK_N: tl.constexpr, PAIRED: tl.constexpr):
    """Tile ``tile``'s weights over the K block ``ks`` ``[BLOCK_N, BLOCK_K]`` (and their pairs'
    second rows; the first again when unpaired), its output columns and their weight rows. A tile
    past the last loads nothing."""
    cols = tile * BLOCK_N + offs
    col_mask = cols < n_cols
    if PAIRED:  # column c pairs weight rows first(c) and first(c) + span
        w_rows = (cols // span) * (2 * span) + cols % span
    else:
        w_rows = cols
    mask = col_mask[:, None] & (ks < K)[None, :]
    w = tl.load(W + w_rows.to(tl.int64)[:, None] * K + ks[None, :], mask=mask, other=0)
    w_2 = w
    if PAIRED:
        w_2 = tl.load(W + (w_rows + span).to(tl.int64)[:, None] * K + ks[None, :], mask=mask, other=0)
    return w, w_2, cols, col_mask, w_rows


@triton.jit
def _decode_row_kernel(
    X, X_ROWS, R, R_ROWS, R_OFFSET, A_OUT, NORM_W, NORM_B, W, SCALE, BIAS, Y,
    Q_OUT, K_CACHE, V_CACHE, WRITE_POS, COS, SIN, PARTIAL, COUNTERS,
    M, N, K, stride_x, stride_r, stride_a, stride_y, stride_q,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_cos,
    eps, head_dim, q_width, kv_width, span,
    HAS_X_ROWS: tl.constexpr, HAS_R: tl.constexpr, HAS_R_ROWS: tl.constexpr, HAS_R_OFFSET: tl.constexpr,
    WRITE_A: tl.constexpr, HAS_NORM: tl.constexpr, RMS_NORM: tl.constexpr, INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, KV_SCATTER: tl.constexpr, ROPE: tl.constexpr,
    STATS_BLOCK: tl.constexpr, SINGLE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PAIRED: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if PAIRED:
        n_cols = N // 2
    else:
        n_cols = N
    tiles = tl.cdiv(n_cols, BLOCK_N)
    offs = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # the first tile is requested before anything else (no kernel of a decode step writes weights)
    w, w_2, cols, col_mask, w_rows = _weight_tile(W, pid, offs, ks, K, n_cols, span, BLOCK_N, PAIRED)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.arange(0, 1)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    x_base, r_base = _row_bases(X_ROWS, R_ROWS, R_OFFSET, rows, row_mask, stride_x, stride_r, HAS_X_ROWS, HAS_R,
                                HAS_R_ROWS, HAS_R_OFFSET)
    mean = tl.zeros((1,), dtype=tl.float32)
    rstd = tl.zeros((1,), dtype=tl.float32)
    h = tl.zeros((1, BLOCK_K), dtype=X.dtype.element_ty)
    if SINGLE_BLOCK:  # the row's a, statistics and h once for all of the program's tiles
        h = _single_block_h(X, x_base, R, r_base, A_OUT, stride_a, NORM_W, NORM_B, ks, K, rows, row_mask, pid, eps,
                            HAS_R, WRITE_A, HAS_NORM, RMS_NORM, BF16_BY_HAND)
    elif HAS_NORM:
        if RMS_NORM:
            rstd = _row_rms(X, x_base, R, r_base, row_mask, K, eps, HAS_R, BF16_BY_HAND, 1, STATS_BLOCK)
        else:
            mean, rstd = _row_stats(X, x_base, R, r_base, row_mask, K, eps, HAS_R, BF16_BY_HAND, 1, STATS_BLOCK)
    for tile in range(pid, tiles, programs):
        w_next, w_next_2, cols_next, col_mask_next, w_rows_next = _weight_tile(
            W, tile + programs, offs, ks, K, n_cols, span, BLOCK_N, PAIRED)
        # the epilogue's scales, biases, rotary tables and cache positions, requested before the sums
        scale, scale_2, bias, bias_2, cos, sin, pos = operands(
            rows, cols, w_rows, row_mask, col_mask, rows64, SCALE, BIAS, WRITE_POS, COS, SIN, span, stride_cos, INT8,
            HAS_BIAS, KV_SCATTER, ROPE, PAIRED)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if not SINGLE_BLOCK:  # h's first block; a is stored by the program of tile 0
            h = _prologue(w, ks, K, rows, row_mask, tile, X, x_base, R, r_base, A_OUT, stride_a, NORM_W, NORM_B,
                          mean, rstd, False, HAS_R, WRITE_A, HAS_NORM, RMS_NORM, BF16_BY_HAND)
        acc = _multiply(acc, w, h, INT8, 1, DOT_FP32, PRECISION)
        if PAIRED:
            acc_2 = _multiply(acc_2, w_2, h, INT8, 1, DOT_FP32, PRECISION)
        if not SINGLE_BLOCK:
            for k0 in range(BLOCK_K, K, BLOCK_K):
                ks_k = k0 + ks
                w_k, w_k_2, _, _, _ = _weight_tile(W, tile, offs, ks_k, K, n_cols, span, BLOCK_N, PAIRED)
                h_k = _prologue(w_k, ks_k, K, rows, row_mask, tile, X, x_base, R, r_base, A_OUT, stride_a, NORM_W,
                                NORM_B, mean, rstd, False, HAS_R, WRITE_A, HAS_NORM, RMS_NORM, BF16_BY_HAND)
                acc = _multiply(acc, w_k, h_k, INT8, 1, DOT_FP32, PRECISION)
                if PAIRED:
                    acc_2 = _multiply(acc_2, w_k_2, h_k, INT8, 1, DOT_FP32, PRECISION)
        total = tl.sum(acc, axis=1)[None, :]
        total_2 = total
        if PAIRED:
            total_2 = tl.sum(acc_2, axis=1)[None, :]
        finish_with(total, total_2, scale, scale_2, bias, bias_2, cos, sin, pos, cols, row_mask, col_mask, rows64, Y,
                    Q_OUT, K_CACHE, V_CACHE, span, stride_y, stride_q, stride_kb, stride_kh, stride_ks, stride_vb,
                    stride_vh, stride_vs, head_dim, q_width, kv_width, INT8, HAS_BIAS, ACT, KV_SCATTER, ROPE, PAIRED,
                    BF16_BY_HAND)
        w, w_2, cols, col_mask, w_rows = w_next, w_next_2, cols_next, col_mask_next, w_rows_next


def row_config(n: int, k: int, int8: bool, paired: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, programs per SM)`` at one row, fixed by shape (at 2-20 us a
    launch a tuner would rank configurations by noise; ``benchmarks/decode_chain_bench.py`` chose
    these on an H200, each group of Llama-3.2-1B's projections timed in the step's chain of
    dependent launches): a whole row per K block up to :data:`MAX_ROW_BLOCK_K`; up to K = 2048, 2
    rows a tile (one rope or SwiGLU pair) in programs of 4 warps, as many as the SMs hold, over 8192
    rows or more (gate/up, the LM head) and for a narrower paired launch (rotary QKV), else 4 rows
    and 4 programs of 8 warps an SM; above, 2 rows and programs of 8 warps, as many as the SMs hold
    (K = 8192: 32 KB a tile). Programs as many as the SMs hold (:data:`RESIDENT`) stream in one
    wave; on the 2026-12-01 H200 chain the rotary QKV launches took 15 us less a step so (700 us
    for the 65 projections, against 715 at 2 programs of 4 rope pairs and 8 warps an SM)."""
    block_k = min(MAX_ROW_BLOCK_K, triton.next_power_of_2(k))
    if block_k > 2048:
        return 2, block_k, 8, RESIDENT
    if n >= 8192 or paired:
        return 2, block_k, 4, RESIDENT
    return 4, block_k, 8, 4


_forced: tuple | None = None


@contextlib.contextmanager
def forced_row_config(config: tuple[int, int, int, int] | None):
    """Launch with ``(BLOCK_N, BLOCK_K, num_warps, programs per SM)`` instead of :func:`row_config`'s
    inside the block (``BLOCK_K`` 0: the whole row up to :data:`MAX_ROW_BLOCK_K`)."""
    global _forced
    previous, _forced = _forced, config
    try:
        yield
    finally:
        _forced = previous


def resident_per_sm(registers: int, warps: int, shared: int, regs_per_sm: int = 65536,
                    threads_per_sm: int = 2048, shared_per_sm: int = 233472, max_blocks: int = 32) -> int:
    """Programs of ``warps`` warps at ``registers`` a thread and ``shared`` bytes of shared memory
    that one SM holds at once (at least 1). Registers are allocated a warp at a time in units of
    256; each resident block also reserves 1 KB of shared memory (Hopper's defaults)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = (regs_per_sm // max(per_warp, 1)) // warps
    by_threads = threads_per_sm // (32 * warps)
    by_shared = shared_per_sm // (shared + 1024)
    return max(1, min(by_registers, by_threads, by_shared, max_blocks))


_resident_cache: dict = {}


def _resident(device, key, compile_kernel) -> int:
    """:func:`resident_per_sm` of the kernel ``compile_kernel()`` compiles (``key`` names it), on
    ``device``'s SMs; cached per key."""
    if key not in _resident_cache:
        import torch

        compiled = compile_kernel()
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()
        props = torch.cuda.get_device_properties(device)
        _resident_cache[key] = resident_per_sm(
            compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared,
            getattr(props, "regs_per_multiprocessor", 65536),
            getattr(props, "max_threads_per_multi_processor", 2048),
            getattr(props, "shared_memory_per_multiprocessor", 233472))
    return _resident_cache[key]


def plan(interpret: bool, n: int, k: int, multiprocessors: int, int8: bool, paired: bool) -> dict:
    """A launch's ``grid``, block constexprs (``BLOCK_N`` in pairs for a paired launch, ``BLOCK_K``,
    ``SINGLE_BLOCK``), options (none under the interpreter), ``tiles`` and ``per_sm`` (programs an
    SM; :data:`RESIDENT`: as many as fit, which :func:`launch` caps ``grid`` to once compiled)."""
    if interpret:
        block_n, block_k, per_sm, options = INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K, None, {}
    else:
        block_n, block_k, warps, per_sm = _forced or row_config(n, k, int8, paired)
        block_k = block_k or min(MAX_ROW_BLOCK_K, triton.next_power_of_2(k))
        options = dict(num_warps=warps, num_stages=1)
    if paired:
        block_n = max(1, block_n // 2)  # the same weight rows a tile as an unpaired launch
    tiles = triton.cdiv(n // 2 if paired else n, block_n)
    if interpret:
        programs = min(tiles, INTERPRETER_PROGRAMS)
    else:
        programs = min(tiles, (per_sm or 32) * multiprocessors)
    return dict(grid=(programs,), options=options, tiles=tiles, per_sm=per_sm,
                constexprs=dict(BLOCK_N=block_n, BLOCK_K=block_k, SINGLE_BLOCK=k <= block_k))


def launch(interpret: bool, n: int, k: int, multiprocessors: int, args: tuple, meta: dict,
           dependent: bool = False) -> None:
    """Launch the kernel as :func:`plan` lays it out; ``dependent``: a programmatic dependent launch
    (:func:`dslab.kernels.dispatch.dependent_launch`; never under the interpreter). A
    :data:`RESIDENT` configuration launches as many programs as the SMs hold at once."""
    shape = plan(interpret, n, k, multiprocessors, meta["INT8"], meta["PAIRED"])
    options = dict(shape["options"])
    if dependent and not interpret:
        options.update(launch_pdl=True, USE_GDC=True)
    grid = shape["grid"]
    if not interpret and shape["per_sm"] == RESIDENT:
        x, w = args[0], args[8]
        key = (x.device.index, x.dtype, w.dtype, tuple(sorted(shape["constexprs"].items())),
               tuple(sorted(options.items())), tuple(sorted(meta.items())))
        per_sm = _resident(x.device, key, lambda: _decode_row_kernel.warmup(
            *args, grid=grid, **shape["constexprs"], **options, **meta))
        grid = (min(shape["tiles"], per_sm * multiprocessors),)
    _decode_row_kernel[grid](*args, **shape["constexprs"], **options, **meta)
