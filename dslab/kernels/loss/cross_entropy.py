"""Softmax cross-entropy over a large vocabulary, fused forward and backward.

For logits ``x`` of shape ``[N, V]``, targets ``t`` of shape ``[N]`` and label smoothing ``eps``,
row ``i`` (with ``lse_i = log(sum_j exp(x_ij))``) contributes

    loss_i = lse_i - (1 - eps) * x_i,t_i - (eps / V) * sum_j x_ij

which is PyTorch's ``(1 - eps) * nll + eps * smooth`` with ``smooth = -mean_j log_softmax(x)_ij``.
The result is ``sum_i loss_i / n_valid`` over rows whose target is not ``ignore_index``
(``F.cross_entropy(..., reduction="mean")``; all rows ignored gives 0/0 = nan, as PyTorch).
The gradient is ``d loss / d x_ij = (softmax(x)_ij - (1 - eps) [j == t_i] - eps / V) * g / n_valid``
for ``g`` the incoming gradient, and zero on ignored rows.

Memory: no ``[N, V]`` fp32 tensor is ever made. The forward kernel streams each row once in
``BLOCK``-wide chunks, keeping for each segment of 16 contiguous logits an online maximum and a
rescaled sum of exponentials in fp32 (so no block-wide reduction runs inside the loop), and saves
only ``lse`` (fp32 ``[N]``). The backward kernel reads each row once more, recomputes
``softmax = exp(x - lse)`` and writes the gradient in the logits' dtype. Traffic for bf16 logits:
forward reads ``2 N V`` bytes, backward reads ``2 N V`` and writes ``2 N V`` (4.9 GB at
16384 x 50304, ~1.2 ms at 4.2 TB/s). Ignored rows are not read at all.

A target outside ``[0, V)`` that is not ``ignore_index`` makes that row's loss (hence the mean)
and its gradient row nan on the Triton path, where checking it would need a device sync; the
reference raises as ``F.cross_entropy`` does.
"""

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import interpreting, use_triton

from dslab.kernels._triton_compat import cast_rounding as _cast
from dslab.kernels._triton_compat import jit as _jit
from dslab.kernels._triton_compat import tl, triton


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SEGMENT = 16  # the forward's online max/sum runs per segment of this many contiguous logits


def cross_entropy_reference(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0
) -> torch.Tensor:
    """The PyTorch reference: ``F.cross_entropy`` on fp32-upcast logits (an fp32 ``[N, V]`` copy)."""
    return F.cross_entropy(
        logits.float(), target, ignore_index=ignore_index, label_smoothing=label_smoothing
    )


# ---------------------------------------------------------------------------------------------
# Triton kernels: one program per row, the row streamed in BLOCK-wide chunks.
# ---------------------------------------------------------------------------------------------


@_jit
def _load_chunk(ptr, cols, limit, MASKED: tl.constexpr):
    """fp32 values at ``ptr + cols``; lanes at or past ``limit`` read -inf when ``MASKED``."""
    if MASKED:
        x = tl.load(ptr + cols, mask=cols < limit, other=float("-inf")).to(tl.float32)
    else:
        x = tl.load(ptr + cols).to(tl.float32)
    return x


@_jit
def _online_chunk(x, segment_max, segment_sum):
    """Fold a chunk ``x`` [segments, SEGMENT] into each segment's running max and sum of exp(x - max).

    Each segment's values sit in one or two threads, so the loop needs no block-wide reduction
    (and no barrier): warps stream their own chunks. One extra exp per segment per chunk.
    """
    new_max = tl.maximum(segment_max, tl.max(x, axis=1))
    # A leading all -inf stretch keeps the max at -inf; shifting by 0 then avoids -inf - -inf.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    segment_sum = segment_sum * tl.exp(segment_max - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
    return new_max, segment_sum


@_jit
def _forward_kernel(
    logits_ptr, row_stride, target_ptr, row_loss_ptr, lse_ptr, vocab, ignore_index, label_smoothing,
    BLOCK: tl.constexpr, SEGMENT: tl.constexpr, SMOOTH: tl.constexpr,
):
    """Row ``pid``: ``lse`` and ``loss_i`` (see the module docstring); 0 and 0 on ignored rows.

    Reads the row once (``V`` elements) as chunks of ``BLOCK`` = segments x ``SEGMENT``; writes two
    fp32 scalars.
    """
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    if target == ignore_index:
        tl.store(row_loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
    else:
        row_ptr = logits_ptr + row * row_stride
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
        loss = tl.where(in_range, loss, float("nan"))
        tl.store(row_loss_ptr + row, loss)
        tl.store(lse_ptr + row, tl.where(in_range, lse, float("nan")))


@_jit
def _grad_chunk(x_ptr, grad_ptr, cols, limit, target, lse, scale, label_smoothing, vocab,
                SMOOTH: tl.constexpr, MASKED: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """grad = (exp(x - lse) - (1 - eps) [col == t] - eps / V) * scale for one chunk."""
    x = _load_chunk(x_ptr, cols, limit, MASKED)
    grad = tl.exp(x - lse)
    if SMOOTH:
        grad -= label_smoothing / vocab
    grad = tl.where(cols == target, grad - (1.0 - label_smoothing), grad) * scale
    grad = _cast(grad, grad_ptr.dtype.element_ty, BF16_BY_HAND)
    if MASKED:
        tl.store(grad_ptr + cols, grad, mask=cols < limit)
    else:
        tl.store(grad_ptr + cols, grad)


@_jit
def _backward_kernel(
    logits_ptr, row_stride, grad_ptr, target_ptr, lse_ptr, scale_ptr, vocab, ignore_index, label_smoothing,
    BLOCK: tl.constexpr, SMOOTH: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """Row ``pid`` of the gradient (contiguous, logits' dtype); ``scale_ptr`` holds g / n_valid.

    Reads the row once and writes it once; an ignored row is only written (zeros).
    """
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    grad_row = grad_ptr + row * vocab
    cols = tl.arange(0, BLOCK)
    if target == ignore_index:
        zeros = tl.zeros([BLOCK], grad_ptr.dtype.element_ty)
        for start in range(0, vocab, BLOCK):
            tl.store(grad_row + start + cols, zeros, mask=cols < vocab - start)
    else:
        row_ptr = logits_ptr + row * row_stride
        lse = tl.load(lse_ptr + row)
        scale = tl.load(scale_ptr)
        full_end = (vocab // BLOCK) * BLOCK
        for start in range(0, full_end, BLOCK):
            _grad_chunk(row_ptr + start, grad_row + start, cols, BLOCK, target - start, lse, scale,
                        label_smoothing, vocab, SMOOTH, MASKED=False, BF16_BY_HAND=BF16_BY_HAND)
        if full_end < vocab:
            _grad_chunk(row_ptr + full_end, grad_row + full_end, cols, vocab - full_end, target - full_end,
                        lse, scale, label_smoothing, vocab, SMOOTH, MASKED=True, BF16_BY_HAND=BF16_BY_HAND)


def _launch_config(vocab: int, backward: bool) -> tuple[int, int]:
    """(BLOCK, num_warps). At 8192 logits per chunk, compiled for sm_90, the forward (8 warps)
    needs ~40 registers a thread: 6 CTAs and 96 KB of bf16 logits in flight per SM; the backward
    (16 warps) ~40: 3 CTAs, 48 KB. Under the interpreter a small block, so that the tests' rows
    span several chunks and a masked tail."""
    if interpreting():
        return 128, 4
    block = max(_SEGMENT, min(8192, triton.next_power_of_2(vocab)))
    return block, 16 if backward and block >= 4096 else 8


def _kernel_layout(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with unit column stride (any row stride) and contiguous targets; copies only if not."""
    return (logits if logits.stride(1) == 1 else logits.contiguous()), target.contiguous()


def cross_entropy_forward_triton(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss: fp32 scalar, lse: fp32 [N]). Allocates 2 fp32 [N] tensors and scalars only."""
    logits, target = _kernel_layout(logits, target)
    n_rows, vocab = logits.shape
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows > 0:
        block, num_warps = _launch_config(vocab, backward=False)
        _forward_kernel[(n_rows,)](
            logits, logits.stride(0), target, row_loss, lse, vocab, ignore_index, float(label_smoothing),
            BLOCK=block, SEGMENT=_SEGMENT, SMOOTH=label_smoothing > 0.0, num_warps=num_warps,
        )
    n_valid = (target != ignore_index).sum()
    return row_loss.sum() / n_valid, lse


def cross_entropy_backward_triton(
    grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
    ignore_index: int, label_smoothing: float,
) -> torch.Tensor:
    """d loss / d logits: a contiguous [N, V] tensor in the logits' dtype (the only large buffer)."""
    logits, target = _kernel_layout(logits, target)
    n_rows, vocab = logits.shape
    grad = torch.empty((n_rows, vocab), dtype=logits.dtype, device=logits.device)
    if n_rows > 0:
        n_valid = (target != ignore_index).sum()
        scale = grad_loss.to(torch.float32) / n_valid
        block, num_warps = _launch_config(vocab, backward=True)
        _backward_kernel[(n_rows,)](
            logits, logits.stride(0), grad, target, lse, scale, vocab, ignore_index, float(label_smoothing),
            BLOCK=block, SMOOTH=label_smoothing > 0.0,
            BF16_BY_HAND=interpreting() and logits.dtype == torch.bfloat16, num_warps=num_warps,
        )
    return grad


# ---------------------------------------------------------------------------------------------
# Custom ops, so that torch.compile treats the kernels as opaque calls with known output shapes.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("dslab::cross_entropy_forward", mutates_args=())
def _forward_op(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_forward_triton(logits, target, ignore_index, label_smoothing)


@_forward_op.register_fake
def _forward_fake(logits, target, ignore_index, label_smoothing):
    loss = logits.new_empty((), dtype=torch.float32)
    return loss, logits.new_empty((logits.shape[0],), dtype=torch.float32)


@torch.library.custom_op("dslab::cross_entropy_backward", mutates_args=())
def _backward_op(
    grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
    ignore_index: int, label_smoothing: float,
) -> torch.Tensor:
    return cross_entropy_backward_triton(grad_loss, logits, target, lse, ignore_index, label_smoothing)


@_backward_op.register_fake
def _backward_fake(grad_loss, logits, target, lse, ignore_index, label_smoothing):
    return logits.new_empty(logits.shape)


def _setup_context(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing = inputs
    _, lse = output
    ctx.save_for_backward(logits, target, lse)
    ctx.ignore_index = ignore_index
    ctx.label_smoothing = label_smoothing
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_loss, grad_lse):
    logits, target, lse = ctx.saved_tensors
    grad = _backward_op(grad_loss, logits, target, lse, ctx.ignore_index, ctx.label_smoothing)
    return grad, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"logits dtype must be float32, float16 or bfloat16, got {logits.dtype}")
    if target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(f"target must be [N] with N={logits.shape[0]}, got shape {tuple(target.shape)}")
    if target.dtype != torch.int64:
        raise ValueError(f"target dtype must be int64, got {target.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def softmax_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [N, V] (fp32/fp16/bf16) against ``target`` [N] (int64).

    Returns an fp32 scalar equal to ``F.cross_entropy(logits.float(), target, ignore_index=...,
    label_smoothing=...)``; its gradient flows to ``logits`` in their dtype. On the Triton path
    the extra memory is two fp32 ``[N]`` vectors in the forward and the ``[N, V]`` gradient
    (logits' dtype) in the backward.
    """
    _check_inputs(logits, target, label_smoothing)
    if use_triton(logits, target):
        loss, _ = _forward_op(logits, target, int(ignore_index), float(label_smoothing))
        return loss
    return cross_entropy_reference(logits, target, ignore_index, label_smoothing)
