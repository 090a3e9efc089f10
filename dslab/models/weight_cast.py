"""Many fp32 weights cast to the autocast dtype in one pass per forward, their gradients back in one.

Under autocast each Linear casts its fp32 weight to bf16 (or fp16) when it runs, one
``aten::_to_copy`` kernel per weight, and its backward's bf16 weight gradient is cast back to
fp32, one more kernel per weight. Each moves a few hundred KiB: the kernels are launch-sized (about
2 us each on an H100/H200). The Evoformer's dslab set at AlphaFold's initial crop (4 blocks,
~90 weight matrices) ran about 180 of them per training step, with the cuBLAS split-K reductions
that bf16 weight gradients of tall-skinny products bring, ~0.9 ms of a 22.7 ms step on an H200.

:func:`cast_weights` joins them: the weights are concatenated into one fp32 buffer and cast to one
buffer of the autocast dtype (two kernels), each weight's cast a view of it; in the backward the
views' gradients are concatenated and cast to fp32 (two kernels), each weight's gradient a view of
that buffer. The values are the ones the per-weight casts give (the same rounding of the same
numbers both ways), so the model trains to the same parameters.

A module reads its weight through :func:`weight` (``F.linear(x, weight(self.linear.weight))``),
which returns the cast view inside a :func:`cast_weights` scope and the parameter itself outside
one, so the same module code runs with and without it. A weight whose consumer accumulates its
gradient in fp32 and takes an fp32 weight directly (a kernel with master-weight support) should
stay out of the scope: its gradient would otherwise be rounded to the autocast dtype first.

The same lookup serves the engine's bf16 weight copies (:mod:`dslab.engine.weight_copies`): there
the scope maps each parameter to a persistent bf16 leaf that the optimizer rewrites every step,
so nothing is cast at all. A module says which of its own parameters it reads only through
:func:`weight` in a class attribute (``_read_through_weight``, :data:`READ_THROUGH`);
:class:`Linear` is ``nn.Linear`` doing so, and :func:`weights_read_through` collects a model's.
Outside every scope :func:`weight` is one global read, which ``torch.compile`` traces without a
graph break.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["cast_weights", "use_casts", "weight", "autocast_dtype", "Linear", "linear", "linear_saves_weights",
           "weights_read_through", "READ_THROUGH"]

_local = threading.local()


# Scopes open in any thread: while none is, weight() returns its argument without touching the
# thread-local list, a plain global read that torch.compile traces (and guards on) without a break.
_open_scopes = 0


def _scopes() -> list[dict[int, torch.Tensor]]:
    scopes = getattr(_local, "scopes", None)
    if scopes is None:
        scopes = _local.scopes = []
    return scopes


def weight(param: torch.Tensor | None) -> torch.Tensor | None:
    """``param``'s cast in the innermost :func:`cast_weights` / :func:`use_casts` scope that holds
    it, else ``param`` itself (None stays None)."""
    if _open_scopes == 0 or param is None:
        return param
    for scope in reversed(_scopes()):
        cast = scope.get(id(param))
        if cast is not None:
            return cast
    return param


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The 16-bit dtype autocast casts to on ``device_type``, or None when autocast is off there
    or casts to another dtype."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


class _FlatCast(torch.autograd.Function):
    """``weights`` cast to ``dtype`` as views of one buffer; gradients cast back through one."""

    @staticmethod
    def forward(ctx, dtype, *weights):
        ctx.shapes = [w.shape for w in weights]
        ctx.numels = [w.numel() for w in weights]
        ctx.source_dtype = weights[0].dtype
        ctx.set_materialize_grads(False)  # an unused cast gives its weight no gradient, not zeros
        flat = torch.cat([w.detach().reshape(-1) for w in weights]).to(dtype)
        return tuple(part.view(shape) for part, shape in zip(flat.split(ctx.numels), ctx.shapes))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        if not present:
            return (None, *([None] * len(grads)))
        dtype = present[0].dtype
        parts = [g.reshape(-1).to(dtype) if g is not None else present[0].new_zeros(n)
                 for g, n in zip(grads, ctx.numels)]
        flat = torch.cat(parts).to(ctx.source_dtype)
        out = [part.view(shape) if g is not None else None
               for part, shape, g in zip(flat.split(ctx.numels), ctx.shapes, grads)]
        return (None, *out)


@contextlib.contextmanager
def use_casts(casts: dict[int, torch.Tensor]) -> Iterator[dict[int, torch.Tensor]]:
    """Make ``casts`` (``id(param) -> cast``, from :func:`cast_weights`) what :func:`weight`
    returns inside the block: for code that runs again later, such as an activation
    checkpoint's recomputation, which must see the same casts as the first run."""
    global _open_scopes
    scopes = _scopes()
    scopes.append(casts)
    _open_scopes += 1
    try:
        yield casts
    finally:
        _open_scopes -= 1
        scopes.pop()


@contextlib.contextmanager
def cast_weights(params: Iterable[torch.Tensor], dtype: torch.dtype | None) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, :func:`weight` returns each fp32 parameter of ``params`` cast to
    ``dtype`` (all cast together, see the module docstring); yields the ``id -> cast`` mapping
    (for :func:`use_casts`). With ``dtype`` None, or no fp32 parameter, nothing is cast and
    :func:`weight` returns the parameters."""
    params = [p for p in params if p.dtype == torch.float32 and p.numel() > 0]
    if dtype is None or dtype == torch.float32 or not params:
        yield {}
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        by_device.setdefault(p.device, []).append(p)
    casts: dict[int, torch.Tensor] = {}
    for group in by_device.values():
        for p, cast in zip(group, _FlatCast.apply(dtype, *group)):
            casts[id(p)] = cast
    with use_casts(casts):
        yield casts


# The attribute a module sets to the names of its own parameters that its forward reads only
# through weight(): the parameters a copies scope (dslab.engine.weight_copies) may stand in for.
READ_THROUGH = "_read_through_weight"


class _LinearSavingWeight(torch.autograd.Function):
    """``F.linear`` whose backward keeps the weight tensor it was given (the parameter itself),
    not a view of it: see :func:`linear_saves_weights`."""

    @staticmethod
    def forward(ctx, input, weight_, bias):
        out = F.linear(input, weight_, bias)  # under autocast: in the autocast dtype
        # the input as the product saw it (autocast casts it), the weight as given
        ctx.save_for_backward(input.to(out.dtype), weight_)
        ctx.input_dtype = input.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        input, weight_ = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad.matmul(weight_.to(grad.dtype)).to(ctx.input_dtype)
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = flat.t().matmul(input.reshape(-1, input.shape[-1])).to(weight_.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = flat.sum(0).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias


# Open linear_saves_weights() blocks (in any thread): while none is, linear() is F.linear.
_saving_weights = 0


@contextlib.contextmanager
def linear_saves_weights() -> Iterator[None]:
    """Within the block, :func:`linear` (every :class:`Linear`'s forward) keeps its weight
    parameter itself for the backward instead of ``F.linear``'s view of it (``weight.t()``).

    For ZeRO stage 3 (:mod:`dslab.engine.zero.stage3_stack`): a gathered weight is a parameter
    bound to a buffer that is freed after the layer's forward and gathered again for its
    backward. A view saved by ``F.linear`` would keep the first buffer alive until the backward;
    the parameter itself sees the buffer it is bound to when the backward runs. The gradients are
    the same products ``F.linear``'s backward computes."""
    global _saving_weights
    _saving_weights += 1
    try:
        yield
    finally:
        _saving_weights -= 1


def linear(input: torch.Tensor, weight_: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or inside :func:`linear_saves_weights` its twin that saves ``weight_`` itself."""
    if _saving_weights and torch.is_grad_enabled() and weight_.requires_grad:
        return _LinearSavingWeight.apply(input, weight_, bias)
    return F.linear(input, weight_, bias)


class Linear(nn.Linear):
    """``nn.Linear`` reading its weight and bias through :func:`weight`: the module parameters
    outside any scope, their casts or copies inside one. Same parameters, state dict and
    initialisation as ``nn.Linear``."""

    _read_through_weight = ("weight", "bias")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, weight(self.weight), weight(self.bias))


def weights_read_through(module: nn.Module) -> list[nn.Parameter]:
    """The parameters that ``module``'s submodules declare (in ``READ_THROUGH``) they read only
    through :func:`weight`, each once, in module order; those that do not require a gradient
    are left out."""
    found: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name in getattr(type(sub), READ_THROUGH, ()):
            param = getattr(sub, name, None)
            if isinstance(param, nn.Parameter) and param.requires_grad:
                found.setdefault(id(param), param)
    return list(found.values())
