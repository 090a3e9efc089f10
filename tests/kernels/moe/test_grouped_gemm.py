"""grouped_gemm: the Triton kernels (under the interpreter on CPU) against the PyTorch reference.

Errors are measured against the reference in float64 and must stay within twice PyTorch's own
error in the same precision, plus a floor of one unit in the last place at the output's scale.
Shapes are odd and smaller than a tile in places; groups include empty ones and one of a single row.
"""

import pytest
import torch
import torch.nn as nn

from dslab.kernels import kernel_backend
from dslab.kernels.dispatch import interpreting
from dslab.kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (K, N, group sizes): M = sum of the sizes.
CASES = {
    "one_group": (24, 19, [37]),
    "empty_and_single_row": (40, 37, [20, 0, 1, 50, 26]),
    "empty_first_and_last": (70, 90, [0, 61, 89, 0]),
}

# (K, N, group sizes) with rows of 16-byte multiples in fp32 and bf16 (but N = 19), for the
# tensor-descriptor loads.
DESCRIPTOR_CASES = {
    "ragged_edges": (40, 24, [20, 0, 1, 50, 26]),
    "whole_tiles": (48, 32, [0, 61, 17, 0]),
    "unaligned_n": (24, 19, [37]),
}

needs_interpreter = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton kernels need a GPU or TRITON_INTERPRET=1"
)


def _assert_within_torch_error(name, actual, torch_low, exact):
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item() if exact.numel() else 0.0
    torch_err = (torch_low.double() - exact).abs().max().item() if exact.numel() else 0.0
    floor = torch.finfo(actual.dtype).eps * (exact.abs().max().item() if exact.numel() else 0.0)
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _offsets(sizes, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=dtype)


def _inputs(k, n, sizes, dtype, with_bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m, groups = sum(sizes), len(sizes)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(groups, n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(groups, n, generator=gen).to(dtype) if with_bias else None
    dy = torch.randn(m, n, generator=gen).to(dtype)
    return x, w, bias, dy


def _run(fn, x, w, offsets, bias, dy, dtype=None):
    """Output and gradients (x, w and bias) of ``fn`` on leaf copies cast to ``dtype``."""
    dtype = dtype or x.dtype
    x, w = (t.detach().to(dtype).requires_grad_() for t in (x, w))
    bias = bias.detach().to(dtype).requires_grad_() if bias is not None else None
    y = fn(x, w, offsets, bias)
    wrt = [x, w] if bias is None else [x, w, bias]
    return [y.detach(), *torch.autograd.grad(y, wrt, dy.to(dtype))]


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_triton_matches_float64_reference(dtype, case, with_bias):
    k, n, sizes = CASES[case]
    x, w, bias, dy = _inputs(k, n, sizes, dtype, with_bias)
    offsets = _offsets(sizes, torch.int32 if dtype == torch.float16 else torch.int64)
    exact = _run(grouped_gemm_reference, x, w, offsets, bias, dy, dtype=torch.float64)
    low = _run(grouped_gemm_reference, x, w, offsets, bias, dy)
    with kernel_backend("triton"):
        got = _run(grouped_gemm, x, w, offsets, bias, dy)
    assert len(got) == (4 if with_bias else 3)
    for name, a, lo, ex in zip(["y", "dx", "dw", "dbias"], got, low, exact):
        assert a.dtype == dtype and a.shape == lo.shape, name
        _assert_within_torch_error(name, a, lo, ex)
    empty = [g for g, size in enumerate(sizes) if size == 0]
    assert torch.all(got[2][empty] == 0), "an empty group's weight gradient must be zero"


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(DESCRIPTOR_CASES))
def test_tensor_descriptor_loads_give_the_pointer_loads_bit_for_bit(dtype, case, monkeypatch):
    """The kernels' tensor-descriptor main loops (Hopper's bulk copies; emulated by the interpreter)
    against their pointer loads: the same products in the same order, so the same bits. Operands
    whose rows break the copy engine's 16-byte rule (N = 19 here) take the pointer loads. Widths
    that the 16-wide interpreter tile does not divide read zeros past the edge from the descriptor."""
    import dslab.kernels.moe.grouped_gemm_triton as kernels

    k, n, sizes = DESCRIPTOR_CASES[case]
    x, w, bias, dy = _inputs(k, n, sizes, dtype)
    offsets = _offsets(sizes)
    chosen = []
    use_tma = kernels._use_tma

    def recording_use_tma(*args):
        chosen.append(use_tma(*args))
        return chosen[-1]

    monkeypatch.setattr(kernels, "_use_tma", recording_use_tma)
    runs = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(kernels, "TMA_MODE", mode)
        chosen.clear()
        with kernel_backend("triton"):
            runs[mode] = _run(grouped_gemm, x, w, offsets, bias, dy)
        k_rows, n_rows = ((width * x.element_size()) % 16 == 0 for width in (k, n))
        # forward (x, w: rows of K), input gradient (dy: rows of N; w), weight gradient (dy, x)
        assert chosen == [mode == "on" and k_rows, mode == "on" and n_rows and k_rows,
                          mode == "on" and n_rows and k_rows], chosen
    for name, a, b in zip(["y", "dx", "dw", "dbias"], runs["off"], runs["on"]):
        assert torch.equal(a, b), name


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_fp32_master_weights_give_fp32_gradients_from_the_accumulators(dtype, with_bias):
    """x in half precision, w and bias fp32: the products run on w cast to x's dtype, and dw/dbias
    come back in fp32 (the cast-then-multiply reference rounds its half-precision dw once more)."""
    k, n, sizes = CASES["empty_and_single_row"]
    x, w, bias, dy = _inputs(k, n, sizes, torch.float32, with_bias)
    x, dy = x.to(dtype), dy.to(dtype)
    offsets = _offsets(sizes)

    def grads(fn, x_dtype, w_dtype):
        xs = x.detach().to(x_dtype).requires_grad_()
        ws = w.detach().to(w_dtype).requires_grad_()
        bs = bias.detach().to(w_dtype).requires_grad_() if bias is not None else None
        y = fn(xs, ws, offsets, bs)
        return [y.detach(), *torch.autograd.grad(y, [xs, ws] + ([bs] if bs is not None else []), dy.to(y.dtype))]

    # exact: the products of the half-precision-rounded weights, in float64
    exact = grads(grouped_gemm_reference, torch.float64, torch.float64)
    rounded_w = w.to(dtype).double()
    with torch.no_grad():
        exact[0] = grouped_gemm_reference(x.double(), rounded_w, offsets,
                                          bias.to(dtype).double() if bias is not None else None)
        exact[1] = torch.cat([dy.double()[a:b] @ rounded_w[g] for g, (a, b) in
                              enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))])
    low = grads(grouped_gemm_reference, dtype, dtype)
    with kernel_backend("triton"):
        got = grads(grouped_gemm, dtype, torch.float32)
    for name, a, lo, ex in zip(["y", "dx", "dw", "dbias"], got, low, exact):
        want_dtype = dtype if name in ("y", "dx") else torch.float32
        assert a.dtype == want_dtype and a.shape == lo.shape, name
        if name in ("dw", "dbias"):  # fp32 from the fp32 accumulator: tighter than the half result
            torch.testing.assert_close(a.double(), ex, rtol=1e-5, atol=1e-5 * ex.abs().max().item())
        else:
            _assert_within_torch_error(name, a, lo, ex)
    mixed_ref = grads(grouped_gemm_reference, dtype, torch.float32)
    assert [t.dtype for t in mixed_ref] == [t.dtype for t in got]


@needs_interpreter
def test_many_groups_and_int32_and_int64_offsets_give_identical_results():
    # 19 groups (a [32]-wide group table), a third of them empty; strided rows of x.
    gen = torch.Generator().manual_seed(5)
    sizes = [int(s) for s in torch.randint(0, 9, (19,), generator=gen)]
    sizes[::3] = [0] * len(sizes[::3])
    k, n = 33, 21
    wide, w, bias, dy = _inputs(2 * k, n, sizes, torch.float32, seed=5)
    x = wide[:, :k]
    w = w[:, :, :k]
    exact = _run(grouped_gemm_reference, x, w, _offsets(sizes), bias, dy, dtype=torch.float64)
    with kernel_backend("triton"):
        runs = [_run(grouped_gemm, x, w, _offsets(sizes, dtype), bias, dy) for dtype in (torch.int64, torch.int32)]
    for name, a, b, ex in zip(["y", "dx", "dw", "dbias"], *runs, exact):
        assert torch.equal(a, b), name
        torch.testing.assert_close(a.double(), ex, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_gradients_only_where_needed_and_a_summed_output():
    k, n, sizes = CASES["empty_and_single_row"]
    x, w, bias, _ = _inputs(k, n, sizes, torch.float32)
    offsets = _offsets(sizes)
    w_ref = w.double().requires_grad_()
    grouped_gemm_reference(x.double(), w_ref, offsets, bias.double()).sum().backward()
    w = w.requires_grad_()
    with kernel_backend("triton"):
        y = grouped_gemm(x, w, offsets, bias)  # only w needs a gradient; dy is an expanded scalar
        y.sum().backward()
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_no_rows():
    x, w, bias, dy = _inputs(8, 5, [0, 0], torch.float32)
    with kernel_backend("triton"):
        y, dx, dw, dbias = _run(grouped_gemm, x, w, _offsets([0, 0]), bias, dy)
    assert y.shape == (0, 5) and dx.shape == (0, 8)
    assert torch.equal(dw, torch.zeros(2, 5, 8)) and torch.equal(dbias, torch.zeros(2, 5))


def test_torch_backend_and_cpu_auto_run_the_reference():
    k, n, sizes = CASES["empty_and_single_row"]
    x, w, bias, _ = _inputs(k, n, sizes, torch.float32)
    offsets = _offsets(sizes)
    expected = torch.cat([x[a:b] @ w[g].T + bias[g] for g, (a, b) in enumerate(zip(offsets, offsets[1:]))])
    for name in ("torch", "auto"):
        with kernel_backend(name):
            torch.testing.assert_close(grouped_gemm(x, w, offsets, bias), expected)


def _bad_arguments():
    x, w, off, bias = torch.ones(6, 4), torch.ones(2, 3, 4), torch.tensor([0, 2, 6]), torch.ones(2, 3)
    return [
        ((torch.ones(6, 4, 1), w, off, bias), "x must be 2-D"),
        ((x.long(), w.long(), off, None), "x must be a floating-point"),
        ((x, torch.ones(3, 4), off, bias), "w must be 3-D"),
        ((x, torch.ones(0, 3, 4), off[:1], None), "w must hold at least one group"),
        ((x, torch.ones(2, 3, 5), off, bias), "w's last dimension"),
        ((x, w.double(), off, bias), "w must have x's dtype"),
        ((x, w, torch.tensor([0, 6]), bias), r"group_offsets must have shape \(3,\)"),
        ((x, w, torch.tensor([[0, 2, 6]]), bias), "group_offsets must have shape"),
        ((x, w, off.float(), bias), "group_offsets must be int32 or int64"),
        ((x, w, off, torch.ones(3)), r"bias must have shape \(2, 3\)"),
        ((x, w, off, bias.half()), "bias must have w's dtype"),
        ((x, w, torch.tensor([0, 2, 5]), bias), "group_offsets must run from 0 to x's 6 rows"),
        ((x, w, torch.tensor([1, 2, 6]), bias), "group_offsets must run from 0"),
        ((x, w, torch.tensor([0, 7, 6]), bias), "nondecreasing"),
    ]


@pytest.mark.parametrize("args, match", _bad_arguments(), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        grouped_gemm(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_offsets_on_another_device_raise_value_error():
    x, w = torch.ones(6, 4, device="cuda"), torch.ones(2, 3, 4, device="cuda")
    with pytest.raises(ValueError, match="group_offsets must be on x's device"):
        grouped_gemm(x, w, torch.tensor([0, 2, 6]))


@needs_interpreter
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_custom_op_passes_opcheck(with_bias):
    x, w, bias, _ = _inputs(20, 17, [5, 0, 9], torch.float32, with_bias)
    bias = bias.requires_grad_() if bias is not None else None
    args = (x.requires_grad_(), w.requires_grad_(), _offsets([5, 0, 9]), bias)
    torch.library.opcheck(torch.ops.dslab.grouped_gemm.default, args)


@needs_interpreter
def test_torch_compile_traces_the_custom_op():
    k, n, sizes = CASES["empty_and_single_row"]
    x, w, bias, dy = _inputs(k, n, sizes, torch.float32)
    offsets = _offsets(sizes)

    def expert_mlp(x, w, offsets, bias):
        return torch.relu(grouped_gemm(x, w, offsets, bias)) * 2

    compiled = torch.compile(expert_mlp, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager = _run(expert_mlp, x, w, offsets, bias, dy)
        got = _run(compiled, x, w, offsets, bias, dy)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)


class _Experts(nn.Module):
    def __init__(self, w, bias, offsets):
        super().__init__()
        self.w, self.bias = nn.Parameter(w), nn.Parameter(bias)
        self.offsets = offsets

    def forward(self, x):
        return grouped_gemm(x, self.w, self.offsets, self.bias)


@needs_interpreter
def test_flops_profiler_counts_six_m_n_k():
    """dslab::grouped_gemm 2*M*N*K (the bias add is free); its backward dx and dw 2*M*N*K each."""
    from dslab.profilers.flops import FlopsProfiler

    k, n, sizes = CASES["empty_and_single_row"]
    x, w, bias, _ = _inputs(k, n, sizes, torch.bfloat16)
    m = x.shape[0]
    model = _Experts(w, bias, _offsets(sizes))
    profiler = FlopsProfiler(model)
    with kernel_backend("triton"):
        profiler.start_profile()
        model(x.requires_grad_()).float().sum().backward()
        profiler.stop_profile()
    records = profiler.records()
    mnk2 = 2 * m * n * k
    by_op = records["flops_by_op"]
    assert by_op["dslab::grouped_gemm"] == {"figure": "matmul", "flops": mnk2}
    assert by_op["dslab::grouped_gemm_backward_input"] == {"figure": "matmul", "flops": mnk2}
    assert by_op["dslab::grouped_gemm_backward_weight"] == {"figure": "matmul", "flops": mnk2}
    assert (records["forward_flops"], records["backward_flops"]) == (mnk2, 2 * mnk2)
    assert records["total_flops"] == 3 * mnk2
    assert records["uncounted_autograd_functions"] == []
