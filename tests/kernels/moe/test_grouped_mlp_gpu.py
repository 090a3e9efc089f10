"""grouped_mlp on a CUDA GPU: the fused Triton path (the activation in the grouped GEMMs' epilogues)
at the mixture-of-experts anchor and at uneven sizes, against the float64 reference.

    python3 -m pytest -q -m gpu tests/kernels/moe/test_grouped_mlp_gpu.py

Errors are measured against the reference in float64 and must stay within twice PyTorch's own
error in the same precision (its per-expert loop of cuBLAS matmuls and torch activations), plus a
floor of one unit in the last place at the output's scale, grown for fp32 by the square root of
the longest contraction behind the result (summation order against cuBLAS's).
"""

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.moe.grouped_mlp import ACTIVATIONS, grouped_mlp, grouped_mlp_reference

pytestmark = pytest.mark.gpu

NAMES = ["y", "dx", "dw1", "db1", "dw2", "db2"]
# 16384 tokens routed top-2 over 8 experts of uneven sizes; hidden 1024, FFN 4096.
ANCHOR_SIZES = [3000, 5200, 4100, 3900, 4500, 3300, 4268, 4500]
ANCHOR_H, ANCHOR_F = 1024, 4096
# Uneven everything: H and F no multiple of a tile, an empty expert and one of a single row.
UNEVEN_SIZES = [1200, 0, 1, 2047, 1752]
UNEVEN_H, UNEVEN_F = 1000, 3000


def _assert_within_torch_error(name, actual, torch_low, exact, contraction=1):
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item()
    torch_err = (torch_low.double() - exact).abs().max().item()
    growth = contraction ** 0.5 if actual.dtype == torch.float32 else 1.0
    floor = torch.finfo(actual.dtype).eps * growth * exact.abs().max().item()
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _offsets(sizes, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=dtype, device="cuda")


def _inputs(h, f, sizes, dtype, seed=0):
    """x, w1, b1, w2, b2, dy on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, groups = sum(sizes), len(sizes)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    x = randn(m, h)
    w1, b1 = randn(groups, f, h, scale=h**-0.5), randn(groups, f)
    w2, b2 = randn(groups, h, f, scale=f**-0.5), randn(groups, h)
    return x, w1, b1, w2, b2, randn(m, h)


def _run(fn, x, w1, b1, w2, b2, dy, offsets, activation, dtype=None, weight_dtype=None):
    """Output and gradients (x, w1, b1, w2, b2) of ``fn`` on leaf copies, x and dy cast to
    ``dtype``, the weights and biases to ``weight_dtype`` (both default to x's dtype)."""
    dtype = dtype or x.dtype
    weight_dtype = weight_dtype or dtype
    x = x.detach().to(dtype).requires_grad_()
    params = [t.detach().to(weight_dtype).requires_grad_() for t in (w1, b1, w2, b2)]
    y = fn(x, *params[:2], *params[2:], offsets, activation)
    return [y.detach(), *torch.autograd.grad(y, [x, *params], dy.to(y.dtype))]


def _check(h, f, sizes, dtype, activation, offsets_dtype=torch.int64):
    x, w1, b1, w2, b2, dy = _inputs(h, f, sizes, dtype)
    offsets = _offsets(sizes, offsets_dtype)
    exact = _run(grouped_mlp_reference, x, w1, b1, w2, b2, dy, offsets, activation, dtype=torch.float64)
    low = _run(grouped_mlp_reference, x, w1, b1, w2, b2, dy, offsets, activation)
    got = _run(grouped_mlp, x, w1, b1, w2, b2, dy, offsets, activation)
    rows = max(sizes)
    contractions = {"y": max(h, f), "dx": max(h, f), "dw1": rows, "db1": rows, "dw2": rows, "db2": rows}
    for name, a, lo, ex in zip(NAMES, got, low, exact, strict=True):
        assert a.dtype == dtype and a.shape == lo.shape, name
        _assert_within_torch_error(name, a, lo, ex, contractions[name])
    return (x, w1, b1, w2, b2, dy, offsets), got


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_anchor_bf16(activation):
    inputs, got = _check(ANCHOR_H, ANCHOR_F, ANCHOR_SIZES, torch.bfloat16, activation)
    x, w1, b1, w2, b2, dy, offsets = inputs
    again = _run(grouped_mlp, x, w1, b1, w2, b2, dy, offsets, activation)
    for name, a, b in zip(NAMES, got, again, strict=True):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_uneven_sizes(dtype, activation):
    _, got = _check(UNEVEN_H, UNEVEN_F, UNEVEN_SIZES, dtype, activation, offsets_dtype=torch.int32)
    assert torch.all(got[2][1] == 0) and torch.all(got[4][1] == 0), "the empty expert's weight gradients"


def test_fp32_master_weights_with_bf16_x():
    """The products run on the weights cast to bf16 (y and dx equal those of bf16 weights), and the
    weight and bias gradients come back in fp32, within the bf16 reference's error of float64."""
    dtype = torch.bfloat16
    x, w1, b1, w2, b2, dy = _inputs(UNEVEN_H, UNEVEN_F, UNEVEN_SIZES, torch.float32, seed=1)
    offsets = _offsets(UNEVEN_SIZES)
    master = _run(grouped_mlp, x, w1, b1, w2, b2, dy, offsets, "gelu", dtype=dtype, weight_dtype=torch.float32)
    half = _run(grouped_mlp, x, w1, b1, w2, b2, dy, offsets, "gelu", dtype=dtype)
    assert [t.dtype for t in master] == [dtype, dtype] + [torch.float32] * 4
    assert torch.equal(master[0], half[0]) and torch.equal(master[1], half[1])
    rounded = [t.to(dtype) for t in (w1, b1, w2, b2)]
    exact = _run(grouped_mlp_reference, x.to(dtype), *rounded, dy, offsets, "gelu", dtype=torch.float64)
    low = _run(grouped_mlp_reference, x, *rounded, dy, offsets, "gelu", dtype=dtype)
    for name, a, lo, ex in zip(NAMES, master, low, exact, strict=True):
        _assert_within_torch_error(name, a.to(dtype), lo, ex)


def test_fast_path_never_synchronises():
    x, w1, b1, w2, b2, dy = _inputs(ANCHOR_H, ANCHOR_F, ANCHOR_SIZES, torch.bfloat16)
    offsets = _offsets(ANCHOR_SIZES)
    _run(grouped_mlp, x, w1, b1, w2, b2, dy, offsets, "gelu")  # compiles and autotunes (which synchronises)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(grouped_mlp, x, w1, b1, w2, b2, dy, offsets, "gelu")
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def test_torch_compile_matches_eager():
    x, w1, b1, w2, b2, dy = _inputs(UNEVEN_H, UNEVEN_F, UNEVEN_SIZES, torch.bfloat16)
    offsets = _offsets(UNEVEN_SIZES)

    def expert_mlp(x, w1, b1, w2, b2, offsets, activation):
        return grouped_mlp(x, w1, b1, w2, b2, offsets, activation) * 2

    compiled = torch.compile(expert_mlp, fullgraph=True)
    eager = _run(expert_mlp, x, w1, b1, w2, b2, dy, offsets, "gelu_tanh")
    got = _run(compiled, x, w1, b1, w2, b2, dy, offsets, "gelu_tanh")
    for name, a, b in zip(NAMES, got, eager, strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_torch_backend_runs_the_reference():
    x, w1, b1, w2, b2, _ = _inputs(256, 384, UNEVEN_SIZES, torch.float32)
    offsets = _offsets(UNEVEN_SIZES)
    with kernel_backend("torch"):
        got = grouped_mlp(x, w1, b1, w2, b2, offsets, "silu")
    assert torch.equal(got, grouped_mlp_reference(x, w1, b1, w2, b2, offsets, "silu"))
