"""Scaled dot-product attention: PyTorch reference, Triton flash attention, custom op and dispatch.

``attention(q, k, v, causal, key_padding_mask, dropout_p, scale)`` computes, per (batch, head),

    out = dropout(softmax(scale * q @ k^T + mask)) @ v

with q ``[batch, heads, seq_q, head_dim]``, k and v ``[batch, kv_heads, seq_k, head_dim]``, out like q.

- Grouped-query attention: ``kv_heads`` divides ``heads`` (equal for plain multi-head attention,
  1 for multi-query attention). Query head ``h`` attends with kv head ``h // (heads // kv_heads)``,
  transformers' ``repeat_kv`` convention: the kv heads repeated ``heads // kv_heads`` times each,
  in place. The Triton kernels index the kv head instead of copying k and v; dk and dv (k's and
  v's shapes) are the sums over each group's query heads.

- ``causal``: query i sees keys j <= i (top-left aligned, as ``scaled_dot_product_attention(
  is_causal=True)``), also when ``seq_q != seq_k``.
- ``key_padding_mask``: bool ``[batch, seq_k]``, True where the key is padding
  (``nn.MultiheadAttention``'s convention).
- A query row whose keys are all masked gets output 0 and gradient 0 (SDPA returns NaN there).
- ``dropout_p``: dropout on the attention probabilities. On the Triton path the keep-mask comes
  from Philox keyed by ``seed``: an int64 ``[1]`` tensor on q's device, by default drawn at call
  time from torch's generator for that device (:func:`draw_dropout_seed`: ``torch.manual_seed``
  reproduces it, no host synchronisation, and a captured CUDA graph draws a new one on each
  replay); an int or a tensor may be passed instead, and the same value gives the same mask. The
  kernels read the seed from device memory, and the backward regenerates the mask from the saved
  seed tensor instead of storing it. :func:`triton_dropout_keep_mask` materialises it for tests.
  The reference draws its mask with ``F.dropout``, or from a generator seeded with ``seed``'s value
  (read on the host) when one is passed. The Triton kernels apply ``dropout_p`` rounded to a
  multiple of ``2**-16`` (:func:`dslab.kernels.attention.attention_triton.kernel_dropout_p`).
- ``scale`` defaults to ``1 / sqrt(head_dim)`` and must be positive.

The same attention straight from a packed ``[batch, seq, 3 * hidden]`` projection is
:mod:`dslab.kernels.attention.attention_packed`.

Backends (:mod:`dslab.kernels.dispatch`): cuDNN's fused attention for the causal calls on Hopper
that autograd will differentiate and that :func:`dslab.kernels.attention.attention_cudnn.eligible_split`
accepts (its backward is faster there: that module says by how much; with dropout and no ``seed``
its mask comes from torch's generator); Triton (:mod:`dslab.kernels.attention.attention_triton`, ``_bwd``)
for fp16 and bf16 inputs when ``use_triton`` says so; :func:`attention_reference` otherwise. The
Triton path is the custom ops ``dslab::attention_forward`` / ``dslab::attention_backward`` under ``torch.compile``, and an
``autograd.Function`` making the same launches in eager mode. fp32
and fp64 inputs always take the reference, which materialises the ``seq_q x seq_k`` scores. Head
dims are 32, 64 or 128 on every backend so that a model behaves the same on CPU and GPU.
"""

import math
from typing import Optional

import torch

from dslab.kernels.attention import attention_cudnn, attention_triton, attention_triton_bwd
from dslab.kernels.dispatch import use_custom_op, use_triton

HEAD_DIMS = (32, 64, 128)
TRITON_DTYPES = (torch.float16, torch.bfloat16)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SEED_HIGH = 2**62
MAX_SEED = 2**63 - 1


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    dropout_mask: Optional[torch.Tensor] = None,
    seed: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch attention in the inputs' dtype; materialises ``[batch, heads, seq_q, seq_k]``.
    k and v with fewer heads than q (a divisor) are repeated to q's heads first, each kv head
    ``heads // kv_heads`` times in place (``repeat_kv``), so their gradients sum over each group.

    ``dropout_mask`` (bool, broadcastable to the scores, True = kept) replaces the random draw
    when given, so tests can apply exactly the mask the Triton kernels used; kept probabilities
    are scaled by ``1 / (1 - dropout_p)``. Otherwise the mask is ``F.dropout``'s, or with ``seed``
    (an int or a 1-element tensor, read on the host) ``rand >= dropout_p`` from a generator seeded
    with it. Fully masked rows give 0 (not NaN) and 0 gradients.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    masked = torch.zeros((1, 1, seq_q, seq_k), dtype=torch.bool, device=q.device)
    if causal:
        masked = masked | torch.ones((seq_q, seq_k), dtype=torch.bool, device=q.device).triu(1)
    if key_padding_mask is not None:
        masked = masked | key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(masked, float("-inf"))
    row_empty = masked.all(dim=-1, keepdim=True)
    # Empty rows would be softmax(-inf, ..., -inf) = NaN: give them finite scores, then zero them.
    probs = torch.softmax(scores.masked_fill(row_empty, 0.0), dim=-1).masked_fill(row_empty, 0.0)
    if dropout_mask is None and dropout_p > 0.0 and seed is not None:
        generator = torch.Generator(device=q.device).manual_seed(int(seed))
        dropout_mask = torch.rand(probs.shape, generator=generator, device=q.device) >= dropout_p
    if dropout_mask is not None:
        probs = probs * dropout_mask / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


def draw_dropout_seed(device: torch.device | str) -> torch.Tensor:
    """The Philox seed of one call: int64 ``[1]`` on ``device`` in ``[0, 2**62)``, from torch's
    generator for that device (``torch.randint``: no host synchronisation, CUDA-graph safe)."""
    return torch.randint(0, SEED_HIGH, (1,), dtype=torch.int64, device=device)


def _seed_tensor(seed: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``seed`` as the int64 ``[1]`` tensor on ``device`` the kernels read (an int by a fill on the
    device, no host-to-device copy); ValueError naming ``seed`` for anything else."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != device:
            raise ValueError(
                f"seed must be a 1-element int64 tensor on {device}, got a {seed.dtype} tensor of shape "
                f"{tuple(seed.shape)} on {seed.device}"
            )
        return seed.view(1)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**63 - 1] or a 1-element int64 tensor, got {seed!r}")
    return torch.full((1,), seed, dtype=torch.int64, device=device)


def triton_dropout_keep_mask(
    seed: int | torch.Tensor, batch: int, heads: int, seq_q: int, seq_k: int, dropout_p: float, device
) -> torch.Tensor:
    """Bool ``[batch, heads, seq_q, seq_k]`` on ``device``: True where the Triton kernels keep a
    probability for ``seed`` (an int, or a :func:`draw_dropout_seed` tensor, moved to ``device``).
    ``heads`` counts query heads: each has its own draws, also where several share a kv head.
    Debug helper for small shapes."""
    if isinstance(seed, torch.Tensor):
        seed = seed.to(device)
        seed = _seed_tensor(seed, seed.device)  # seed.device is "cuda:0" where device may say "cuda"
    else:
        seed = _seed_tensor(seed, torch.device(device))
    return attention_triton.dropout_keep_mask(seed, batch, heads, seq_q, seq_k, dropout_p)


@torch.library.custom_op("dslab::attention_forward", mutates_args=())
def _attention_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
    causal: bool,
    dropout_p: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton forward: (out, base-2 logsumexp ``[batch, heads, seq_q]`` fp32, the dropout mask's bits
    for the backward: uint8 ``[batch * heads, seq_q, ceil(seq_k / 8)]``, ``[0]`` without dropout);
    ``heads`` are q's (k and v may have a divisor of them); ``seed`` int64 ``[1]`` on q's device,
    None without dropout."""
    keep = _keep_buffer(q, k.shape[2], dropout_p)
    out, lse = attention_triton.attention_forward(q, k, v, key_padding_mask, seed, causal, dropout_p, scale,
                                                  keep=keep)
    return out, lse, keep


def _keep_buffer(q: torch.Tensor, seq_k: int, dropout_p: float) -> torch.Tensor:
    """Where the forward stores its dropout bits (an empty uint8 tensor without dropout)."""
    if dropout_p > 0.0:
        return attention_triton.empty_keep_bits(q, seq_k)
    return q.new_empty((0,), dtype=torch.uint8)


@_attention_forward_op.register_fake
def _attention_forward_fake(q, k, v, key_padding_mask, seed, causal, dropout_p, scale):
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return attention_triton.empty_rows_like(q), lse, _keep_buffer(q, k.shape[2], dropout_p)


@torch.library.custom_op("dslab::attention_backward", mutates_args=())
def _attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
    causal: bool,
    dropout_p: float,
    scale: float,
    keep: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward: (dq, dk, dv) shaped like q, k, v (dk, dv summed over each kv head's query
    heads), the dropout mask loaded from the forward's bits ``keep``, or drawn again from its
    ``seed`` without them."""
    return attention_triton_bwd.attention_backward(
        grad_out, q, k, v, out, lse, key_padding_mask, seed, causal, dropout_p, scale, keep=keep
    )


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, key_padding_mask, seed, causal, dropout_p, scale,
                             keep=None):
    empty = attention_triton.empty_rows_like
    return empty(q), empty(k), empty(v)


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, seed, causal, dropout_p, scale = inputs
    out, lse, keep = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, seed, keep)
    ctx.causal, ctx.dropout_p, ctx.scale = causal, dropout_p, scale
    ctx.mark_non_differentiable(lse, keep)


def _backward(ctx, grad_out, grad_lse, grad_keep):
    q, k, v, out, lse, key_padding_mask, seed, keep = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = _attention_backward_op(
        grad_out, q, k, v, out, lse, key_padding_mask, seed, ctx.causal, ctx.dropout_p, ctx.scale, keep
    )
    return dq, dk, dv, None, None, None, None, None


_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same launches as the custom ops, for eager mode: a custom op's Python dispatch costs
    about 2.5x an autograd.Function's host time per fwd+bwd, which is felt at BERT's seq 128 where
    the whole fwd+bwd is ~0.1 ms of GPU time. ``torch.compile`` sees the custom ops instead."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, seed, causal, dropout_p, scale):
        keep = _keep_buffer(q, k.shape[2], dropout_p)
        out, lse = attention_triton.attention_forward(q, k, v, key_padding_mask, seed, causal, dropout_p, scale,
                                                      keep=keep)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, seed, keep)
        ctx.params = (causal, dropout_p, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # once_differentiable's no_grad block only matters under create_graph=True; skipping it
        # otherwise saves host time on every backward.
        if torch.is_grad_enabled():
            return _eager_backward_once_differentiable(ctx, grad_out)
        return _eager_backward(ctx, grad_out)


def _eager_backward(ctx, grad_out):
    q, k, v, out, lse, key_padding_mask, seed, keep = ctx.saved_tensors
    dq, dk, dv = attention_triton_bwd.attention_backward(
        grad_out, q, k, v, out, lse, key_padding_mask, seed, *ctx.params, keep=keep
    )
    return dq, dk, dv, None, None, None, None, None


_eager_backward_once_differentiable = torch.autograd.function.once_differentiable(_eager_backward)


def _function_apply(function):
    """``function.apply`` without ``torch.autograd.Function.apply``'s Python prologue (default-arg
    binding for ``setup_context`` style Functions and functorch wrapper unwrapping, neither used
    here): the C ``apply`` it ends in, ~10 us less host time per call on a lent H100 host. Under
    functorch transforms the full ``apply`` runs (and refuses this Function)."""
    c_apply = getattr(torch._C, "_FunctionBase", None)
    c_apply = None if c_apply is None else c_apply.__dict__.get("apply")
    if c_apply is None:
        return function.apply
    bound = c_apply.__get__(None, function)

    def apply(*args):
        if torch._C._are_functorch_transforms_active():
            return function.apply(*args)
        return bound(*args)

    return apply


_eager_attention = _function_apply(_EagerAttention)


def _validate(q, k, v, key_padding_mask, dropout_p, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor [batch, heads, seq, head_dim], got {_describe(t)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of {', '.join(map(str, _DTYPES))}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"q has head_dim {q.shape[-1]}; supported head dims are {HEAD_DIMS}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.shape[0] != q.shape[0] or t.shape[-1] != q.shape[-1]:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; expected [batch, kv_heads, seq_k, head_dim] = "
                f"[{q.shape[0]}, kv_heads, seq_k, {q.shape[3]}] to match q {tuple(q.shape)}"
            )
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads but k has {k.shape[1]}; k and v need the same kv_heads")
    heads, kv_heads = q.shape[1], k.shape[1]
    if (kv_heads == 0 and heads != 0) or (kv_heads != 0 and heads % kv_heads != 0):
        raise ValueError(
            f"q has {heads} heads and k, v have {kv_heads}: grouped-query attention needs q's heads to be "
            f"a multiple of k's and v's (kv_heads must divide heads)"
        )
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v has seq_k {v.shape[2]} but k has {k.shape[2]}")
    _validate_options(key_padding_mask, q.shape[0], k.shape[2], q.device, "q", dropout_p, scale)


def _validate_options(key_padding_mask, batch, seq_k, device, input_name, dropout_p, scale) -> None:
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be a bool tensor, got {_describe(key_padding_mask)}")
        if tuple(key_padding_mask.shape) != (batch, seq_k):
            raise ValueError(
                f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; expected [batch, seq_k] = "
                f"[{batch}, {seq_k}]"
            )
        if key_padding_mask.device != device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but {input_name} is on {device}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is not None and not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-d {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    seed: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over q ``[B, Hq, Sq, D]``, k, v ``[B, Hkv, Sk, D]`` -> ``[B, Hq, Sq, D]``, with
    ``Hq % Hkv == 0`` and query head ``h`` attending with kv head ``h // (Hq // Hkv)`` (see the module
    docstring for grouped-query attention, the masks, dropout, ``seed`` and backends). Raises
    ValueError naming the bad argument."""
    _validate(q, k, v, key_padding_mask, dropout_p, scale)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if attention_cudnn.eligible_split(q, k, v, causal, key_padding_mask, dropout_p, seed):
        return attention_cudnn.attention(q, k, v, float(dropout_p), float(scale))
    if seed is not None:
        seed = _seed_tensor(seed, q.device)
    has_work = q.numel() > 0 and k.shape[2] > 0
    if has_work and q.dtype in TRITON_DTYPES and use_triton(q, k, v, key_padding_mask):
        if dropout_p > 0.0:
            seed = draw_dropout_seed(q.device) if seed is None else seed
        else:
            seed = None
        args = (q, k, v, key_padding_mask, seed, bool(causal), float(dropout_p), float(scale))
        if use_custom_op():
            return _attention_forward_op(*args)[0]
        return _eager_attention(*args)
    return attention_reference(q, k, v, causal, key_padding_mask, dropout_p, scale, seed=seed)
