"""grouped_gemm on a CUDA GPU: the Triton kernels at the mixture-of-experts anchor and at uneven
sizes, against the float64 reference.

    python3 -m pytest -q -m gpu tests/kernels/moe/test_grouped_gemm_gpu.py

Errors are measured against the reference in float64 and must stay within twice PyTorch's own
error in the same precision (its per-expert loop of cuBLAS matmuls), plus a floor of one unit in the
last place at the output's scale (STYLE.md #4).
"""

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_reference

pytestmark = pytest.mark.gpu

# 16384 tokens routed top-2 over 8 experts of uneven sizes.
ANCHOR_SIZES = [3000, 5200, 4100, 3900, 4500, 3300, 4268, 4500]
# Uneven everything: N and K no multiple of a tile, an empty expert and one of a single row.
UNEVEN_SIZES = [1200, 0, 1, 2047, 1752]


def _assert_within_torch_error(name, actual, torch_low, exact, contraction=1):
    """Within twice PyTorch's error plus a floor: one unit in the last place at the result's scale
    for 16-bit outputs (their rounding dominates); for fp32, the error a length-``contraction``
    dot product may gather in a different summation order than cuBLAS's, eps * sqrt(length)."""
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item()
    torch_err = (torch_low.double() - exact).abs().max().item()
    growth = contraction ** 0.5 if actual.dtype == torch.float32 else 1.0
    floor = torch.finfo(actual.dtype).eps * growth * exact.abs().max().item()
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _offsets(sizes, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=dtype, device="cuda")


def _inputs(k, n, sizes, dtype, with_bias=True, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, groups = sum(sizes), len(sizes)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(groups, n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(groups, n, device="cuda", generator=gen).to(dtype) if with_bias else None
    dy = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
    return x, w, bias, dy


def _run(fn, x, w, offsets, bias, dy, dtype=None):
    """Output and gradients (x, w and bias) of ``fn`` on leaf copies cast to ``dtype``."""
    dtype = dtype or x.dtype
    x, w = (t.detach().to(dtype).requires_grad_() for t in (x, w))
    bias = bias.detach().to(dtype).requires_grad_() if bias is not None else None
    y = fn(x, w, offsets, bias)
    wrt = [x, w] if bias is None else [x, w, bias]
    return [y.detach(), *torch.autograd.grad(y, wrt, dy.to(dtype))]


def _check(k, n, sizes, dtype, with_bias=True, offsets_dtype=torch.int64):
    x, w, bias, dy = _inputs(k, n, sizes, dtype, with_bias)
    offsets = _offsets(sizes, offsets_dtype)
    exact = _run(grouped_gemm_reference, x, w, offsets, bias, dy, dtype=torch.float64)
    low = _run(grouped_gemm_reference, x, w, offsets, bias, dy)
    got = _run(grouped_gemm, x, w, offsets, bias, dy)
    contractions = {"y": k, "dx": n, "dw": max(sizes), "dbias": max(sizes)}
    for name, a, lo, ex in zip(["y", "dx", "dw", "dbias"], got, low, exact):
        assert a.dtype == dtype and a.shape == lo.shape, name
        _assert_within_torch_error(name, a, lo, ex, contractions[name])
    return x, w, bias, dy, offsets, got


@pytest.mark.parametrize("k, n", [(1024, 4096), (4096, 1024)], ids=["up_1024_4096", "down_4096_1024"])
def test_anchor_bf16(k, n):
    x, w, bias, dy, offsets, got = _check(k, n, ANCHOR_SIZES, torch.bfloat16)
    again = _run(grouped_gemm, x, w, offsets, bias, dy)
    for name, a, b in zip(["y", "dx", "dw", "dbias"], got, again):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_uneven_sizes(dtype, with_bias):
    _, _, _, _, _, got = _check(1000, 3000, UNEVEN_SIZES, dtype, with_bias, offsets_dtype=torch.int32)
    assert torch.all(got[2][1] == 0), "the empty expert's weight gradient must be zero"


def test_fast_path_never_synchronises():
    x, w, bias, dy = _inputs(1024, 4096, ANCHOR_SIZES, torch.bfloat16)
    offsets = _offsets(ANCHOR_SIZES)
    _run(grouped_gemm, x, w, offsets, bias, dy)  # compiles and autotunes (which synchronises)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(grouped_gemm, x, w, offsets, bias, dy)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def test_torch_compile_matches_eager():
    x, w, bias, dy = _inputs(1024, 4096, UNEVEN_SIZES, torch.bfloat16)
    offsets = _offsets(UNEVEN_SIZES)

    def expert_up(x, w, offsets, bias):
        return torch.relu(grouped_gemm(x, w, offsets, bias))

    compiled = torch.compile(expert_up, fullgraph=True)
    eager = _run(expert_up, x, w, offsets, bias, dy)
    got = _run(compiled, x, w, offsets, bias, dy)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)


def test_torch_backend_runs_the_reference():
    x, w, bias, _ = _inputs(256, 128, UNEVEN_SIZES, torch.float32)
    offsets = _offsets(UNEVEN_SIZES)
    with kernel_backend("torch"):
        assert torch.equal(grouped_gemm(x, w, offsets, bias), grouped_gemm_reference(x, w, offsets, bias))


@pytest.mark.parametrize("mode", ["off", "on"])
def test_pointer_and_descriptor_main_loops(mode, monkeypatch):
    """Both main loops of the kernels at the anchor and at uneven widths: "on" takes the tensor
    descriptors wherever the operands allow (a Hopper device), "off" the pointer loads."""
    import dslab.kernels.moe.grouped_gemm_triton as kernels

    if mode == "on" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need compute capability 9+")
    monkeypatch.setattr(kernels, "TMA_MODE", mode)
    _check(1024, 4096, ANCHOR_SIZES, torch.bfloat16)
    _check(1000, 3000, UNEVEN_SIZES, torch.bfloat16, offsets_dtype=torch.int32)
