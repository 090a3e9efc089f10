"""LAMB: Adam moments with a per-parameter trust ratio (You et al., 2019, arXiv:1904.00962, Alg. 2).

For each parameter ``p`` with gradient ``g`` at step ``k`` (1-based), in the parameter's dtype::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** k),  v_hat = v / (1 - beta2 ** k)      (m, v if not bias_correction)
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p
    ratio = clamp(||p|| / ||u||, min_coeff, max_coeff)     (1 when ||p|| or ||u|| is 0)
    p = p - lr * ratio * u

Norms are Frobenius norms of the whole tensor. ``max_grad_norm > 0`` first scales the gradients
used in the update by ``max_grad_norm / total_norm`` when ``total_norm`` (the global L2 norm of
all the optimizer's gradients, over every param group) exceeds it; ``.grad`` itself is left
unchanged. Parameters whose ``.grad`` is None are skipped and their step count does not advance.

Memory traffic per step: reads p, g, m, v and writes p, m, v, plus one temporary the size of p
(the update ``u``). The ratio stays on the device: a step does not synchronize with the host.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch


class Lamb(torch.optim.Optimizer):
    """LAMB with DeepSpeed FusedLamb's parameter names; see the module docstring for the update.

    State per parameter: ``step`` (int), ``exp_avg`` (m), ``exp_avg_sq`` (v), both shaped like p.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01):
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0 (got {lr!r})")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0 (got {eps!r})")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1) (got {betas!r})")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0 (got {weight_decay!r})")
        if not max_grad_norm >= 0.0:
            raise ValueError(f"max_grad_norm must be >= 0 (got {max_grad_norm!r})")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"min_coeff and max_coeff must satisfy 0 <= min_coeff <= max_coeff "
                f"(got min_coeff={min_coeff!r}, max_coeff={max_coeff!r})")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)

    def _global_grad_norm(self) -> torch.Tensor | None:
        """The L2 norm of every gradient in the optimizer (None: no grads).

        A 0-dim tensor on the first gradient's device, in float32 (float64 if a gradient is).
        """
        grads = [p.grad for group in self.param_groups for p in group["params"]
                 if p.grad is not None]
        if not grads:
            return None
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_device[g.device].append(g)
        device = grads[0].device
        dtype = torch.float32
        for g in grads:
            dtype = torch.promote_types(dtype, g.dtype)
        squares = [torch.stack([n.to(dtype) for n in torch._foreach_norm(gs)]).square().sum()
                   for gs in by_device.values()]
        return torch.stack([s.to(device) for s in squares]).sum().sqrt()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        needs_norm = any(group["max_grad_norm"] > 0 for group in self.param_groups)
        total_norm = self._global_grad_norm() if needs_norm else None

        for group in self.param_groups:
            params, grads = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("Lamb does not support sparse gradients")
                params.append(p)
                grads.append(p.grad)
            if not params:
                continue
            if group["max_grad_norm"] > 0 and total_norm is not None:
                clip = (group["max_grad_norm"] / total_norm).clamp(max=1.0)
                grads = [g * clip.to(device=g.device, dtype=g.dtype) for g in grads]
            self._update_group(group, params, grads)
        return loss

    def _update_group(self, group: dict[str, Any], params: list[torch.Tensor],
                      grads: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])

        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        if group["bias_correction"]:
            m_scale = [1.0 / (1.0 - beta1 ** k) for k in steps]
            v_scale = [1.0 / math.sqrt(1.0 - beta2 ** k) for k in steps]
        else:
            m_scale = v_scale = [1.0] * len(steps)
        # u = (m * m_scale) / (sqrt(v) * v_scale + eps) + weight_decay * p
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_mul_(denom, v_scale)
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_mul(exp_avgs, m_scale)
        torch._foreach_div_(updates, denom)
        del denom
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])

        ratios = _trust_ratios(torch._foreach_norm(params), torch._foreach_norm(updates),
                               group["min_coeff"], group["max_coeff"])
        torch._foreach_mul_(updates, ratios)
        torch._foreach_add_(params, updates, alpha=-group["lr"])


def _trust_ratios(p_norms: list[torch.Tensor], u_norms: list[torch.Tensor],
                  min_coeff: float, max_coeff: float) -> list[torch.Tensor]:
    """clamp(||p|| / ||u||, min_coeff, max_coeff) per parameter, 1 where either norm is 0.

    The 0-dim norms are stacked per device (in float32, or float64 if a parameter is float64) so
    that the ratios take a few kernels, not a few per parameter; each ratio comes back in its
    parameter's dtype.
    """
    ratios: list[torch.Tensor | None] = [None] * len(p_norms)
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for index, norm in enumerate(p_norms):
        by_device[norm.device].append(index)
    for indices in by_device.values():
        dtype = torch.float32
        for i in indices:
            dtype = torch.promote_types(dtype, p_norms[i].dtype)
        p_norm = torch.stack([p_norms[i].to(dtype) for i in indices])
        u_norm = torch.stack([u_norms[i].to(dtype) for i in indices])
        trust = (p_norm / u_norm).clamp(min_coeff, max_coeff)
        trust = torch.where((p_norm > 0) & (u_norm > 0), trust, torch.ones_like(trust))
        for i, ratio in zip(indices, trust.unbind()):
            ratios[i] = ratio.to(p_norms[i].dtype)
    return ratios
