"""Causal fused attention in flop counts: which op calls are causal, and torch's formulas halved
for them.

torch's ``flop_counter`` prices SDPA's fused kernels (flash, memory-efficient, cuDNN, and the
flash/efficient entry points under them) over the whole ``[Sq, Sk]`` score square whatever the
mask. Called causal, those kernels skip the blocks above the diagonal and do half of it, which is
what dslab's own attention ops count (FlashAttention's convention). :func:`runs_causal` reads the
call's ``is_causal`` (or ``custom_mask_type``) argument by name from the op's schema;
:func:`dslab.profilers.flops_formulas.count` halves such a call, and
:func:`causal_aware_formulas` gives ``FlopCounterMode`` the same prices.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter

#: Where a fused attention op says it is causal: ``is_causal`` (SDPA's flash, efficient, cuDNN and
#: CPU kernels, and their backwards) or ``custom_mask_type`` (1 and 2 are the causal masks of
#: ``_efficient_attention_forward`` and its backward), by op overload: (argument index, name) or None.
_CAUSAL_ARGUMENT: dict = {}


def _causal_argument(func) -> tuple[int, str] | None:
    try:
        return _CAUSAL_ARGUMENT[func]
    except KeyError:
        pass
    found = None
    for index, argument in enumerate(func._schema.arguments):
        if argument.name in ("is_causal", "custom_mask_type"):
            found = (index, argument.name)
            break
    _CAUSAL_ARGUMENT[func] = found
    return found


def runs_causal(func, args, kwargs) -> bool:
    """Whether ``func`` is a fused attention kernel called with a causal mask."""
    where = _causal_argument(func)
    if where is None:
        return False
    index, name = where
    value = args[index] if index < len(args) else kwargs.get(name)
    if name == "custom_mask_type":
        return value is not None and int(value) in (1, 2)
    return bool(value)


def _first_overload(packet):
    """An op packet's first overload (its schema names the arguments), None for a higher-order
    op (flex attention), which has no schema."""
    overloads = getattr(packet, "overloads", None)
    for name in overloads() if overloads is not None else ():
        return getattr(packet, name)
    return None


def expand_kv_heads(args: tuple) -> tuple:
    """SDPA arguments with grouped-query key/value heads widened to the query's: every 4-d tensor
    ``[batch, heads, seq, dim]`` whose head count divides the largest one's becomes a meta tensor
    of that head count (the formulas read shapes only). torch's SDPA formulas require equal head
    counts; with ``enable_gqa`` each query head still meets a whole key and value sequence, so the
    work is that of the widened shapes."""
    heads = [a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if not heads:
        return args
    most = max(heads)

    def widen(a):
        if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] != most and most % a.shape[1] == 0:
            return torch.empty((a.shape[0], most, *a.shape[2:]), dtype=a.dtype, device="meta")
        return a

    return tuple(widen(a) for a in args)


def causal_aware_formulas() -> dict:
    """A ``custom_mapping`` for ``FlopCounterMode``: torch's formula for every fused attention op
    that takes a causal flag, halved when the call is causal (as
    :func:`dslab.profilers.flops_formulas.count` prices it), so a
    plain counter agrees with the flops profiler on causal attention."""
    mapping = {}
    for packet, formula in flop_counter.flop_registry.items():
        overload = _first_overload(packet)
        if overload is None or _causal_argument(overload) is None:
            continue

        def halved(*args, out_val=None, _formula=formula, _overload=overload, **kwargs):
            try:
                flops = _formula(*args, **kwargs, out_val=out_val)
            except AssertionError:  # grouped-query heads (enable_gqa), which torch's formulas refuse
                flops = _formula(*expand_kv_heads(args), **kwargs, out_val=out_val)
            return flops // 2 if runs_causal(_overload, args, kwargs) else flops

        halved._get_raw = True  # FlopCounterMode hands raw arguments (is_causal) to such a formula
        mapping[packet] = halved
    return mapping
