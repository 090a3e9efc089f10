"""Mixed precision: the ``fp16`` and ``bf16`` config sections, the autocast context and the loss
scaler.

dslab's choice for both half precisions is autocast over fp32 parameters (with bf16, the forward
reads bf16 copies of the weights that the optimizer keeps where :mod:`dslab.engine.weight_copies`
applies, the same arithmetic without the per-step casts): the forward runs matrix
products in bf16/fp16 while the parameters, their gradients and the optimizer states stay fp32.
Model states cost 16 bytes per parameter with Adam (4 param + 4 grad + 8 moments), the same as
DeepSpeed's bf16 mode with fp32 master weights (2 + 2 + 4 master + 8), and autocast adds one
transient half-precision copy of each weight during forward and backward (2 bytes per parameter,
freed after use). The optimizer updates the fp32 parameters directly, so there is no master-copy
sync step, and the numbers match a hand-written autocast loop.

fp16 also needs loss scaling: :class:`LossScaler` implements DeepSpeed's dynamic scaler
(``loss_scale: 0``) and a static one (``loss_scale > 0``).
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from pydantic import Field

from dslab.config_base import ConfigSection, accepted_off


class FP16Config(ConfigSection):
    """DeepSpeed's ``fp16`` section."""

    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0.0, description="0 selects dynamic loss scaling")
    initial_scale_power: int = Field(16, ge=0, le=63)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0.0)
    # DeepSpeed casts the forward's floating-point inputs to fp16 with it; dslab runs fp16 under
    # torch.autocast, which casts per op: accepted false only
    auto_cast: bool = False
    _no_auto_cast = accepted_off("auto_cast", why="a DeepSpeed feature dslab does not support: fp16 runs under "
                                              "torch.autocast, which casts at each op")


class BF16Config(ConfigSection):
    """DeepSpeed's ``bf16`` section. ``weight_copies`` (dslab's): the forward computes with bf16
    copies of the weights that the optimizer keeps, instead of casting them every step
    (:mod:`dslab.engine.weight_copies`): ``"auto"`` where they apply, ``true`` required, ``false``
    off."""

    enabled: bool = False
    weight_copies: Literal["auto"] | bool = "auto"


class DataTypesConfig(ConfigSection):
    """DeepSpeed's ``data_types`` section: ``grad_accum_dtype``, the dtype gradients accumulate in
    over micro-steps. dslab accumulates into each trainable parameter's ``.grad``, in the
    parameter's dtype, so the key is accepted when it names that dtype
    (:func:`check_grad_accum_dtype`)."""

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = None


_DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def check_grad_accum_dtype(data_types: DataTypesConfig, params) -> None:
    """Refuse ``data_types.grad_accum_dtype`` when a trainable parameter of ``params`` (whose
    ``.grad`` gradients accumulate in) has another dtype, naming it."""
    wanted = data_types.grad_accum_dtype
    if wanted is None:
        return
    for p in params:
        if p.requires_grad and p.dtype != _DTYPE_NAMES[wanted]:
            raise ValueError(
                f"config key 'data_types.grad_accum_dtype' is {wanted!r}, but gradients accumulate in the "
                f"parameters' dtype and a trainable parameter is {str(p.dtype).replace('torch.', '')}; "
                f"remove the key or make it match the model's parameters")


def autocast_dtype(fp16: FP16Config, bf16: BF16Config) -> torch.dtype | None:
    if fp16.enabled and bf16.enabled:
        raise ValueError("config keys 'fp16.enabled' and 'bf16.enabled' are both true; choose one")
    if bf16.enabled:
        return torch.bfloat16
    if fp16.enabled:
        return torch.float16
    return None


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class LossScaler:
    """Loss scaling for fp16 training.

    Dynamic mode (DeepSpeed's ``loss_scale: 0``) starts at ``2**initial_scale_power``. A step whose
    gradients hold an inf or NaN is skipped; the scale is divided by 2 (not below
    ``min_loss_scale``) once ``hysteresis`` overflows have been absorbed, and doubled after every
    ``loss_scale_window`` steps in a row without overflow. With ``consecutive_hysteresis`` the
    hysteresis budget is refilled after every good step instead of only when the scale grows.

    Static mode (``loss_scale > 0``) keeps the scale fixed; overflowing steps are still skipped.
    """

    def __init__(self, config: FP16Config):
        self.dynamic = config.loss_scale == 0
        self.cur_scale = float(2 ** config.initial_scale_power) if self.dynamic else float(config.loss_scale)
        self.scale_factor = 2.0
        self.scale_window = config.loss_scale_window
        self.min_scale = config.min_loss_scale
        self.delayed_shift = config.hysteresis
        self.cur_hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        if self.dynamic:
            if overflow:
                if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                    self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.cur_iter
            else:
                if self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                    if not self.consecutive_hysteresis:
                        self.cur_hysteresis = self.delayed_shift
                    self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; True when any of them is inf or NaN.

        One fused kernel per device and dtype, and one host synchronisation for the verdict.
        """
        if not grads:
            return False
        return bool(self.unscale_and_find_inf(grads).item() > 0)

    def unscale_and_find_inf(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` (a non-empty list) by the scale in place; returns a 0-dim float32
        tensor on the first gradient's device, > 0 when any of them is inf or NaN. No host
        synchronisation: ZeRO all-reduces the flag across ranks before reading it."""
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            by_key.setdefault((g.device, g.dtype), []).append(g)
        flags = []
        for (device, _), group in by_key.items():
            found = torch.zeros((), dtype=torch.float32, device=device)
            inv_scale = torch.full((), 1.0 / self.cur_scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale)
            flags.append(found)
        device = grads[0].device
        return torch.stack([f.to(device) for f in flags]).sum()

    def state_dict(self) -> dict:
        return {
            "cur_scale": self.cur_scale,
            "cur_hysteresis": self.cur_hysteresis,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state: dict) -> None:
        self.cur_scale = float(state["cur_scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
