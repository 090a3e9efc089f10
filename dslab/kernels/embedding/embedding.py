"""Embedding lookup with a deterministic weight gradient, and the tie that folds a tied head's
gradient into it.

    y = weight[ids]                               weight [V, H], ids [...] -> y [..., H]
    d weight[v] = head(v) + sum_{i : ids[i] == v} dy[i]

``head(v)`` is the gradient a head reading the same matrix (a tied LM head or MLM decoder) sends
back, or 0 (the kernel and its traffic: :mod:`dslab.kernels.embedding.embedding_triton`).

Why: under autocast a tied head's weight gradient comes back in bf16 ``[V, H]``, is scaled (for
the fused :func:`~dslab.kernels.loss.linear_cross_entropy.linear_cross_entropy`), cast to fp32 by
autograd, and added by autograd's engine to the lookup's dense fp32 gradient, which
``embedding_dense_backward`` made with a sort, a zero fill of ``[V, H]`` and a scatter. At
GPT-2 124M (16384 tokens, 50304 x 768) on an H200 that is a 40 us scale, a 54 us cast, ~350 us of
embedding backward (token and position tables) and a 106 us add per step. Here the lookup's
backward writes the fp32 gradient once, head included; the position tables are read as
``weight[:seq]`` by the models (their gradient a sum over the batch).

The tie (:class:`EmbeddingTie`), one per forward: the model arms it for the embedding matrix
(:meth:`EmbeddingTie.arm`), the lookup records itself on it (:func:`embedding`), and the head
reads the matrix through it (:meth:`EmbeddingTie.head_weight`, or the fused loss's ``tie``
argument). Autograd runs the head's backward before the lookup's (the lookup's output gradient
depends on the head's input gradient). The head's backward *offers* its gradient to the tie and,
when the tie takes it, returns None for the matrix (so autograd neither casts nor adds it); the
lookup's backward takes the offer (if any) and writes the combined gradient. The tie takes an
offer only while the lookup's backward is still to run in the same backward pass (autograd's
``_will_engine_execute_node``) and has not run yet, and at most one offer: otherwise the head
returns its gradient and autograd adds it as usual. The lookup's first backward closes the tie:
a second backward through a retained graph takes the plain path, and an offer never outlives its
forward's graph. Gradient accumulation is autograd's: the lookup returns the combined gradient
and ``AccumulateGrad`` adds it to ``.grad``.

Arithmetic: ``head(v)`` is what autograd would have added, ``float(head_grad)`` or, with the
fused loss's scale ``g``, ``float(round(head_grad * g))`` rounded to the head gradient's dtype as
``head_grad * g`` rounds in PyTorch; so the result equals autocast's up to the fp32 summation
order of the segment sums.

Layers: :func:`embedding_grad_reference` (``index_add_``) → the ``dslab::embedding_backward``
custom op (under ``torch.compile`` and dispatch modes) or a direct launch → the Triton kernels.
:func:`embedding_grad` picks with :func:`dslab.kernels.dispatch.use_triton` (the reference on CPU
without the interpreter, for fp64, and on the ``torch`` backend).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def embedding_grad_reference(
    ids: torch.Tensor, grad_rows: torch.Tensor, num_rows: int, out_dtype: torch.dtype,
    head_grad: torch.Tensor | None = None, head_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch reference: ``index_add_`` of the rows in token order into fp32 zeros (fp64
    for fp64 inputs), then ``head_grad`` (times ``head_scale``, in ``head_grad``'s dtype) added,
    in ``out_dtype``. On CPU the sums run in token order; on CUDA ``index_add_`` uses atomics."""
    wide = torch.float64 if torch.float64 in (grad_rows.dtype, out_dtype) else torch.float32
    grad = torch.zeros((num_rows, grad_rows.shape[1]), dtype=wide, device=grad_rows.device)
    grad.index_add_(0, ids, grad_rows.to(wide))
    if head_grad is not None:
        head = head_grad if head_scale is None else head_grad * head_scale
        grad = head.to(wide) + grad
    return grad.to(out_dtype)


@torch.library.custom_op("dslab::embedding_backward", mutates_args=())
def _embedding_backward_op(
    ids: torch.Tensor, grad_rows: torch.Tensor, num_rows: int, out_dtype: torch.dtype,
    head_grad: torch.Tensor | None, head_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The ``[num_rows, H]`` weight gradient of a lookup of ``ids`` ``[N]``, ``grad_rows`` ``[N, H]``."""
    from dslab.kernels.embedding import embedding_triton

    return embedding_triton.embedding_grad(ids, grad_rows, num_rows, out_dtype, head_grad, head_scale)


@_embedding_backward_op.register_fake
def _(ids, grad_rows, num_rows, out_dtype, head_grad, head_scale):
    return grad_rows.new_empty((num_rows, grad_rows.shape[1]), dtype=out_dtype)


def _check_grad_inputs(ids, grad_rows, num_rows, out_dtype, head_grad, head_scale) -> None:
    if ids.dim() != 1 or ids.dtype not in _INDEX_DTYPES:
        raise ValueError(f"ids must be a 1-D int32 or int64 tensor, got shape {tuple(ids.shape)} and {ids.dtype}")
    if grad_rows.dim() != 2 or grad_rows.shape[0] != ids.shape[0]:
        raise ValueError(f"grad_rows must be [N, H] with N={ids.shape[0]} (ids'), got shape {tuple(grad_rows.shape)}")
    if grad_rows.dtype not in _FLOATS:
        raise ValueError(f"grad_rows dtype must be float32, float64, float16 or bfloat16, got {grad_rows.dtype}")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
        raise ValueError(f"num_rows must be a positive int, got {num_rows!r}")
    if out_dtype not in _FLOATS:
        raise ValueError(f"out_dtype must be float32, float64, float16 or bfloat16, got {out_dtype}")
    if head_grad is not None:
        if tuple(head_grad.shape) != (num_rows, grad_rows.shape[1]) or head_grad.dtype not in _FLOATS:
            raise ValueError(f"head_grad must be a float [{num_rows}, {grad_rows.shape[1]}] tensor (num_rows, H), "
                             f"got shape {tuple(head_grad.shape)} and {head_grad.dtype}")
    if head_scale is not None and (head_grad is None or head_scale.numel() != 1 or head_scale.dtype not in _FLOATS):
        raise ValueError("head_scale must be a float tensor of one element, given with head_grad")
    for name, t in (("grad_rows", grad_rows), ("head_grad", head_grad), ("head_scale", head_scale)):
        if t is not None and t.device != ids.device:
            raise ValueError(f"{name} must be on ids' device {ids.device}, got {t.device}")


def embedding_grad(
    ids: torch.Tensor, grad_rows: torch.Tensor, num_rows: int, out_dtype: torch.dtype | None = None,
    head_grad: torch.Tensor | None = None, head_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight gradient ``[num_rows, H]`` of a lookup of ``ids`` ``[N]`` (int32 or int64) whose
    output gradient is ``grad_rows`` ``[N, H]``: row ``v`` is ``head(v)`` plus the fp32 sum of the
    rows whose id is ``v`` (see the module docstring for ``head_grad`` ``[num_rows, H]`` and the
    one-element ``head_scale``), in ``out_dtype`` (default ``grad_rows``' dtype). Not
    differentiable (it serves backward passes).

    The Triton kernels (CUDA tensors, or the ``triton`` backend under the interpreter; fp32/fp16/
    bf16) are deterministic and make no host synchronisation; they ignore ids outside
    ``[0, num_rows)``. The reference runs otherwise and refuses such ids (a ValueError naming
    ``ids``, after reading them on the host).
    """
    out_dtype = out_dtype or grad_rows.dtype
    _check_grad_inputs(ids, grad_rows, num_rows, out_dtype, head_grad, head_scale)
    dtypes = {grad_rows.dtype, out_dtype} | ({head_grad.dtype} if head_grad is not None else set())
    if (ids.numel() == 0 or grad_rows.shape[1] == 0 or not dtypes <= set(_TRITON_DTYPES)
            or not use_triton(ids, grad_rows, head_grad, head_scale)):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
            raise ValueError(f"ids must lie in [0, num_rows={num_rows}), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        return embedding_grad_reference(ids, grad_rows, num_rows, out_dtype, head_grad, head_scale)
    if use_custom_op():
        return _embedding_backward_op(ids, grad_rows, num_rows, out_dtype, head_grad, head_scale)
    from dslab.kernels.embedding import embedding_triton

    return embedding_triton.embedding_grad(ids, grad_rows, num_rows, out_dtype, head_grad, head_scale)


# ---------------------------------------------------------------------------------------------
# The tie and the two autograd functions that meet on it.
# ---------------------------------------------------------------------------------------------


def _head_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would read ``weight`` in: autocast's for weight's device type while
    autocast is on there (for the floating dtypes it casts), else weight's own."""
    device = weight.device.type
    if weight.dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class EmbeddingTie:
    """One forward's tie between an embedding matrix ``weight`` and a head that reads it (see the
    module docstring). Made by :meth:`arm`; read by :func:`embedding` (the lookup) and
    :meth:`head_weight` or ``linear_cross_entropy(..., tie=)`` (the head)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self._lookup = None  # the lookup's backward node, held weakly: that node holds this tie
        self._offer: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._closed = False

    @classmethod
    def arm(cls, weight: torch.Tensor) -> EmbeddingTie | None:
        """A tie for ``weight``, or None where the plain path must run: grad mode off, ``weight``
        not requiring a gradient, or ``torch.compile`` tracing."""
        if not (torch.is_grad_enabled() and weight.requires_grad) or torch.compiler.is_compiling():
            return None
        return cls(weight)

    def head_weight(self) -> torch.Tensor:
        """``weight`` in the dtype ``F.linear`` would compute in (autocast's, else its own), whose
        gradient is offered to the lookup's backward."""
        return _HeadRead.apply(self.weight, _head_dtype(self.weight), self)

    def offer(self, grad: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
        """Hand the head's gradient ``grad`` ``[V, H]`` (times ``scale``, a one-element tensor,
        if given) to the lookup's backward. True when the tie took it: the caller then returns no
        gradient for the matrix; False when the lookup's backward is not to run in this pass, has
        run, or already holds an offer, and outside autograd's engine: the caller then returns its
        gradient as usual."""
        node = None if self._lookup is None else self._lookup()
        if self._closed or self._offer is not None or node is None or torch._C._current_graph_task_id() == -1:
            return False
        if not torch._C._will_engine_execute_node(node):  # the query register_multi_grad_hook makes
            return False
        self._offer = (grad, scale)
        return True

    def _record_lookup(self, output: torch.Tensor) -> None:
        if output.grad_fn is not None and self._lookup is None:
            self._lookup = weakref.ref(output.grad_fn)

    def _take(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        offer, self._offer, self._closed = self._offer, None, True
        return offer


class _HeadRead(torch.autograd.Function):
    """``weight`` cast to ``dtype`` (itself when it has that dtype); the backward offers its
    gradient to the tie and returns it (cast to ``weight``'s dtype) only when the tie refuses."""

    @staticmethod
    def forward(ctx, weight, dtype, tie):
        ctx.tie, ctx.weight_dtype = tie, weight.dtype
        return weight if weight.dtype == dtype else weight.to(dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        if ctx.tie.offer(grad):
            return None, None, None
        return grad.to(ctx.weight_dtype), None, None


class _Lookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward is :func:`embedding_grad`, with the tie's offer
    folded in."""

    @staticmethod
    def forward(ctx, weight, ids, tie):
        ctx.save_for_backward(ids)
        ctx.num_rows, ctx.weight_dtype, ctx.tie = weight.shape[0], weight.dtype, tie
        return F.embedding(ids, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        offer = None if ctx.tie is None else ctx.tie._take()
        head_grad, head_scale = offer if offer is not None else (None, None)
        rows = grad.reshape(-1, grad.shape[-1])
        return embedding_grad(ids.reshape(-1), rows, ctx.num_rows, ctx.weight_dtype, head_grad, head_scale), None, None


def embedding(weight: torch.Tensor, ids: torch.Tensor, tie: EmbeddingTie | None = None) -> torch.Tensor:
    """``F.embedding(ids, weight)``: ``weight`` ``[V, H]``, ``ids`` of any shape (int32 or int64)
    -> ``[*ids.shape, H]`` in weight's dtype. Its weight gradient comes from :func:`embedding_grad`
    (deterministic on the Triton path) and includes the offer of ``tie`` (made by
    :meth:`EmbeddingTie.arm` for this ``weight``), if any. Without autograd (grad mode off or a
    weight that needs no gradient) and under ``torch.compile``, plain ``F.embedding``."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    if ids.dtype not in _INDEX_DTYPES:
        raise ValueError(f"ids dtype must be int32 or int64, got {ids.dtype}")
    if tie is not None and tie.weight is not weight:
        raise ValueError("tie was armed for another weight than this lookup's")
    if not (torch.is_grad_enabled() and weight.requires_grad) or torch.compiler.is_compiling():
        return F.embedding(ids, weight)
    out = _Lookup.apply(weight, ids, tie)
    if tie is not None:
        tie._record_lookup(out)
    return out
