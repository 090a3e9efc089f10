"""The ``optimizer`` config section and the optimizers it builds.

DeepSpeed's types and parameter names, mapped onto PyTorch's optimizers and dslab's Lamb:

=========  ============================================  ====================================
type       params (defaults)                             builds
=========  ============================================  ====================================
Adam       lr=1e-3, betas=(0.9, 0.999), eps=1e-8,        ``adam_w_mode`` true: torch AdamW
           weight_decay=0, adam_w_mode=true,             (decoupled weight decay); false:
           torch_adam=false, amsgrad=false               torch Adam (L2 added to the gradient)
AdamW      as Adam (``adam_w_mode`` may only be true)    torch AdamW
Lamb       lr=1e-3, bias_correction=true,                :class:`dslab.engine.lamb.Lamb`
           betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
           max_grad_norm=0, max_coeff=10, min_coeff=0.01
SGD        lr=1e-3, momentum=0, dampening=0,             torch SGD
           weight_decay=0, nesterov=false
=========  ============================================  ====================================

``type`` is case-insensitive, as in DeepSpeed. ``weight_decay`` defaults to 0 for AdamW too
(DeepSpeed's FusedAdam default, not torch AdamW's 0.01). ``torch_adam`` picks PyTorch's Adam
over DeepSpeed's fused CUDA one there; dslab always uses PyTorch's, so it is accepted and has no
effect. The torch optimizers run their fused kernels (``fused=True``) when the caller says every
parameter is on CUDA, or every one in CPU memory (``fused_ok``, :func:`fused_kernels_supported`:
torch's fused Adam, AdamW and SGD have CPU kernels, about 6x faster than the multi-tensor path
there), and their multi-tensor path (``foreach=True``) otherwise; Lamb always runs its
multi-tensor path.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterable, Literal

import torch
from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from dslab.config_base import ConfigSection, closest_key, parse_section
from dslab.engine.lamb import Lamb

OptimizerType = Literal["Adam", "AdamW", "Lamb", "SGD"]
OPTIMIZER_TYPES: tuple[str, ...] = ("Adam", "AdamW", "Lamb", "SGD")

# DeepSpeed optimizer types that dslab does not have, so the error can say so plainly.
_DEEPSPEED_ONLY_TYPES = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adagrad", "Lion",
                         "MuAdam", "MuAdamW", "MuSGD")



def _check_betas(value: tuple[float, float]) -> tuple[float, float]:
    if not all(0.0 <= b < 1.0 for b in value):
        raise ValueError("each beta must be in [0, 1)")
    return value


Betas = Annotated[tuple[float, float], AfterValidator(_check_betas)]


class _AdamFamilyParams(ConfigSection):
    lr: float = Field(1e-3, ge=0.0)
    betas: Betas = (0.9, 0.999)
    eps: float = Field(1e-8, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_w_mode: bool = True
    torch_adam: bool = False
    amsgrad: bool = False


class AdamParams(_AdamFamilyParams):
    """``optimizer.params`` for type Adam."""


class AdamWParams(_AdamFamilyParams):
    """``optimizer.params`` for type AdamW: decoupled weight decay always."""

    @field_validator("adam_w_mode")
    @classmethod
    def _must_be_true(cls, value: bool) -> bool:
        if not value:
            raise ValueError("AdamW always decouples weight decay; use type Adam with "
                             "adam_w_mode false for L2 weight decay")
        return value


class LambParams(ConfigSection):
    """``optimizer.params`` for type Lamb (the arguments of :class:`Lamb`)."""

    lr: float = Field(1e-3, ge=0.0)
    bias_correction: bool = True
    betas: Betas = (0.9, 0.999)
    eps: float = Field(1e-8, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(0.0, ge=0.0)
    max_coeff: float = Field(10.0, ge=0.0)
    min_coeff: float = Field(0.01, ge=0.0)

    @model_validator(mode="after")
    def _coeffs_ordered(self) -> "LambParams":
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"min_coeff ({self.min_coeff}) must not exceed max_coeff "
                             f"({self.max_coeff})")
        return self


class SGDParams(ConfigSection):
    """``optimizer.params`` for type SGD (the arguments of torch SGD)."""

    lr: float = Field(1e-3, ge=0.0)
    momentum: float = Field(0.0, ge=0.0)
    dampening: float = 0.0
    weight_decay: float = Field(0.0, ge=0.0)
    nesterov: bool = False

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> "SGDParams":
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov requires momentum > 0 and dampening 0 "
                             f"(got momentum={self.momentum}, dampening={self.dampening})")
        return self


PARAMS_MODELS: dict[str, type[ConfigSection]] = {
    "Adam": AdamParams, "AdamW": AdamWParams, "Lamb": LambParams, "SGD": SGDParams,
}


def _canonical_type(value: str) -> str:
    """The canonical spelling of an optimizer type, matched case-insensitively."""
    by_lower = {name.lower(): name for name in OPTIMIZER_TYPES}
    if value.lower() in by_lower:
        return by_lower[value.lower()]
    unsupported = {name.lower(): name for name in _DEEPSPEED_ONLY_TYPES}
    if value.lower() in unsupported:
        raise ValueError(f"DeepSpeed optimizer type {unsupported[value.lower()]!r} is not "
                         f"supported by dslab (supported: {', '.join(OPTIMIZER_TYPES)})")
    msg = f"unknown optimizer type {value!r}"
    hint = closest_key(value.lower(), list(by_lower))
    if hint:
        msg += f"; did you mean {by_lower[hint]!r}?"
    raise ValueError(f"{msg} (supported: {', '.join(OPTIMIZER_TYPES)})")


class OptimizerConfig(ConfigSection):
    """The ``optimizer`` section: ``{"type": "Adam", "params": {"lr": 1e-4, ...}}``."""

    type: OptimizerType
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> Any:
        return _canonical_type(value) if isinstance(value, str) else value

    @field_validator("params")
    @classmethod
    def _known_params(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        optimizer_type = info.data.get("type")
        if optimizer_type is not None:
            parse_section(PARAMS_MODELS[optimizer_type], value, "optimizer.params")
        return value


def fused_kernels_supported(params: Iterable[torch.Tensor]) -> bool:
    """True when ``params`` (non-empty) are floating-point tensors on CUDA or in CPU memory:
    the devices torch's fused Adam/AdamW/SGD kernels run on (a mix of both is stepped device by
    device, as ZeRO's partial optimizer offload needs)."""
    params = list(params)
    if not params or not all(torch.is_floating_point(p) for p in params):
        return False
    kinds = {p.device.type for p in params}
    return kinds <= {"cuda", "cpu"}


def build_optimizer(config: OptimizerConfig | dict[str, Any],
                    parameters: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *,
                    fused_ok: bool) -> torch.optim.Optimizer:
    """The optimizer that ``config`` (an :class:`OptimizerConfig` or dict) names, on ``parameters``.

    ``parameters`` are tensors or param-group dicts, as torch optimizers take them. ``fused_ok``
    is the caller's word that the fused torch kernels may run on the parameters
    (:func:`fused_kernels_supported`). Raises ValueError naming ``optimizer.params.<name>`` for an unknown
    or bad param (with the closest known name), or ``optimizer.type`` for an unknown type.
    """
    if isinstance(config, dict):
        config = parse_section(OptimizerConfig, config, "optimizer")
    params = parse_section(PARAMS_MODELS[config.type], config.params, "optimizer.params")
    kwargs = params.model_dump()
    kernel = {"fused": True} if fused_ok else {"foreach": True}
    if config.type in ("Adam", "AdamW"):
        adam_w_mode = kwargs.pop("adam_w_mode")
        kwargs.pop("torch_adam")
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        return cls(parameters, **kwargs, **kernel)
    if config.type == "Lamb":
        return Lamb(parameters, **kwargs)
    return torch.optim.SGD(parameters, **kwargs, **kernel)
