"""An LM head and its cross-entropy in one op, whose forward writes the logits' gradient in place.

For hidden states ``h`` ``[N, H]``, a head ``W`` ``[Vp, H]`` (rows at or past ``vocab`` are
padding), a bias ``b`` ``[Vp]`` or None, targets ``t`` ``[N]`` and label smoothing ``eps``, the
result is

    F.cross_entropy((h @ W.T + b)[:, :vocab].float(), t, ignore_index=..., label_smoothing=eps)

the mean over rows whose target is not ``ignore_index`` (all rows ignored gives 0/0 = nan, as
PyTorch). Gradients flow to ``h``, ``W`` and ``b``, each in its own dtype; the padding rows of
``W`` and ``b`` get exactly zero.

Why one op: the LM head's logits ``x = h W^T + b`` (``[N, Vp]``) exist only to be reduced to the
loss, and the loss's gradient with respect to them,

    d loss / d x_ij = (softmax(x_i)_j - (1 - eps) [j == t_i] - eps / vocab) * g / n_valid

(zero on ignored rows and on the padding columns ``j >= vocab``), needs nothing but the row's
``lse`` and ``g``, the incoming gradient, which is a common factor. So the forward writes
``G = d loss / d x`` for ``g = 1`` over the logits themselves, and the backward is three matmuls
scaled by ``g``: ``dh = g G W``, ``dW = g G^T h``, ``db = g sum_i G_i``. Composed of a sliced
``F.linear`` and a separate cross-entropy (:mod:`dslab.kernels.loss.cross_entropy`), the same step
also runs the cross-entropy's backward kernel over the logits and autograd's backward of the
slice: a zero fill of a padded ``[N, Vp]`` buffer and a strided copy into it (at 16384 x 50304
in bf16 on an H200: 1.64 + 0.49 + 1.89 ms, beside the forward kernel's 0.45 ms).

Triton path (CUDA tensors, or the ``triton`` backend under the interpreter, with a 16-bit compute
dtype): ``x`` is one ``torch.mm`` (``torch.addmm`` with a bias) into a fresh ``[N, Vp]`` buffer in
the compute dtype, then one kernel, one program per row:

- pass 1 streams the row's first ``vocab`` logits in ``BLOCK``-wide chunks, keeping per segment
  of 16 logits an online maximum and rescaled sum of exponentials in fp32 (the helpers of
  :mod:`dslab.kernels.loss.cross_entropy`), and stores the row's loss
  ``lse - (1 - eps) x_t - (eps / vocab) sum_j x_j`` (fp32);
- pass 2 reads the row again and overwrites it with its gradient row for ``g = 1``, rounded once
  to the buffer's dtype, and zeros over the padding columns. An ignored row is only written:
  zeros, and a row loss of 0.

``n_valid`` is counted on the device and the kernel reads ``1 / n_valid`` through a pointer: no
host synchronisation. Traffic for ``e``-byte logits: the matmul writes ``N Vp e``; the kernel
reads ``2 N vocab e`` (the second pass largely from L2) and writes ``N Vp e``; the backward's two
matmuls read ``G`` once each (the bias gradient's column sum once more). Memory: the ``[N, Vp]``
buffer is the only large tensor, held from the forward to the backward as the logits of the
unfused composition would be; no fp32 copy of it is made, and autograd hands the backward no
zero-filled gradient for it.

Dtypes: the compute dtype is the autocast dtype of ``hidden``'s device type while autocast is
enabled there (and ``hidden`` is fp32, fp16 or bf16), else ``hidden``'s dtype. ``hidden``,
``weight`` and ``bias`` are cast to it explicitly and the op runs with autocast disabled, so that
under ``torch.autocast("cuda", torch.bfloat16)`` an fp32 head and bf16 hidden states compute in
bf16 as ``F.linear`` would, each cast made once. Outside autocast the weight and bias must be in
``hidden``'s dtype, as ``F.linear`` requires. The backward's matmuls run in the compute dtype with
fp32 accumulation; the bias gradient is summed in fp32.

A target outside ``[0, vocab)`` that is not ``ignore_index`` makes that row's loss (hence the
mean) and its gradient row over ``[0, vocab)`` nan on the Triton path, where checking it would
need a device sync; the reference raises as ``F.cross_entropy`` does.

A tied head (``tie``, an :class:`~dslab.kernels.embedding.embedding.EmbeddingTie` armed for ``weight``, the
token embeddings): the head reads ``weight`` through the tie, and its weight gradient goes to the
embedding lookup's backward, which adds it into the one fp32 gradient it writes. On the fused
path the backward hands the tie the unscaled ``G^T h`` and ``g``, and the lookup's kernel scales
it (rounded as ``G^T h * g`` would be), so no ``[Vp, H]`` scale, cast or add runs; where the tie
refuses (see :mod:`dslab.kernels.embedding.embedding`) the backward returns ``g G^T h`` in ``weight``'s
dtype as without a tie. Elsewhere the head reads :meth:`EmbeddingTie.head_weight`.

Layers: :func:`linear_cross_entropy_reference` (``F.linear``, the slice and
:func:`dslab.kernels.loss.cross_entropy.cross_entropy_reference`) → the
``dslab::linear_cross_entropy_forward`` custom op returning ``(loss, G)``, ``G`` a
non-differentiable output saved for the backward, whose autograd formula is the three matmuls
(``torch.compile`` sees one opaque call and traces the matmuls) → the Triton kernel.
:func:`linear_cross_entropy` picks with :func:`dslab.kernels.dispatch.use_triton`: the fused op
for an fp16/bf16 compute dtype; for fp32 compute, ``F.linear``, the slice and
:func:`dslab.kernels.loss.cross_entropy.softmax_cross_entropy` (its Triton kernels read the strided
rows); the reference otherwise (CPU tensors without the interpreter, the ``torch`` backend, fp64).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dslab.kernels._triton_compat import cast_rounding as _cast
from dslab.kernels._triton_compat import jit as _jit
from dslab.kernels._triton_compat import tl, triton
from dslab.kernels.loss.cross_entropy import (
    _SEGMENT, _grad_chunk, _load_chunk, _online_chunk, cross_entropy_reference, softmax_cross_entropy,
)
from dslab.kernels.dispatch import interpreting, use_triton

if TYPE_CHECKING:
    from dslab.kernels.embedding.embedding import EmbeddingTie

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_AUTOCAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes autocast casts
_TRITON_DTYPES = (torch.float16, torch.bfloat16)


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab: int,
    bias: torch.Tensor | None = None, ignore_index: int = -100, label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The PyTorch reference: ``F.linear`` (autocast applies as usual), the logits' first ``vocab``
    columns (a strided view when ``vocab < Vp``) and ``F.cross_entropy`` on their fp32 copy."""
    logits = F.linear(hidden, weight, bias)
    if vocab < logits.shape[-1]:
        logits = logits[:, :vocab]
    return cross_entropy_reference(logits, target, ignore_index, label_smoothing)


# ---------------------------------------------------------------------------------------------
# Triton kernel: one program per row, the row read twice in BLOCK-wide chunks and written once.
# ---------------------------------------------------------------------------------------------


@_jit
def _grad_tail_chunk(row_ptr, cols, vocab_limit, row_limit, target, lse, scale, label_smoothing, vocab,
                     SMOOTH: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """One chunk past the last full chunk of ``[0, vocab)``, overwritten in place: the gradient
    (as ``_grad_chunk``) at ``cols < vocab_limit``, zeros at ``vocab_limit <= cols < row_limit``
    (the padding columns; ``vocab_limit`` may be <= 0, a chunk of padding only)."""
    valid = cols < vocab_limit
    x = _load_chunk(row_ptr, cols, vocab_limit, MASKED=True)
    grad = tl.exp(x - lse)
    if SMOOTH:
        grad -= label_smoothing / vocab
    grad = tl.where(cols == target, grad - (1.0 - label_smoothing), grad) * scale
    grad = _cast(tl.where(valid, grad, 0.0), row_ptr.dtype.element_ty, BF16_BY_HAND)
    tl.store(row_ptr + cols, grad, mask=cols < row_limit)


@_jit
def _loss_and_grad_kernel(
    logits_ptr, target_ptr, row_loss_ptr, inv_n_ptr, vocab, padded_vocab, ignore_index, label_smoothing,
    BLOCK: tl.constexpr, SEGMENT: tl.constexpr, SMOOTH: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """Row ``pid`` of the contiguous ``[N, padded_vocab]`` logits: its loss (fp32, 0 when ignored)
    to ``row_loss_ptr``, and the row overwritten with its gradient times ``*inv_n_ptr``
    (``1 / n_valid``), zeros past ``vocab`` and over ignored rows.

    Pass 1 reads ``vocab`` elements as chunks of ``BLOCK`` = segments x ``SEGMENT`` (the forward
    kernel of :mod:`dslab.kernels.loss.cross_entropy`); pass 2 reads them again as ``BLOCK``-wide rows
    and writes ``padded_vocab`` elements.
    """
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    row_ptr = logits_ptr + row * padded_vocab
    flat = tl.arange(0, BLOCK)
    if target == ignore_index:
        zeros = tl.zeros([BLOCK], logits_ptr.dtype.element_ty)
        for start in range(0, padded_vocab, BLOCK):
            tl.store(row_ptr + start + flat, zeros, mask=flat < padded_vocab - start)
        tl.store(row_loss_ptr + row, 0.0)
    else:
        cols = tl.arange(0, BLOCK // SEGMENT)[:, None] * SEGMENT + tl.arange(0, SEGMENT)[None, :]
        segment_max = tl.full([BLOCK // SEGMENT], float("-inf"), tl.float32)
        segment_sum = tl.zeros([BLOCK // SEGMENT], tl.float32)
        segment_total = tl.zeros([BLOCK // SEGMENT], tl.float32)
        full_end = (vocab // BLOCK) * BLOCK
        for start in range(0, full_end, BLOCK):
            x = _load_chunk(row_ptr + start, cols, BLOCK, MASKED=False)
            segment_max, segment_sum = _online_chunk(x, segment_max, segment_sum)
            if SMOOTH:
                segment_total += tl.sum(x, axis=1)
        if full_end < vocab:
            x = _load_chunk(row_ptr + full_end, cols, vocab - full_end, MASKED=True)
            segment_max, segment_sum = _online_chunk(x, segment_max, segment_sum)
            if SMOOTH:
                segment_total += tl.sum(tl.where(cols < vocab - full_end, x, 0.0), axis=1)
        row_max = tl.max(segment_max, axis=0)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        lse = row_max + tl.log(tl.sum(segment_sum * tl.exp(segment_max - shift), axis=0))
        in_range = (target >= 0) & (target < vocab)
        target_logit = tl.load(row_ptr + target, mask=in_range, other=0.0).to(tl.float32)
        if SMOOTH:
            row_total = tl.sum(segment_total, axis=0)
            loss = lse - (1.0 - label_smoothing) * target_logit - (label_smoothing / vocab) * row_total
        else:
            loss = lse - target_logit
        tl.store(row_loss_ptr + row, tl.where(in_range, loss, float("nan")))
        # Pass 2, in place. An out-of-range target turns the gradient over [0, vocab) into nan.
        lse = tl.where(in_range, lse, float("nan"))
        scale = tl.load(inv_n_ptr)
        for start in range(0, full_end, BLOCK):
            _grad_chunk(row_ptr + start, row_ptr + start, flat, BLOCK, target - start, lse, scale,
                        label_smoothing, vocab, SMOOTH, MASKED=False, BF16_BY_HAND=BF16_BY_HAND)
        for start in range(full_end, padded_vocab, BLOCK):
            _grad_tail_chunk(row_ptr + start, flat, vocab - start, padded_vocab - start, target - start, lse,
                             scale, label_smoothing, vocab, SMOOTH, BF16_BY_HAND)


def _launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the chunking of :mod:`dslab.kernels.loss.cross_entropy`'s backward kernel,
    which this kernel's second pass is: 8192 logits a chunk and 16 warps at a GPT-2 vocabulary. On
    an H200 at 16384 x 50304 in bf16 that takes 1.09 ms, against 1.12 to 1.22 ms for chunks of
    2048, 4096 or 16384 or for 8 warps. Under the interpreter a small block, so that the tests'
    rows span several chunks, a masked tail and padding columns across a chunk boundary."""
    if interpreting():
        return 128, 4
    block = max(_SEGMENT, min(8192, triton.next_power_of_2(vocab)))
    return block, 16 if block >= 4096 else 8


def linear_cross_entropy_forward_triton(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    vocab: int, ignore_index: int, label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss: fp32 scalar, G: contiguous ``[N, Vp]`` in the inputs' dtype, the loss's gradient
    with respect to the logits for an incoming gradient of 1). ``hidden``, ``weight`` and ``bias``
    share one dtype. Allocates ``G`` and fp32 ``[N]`` row losses; no host synchronisation."""
    target = target.contiguous()
    with torch.autocast(hidden.device.type, enabled=False):
        if bias is None:
            logits = torch.mm(hidden, weight.t())
        else:
            logits = torch.addmm(bias, hidden, weight.t())
    n_rows, padded_vocab = logits.shape
    n_valid = (target != ignore_index).sum()
    inv_n = 1.0 / n_valid.to(torch.float32)
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows > 0:
        block, num_warps = _launch_config(vocab)
        _loss_and_grad_kernel[(n_rows,)](
            logits, target, row_loss, inv_n, vocab, padded_vocab, ignore_index, float(label_smoothing),
            BLOCK=block, SEGMENT=_SEGMENT, SMOOTH=label_smoothing > 0.0,
            BF16_BY_HAND=interpreting() and logits.dtype == torch.bfloat16, num_warps=num_warps,
        )
    return row_loss.sum() * inv_n, logits


# ---------------------------------------------------------------------------------------------
# Custom op, so that torch.compile treats the forward as an opaque call with known output shapes;
# its backward is three matmuls, traced as such.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("dslab::linear_cross_entropy_forward", mutates_args=())
def _forward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    vocab: int, ignore_index: int, label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return linear_cross_entropy_forward_triton(hidden, weight, bias, target, vocab, ignore_index, label_smoothing)


@_forward_op.register_fake
def _forward_fake(hidden, weight, bias, target, vocab, ignore_index, label_smoothing):
    loss = hidden.new_empty((), dtype=torch.float32)
    return loss, hidden.new_empty((hidden.shape[0], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, _, _, _, _ = inputs
    _, grad_logits = output
    ctx.save_for_backward(hidden, weight, grad_logits)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(grad_logits)
    # Otherwise autograd would hand the backward a zero-filled [N, Vp] gradient for grad_logits.
    ctx.set_materialize_grads(False)


def _head_grads(hidden, weight, grad_logits, grad_loss, needs_input_grad, bias_dtype, weight_dtype, tie=None):
    """``g G W``, ``g G^T h`` and ``g sum_i G_i`` for ``g = grad_loss``: the hidden gradient in
    ``hidden``'s dtype, the bias's in ``bias_dtype`` and the weight's in ``weight_dtype``, or None
    for the weight when ``tie`` takes the unscaled ``G^T h`` and ``g``."""
    need_hidden, need_weight, need_bias = needs_input_grad[:3]
    g = grad_loss.to(torch.float32)
    grad_hidden = grad_weight = grad_bias = None
    with torch.autocast(hidden.device.type, enabled=False):
        if need_hidden:
            grad_hidden = (torch.mm(grad_logits, weight) * g).to(hidden.dtype)
        if need_weight:
            unscaled = torch.mm(grad_logits.t(), hidden)
            if tie is None or not tie.offer(unscaled, g):
                grad_weight = (unscaled * g).to(weight_dtype)
        if bias_dtype is not None and need_bias:
            grad_bias = (grad_logits.sum(0, dtype=torch.float32) * g).to(bias_dtype)
    return grad_hidden, grad_weight, grad_bias


def _backward(ctx, grad_loss, grad_grad_logits):
    """``g G W``, ``g G^T h`` and ``g sum_i G_i`` for ``g = grad_loss``, in the inputs' dtype."""
    hidden, weight, grad_logits = ctx.saved_tensors
    grads = _head_grads(hidden, weight, grad_logits, grad_loss, ctx.needs_input_grad, ctx.bias_dtype, weight.dtype)
    return *grads, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _TiedForward(torch.autograd.Function):
    """The fused op on a head read through a tie: ``weight`` is the tied parameter (in its own
    dtype), cast to ``hidden``'s inside; the backward offers the weight gradient to the tie."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, vocab, ignore_index, label_smoothing, tie):
        cast = weight.to(hidden.dtype)
        loss, grad_logits = _forward_op(hidden, cast, bias, target, vocab, ignore_index, label_smoothing)
        ctx.save_for_backward(hidden, cast, grad_logits)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.weight_dtype, ctx.tie = weight.dtype, tie
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        hidden, cast, grad_logits = ctx.saved_tensors
        grads = _head_grads(hidden, cast, grad_logits, grad_loss, ctx.needs_input_grad, ctx.bias_dtype,
                            ctx.weight_dtype, ctx.tie)
        return *grads, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# The public op.
# ---------------------------------------------------------------------------------------------


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The autocast dtype of ``hidden``'s device type while autocast is on there (for the dtypes
    autocast casts), else ``hidden``'s dtype: what ``F.linear`` would compute in."""
    device = hidden.device.type
    if hidden.dtype in _AUTOCAST_DTYPES and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _check_inputs(hidden, weight, target, vocab, bias, label_smoothing) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, H], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in _DTYPES:
        raise ValueError(f"hidden dtype must be float32, float64, float16 or bfloat16, got {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [Vp, H] with H={hidden.shape[1]} (hidden's), got shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},) (weight's Vp), got {tuple(bias.shape)}")
    autocast = hidden.dtype in _AUTOCAST_DTYPES and torch.is_autocast_enabled(hidden.device.type)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype must be float32, float64, float16 or bfloat16, got {t.dtype}")
        if not autocast and t.dtype != hidden.dtype:
            raise ValueError(f"{name} dtype must be hidden's dtype {hidden.dtype} outside autocast, got {t.dtype}")
        if t.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {t.device}")
    if target.dim() != 1 or target.shape[0] != hidden.shape[0]:
        raise ValueError(f"target must be [N] with N={hidden.shape[0]} (hidden's), got shape {tuple(target.shape)}")
    if target.dtype != torch.int64:
        raise ValueError(f"target dtype must be int64, got {target.dtype}")
    if target.device != hidden.device:
        raise ValueError(f"target must be on hidden's device {hidden.device}, got {target.device}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= weight.shape[0]:
        raise ValueError(f"vocab must be an int in [1, Vp={weight.shape[0]}] (weight's rows), got {vocab!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab: int | None = None,
    bias: torch.Tensor | None = None, ignore_index: int = -100, label_smoothing: float = 0.0,
    tie: EmbeddingTie | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of an LM head's logits ``(hidden @ weight.T + bias)[:, :vocab]`` against
    ``target``.

    ``hidden`` ``[N, H]``, ``weight`` ``[Vp, H]`` (``Vp >= vocab``; rows from ``vocab`` on are
    padding), ``bias`` ``[Vp]`` or None, ``target`` ``[N]`` int64; ``vocab`` defaults to ``Vp``.
    Returns an fp32 scalar equal to ``F.cross_entropy(logits.float(), target, ignore_index=...,
    label_smoothing=...)``; gradients flow to ``hidden``, ``weight`` and ``bias`` in their own
    dtypes, exactly zero on the padding rows. The Triton path (see the module docstring) runs when
    :func:`dslab.kernels.dispatch.use_triton` says so and the compute dtype (the autocast dtype
    under autocast, else ``hidden``'s) is fp16 or bf16; its extra memory is the ``[N, Vp]``
    gradient buffer in that dtype, held until the backward, and an fp32 ``[N]`` vector. Where
    Triton runs and the compute dtype is fp32, the logits are made and sliced as in the reference
    and :func:`dslab.kernels.loss.cross_entropy.softmax_cross_entropy` takes them. Otherwise
    :func:`linear_cross_entropy_reference` runs.

    ``tie``: an :class:`~dslab.kernels.embedding.embedding.EmbeddingTie` armed for ``weight`` (a head tied
    to the token embeddings), whose lookup's backward then writes ``weight``'s gradient, this
    head's included (see the module docstring).
    """
    if vocab is None and weight.dim() == 2:
        vocab = weight.shape[0]
    _check_inputs(hidden, weight, target, vocab, bias, label_smoothing)
    if tie is not None and tie.weight is not weight:
        raise ValueError("tie was armed for another weight than this head's")
    dtype = _compute_dtype(hidden)
    if not (dtype in (*_TRITON_DTYPES, torch.float32) and use_triton(hidden, weight, bias, target)):
        head = weight if tie is None else tie.head_weight()
        return linear_cross_entropy_reference(hidden, head, target, vocab, bias, ignore_index, label_smoothing)
    if dtype == torch.float32:
        logits = F.linear(hidden, weight if tie is None else tie.head_weight(), bias)
        logits = logits[:, :vocab] if vocab < logits.shape[-1] else logits
        return softmax_cross_entropy(logits, target, ignore_index, label_smoothing)
    hidden = hidden.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    if tie is not None:
        return _TiedForward.apply(hidden, weight, bias, target, vocab, int(ignore_index), float(label_smoothing), tie)
    loss, _ = _forward_op(hidden, weight.to(dtype), bias, target, vocab, int(ignore_index), float(label_smoothing))
    return loss
