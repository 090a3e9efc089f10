"""The wrapped module's parameters as the engine's optimizer step uses them, and clipping by the
global gradient norm.

Every optimizer step needs the module's parameters: their gradients are unscaled (fp16), clipped
and cleared. ``module.parameters()`` walks the module tree through nested generators and a
de-duplicating set; for BERT-large (227 modules, 302 parameter tensors) one walk costs ~0.2 ms of
host time on a CPU core. :class:`ModuleParameters` keeps the list and re-checks, in C-level loops
(~25 us for BERT-large), that the tree it came from is unchanged.

:func:`clip_grad_norm_` is ``torch.nn.utils.clip_grad_norm_`` (L2 norm) issuing the same kernels on
the same tensors, so its results are bitwise the same, with half the host work: the gradients are
grouped by device and dtype once instead of twice, and the per-tensor Python checks and copies of
torch's function are gone. :func:`clipped_step` goes one further with torch's fused Adam/AdamW: the
optimizer's kernel divides each gradient by the clipping scale as it reads it.
"""

from __future__ import annotations

import itertools
import operator

import torch
import torch.nn as nn
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _foreach_supported_types,
    _group_tensors_by_device_and_dtype,
)

from dslab import comm
from dslab.kernels.optim.fused_adam import FusedAdam

# The nn.Module methods module.parameters() goes through; a tree whose classes override one of
# them is walked on every call instead of being cached.
_WALK_METHODS = ("parameters", "named_parameters", "_named_members")
_TREE_METHODS = ("named_modules",)


def _default_walk(modules: list[nn.Module]) -> bool:
    """True when ``modules[0].parameters()`` is nn.Module's walk over ``modules``' dicts."""
    root = type(modules[0])
    if any(getattr(root, name) is not getattr(nn.Module, name) for name in _WALK_METHODS):
        return False
    return all(getattr(type(m), name) is getattr(nn.Module, name)
               for m in modules for name in _TREE_METHODS)


class ModuleParameters:
    """``list(module.parameters())``, kept between calls while the module tree is unchanged.

    The list is rebuilt when a module of the tree gained, lost or replaced a parameter or a
    submodule: every call compares, object by object, the values of each ``_parameters`` and
    ``_modules`` dict of the tree with what they held when the list was built. Every torch API
    that changes a module's parameters or children edits those dicts in place (attribute
    assignment, ``register_parameter``, ``add_module``, ``del module.weight``,
    ``load_state_dict(assign=True)``, ``ModuleList.insert`` / ``del``, ``nn.Module.to`` where it
    makes new Parameters), so the next call sees it. What keeps the Parameter objects
    (``load_state_dict``'s in-place copies, ``p.data = ...``, ``requires_grad_``) keeps the list, as
    it keeps ``module.parameters()``.

    A tree with a class that overrides how ``parameters()`` walks it (``parameters``,
    ``named_parameters``, ``_named_members`` on the root, ``named_modules`` anywhere) is walked on
    every call.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.rebuilds = 0
        self._params: list[nn.Parameter] | None = None
        self._cacheable = True
        self._dicts: list[dict] = []
        self._views: list = []
        self._slots: list = []

    def __call__(self) -> list[nn.Parameter]:
        """The module's parameters, each once, in ``module.parameters()``'s order. The list is
        shared between calls: do not modify it."""
        if self._params is None or not self._cacheable or not self._unchanged():
            self._build()
        return self._params

    def invalidate(self) -> None:
        """Rebuild the list at the next call."""
        self._params = None

    def _unchanged(self) -> bool:
        return (sum(map(len, self._dicts)) == len(self._slots)
                and all(map(operator.is_, itertools.chain.from_iterable(self._views), self._slots)))

    def _build(self) -> None:
        self.rebuilds += 1
        modules = list(self.module.modules())
        self._cacheable = _default_walk(modules)
        self._dicts = [d for m in modules for d in (m._modules, m._parameters)]
        self._views = [d.values() for d in self._dicts]
        self._slots = list(itertools.chain.from_iterable(self._views))
        self._params = list(self.module.parameters())


def grads_of(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of ``params`` that are not None, in order."""
    return [p.grad for p in params if p.grad is not None]


def clear_grads(params: list[nn.Parameter]) -> None:
    """``p.grad = None`` for each of ``params`` (``nn.Module.zero_grad(set_to_none=True)``)."""
    for p in params:
        if p.grad is not None:
            p.grad = None


def _grad_norm(params: list[nn.Parameter], fp32_norms: bool = False):
    """``(total L2 norm of the gradients, the gradients grouped by device and dtype)``, computed
    with the kernels of ``torch.nn.utils.clip_grad_norm_``; ``(None, None)`` when torch's function
    would leave its foreach path, ``(tensor(0.), {})`` when no parameter has a gradient.
    ``fp32_norms``: half-precision gradients' norms are summed in fp32 (torch's are bf16/fp16)."""
    grads = grads_of(params)
    if not grads:
        return torch.tensor(0.0), {}
    grouped = _group_tensors_by_device_and_dtype([grads])
    if not (set(map(type, grads)) <= set(_foreach_supported_types)
            and all(_device_has_foreach_support(device) for device, _ in grouped)):
        return None, None
    with torch.no_grad():
        norms = []
        for (_, dtype), ([device_grads], _) in grouped.items():
            low = fp32_norms and dtype in (torch.bfloat16, torch.float16)
            norms.extend(torch._foreach_norm(device_grads, 2.0, dtype=torch.float32) if low
                         else torch._foreach_norm(device_grads, 2.0))
        if len(grouped) > 1:
            first_device = grads[0].device
            norms = [norm.to(first_device) for norm in norms]
        return torch.linalg.vector_norm(torch.stack(norms), 2.0), grouped


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)``: scale the gradients of ``params`` in
    place by ``min(1, max_norm / (norm + 1e-6))``, with ``norm`` the L2 norm of all of them;
    returns ``norm`` (a 0-dim tensor; ``tensor(0.)`` when no parameter has a gradient).

    The same kernels as torch's function (``_foreach_norm`` per device and dtype, the norm of the
    stacked norms, ``_foreach_mul_`` by the clamped coefficient), so the gradients and the norm
    are bitwise the same, and no host synchronisation. Where torch's function would leave its
    foreach path (a device without foreach kernels, a gradient of a tensor subclass) it is
    called instead.
    """
    total_norm, grouped = _grad_norm(params)
    if total_norm is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    with torch.no_grad():
        if grouped:
            coefficient = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
            for (device, _), ([device_grads], _) in grouped.items():
                torch._foreach_mul_(device_grads, coefficient.to(device))
    return total_norm


def steps_with_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can divide the gradients by a device scalar on its own: torch's
    fused Adam or AdamW (their kernels read ``optimizer.grad_scale``, the hook ``GradScaler`` uses)
    or dslab's :class:`~dslab.kernels.optim.fused_adam.FusedAdam` (which reads the same attribute),
    not already given a scale by someone else."""
    torch_fused = (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
                   and getattr(optimizer, "_step_supports_amp_scaling", False)
                   and all(group.get("fused") for group in optimizer.param_groups))
    return ((torch_fused or isinstance(optimizer, FusedAdam))
            and getattr(optimizer, "grad_scale", None) is None
            and getattr(optimizer, "found_inf", None) is None)


def model_parallel_norm(params: list[nn.Parameter], groups: list, fp32_norms: bool = False) -> torch.Tensor:
    """The L2 norm of the gradients of ``params`` summed (as squares) over each process group of
    ``groups`` in turn: the whole model's gradient norm when each rank passes the parameters it
    counts (:class:`~dslab.engine.model_parallel.ModelParallelLayout`). A collective on every
    rank of the groups; a 0-dim fp32 tensor."""
    total, _ = _grad_norm(params, fp32_norms)
    if total is None:
        total = torch.nn.utils.get_total_norm(grads_of(params))
    device = next((p.grad.device for p in params if p.grad is not None), None)
    squared = total.float().square()
    if device is not None:
        squared = squared.to(device)
    for group in groups:
        comm.all_reduce(squared, group=group)
    return squared.sqrt()


def clipped_step(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float,
                 fp32_norms: bool = False, norm_params: list[nn.Parameter] | None = None,
                 norm_groups: list | None = None) -> torch.Tensor:
    """Clip the gradients of ``params`` by their global L2 norm (as :func:`clip_grad_norm_`) and
    step ``optimizer``; returns the norm before clipping.

    With a fused Adam/AdamW (:func:`steps_with_grad_scale`) the clipping rides in the optimizer's
    kernel: it gets ``grad_scale = max(1, (norm + 1e-6) / max_norm)`` and divides each gradient by
    it as it reads it, so no pass of its own multiplies every gradient in memory (BERT-large's
    ``_foreach_mul_`` took 0.74 ms of an H200 step). The update equals clip-then-step up to the rounding of a division
    against a multiplication (an ulp). Otherwise the gradients are clipped first.

    ``fp32_norms`` (the engine's bf16 weight copies, whose gradients are what autocast would hand
    over in fp32) sums half-precision gradients' norms in fp32, as autocast's fp32 gradients'
    are: a bf16 norm per tensor would round the clipping coefficient by up to 0.4%.

    Under model parallelism (``norm_groups`` given) the norm is :func:`model_parallel_norm` of
    ``norm_params`` (the parameters this rank counts) over those groups, and every gradient of
    ``params`` is scaled by the coefficient it gives.
    """
    if norm_groups:
        total_norm = model_parallel_norm(params if norm_params is None else norm_params, norm_groups,
                                         fp32_norms)
        grads = grads_of(params)
        with torch.no_grad():
            coefficient = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
            for (device, _), ([device_grads], _) in _group_tensors_by_device_and_dtype([grads]).items():
                torch._foreach_mul_(device_grads, coefficient.to(device))
        optimizer.step()
        return total_norm
    if steps_with_grad_scale(optimizer):
        total_norm, grouped = _grad_norm(params, fp32_norms)
        if total_norm is not None and len({device for device, _ in grouped}) == 1:
            with torch.no_grad():
                optimizer.grad_scale = torch.clamp((total_norm + 1e-6) / float(max_norm), min=1.0)
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale
            return total_norm
    total_norm = clip_grad_norm_(params, max_norm)
    optimizer.step()
    return total_norm
