"""Decode attention: the one new token of each sequence attending over a preallocated KV cache.

    out[b, h] = softmax(scale * k_cache[b, g, j] . q[b, h]  for valid_start[b] <= j < valid_end[b]) @ v_cache[b, g, j]

with ``g = h // (H // H_kv)``.

- ``q`` ``[B, H, D]``: the query of the new token of each sequence.
- ``k_cache``, ``v_cache`` ``[B, H_kv, S_max, D]``: the preallocated cache (unit stride along D; the
  new token's k and v are already written at position ``valid_end[b] - 1``). ``H_kv`` divides
  ``H``: grouped-query attention (``H_kv = H`` for multi-head attention, 1 for multi-query), query
  head ``h`` reading kv head ``h // (H // H_kv)`` (transformers' ``repeat_kv`` convention). The
  kernels index the kv head; the cache is never copied per query head.
- ``valid_start``, ``valid_end`` ``[B]`` int32/int64 on q's device: sequence b attends to the cache
  positions ``valid_start[b] <= j < valid_end[b]`` (left padding puts the pad tokens before
  ``valid_start``). They are read on the device, never on the host, so that a CUDA graph captures
  one call and replays it for every decode step; their values are therefore not checked. An empty
  range (``valid_start[b] >= valid_end[b]``) gives an output of zeros, never NaN; positions outside
  ``[0, S_max)`` do not exist and are never read.
- ``scale`` defaults to ``D ** -0.5``; out ``[B, H, D]`` in q's dtype; scores, softmax and the
  weighted sum accumulate in fp32.

Memory traffic: the valid part of the cache, ``2 * B * H_kv * L * D`` elements for L valid
positions (plus q and out; the ``H // H_kv`` programs of a group read the same cache rows, mostly
from L2); the flops are ``4 * B * H * L * D``. Decode attention is bound by reading the cache.

Forward-only: this is an inference op. A backward through it (any backend) raises a RuntimeError
that says so, rather than differentiating the reference on one device and failing on another.

Layers: :func:`decode_attention_reference` (masked softmax attention in fp32; it reads the whole
cache) → the ``dslab::decode_attention`` custom op (under ``torch.compile`` and dispatch modes) or a
direct launch in eager mode → the flash-decoding Triton kernels in
:mod:`dslab.kernels.decode.decode_attention_triton` for D in {16, 32, 64, 128} and fp32/fp16/bf16
(other head dims take the reference). :func:`decode_attention` picks between them with
:func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools

import torch

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_HEAD_DIMS = (16, 32, 64, 128)
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BOUND_DTYPES = (torch.int32, torch.int64)


class ForwardOnly(torch.autograd.Function):
    """Runs ``compute(*inputs)`` as one node of the autograd graph whose backward raises: the
    inference ops' outputs keep ``requires_grad`` (so a mistaken backward reaches this node) and
    the error names the op."""

    @staticmethod
    def forward(ctx, op_name, compute, *inputs):
        ctx.op_name = op_name
        return compute(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(forward_only_message(ctx.op_name))


def forward_only_message(op_name: str) -> str:
    return (f"{op_name} is forward-only (an inference kernel): it has no backward. Run it under "
            f"torch.no_grad() / torch.inference_mode(), or use a differentiable op for training.")


def run_forward_only(op_name: str, compute, *inputs):
    """``compute(*inputs)``, wrapped in :class:`ForwardOnly` when autograd would record it."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return ForwardOnly.apply(op_name, compute, *inputs)
    return compute(*inputs)


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid_start: torch.Tensor,
    valid_end: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain masked softmax attention in fp32 (fp64 for fp64 inputs) over the whole cache, cast to
    q's dtype.

    Materialises fp32 copies of the caches (repeated to q's heads, ``repeat_kv``, when they have
    fewer) and the ``[B, H, S_max]`` scores; reads the bounds on the device (no host
    synchronisation). An empty range gives zeros.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if k_cache.shape[1] != q.shape[1]:
        group = q.shape[1] // k_cache.shape[1]
        k_cache, v_cache = k_cache.repeat_interleave(group, dim=1), v_cache.repeat_interleave(group, dim=1)
    compute = torch.promote_types(q.dtype, torch.float32)
    positions = torch.arange(k_cache.shape[2], device=q.device)
    valid = (positions >= valid_start[:, None]) & (positions < valid_end[:, None])  # [B, S_max]
    scores = torch.einsum("bhd,bhsd->bhs", q.to(compute), k_cache.to(compute)) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    empty = ~valid.any(dim=1)[:, None, None]  # [B, 1, 1]
    # An empty range would be softmax(-inf, ..., -inf) = NaN: give it finite scores, then zero it.
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return torch.einsum("bhs,bhsd->bhd", probs, v_cache.to(compute)).to(q.dtype)


@functools.cache
def _triton_module():
    from dslab.kernels.decode import decode_attention_triton

    return decode_attention_triton


@torch.library.custom_op("dslab::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         valid_start: torch.Tensor, valid_end: torch.Tensor, scale: float) -> torch.Tensor:
    """out [B, H, D] for q [B, H, D], caches [B, H_kv, S_max, D] (H_kv divides H), bounds [B]."""
    return _triton_module().decode_attention(q, k_cache, v_cache, valid_start, valid_end, scale)


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, valid_start, valid_end, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _no_backward(ctx, grad_out):
    raise RuntimeError(forward_only_message("dslab::decode_attention"))


_decode_attention_op.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def _validate(q, k_cache, v_cache, valid_start, valid_end, scale) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [B, H, D] (one new token per sequence), got shape {tuple(q.shape)}")
    if not q.is_floating_point():
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    batch, heads, head_dim = q.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or (cache.shape[0], cache.shape[3]) != (batch, head_dim):
            raise ValueError(f"{name} must have shape [B, H_kv, S_max, D] = [{batch}, H_kv, S_max, {head_dim}] "
                             f"(q's B, D), got {tuple(cache.shape)}")
        if cache.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {cache.dtype}")
        if cache.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cache.device}")
    kv_heads = k_cache.shape[1]
    if v_cache.shape[1] != kv_heads:
        raise ValueError(f"k_cache must have shape [B, H, S_max, D] with the same H (H_kv) as v_cache: k_cache has "
                         f"{kv_heads} heads, v_cache {v_cache.shape[1]}")
    if (kv_heads == 0 and heads != 0) or (kv_heads != 0 and heads % kv_heads != 0):
        raise ValueError(f"q has {heads} heads and k_cache, v_cache have {kv_heads}: grouped-query attention "
                         f"needs q's heads to be a multiple of the caches' (H_kv must divide H)")
    if v_cache.shape[2] != k_cache.shape[2]:
        raise ValueError(f"v_cache must have k_cache's S_max = {k_cache.shape[2]}, got {v_cache.shape[2]}")
    for name, bound in (("valid_start", valid_start), ("valid_end", valid_end)):
        if not isinstance(bound, torch.Tensor):
            raise ValueError(f"{name} must be a [B] int32/int64 tensor on q's device, got {type(bound).__name__}")
        if tuple(bound.shape) != (batch,):
            raise ValueError(f"{name} must have shape ({batch},) (q's B), got {tuple(bound.shape)}")
        if bound.dtype not in BOUND_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {bound.dtype}")
        if bound.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device} (it is read there, never on the host), "
                             f"got {bound.device}")
    if scale is not None and not scale > 0.0:
        raise ValueError(f"scale must be positive, got {scale}")


def _triton_path(q, k_cache, v_cache, valid_start, valid_end, scale) -> torch.Tensor:
    if use_custom_op():
        return _decode_attention_op(q, k_cache, v_cache, valid_start, valid_end, scale)
    return _triton_module().decode_attention(q, k_cache, v_cache, valid_start, valid_end, scale)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid_start: torch.Tensor,
    valid_end: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of q ``[B, H, D]`` over ``k_cache``/``v_cache`` ``[B, H_kv, S_max, D]`` positions
    ``valid_start[b] <= j < valid_end[b]``, query head ``h`` with kv head ``h // (H // H_kv)``
    (``H % H_kv == 0``); returns ``[B, H, D]`` in q's dtype (see the module docstring). Forward-only.

    The Triton path runs on CUDA tensors (or under the ``triton`` backend with
    ``TRITON_INTERPRET=1``) for fp32/fp16/bf16 and D in {16, 32, 64, 128}, and never synchronises
    with the host; otherwise the reference runs. Shapes, dtypes and devices are checked here and
    raise ``ValueError`` naming the argument.
    """
    _validate(q, k_cache, v_cache, valid_start, valid_end, scale)
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    triton_ok = (q.dtype in TRITON_DTYPES and q.shape[-1] in TRITON_HEAD_DIMS and k_cache.shape[2] > 0
                 and q.shape[0] * q.shape[1] > 0 and use_triton(q, k_cache, v_cache, valid_start, valid_end))
    compute = _triton_path if triton_ok else decode_attention_reference
    return run_forward_only("dslab::decode_attention",
                            lambda *inputs: compute(*inputs, scale), q, k_cache, v_cache, valid_start, valid_end)
