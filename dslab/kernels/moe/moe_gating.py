"""The gate of a mixture-of-experts layer: softmax over experts, top-1 or top-2 choice, gate
weights, and each assignment's slot among its expert's assignments (DeepSpeed-MoE's
``top1gating`` / ``top2gating`` before capacity dropping; GShard, Lepikhin et al. 2020, Algorithm 1).

For logits ``l`` [T, E] (computed in fp32) and ``k`` in {1, 2}:

    probs            = softmax(l)                                  [T, E] fp32
    expert_index[:,0] = argmax_e l                                 (ties: the lowest index)
    expert_index[:,1] = argmax_{e != first} (l + noise)            (k = 2; noise = 0 when None)
    gate_weight      = probs[first]                                (k = 1)
                     = probs[chosen] / max(sum probs[chosen], eps) (k = 2; eps = fp32 eps)
    position[t, c]   = rank of (t, c) among all assignments to expert_index[t, c], ranked
                       choice-major: every first choice in token order, then every second choice
                       (DeepSpeed's ``locations2 += sum(mask1)``)
    expert_counts[e] = number of assignments to e (both choices), before any capacity dropping

``second_choice_noise`` is the Gumbel noise DeepSpeed's ``top2gating`` adds to the logits before
choosing the second expert (``gumbel_rsample``); the caller draws it, so this op is deterministic.
Gradients reach ``logits`` from ``probs`` (the load-balancing loss) and ``gate_weight``; the integer
outputs are not differentiable, and nothing flows to the noise.

Layers: :func:`moe_gating_reference` (PyTorch) → the ``dslab::moe_gating`` custom op with its
autograd (``dslab::moe_gating_backward``) under ``torch.compile``, and an ``autograd.Function``
making the same launches in eager mode (see :mod:`dslab.kernels.norm.layer_norm` for why both) → the
Triton kernels in :mod:`dslab.kernels.moe.moe_gating_triton` (two forward launches, one backward; no
host synchronisation). :func:`moe_gating` picks between them with
:func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The Triton kernels hold a row of logits in registers; equal to moe_gating_triton.MAX_EXPERTS,
# repeated so that validating arguments does not import Triton.
MAX_EXPERTS = 128
EPS = torch.finfo(torch.float32).eps


class GatingOutput(NamedTuple):
    """What :func:`moe_gating` returns, for ``T`` tokens, ``E`` experts and ``k`` choices."""

    probs: torch.Tensor  # [T, E] fp32, softmax of the logits; differentiable
    expert_index: torch.Tensor  # [T, k] int32, choice 0 first
    gate_weight: torch.Tensor  # [T, k] fp32; differentiable
    position: torch.Tensor  # [T, k] int32, choice-major rank within the expert
    expert_counts: torch.Tensor  # [E] int32, assignments per expert


def moe_gating_reference(
    logits: torch.Tensor, k: int, second_choice_noise: torch.Tensor | None = None
) -> GatingOutput:
    """The PyTorch reference, DeepSpeed's ``top1gating``/``top2gating`` arithmetic in fp32.

    The positions come from a cumulative sum over a ``[k*T, E]`` int32 one-hot matrix, as
    DeepSpeed's ``locations = cumsum(mask) - 1``.
    """
    tokens, experts = logits.shape
    scores = logits.float()
    probs = torch.softmax(scores, dim=1)
    first = scores.argmax(dim=1)
    if k == 1:
        expert_index = first[:, None]
        gate_weight = probs.gather(1, expert_index)
    else:
        noisy = scores if second_choice_noise is None else scores + second_choice_noise
        second = noisy.masked_fill(F.one_hot(first, experts).bool(), float("-inf")).argmax(dim=1)
        expert_index = torch.stack([first, second], dim=1)
        chosen = probs.gather(1, expert_index)
        gate_weight = chosen / chosen.sum(dim=1, keepdim=True).clamp(min=EPS)
    choice_major = expert_index.t().reshape(-1)
    one_hot = F.one_hot(choice_major, experts).to(torch.int32)
    ranks = torch.cumsum(one_hot, dim=0, dtype=torch.int32) - 1
    position = ranks.gather(1, choice_major[:, None]).view(k, tokens).t().contiguous()
    expert_counts = one_hot.sum(dim=0, dtype=torch.int32)
    return GatingOutput(probs, expert_index.to(torch.int32), gate_weight, position, expert_counts)


@torch.library.custom_op("dslab::moe_gating", mutates_args=())
def _moe_gating_op(
    logits: torch.Tensor, k: int, second_choice_noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs, expert_index, gate_weight, position, expert_counts) for ``logits`` [T, E]."""
    from dslab.kernels.moe import moe_gating_triton

    return moe_gating_triton.forward(logits, k, second_choice_noise)


@_moe_gating_op.register_fake
def _(logits, k, second_choice_noise):
    tokens, experts = logits.shape
    return (
        logits.new_empty((tokens, experts), dtype=torch.float32),
        logits.new_empty((tokens, k), dtype=torch.int32),
        logits.new_empty((tokens, k), dtype=torch.float32),
        logits.new_empty((tokens, k), dtype=torch.int32),
        logits.new_empty((experts,), dtype=torch.int32),
    )


@torch.library.custom_op("dslab::moe_gating_backward", mutates_args=())
def _moe_gating_backward_op(
    dprobs: torch.Tensor | None,
    dgate_weight: torch.Tensor | None,
    probs: torch.Tensor,
    expert_index: torch.Tensor,
    logits_dtype: torch.dtype,
) -> torch.Tensor:
    """d logits [T, E] in ``logits_dtype`` from d probs [T, E] and d gate_weight [T, k] (None where
    no gradient arrived), given the forward's ``probs`` and ``expert_index``."""
    from dslab.kernels.moe import moe_gating_triton

    return moe_gating_triton.backward(dprobs, dgate_weight, probs, expert_index, logits_dtype)


@_moe_gating_backward_op.register_fake
def _(dprobs, dgate_weight, probs, expert_index, logits_dtype):
    return probs.new_empty(probs.shape, dtype=logits_dtype)


def _setup(ctx, inputs, output):
    logits, _k, _noise = inputs
    probs, expert_index, _gate_weight, position, expert_counts = output
    ctx.mark_non_differentiable(expert_index, position, expert_counts)
    ctx.set_materialize_grads(False)
    ctx.logits_dtype = logits.dtype
    ctx.save_for_backward(probs, expert_index)


def _backward(ctx, dprobs, _dindex, dgate_weight, _dposition, _dcounts):
    if dprobs is None and dgate_weight is None:
        return None, None, None
    probs, expert_index = ctx.saved_tensors
    dlogits = _moe_gating_backward_op(dprobs, dgate_weight, probs, expert_index, ctx.logits_dtype)
    return dlogits, None, None


_moe_gating_op.register_autograd(_backward, setup_context=_setup)


@functools.cache
def _triton_module():
    from dslab.kernels.moe import moe_gating_triton

    return moe_gating_triton


class _EagerMoeGating(torch.autograd.Function):
    """The custom ops' launches for eager mode."""

    @staticmethod
    def forward(ctx, logits, k, second_choice_noise):
        outputs = _triton_module().forward(logits, k, second_choice_noise)
        probs, expert_index, _gate_weight, position, expert_counts = outputs
        ctx.mark_non_differentiable(expert_index, position, expert_counts)
        ctx.set_materialize_grads(False)
        ctx.logits_dtype = logits.dtype
        ctx.save_for_backward(probs, expert_index)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dprobs, _dindex, dgate_weight, _dposition, _dcounts):
        if dprobs is None and dgate_weight is None:
            return None, None, None
        probs, expert_index = ctx.saved_tensors
        dlogits = _triton_module().backward(dprobs, dgate_weight, probs, expert_index, ctx.logits_dtype)
        return dlogits, None, None


def _check(logits: torch.Tensor, k: int, noise: torch.Tensor | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if k not in (1, 2):
        raise ValueError(f"k must be 1 or 2, got {k!r}")
    experts = logits.shape[1]
    if not k <= experts <= MAX_EXPERTS:
        raise ValueError(f"the number of experts E (logits.shape[1]) must be in [k, {MAX_EXPERTS}], got {experts}")
    if noise is None:
        return
    if k != 2:
        raise ValueError("second_choice_noise is only used with k=2")
    if noise.shape != logits.shape:
        raise ValueError(f"second_choice_noise must have logits' shape {tuple(logits.shape)}, got {tuple(noise.shape)}")
    if noise.dtype != torch.float32:
        raise ValueError(f"second_choice_noise must be float32, got {noise.dtype}")
    if noise.device != logits.device:
        raise ValueError(f"second_choice_noise must be on logits' device {logits.device}, got {noise.device}")


def moe_gating(
    logits: torch.Tensor, k: int, second_choice_noise: torch.Tensor | None = None
) -> GatingOutput:
    """Top-``k`` gating of ``logits`` [T, E] (any float dtype, computed in fp32; E <= 128).

    Returns :class:`GatingOutput` ``(probs [T, E] fp32, expert_index [T, k] int32, gate_weight
    [T, k] fp32, position [T, k] int32, expert_counts [E] int32)``, defined in the module
    docstring. ``second_choice_noise`` ([T, E] fp32, k=2 only) perturbs the second choice.
    Gradients flow from ``probs`` and ``gate_weight`` to ``logits`` (in the logits' dtype). The
    Triton path runs on CUDA tensors (or under the ``triton`` backend with ``TRITON_INTERPRET=1``)
    for fp32/fp16/bf16 logits; otherwise the reference runs. Logits holding NaN give unspecified
    choices on the Triton path.
    """
    _check(logits, k, second_choice_noise)
    if not (logits.dtype in TRITON_DTYPES and use_triton(logits, second_choice_noise)):
        return moe_gating_reference(logits, k, second_choice_noise)
    if use_custom_op():
        return GatingOutput(*_moe_gating_op(logits, k, second_choice_noise))
    return GatingOutput(*_EagerMoeGating.apply(logits, k, second_choice_noise))
