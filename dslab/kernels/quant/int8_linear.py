"""INT8 weights: symmetric quantisation and a linear layer that dequantises inside its GEMM.

    quantize_int8(w [N, K], group_size)    -> qweight int8 [N, K], scale fp32 [N] or [N, K // group_size]
    dequantize_int8(qweight, scale, ...)   -> w ~ qweight * scale (per row, or per group of K)
    int8_linear(x [..., K], qweight, scale, bias, group_size) -> y [..., N] = x @ dequant(w).T + bias

Quantisation is symmetric, round to nearest, clamped to [-127, 127] (-128 is never used, so the
range is symmetric): per output channel ``scale[n] = max_k |w[n, k]| / 127``, or per group of
``group_size`` consecutive inputs ``scale[n, g] = max_{k in g} |w[n, k]| / 127``. An all-zero row or
group gets scale 0 and dequantises to exact zeros (nothing is divided by zero). Elementwise,
``|w - dequantize_int8(quantize_int8(w))| <= scale / 2``.

The linear layer reads 1 byte per weight instead of 2 (bf16), which is what decode's skinny GEMMs
(M = 1 .. ~64 rows of x) cost: their time is reading the weights. Memory traffic of the Triton
path: ``N * K`` bytes of weights, ``4 * N`` (per channel) or ``4 * N * K / group_size`` bytes of
scales, ``M * K`` elements of x, ``M * N`` of y (and ``split_k * M * N`` fp32 partials when the K
loop is split); ``2 * M * N * K`` flops.

Which path runs (:func:`int8_linear`):

- the reference, :func:`int8_linear_reference`: ``F.linear(x, dequantize_int8(...).to(x.dtype),
  bias)``, off the Triton backend (CPU tensors, ``DSLAB_KERNELS=torch``) or for dtypes other than
  fp32/fp16/bf16;
- for more than :data:`SKINNY_MAX_ROWS` rows (prefill): the weight is dequantised once into x's
  dtype and ``F.linear`` (cuBLAS) runs, compute-bound work where the weight read is amortised;
- otherwise the Triton kernel of :mod:`dslab.kernels.quant.int8_linear_triton` (int8 loaded and
  dequantised in registers, fp32 accumulation, split-K when the output tiles alone cannot fill the
  device, reduced in a fixed order: deterministic).

Forward-only: an inference op; a backward through it raises a RuntimeError that says so.

Layers: the reference → the ``dslab::int8_linear`` custom op (under ``torch.compile`` and dispatch
modes) or a direct launch in eager mode → the Triton kernels.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dslab.kernels.decode.decode_attention import forward_only_message, run_forward_only
from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QMAX = 127
#: Up to this many rows of x the Triton weight-streaming kernel runs; above it, dequantise + cuBLAS.
SKINNY_MAX_ROWS = 64


def _check_group_size(group_size: int | None, k: int, name: str = "weight") -> None:
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int or None (per output channel), got {group_size!r}")
    if k % group_size != 0:
        raise ValueError(f"group_size {group_size} must divide {name}'s K = {k} (the input features)")


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scale)`` for ``weight`` ``[N, K]`` (floating point, any strides): qweight int8
    ``[N, K]`` contiguous (row-major, the layout the Triton kernel streams), scale fp32 ``[N]``
    (``group_size=None``, per output channel) or ``[N, K // group_size]``, contiguous too.
    Computed in fp32; symmetric, round to nearest (half to even), clamped to [-127, 127].

    A transposed ``weight`` (transformers' ``Conv1D`` stores ``[in, out]``, so its ``.t()`` is an
    ``[N, K]`` view with strides ``(1, N)``) would otherwise give a qweight with those strides, and
    :func:`int8_linear` would copy the whole weight into row-major order on every call."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a matrix [N, K] (nn.Linear's [out, in]), got {shape}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
    n, k = weight.shape
    _check_group_size(group_size, k)
    w = weight.detach().float().contiguous()
    groups = w.view(n, 1, k) if group_size is None else w.reshape(n, k // group_size, group_size)
    if not torch.isfinite(groups).all():
        raise ValueError("weight must be finite (it holds inf or NaN)")
    scale = groups.abs().amax(dim=2) / QMAX  # [N, G]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: 0 / 1 = 0
    qweight = torch.round(groups / safe[:, :, None]).clamp_(-QMAX, QMAX).to(torch.int8).view(n, k)
    return qweight, (scale.view(n) if group_size is None else scale)


def _check_quantized(qweight, scale, group_size) -> None:
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2 or qweight.dtype != torch.int8:
        desc = f"{qweight.dtype} {tuple(qweight.shape)}" if isinstance(qweight, torch.Tensor) else type(qweight).__name__
        raise ValueError(f"qweight must be an int8 matrix [N, K], got {desc}")
    n, k = qweight.shape
    _check_group_size(group_size, k, "qweight")
    expected = (n,) if group_size is None else (n, k // group_size)
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != expected:
        got = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        how = "per output channel (group_size=None)" if group_size is None else f"group_size={group_size}"
        raise ValueError(f"scale must have shape {expected} for qweight {tuple(qweight.shape)} {how}, got {got}")
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")
    if scale.device != qweight.device:
        raise ValueError(f"scale must be on qweight's device {qweight.device}, got {scale.device}")


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, group_size: int | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``qweight * scale`` ``[N, K]`` computed in fp32, returned in ``dtype``: the inverse of
    :func:`quantize_int8` up to its rounding."""
    _check_quantized(qweight, scale, group_size)
    n, k = qweight.shape
    if group_size is None:
        w = qweight.float() * scale[:, None]
    else:
        w = (qweight.float().view(n, k // group_size, group_size) * scale[:, :, None]).view(n, k)
    return w.to(dtype)


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None, group_size: int | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize_int8(qweight, scale, group_size).to(x.dtype), bias)``, the bias in
    x's dtype: the reference the kernel is held to."""
    weight = dequantize_int8(qweight, scale, group_size, torch.float32).to(x.dtype)
    return F.linear(x, weight, bias.to(x.dtype) if bias is not None else None)


@functools.cache
def _triton_module():
    from dslab.kernels.quant import int8_linear_triton

    return int8_linear_triton


@torch.library.custom_op("dslab::int8_linear", mutates_args=())
def _int8_linear_op(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    group_size: int | None) -> torch.Tensor:
    """y [M, N] in x's dtype for x [M, K], qweight int8 [N, K], scale fp32, bias [N] in x's dtype."""
    return _triton_module().int8_linear(x, qweight, scale, bias, group_size)


@_int8_linear_op.register_fake
def _(x, qweight, scale, bias, group_size):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _no_backward(ctx, grad_out):
    raise RuntimeError(forward_only_message("dslab::int8_linear"))


_int8_linear_op.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


def _validate(x, qweight, scale, bias, group_size) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError("x must be a tensor [..., K] with at least one dimension")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    _check_quantized(qweight, scale, group_size)
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension {x.shape[-1]} must equal qweight's K = {k} (qweight is [N, K])")
    if qweight.device != x.device:
        raise ValueError(f"qweight must be on x's device {x.device}, got {qweight.device}")
    if bias is not None:
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},) (qweight's N), got {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise ValueError(f"bias must be a floating-point tensor, got {bias.dtype}")
        if bias.device != x.device:
            raise ValueError(f"bias must be on x's device {x.device}, got {bias.device}")


def _triton_path(x2d, qweight, scale, bias, group_size) -> torch.Tensor:
    if use_custom_op():
        return _int8_linear_op(x2d, qweight, scale, bias, group_size)
    return _triton_module().int8_linear(x2d, qweight, scale, bias, group_size)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                group_size: int | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize_int8(qweight, scale, group_size).to(x.dtype), bias)`` for x
    ``[..., K]`` (fp16/bf16/fp32), qweight int8 ``[N, K]``, scale fp32 ``[N]`` or
    ``[N, K // group_size]``, bias ``[N]`` or None (cast to x's dtype); y ``[..., N]`` in x's dtype.
    Forward-only. Which path runs for which shapes: see the module docstring. Bad shapes, dtypes,
    devices and group sizes raise ``ValueError`` naming the argument.

    The Triton kernel reads qweight row-major: a non-contiguous qweight (a transposed view) is
    copied into that order on every call, ``N * K`` bytes read and written besides the kernel's
    own read, and a copy across strides runs far below copy bandwidth. Keep it as
    :func:`quantize_int8` returns it (contiguous)."""
    _validate(x, qweight, scale, bias, group_size)
    n, k = qweight.shape
    x2d = x.reshape(-1, k)
    rows = x2d.shape[0]
    if bias is not None:
        bias = bias.to(x.dtype)
    skinny = 0 < rows <= SKINNY_MAX_ROWS and n > 0 and k > 0
    # Prefill (many rows) and the reference backend both run dequantise + F.linear.
    on_triton = skinny and x.dtype in TRITON_DTYPES and use_triton(x, qweight, scale, bias)
    compute = _triton_path if on_triton else int8_linear_reference
    y = run_forward_only("dslab::int8_linear", lambda *inputs: compute(*inputs, group_size),
                         x2d, qweight, scale, bias)
    return y.reshape(*x.shape[:-1], n)
