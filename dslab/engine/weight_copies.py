"""bf16 weight copies kept by the optimizer: the forward computes with them, so no step casts a
weight or a weight's gradient.

Under plain autocast every matmul casts its fp32 weight to bf16 when it runs and autograd casts
the bf16 weight gradient back to fp32: two kernels per weight and step, each launch-sized for a
bias (BERT-large on an H200: 202 weight casts, 1.5 ms, and 226 gradient casts, 0.9 ms, of a 39 ms
step; GPT-2 1.5B: 5.2 + 2.8 ms of 111). With weight copies (``bf16.weight_copies``):

* the engine gives each parameter the model reads through :func:`dslab.models.weight_cast.weight`
  (the ones its modules list in ``_read_through_weight``: the transformer layers' matmul weights
  and separate biases, and the heads' dense layers) a bf16 copy, a leaf tensor that requires a
  gradient;
* the forward (and the backward, for any recomputation) runs in a scope where ``weight(p)`` is the
  copy: the matmuls read bf16 directly and autograd leaves the bf16 gradient on the copy;
* the optimizer is dslab's :class:`~dslab.kernels.optim.fused_adam.FusedAdam`, which reads that
  bf16 gradient as the parameter's, updates the fp32 parameter (the master) and its moments, and writes the new
  bf16 copy in the same pass; gradient clipping's scale rides in that pass too.

The arithmetic is autocast's: the copy is the round-to-nearest bf16 of the fp32 parameter, which
is what autocast's cast computes, and the bf16 gradient read as fp32 is what the cast's backward
hands over. The parameters, the optimizer states and checkpoints stay fp32 (16 bytes per
parameter with Adam, plus 2 for the copy and 2 for its gradient, which replaces the fp32
gradient's 4 for those parameters: the same as DeepSpeed's bf16 mode).

``bf16.weight_copies``: ``"auto"`` (the default) turns them on where they apply, ``true`` requires
them (a ValueError names the condition that fails), ``false`` keeps plain autocast. They apply
with bf16 on, on a CUDA device, with ZeRO stage 0, one micro-step per optimizer step
(accumulating several in bf16 would round where autocast's fp32 ``.grad`` does not), no
``compile`` section, no MoE expert parameters, an ``optimizer`` section of type Adam or AdamW
without amsgrad, and a model that reads some parameter through ``weight()``. ``true`` also
accepts a CPU device (tests; :class:`~dslab.kernels.optim.fused_adam.FusedAdam` runs its reference
path there).
After the parameters change outside a step (a checkpoint load) the engine refreshes the copies.

On several data-parallel ranks, stage 0 averages the copies' bf16 gradients (the tensors the
optimizer reads) in bf16, half the bytes of autocast's fp32 gradients
(:class:`~dslab.engine.data_parallel.GradientAllReducer` is given the copies in their parameters'
place); DeepSpeed's bf16 mode reduces its bf16 gradients in bf16 too. The sum of the ranks'
gradients is rounded to bf16 once more than a one-rank step's would be, so ``"auto"`` turning the
copies on at N ranks trades that rounding for the casts and half the all-reduce traffic; ``false``
keeps fp32 gradients and an fp32 all-reduce.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from dslab.config_base import parse_section
from dslab.engine.optimizers import PARAMS_MODELS
from dslab.kernels.optim.fused_adam import FusedAdam
from dslab.models.weight_cast import use_casts, weights_read_through

AUTO = "auto"


def unmet_condition(config, *, device: torch.device, optimizer_passed: bool,
                    experts: bool, explicit: bool, model_parallel: bool = False) -> str | None:
    """Why weight copies cannot run under ``config`` (a :class:`~dslab.engine.config.DslabConfig`),
    or None when they can. ``explicit``: the config asked for them (``true``), which also allows
    a CPU device."""
    if not config.bf16.enabled:
        return "they need 'bf16.enabled'"
    if device.type != "cuda" and not (explicit and device.type == "cpu"):
        return f"they run on a CUDA device, not {device.type}"
    if config.zero_optimization.stage != 0:
        return f"'zero_optimization.stage' is {config.zero_optimization.stage}; they run at stage 0"
    if model_parallel:
        return "the model is split over model-parallel ranks (pipeline or tensor parallel); they run on one"
    if config.gradient_accumulation_steps != 1:
        return (f"'gradient_accumulation_steps' is {config.gradient_accumulation_steps}; they need 1 "
                "(bf16 gradients would accumulate where autocast's fp32 .grad does)")
    if config.compile.enabled:
        return "'compile.enabled' is true"
    if experts:
        return "the model has MoE expert parameters"
    if optimizer_passed or config.optimizer is None:
        return "they need the config's 'optimizer' section (the engine builds the optimizer that keeps them)"
    if config.optimizer.type not in ("Adam", "AdamW"):
        return f"'optimizer.type' is {config.optimizer.type}; they need Adam or AdamW"
    if config.optimizer.params.get("amsgrad", False):
        return "'optimizer.params.amsgrad' is true"
    return None


class WeightCopies:
    """The bf16 copies of ``params`` and the scope in which the model reads them (see the module
    docstring)."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype = torch.bfloat16):
        if not params:
            raise ValueError("WeightCopies needs at least one parameter")
        self.params = list(params)
        self.copies = [torch.empty(p.shape, dtype=dtype, device=p.device).requires_grad_() for p in self.params]
        with torch.no_grad():
            for p, c in zip(self.params, self.copies):
                c.copy_(p)
        self._casts = {id(p): c for p, c in zip(self.params, self.copies)}
        self._holders: tuple[list, list] | None = None

    def scope(self):
        """The block in which ``weight(p)`` is ``p``'s copy."""
        return use_casts(self._casts)

    def copy_of(self, param: torch.Tensor) -> torch.Tensor | None:
        return self._casts.get(id(param))

    def grad_holders(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """``params`` with each copied parameter replaced by its copy: the tensors whose ``.grad``
        holds the step's gradients (for the clipping norm). Kept while ``params`` is the same list."""
        if self._holders is None or self._holders[0] is not params:
            self._holders = (params, [self._casts.get(id(p), p) for p in params])
        return self._holders[1]

    def clear_grads(self) -> None:
        for c in self.copies:
            c.grad = None

    def register(self, optimizer: FusedAdam) -> None:
        """Hand the copies to ``optimizer``: it reads their gradients and rewrites them every step."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer.set_param_copies([self._casts.get(id(p)) for p in params], grads_from_copies=True)

    def refresh(self) -> None:
        """Rewrite every copy from its parameter (after the parameters changed outside a step)."""
        with torch.no_grad():
            for p, c in zip(self.params, self.copies):
                if c.device != p.device:
                    c.data = torch.empty(c.shape, dtype=c.dtype, device=p.device)
                c.copy_(p)


def build(config, module: nn.Module, *, device: torch.device, optimizer_passed: bool,
          experts: bool, log, model_parallel: bool = False) -> WeightCopies | None:
    """The engine's weight copies, or None where ``bf16.weight_copies`` leaves them off (``"auto"``
    and a condition unmet: logged at info level; ``false``). Raises ValueError naming the unmet
    condition when the config says ``true``."""
    setting = config.bf16.weight_copies
    if setting is False:
        return None
    explicit = setting is True
    reason = unmet_condition(config, device=device, optimizer_passed=optimizer_passed,
                             experts=experts, explicit=explicit, model_parallel=model_parallel)
    params = weights_read_through(module) if reason is None else []
    if reason is None and not params:
        reason = ("the model reads no parameter through dslab.models.weight_cast.weight "
                  "(no module lists one in _read_through_weight)")
    if reason is not None:
        if explicit:
            raise ValueError(f"config key 'bf16.weight_copies' is true but {reason}")
        if config.bf16.enabled:
            log.info("bf16 weight copies off: %s", reason)
        return None
    return WeightCopies(params)


def build_optimizer(config, params) -> FusedAdam:
    """dslab's FusedAdam for the config's Adam/AdamW section (its hyperparameters as
    :func:`dslab.engine.optimizers.build_optimizer` reads them)."""
    kwargs = parse_section(PARAMS_MODELS[config.type], config.params, "optimizer.params").model_dump()
    kwargs.pop("torch_adam")
    kwargs.pop("amsgrad")
    return FusedAdam(params, **kwargs)


def scope(copies: WeightCopies | None):
    return copies.scope() if copies is not None else contextlib.nullcontext()
