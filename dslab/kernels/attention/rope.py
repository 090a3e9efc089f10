"""Rotary position embedding (RoPE) of Llama-family models: frequencies, tables and the rotation of
q and k (Su et al. 2021, "RoFormer", eq. 34, in transformers' rotate-half layout).

Frequencies: for a head of ``head_dim`` = d columns, pair i (i < d/2) turns at

    inv_freq[i] = 1 / theta ** (2 i / d)

radians per position (:func:`rope_inv_freq`), optionally rescaled for longer contexts as
transformers' ``rope_scaling`` dict says: ``"linear"`` divides every frequency by ``factor``;
``"llama3"`` (Llama 3.1) divides the low frequencies (wavelength ``2 pi / inv_freq`` above
``original_max_position_embeddings / low_freq_factor``) by ``factor``, keeps the high ones
(wavelength below ``original_max_position_embeddings / high_freq_factor``) and blends linearly in
``original_max_position_embeddings / wavelength`` between them.

Tables: ``angle = position * inv_freq`` and the half tables ``cos(angle)``, ``sin(angle)``, fp32
``[*positions.shape, d/2]`` (:func:`rope_tables`); transformers' ``cos``/``sin`` are these repeated
twice along the last dimension.

Rotation: with x1 = x[..., :d/2] and x2 = x[..., d/2:] (column i is paired with column i + d/2),

    out1 = x1 * cos - x2 * sin        out2 = x2 * cos + x1 * sin

in fp32, rounded once to x's dtype. The map is a rotation, so the backward is the rotation by the
opposite angle: dx1 = dy1 * cos + dy2 * sin, dx2 = dy2 * cos - dy1 * sin; the tables take no
gradient.

Layouts: q ``[batch, seq, heads_q, d]`` and k ``[batch, seq, heads_k, d]`` (grouped-query attention
when heads_k < heads_q; k may be None), any strides with a unit last stride, typically views into
one packed projection ``[batch, seq, (heads_q + 2 heads_k) d]``, read in place. Tables ``[seq, d/2]``
(shared by the batch) or ``[batch, seq, d/2]`` (per-sequence positions, e.g. left padding). Outputs
are new contiguous ``[batch, seq, heads, d]`` tensors in the inputs' dtype.

Layers: :func:`apply_rope_reference` (PyTorch) → the ``dslab::rope`` custom op with its autograd
(``dslab::rope_backward``) under ``torch.compile`` and dispatch modes, and an ``autograd.Function``
making the same launches in eager mode → one Triton launch rotating q and k together, forward and
backward, in :mod:`dslab.kernels.attention.rope_triton`. :func:`apply_rope` picks between them with
:func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools
import math

import torch

from dslab.kernels.dispatch import use_custom_op, use_triton

ROPE_TYPES = ("default", "linear", "llama3")
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _scaling_value(scaling: dict, key: str, rope_type: str) -> float:
    if key not in scaling:
        raise ValueError(f"rope_scaling of rope_type {rope_type!r} needs {key!r}, got keys {sorted(scaling)}")
    value = scaling[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"rope_scaling[{key!r}] must be a positive number, got {value!r}")
    return float(value)


def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: dict | None = None) -> torch.Tensor:
    """The rotation frequencies, fp32 ``[head_dim // 2]``: ``1 / theta ** (2 i / head_dim)``,
    rescaled as ``scaling`` says (None or transformers' ``rope_scaling`` dict, its ``rope_type``
    or legacy ``type`` one of :data:`ROPE_TYPES`). Same values as transformers' ``rope_init_fn``.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"theta must be a positive number, got {theta!r}")
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if "rope_theta" in scaling and float(scaling["rope_theta"]) != float(theta):
        raise ValueError(f"rope_scaling['rope_theta']={scaling['rope_theta']!r} differs from theta={theta!r}")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"rope_scaling['partial_rotary_factor'] must be 1.0, got {scaling['partial_rotary_factor']!r}")
    # transformers' expression, so that the fp32 values agree bit for bit.
    inv_freq = 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        return inv_freq / _scaling_value(scaling, "factor", rope_type)
    if rope_type == "llama3":
        factor, low, high, original = (_scaling_value(scaling, key, rope_type) for key in _LLAMA3_KEYS)
        if not high > low:
            raise ValueError(f"rope_scaling['high_freq_factor'] ({high}) must exceed 'low_freq_factor' ({low})")
        low_freq_wavelen, high_freq_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of ``positions * inv_freq``, fp32 ``[*positions.shape, head_dim // 2]`` on
    positions' device, for integer ``positions`` of any shape (``[seq]``, ``[batch, seq]``)."""
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype.is_complex:
        raise ValueError(f"positions must be an integer tensor, got {getattr(positions, 'dtype', type(positions))}")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1:
        raise ValueError(f"inv_freq must be a 1-d tensor [head_dim // 2], got {getattr(inv_freq, 'shape', inv_freq)}")
    angle = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float32)
    return angle.cos(), angle.sin()


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    compute = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    half = x.shape[-1] // 2
    cos, sin = cos.to(compute).unsqueeze(-2), sin.to(compute).unsqueeze(-2)  # broadcast over heads
    x1, x2 = x[..., :half].to(compute), x[..., half:].to(compute)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rope_reference(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The PyTorch reference: q and k (``[batch, seq, heads, d]``, or k None) rotated by the half
    tables ``cos``/``sin`` (``[seq, d/2]`` or ``[batch, seq, d/2]``), computed in fp32 (float64
    for float64 inputs or tables) and rounded once to the inputs' dtype."""
    return _rotate_reference(q, cos, sin), (_rotate_reference(k, cos, sin) if k is not None else None)


@torch.library.custom_op("dslab::rope", mutates_args=())
def _rope_op(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, k_rot) for q/k ``[batch, seq, heads, d]``; k_rot is an empty tensor when k is None."""
    from dslab.kernels.attention import rope_triton

    q_rot, k_rot = rope_triton.rotate(q, k, cos, sin, inverse=False)
    return q_rot, k_rot if k_rot is not None else q.new_empty(0)


@_rope_op.register_fake
def _(q, k, cos, sin):
    return q.new_empty(q.shape), (k.new_empty(k.shape) if k is not None else q.new_empty(0))


@torch.library.custom_op("dslab::rope_backward", mutates_args=())
def _rope_backward_op(
    dq_rot: torch.Tensor, dk_rot: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk): the incoming gradients rotated back; dk is an empty tensor when dk_rot is None."""
    from dslab.kernels.attention import rope_triton

    dq, dk = rope_triton.rotate(dq_rot, dk_rot, cos, sin, inverse=True)
    return dq, dk if dk is not None else dq_rot.new_empty(0)


@_rope_backward_op.register_fake
def _(dq_rot, dk_rot, cos, sin):
    return dq_rot.new_empty(dq_rot.shape), (dk_rot.new_empty(dk_rot.shape) if dk_rot is not None else dq_rot.new_empty(0))


def _setup(ctx, inputs, output):
    q, k, cos, sin = inputs
    ctx.has_k = k is not None
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq_rot, dk_rot):
    cos, sin = ctx.saved_tensors
    dq, dk = _rope_backward_op(dq_rot, dk_rot if ctx.has_k else None, cos, sin)
    return dq, (dk if ctx.has_k else None), None, None


_rope_op.register_autograd(_backward, setup_context=_setup)


@functools.cache
def _triton_module():
    from dslab.kernels.attention import rope_triton

    return rope_triton


class _EagerRope(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _triton_module().rotate(q, k, cos, sin, inverse=False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq_rot, dk_rot):
        cos, sin = ctx.saved_tensors
        dq, dk = _triton_module().rotate(dq_rot, dk_rot, cos, sin, inverse=True)
        return dq, dk, None, None


def _validate(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be 4-d [batch, seq, heads_q, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    batch, seq, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q's head_dim must be even, got {head_dim}")
    if k is not None:
        if k.dim() != 4:
            raise ValueError(f"k must be 4-d [batch, seq, heads_k, head_dim], got shape {tuple(k.shape)}")
        if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq, head_dim):
            raise ValueError(
                f"k must match q's batch, seq and head_dim ({batch}, {seq}, {head_dim}), got shape {tuple(k.shape)}"
            )
        if k.dtype != q.dtype:
            raise ValueError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    tables = ((seq, head_dim // 2), (batch, seq, head_dim // 2))
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {table.dtype}")
        if tuple(table.shape) not in tables:
            raise ValueError(f"{name} must have shape {tables[0]} or {tables[1]}, got {tuple(table.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")


def apply_rope(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q and k rotated by the half tables: ``(q_rot, k_rot)``, new contiguous ``[batch, seq,
    heads, head_dim]`` tensors in the inputs' dtype (k_rot None when k is None).

    q ``[batch, seq, heads_q, head_dim]``, k ``[batch, seq, heads_k, head_dim]`` (any strides),
    cos/sin fp32 ``[seq, head_dim // 2]`` or ``[batch, seq, head_dim // 2]`` (:func:`rope_tables`).
    Gradients flow to q and k. The Triton path (one launch for q and k) runs on CUDA tensors (or
    under the ``triton`` backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16; otherwise the
    reference runs.
    """
    _validate(q, k, cos, sin)
    if not (q.dtype in TRITON_DTYPES and use_triton(q, k, cos, sin)):
        return apply_rope_reference(q, k, cos, sin)
    if use_custom_op():
        q_rot, k_rot = _rope_op(q, k, cos, sin)
        return q_rot, (k_rot if k is not None else None)
    return _EagerRope.apply(q, k, cos, sin)
