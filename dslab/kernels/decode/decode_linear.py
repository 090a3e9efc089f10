"""``decode_linear``: one linear layer of a decode step with the ops around it folded in.

::

    a = x[x_rows] + residual[residual_rows - residual_row_offset]     (each part optional)
    h = layer_norm(a, *norm)  or  rms_norm(a, *rms_norm)             (optional)
    y = activation(h @ weight.T + bias)                              (activation: GELU, SwiGLU or none)
    returns y, or (y, a) with return_sum=True; with kv=..., y's q part (see below)

A decode step at batch 1..64 spends its time reading weights and launching small kernels; a
GPT-2 layer written op by op launches about a dozen (layer norm, QKV GEMM, two cache scatters, a
copy of q, attention, output GEMM, layer norm, MLP GEMM, bias + GELU, MLP GEMM), a Llama layer
about eleven (RMSNorm, QKV GEMM, rope, two cache scatters, attention's two, output GEMM, RMSNorm,
gate/up GEMM, SwiGLU, down GEMM). With this op, either layout launches five: ``decode_linear`` for QKV
(the residual add and norm in front, rope and the cache writes behind), attention, the output
projection, the MLP's first GEMM (add, norm, bias, GELU or SwiGLU), its second.
:mod:`dslab.kernels.decode.decode_linear_triton` says how the kernel does it (at one row
:mod:`dslab.kernels.decode.decode_row_triton`'s persistent kernel runs instead). From
:data:`PROLOGUE_KERNEL_MIN_ROWS` rows a launch with a norm first runs the add and the norm in a
kernel of its own (:mod:`dslab.kernels.decode.decode_prologue_triton`), then the linear on its
output: one launch more, instead of every program's pass over the rows.

Arguments (``M`` rows, ``K`` inputs, ``N`` outputs; activations bf16, fp16 or fp32):

- ``x`` ``[M, K]``, or a table ``[V, K]`` with ``x_rows`` int ``[M]`` choosing its rows (a word
  embedding lookup);
- ``residual`` ``[M, K]`` in x's dtype, or a table with ``residual_rows`` (and optionally
  ``residual_row_offset``, subtracted: GPT-2's position ids ``write_pos - valid_start``);
  ``a = x + residual`` is rounded to x's dtype, as the separate add would round it;
- ``norm`` ``(weight [K], bias [K], eps)``: LayerNorm of ``a`` (fp32 statistics), rounded to x's
  dtype; or ``rms_norm`` ``(weight [K], eps)``: RMSNorm, ``a * rsqrt(mean(a^2) + eps) * weight``
  in fp32 rounded once to x's dtype (:func:`dslab.kernels.norm.rms_norm.rms_norm`'s rounding). Two
  keywords rather than a LayerNorm without bias standing for RMSNorm: the two norms differ in
  more than the bias (RMSNorm subtracts no mean), and a call says which it means;
- ``weight`` ``[N, K]`` contiguous, x's dtype, or int8 with ``scale`` fp32 ``[N]`` (per output
  channel, :func:`dslab.kernels.quant.int8_linear.quantize_int8`); ``bias`` ``[N]`` or None;
- ``activation``: None, ``"gelu"`` (exact), ``"gelu_tanh"``, or ``"swiglu"``: ``weight`` is
  Llama's stacked ``[gate rows; up rows]`` (N = 2I, bias likewise) and ``y = silu(gate) * up``
  ``[M, I]`` (:func:`dslab.kernels.activation.swiglu.swiglu`); the kernel reads each weight row
  once and writes nothing of width 2I;
- ``kv`` ``(q_out [M, N / 3], k_cache, v_cache, write_pos [M], head_dim)``: ``y`` is a fused QKV
  projection (GPT-2's: q, k and v of equal width); its q third goes to ``q_out``, its k and v
  thirds into the layer's caches ``[batch >= M, heads, max_seq, head_dim]`` at ``[m, head,
  write_pos[m]]``; returns ``q_out``. Grouped-query attention with rotary positions (the Llama
  layout) adds a sixth element, ``rope``: ``y`` has ``H * D + 2 * Hkv * D`` columns (q heads, then
  k heads, then v heads; ``H = q_out.shape[1] / D``, ``Hkv`` the caches' heads), and ``rope =
  (cos, sin)``, fp32 ``[M, D / 2]`` tables of each row's position
  (:func:`dslab.kernels.attention.rope.rope_tables`), rotates q and k rotate-half style
  (:func:`dslab.kernels.attention.rope.apply_rope`) before they are stored; ``rope=None`` stores
  them unrotated. Tables rather than positions and ``inv_freq``: the caller makes them once a
  step for every layer (five small launches a step, none a layer), their values are the op-by-op
  step's bit for bit, and the kernel computes no sine or cosine (angles of long positions need
  the careful range reduction PyTorch's ``cos``/``sin`` do).

Paths: the Triton kernel when :func:`dslab.kernels.dispatch.use_triton` says so (CUDA tensors, or
the interpreter) and the rows fit :data:`MAX_ROWS`; otherwise :func:`decode_linear_reference`, the
same computation op by op in PyTorch (each op's reference, rounded where the separate ops round).
The kernel applies bias, GELU, SwiGLU and rope to the fp32 accumulator and rounds once, and
multiplies int8 weights in fp32 before their scale: within the dtype's rounding of the
reference. Forward-only, and not a registered custom op: the inference engine runs the unfused
layer (whose ops the flops profiler counts one by one) while a dispatch mode is active.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dslab.kernels.activation.swiglu import swiglu_reference
from dslab.kernels.attention.rope import apply_rope_reference
from dslab.kernels.dispatch import dependent_launch, interpreting, use_triton
from dslab.kernels.norm.rms_norm import rms_norm_reference

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = (None, "gelu", "gelu_tanh", "swiglu")
#: The kernel's row tiles: 1 (batch 1) or a tensor-core tile of up to this many rows.
MAX_ROWS = 64
#: Rows from which a launch with a norm computes the norm in a kernel of its own first
#: (:mod:`dslab.kernels.decode.decode_prologue_triton`), not in every program's prologue.
PROLOGUE_KERNEL_MIN_ROWS = 2
#: One row runs :mod:`dslab.kernels.decode.decode_row_triton`'s persistent kernel; False runs the
#: tile-per-program kernel at one row too (benchmarks compare the two in one run).
ROW_KERNEL = True


def _rows(table: torch.Tensor, rows: torch.Tensor | None, offset: torch.Tensor | None) -> torch.Tensor:
    if rows is None:
        return table
    index = rows.long() - offset.long() if offset is not None else rows.long()
    return table[index]


def _kv_parts(kv):
    """``(q_out, k_cache, v_cache, write_pos, head_dim, rope)`` of either ``kv`` form (rope None
    for GPT-2's five)."""
    q_out, k_cache, v_cache, write_pos, head_dim = kv[:5]
    return q_out, k_cache, v_cache, write_pos, head_dim, (kv[5] if len(kv) == 6 else None)


def decode_linear_reference(x, weight, bias=None, *, scale=None, x_rows=None, residual=None, residual_rows=None,
                            residual_row_offset=None, norm=None, rms_norm=None, activation=None, return_sum=False,
                            kv=None):
    """The op in PyTorch (see the module docstring); the kernel is held to it."""
    a = _rows(x, x_rows, None)
    if residual is not None:
        a = a + _rows(residual, residual_rows, residual_row_offset)
    if norm is not None:
        h = F.layer_norm(a, a.shape[-1:], norm[0], norm[1], norm[2])
    elif rms_norm is not None:
        h = rms_norm_reference(a, rms_norm[0], rms_norm[1])
    else:
        h = a
    w = weight if scale is None else (weight.float() * scale[:, None]).to(h.dtype)
    y = F.linear(h, w, bias)
    if activation == "swiglu":
        y = swiglu_reference(y)
    elif activation is not None:
        y = F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
    if kv is not None:
        q_out, k_cache, v_cache, write_pos, head_dim, rope = _kv_parts(kv)
        m, kv_width = y.shape[0], k_cache.shape[1] * head_dim
        q, k, v = y.split([q_out.shape[1], kv_width, kv_width], dim=-1)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope_reference(q.reshape(m, 1, -1, head_dim), k.reshape(m, 1, -1, head_dim),
                                        cos[:, None], sin[:, None])
            q, k = q.reshape(m, -1), k.reshape(m, -1)
        q_out.copy_(q)
        heads = k.shape[-1] // head_dim
        index = write_pos.long().view(m, 1, 1, 1).expand(m, heads, 1, head_dim)
        k_cache[:m].scatter_(2, index, k.reshape(m, heads, 1, head_dim).to(k_cache.dtype))
        v_cache[:m].scatter_(2, index, v.reshape(m, heads, 1, head_dim).to(v_cache.dtype))
        y = q_out
    return (y, a) if return_sum else y


def _check(x, weight, bias, scale, x_rows, residual, residual_rows, residual_row_offset, norm, rms_norm, activation,
           kv):
    def fail(message):
        raise ValueError(f"decode_linear: {message}")

    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        fail(f"x must be a floating-point matrix [M, K] (or a table with x_rows), got "
             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        fail("weight must be a matrix [N, K]")
    n, k = weight.shape
    if x.shape[1] != k:
        fail(f"x's last dimension {x.shape[1]} must equal weight's K = {k} (weight is [N, K])")
    if weight.dtype == torch.int8:
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != (n,):
            fail(f"an int8 weight needs scale, fp32 of shape ({n},) (one per output channel)")
    elif weight.dtype != x.dtype or scale is not None:
        fail(f"weight must be in x's dtype {x.dtype} (or int8 with scale), got {weight.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        fail(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    m = x_rows.shape[0] if x_rows is not None else x.shape[0]
    for name, idx in (("x_rows", x_rows), ("residual_rows", residual_rows), ("residual_row_offset", residual_row_offset)):
        if idx is not None and (idx.dim() != 1 or idx.shape[0] != m or idx.is_floating_point()):
            fail(f"{name} must be an integer vector of the {m} rows")
    if residual_row_offset is not None and residual_rows is None:
        fail("residual_row_offset needs residual_rows")
    if residual is not None:
        if residual.dim() != 2 or residual.shape[1] != k or residual.dtype != x.dtype:
            fail(f"residual must be [rows, {k}] in x's dtype {x.dtype}, got {residual.dtype} {tuple(residual.shape)}")
        if residual_rows is None and residual.shape[0] != m:
            fail(f"residual has {residual.shape[0]} rows, x {m}")
    if norm is not None and (len(norm) != 3 or norm[0].shape != (k,) or norm[1].shape != (k,)):
        fail(f"norm must be (weight [{k}], bias [{k}], eps)")
    if rms_norm is not None:
        if norm is not None:
            fail("norm (LayerNorm) and rms_norm are exclusive: pass one")
        if len(rms_norm) != 2 or not isinstance(rms_norm[0], torch.Tensor) or rms_norm[0].shape != (k,):
            fail(f"rms_norm must be (weight [{k}], eps)")
    if activation not in ACTIVATIONS:
        fail(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation == "swiglu":
        if n % 2:
            fail(f"activation='swiglu' needs the stacked [gate; up] weight of 2 * I rows, got N = {n}")
        if kv is not None:
            fail("activation='swiglu' and kv are exclusive (an MLP's first GEMM or a QKV projection)")
    if kv is not None:
        _check_kv(kv, m, n, fail)
    return m, n, k


def _check_kv(kv, m, n, fail):
    if len(kv) not in (5, 6):
        fail("kv must be (q_out, k_cache, v_cache, write_pos, head_dim) or the same with rope last")
    q_out, k_cache, v_cache, write_pos, head_dim, rope = _kv_parts(kv)
    if len(kv) == 5:
        if n % 3 or (n // 3) % head_dim:
            fail(f"kv: the fused QKV weight's N = {n} must be 3 * heads * head_dim (head_dim {head_dim})")
        q_width, heads = n // 3, n // 3 // head_dim
    else:
        if q_out.dim() != 2 or q_out.shape[1] % head_dim or k_cache.dim() != 4:
            fail(f"kv: q_out must be [{m}, heads * {head_dim}] and the caches 4-d")
        q_width, heads = q_out.shape[1], k_cache.shape[1]
        if n != q_width + 2 * heads * head_dim:
            fail(f"kv: the fused QKV weight's N = {n} must be (heads + 2 * kv_heads) * head_dim = "
                 f"{q_width} + 2 * {heads} * {head_dim} (q_out's width, the caches' heads)")
    if tuple(q_out.shape) != (m, q_width):
        fail(f"kv: q_out must be [{m}, {q_width}], got {tuple(q_out.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[0] < m or cache.shape[1] != heads or cache.shape[3] != head_dim \
                or cache.stride(3) != 1:
            fail(f"kv: {name} must be [batch >= {m}, {heads}, max_seq, {head_dim}] with unit stride in the "
                 f"last dimension, got {tuple(cache.shape)}")
    if write_pos.shape != (m,):
        fail(f"kv: write_pos must have the {m} rows' positions")
    if rope is not None:
        if head_dim % 2 or len(rope) != 2:
            fail(f"kv: rope must be (cos, sin) and head_dim even, got head_dim {head_dim}")
        for name, table in zip(("cos", "sin"), rope):
            if not isinstance(table, torch.Tensor) or table.dtype != torch.float32 \
                    or tuple(table.shape) != (m, head_dim // 2):
                fail(f"kv: rope's {name} must be fp32 [{m}, {head_dim // 2}] (rope_tables of the rows' positions), "
                     f"got {getattr(table, 'dtype', type(table).__name__)} {tuple(getattr(table, 'shape', ()))}")


#: Split-K tile counters per device (zero between launches: the last split of a tile resets its own).
COUNTERS = 1 << 16
_counter_buffers: dict = {}


def _counters(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _counter_buffers:
        _counter_buffers[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counter_buffers[key]


def _programs_wanted(device: torch.device) -> int:
    """Programs to fill the device: two per SM (four under the interpreter, so CPU tests split K;
    half of it is the SM count the batch-1 kernel sizes its grid by)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _triton_module():
    from dslab.kernels.decode import decode_linear_triton

    return decode_linear_triton


@functools.cache
def _row_module():
    from dslab.kernels.decode import decode_row_triton

    return decode_row_triton


def _prologue_kernel(x, x_rows, residual, residual_rows, residual_row_offset, norm, rms_norm, a_out, k, dummy):
    """``h = norm(x (+ residual))`` of every row by :mod:`.decode_prologue_triton` (``a_out``
    receives the sum when given); the rows of ``h`` are the linear's input."""
    from dslab.kernels.decode import decode_prologue_triton

    m = x_rows.shape[0] if x_rows is not None else x.shape[0]
    h = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if norm is not None:
        norm_weight, norm_bias, eps = norm
    else:
        (norm_weight, eps), norm_bias = rms_norm, None
    or_dummy = (lambda t: dummy if t is None else t)
    args = (x, or_dummy(x_rows), or_dummy(residual), or_dummy(residual_rows), or_dummy(residual_row_offset),
            or_dummy(a_out), h, norm_weight, or_dummy(norm_bias), k, x.stride(0),
            residual.stride(0) if residual is not None else 0, k, k, float(eps))
    meta = dict(HAS_X_ROWS=x_rows is not None, HAS_R=residual is not None, HAS_R_ROWS=residual_rows is not None,
                HAS_R_OFFSET=residual_row_offset is not None, WRITE_A=a_out is not None, RMS_NORM=rms_norm is not None,
                BF16_BY_HAND=interpreting() and x.dtype == torch.bfloat16)
    decode_prologue_triton.launch(interpreting(), m, k, args, meta)
    return h


def _triton(x, weight, bias, scale, x_rows, residual, residual_rows, residual_row_offset, norm, rms_norm, activation,
            return_sum, kv, m, n, k):
    from dslab.kernels._grid import device_guard

    kernels = _triton_module()
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    weight = weight.contiguous()
    a_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if return_sum else None
    dummy = weight
    if (norm is not None or rms_norm is not None) and m >= PROLOGUE_KERNEL_MIN_ROWS:
        x = _prologue_kernel(x, x_rows, residual, residual_rows, residual_row_offset, norm, rms_norm, a_out, k, dummy)
        x_rows = residual = residual_rows = residual_row_offset = norm = rms_norm = None
        write_a = False
    else:
        write_a = return_sum
    cos = sin = None
    span = 0  # a paired launch's distance between a pair's two weight rows
    if kv is not None:
        q_out, k_cache, v_cache, write_pos, head_dim, rope = _kv_parts(kv)
        y = q_out
        q_width, kv_width = q_out.shape[1], k_cache.shape[1] * head_dim
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        if rope is not None:
            cos, sin = (t.contiguous() for t in rope)
            span = head_dim // 2
    else:
        y = torch.empty((m, n // 2 if activation == "swiglu" else n), dtype=x.dtype, device=x.device)
        q_out = k_cache = v_cache = write_pos = None
        head_dim, q_width, kv_width = 1, 0, 0
        cache_strides = (0,) * 6
    if activation == "swiglu":
        span = n // 2
    paired = span > 0
    block_m = kernels.row_block(m)
    programs = _programs_wanted(x.device)
    row_kernel = block_m == 1 and ROW_KERNEL
    partial_size = 0 if row_kernel else kernels.partial_elements(m, n, k, block_m, programs, interpreting(),
                                                                   weight.dtype == torch.int8, paired)
    partial = torch.empty(partial_size, dtype=torch.float32, device=x.device) if partial_size else dummy
    counters = _counters(x.device) if partial_size else dummy
    bf16_by_hand = interpreting() and x.dtype == torch.bfloat16
    strict_fp32 = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    or_dummy = (lambda t: dummy if t is None else t)
    if norm is not None:
        norm_weight, norm_bias, eps = norm
    elif rms_norm is not None:
        (norm_weight, eps), norm_bias = rms_norm, None
    else:
        norm_weight = norm_bias = None
        eps = 0.0
    args = (
        x, or_dummy(x_rows), or_dummy(residual), or_dummy(residual_rows), or_dummy(residual_row_offset),
        or_dummy(a_out), or_dummy(norm_weight), or_dummy(norm_bias), weight,
        or_dummy(scale), or_dummy(bias), y, or_dummy(q_out), or_dummy(k_cache), or_dummy(v_cache), or_dummy(write_pos),
        or_dummy(cos), or_dummy(sin), partial, counters,
        m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, k, y.stride(0),
        q_out.stride(0) if q_out is not None else 0, *cache_strides, cos.stride(0) if cos is not None else 0,
        float(eps), head_dim, q_width, kv_width, span,
    )
    meta = dict(
        HAS_X_ROWS=x_rows is not None, HAS_R=residual is not None, HAS_R_ROWS=residual_rows is not None,
        HAS_R_OFFSET=residual_row_offset is not None, WRITE_A=write_a,
        HAS_NORM=norm is not None or rms_norm is not None, RMS_NORM=rms_norm is not None,
        INT8=weight.dtype == torch.int8, HAS_BIAS=bias is not None,
        ACT=kernels.ACTIVATION_CODES[activation], KV_SCATTER=kv is not None, ROPE=cos is not None, PAIRED=paired,
        DOT_FP32=bf16_by_hand or (interpreting() and weight.dtype == torch.int8),
        PRECISION="ieee" if strict_fp32 else "tf32", BF16_BY_HAND=bf16_by_hand,
        STATS_BLOCK=32 if interpreting() else min(1 << (k - 1).bit_length(), 4096 // block_m),
    )
    with device_guard(x):
        if row_kernel:
            _row_module().launch(interpreting(), n, k, programs // 2, args, meta, dependent_launch(x.device, m))
        else:
            kernels.launch(block_m, interpreting(), -(-m // block_m), n, k, programs, args, meta,
                           dependent_launch(x.device, m))
    return (y, a_out) if return_sum else y


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  scale: torch.Tensor | None = None, x_rows: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, residual_rows: torch.Tensor | None = None,
                  residual_row_offset: torch.Tensor | None = None, norm=None, rms_norm=None,
                  activation: str | None = None, return_sum: bool = False, kv=None):
    """See the module docstring. Bad arguments raise ValueError naming the argument."""
    m, n, k = _check(x, weight, bias, scale, x_rows, residual, residual_rows, residual_row_offset, norm, rms_norm,
                     activation, kv)
    rope = _kv_parts(kv)[5] if kv is not None else None
    tensors = (x, weight, bias, scale, residual, *(rope or ()))
    if 0 < m <= MAX_ROWS and n > 0 and k > 0 and x.dtype in TRITON_DTYPES and use_triton(*tensors):
        return _triton(x, weight, bias, scale, x_rows, residual, residual_rows, residual_row_offset, norm, rms_norm,
                       activation, return_sum, kv, m, n, k)
    return decode_linear_reference(x, weight, bias, scale=scale, x_rows=x_rows, residual=residual,
                                   residual_rows=residual_rows, residual_row_offset=residual_row_offset, norm=norm,
                                   rms_norm=rms_norm, activation=activation, return_sum=return_sum, kv=kv)
