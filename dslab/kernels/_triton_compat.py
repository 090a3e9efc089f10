"""What kernel modules share about Triton itself: the optional import and a rounding cast.

Triton is optional for modules that can run without it (the references then run); they import
``triton``, ``tl`` and ``jit`` from here, and ``jit`` leaves functions undecorated when Triton is
missing so the kernel signatures still parse.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # Triton is optional: without it only the references run.
    triton = None

    class tl:  # noqa: N801 - stands in for triton.language so the kernel signatures parse
        constexpr = None

    def jit(fn):
        return fn


@jit
def cast_rounding(x, dtype: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """``x.to(dtype)``. With ``BF16_BY_HAND`` (set under the interpreter for bf16 outputs), fp32 ->
    bf16 rounds to nearest even with integer ops: the interpreter's own cast truncates, while the
    GPU's ``cvt.rn.bf16.f32`` rounds to nearest even like ``torch.Tensor.to``."""
    if BF16_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(dtype)
    return out
