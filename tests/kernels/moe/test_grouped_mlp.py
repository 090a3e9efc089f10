"""grouped_mlp: the fused Triton path (under the interpreter on CPU) against the PyTorch reference.

Errors are measured against the reference in float64 and must stay within twice PyTorch's own
error in the same precision, plus a floor of one unit in the last place at the output's scale.
Shapes are odd and smaller than a tile in places (37 rows over three groups, one of them empty;
H = 24, F = 40 against the interpreter's 16-wide tiles).
"""

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.dispatch import interpreting
from dslab.kernels.moe.grouped_mlp import ACTIVATIONS, grouped_mlp, grouped_mlp_reference
from dslab.moe.experts import Experts, MLPExpert

H, F = 24, 40
SIZES = [20, 0, 17]
NAMES = ["y", "dx", "dw1", "db1", "dw2", "db2"]

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


def _inputs(sizes, dtype, with_bias=True, seed=0):
    """x, w1, b1, w2, b2, dy; the biases None without ``with_bias``."""
    gen = torch.Generator().manual_seed(seed)
    m, groups = sum(sizes), len(sizes)
    x = torch.randn(m, H, generator=gen).to(dtype)
    w1 = (torch.randn(groups, F, H, generator=gen) / H**0.5).to(dtype)
    b1 = torch.randn(groups, F, generator=gen).to(dtype) if with_bias else None
    w2 = (torch.randn(groups, H, F, generator=gen) / F**0.5).to(dtype)
    b2 = torch.randn(groups, H, generator=gen).to(dtype) if with_bias else None
    dy = torch.randn(m, H, generator=gen).to(dtype)
    return x, w1, b1, w2, b2, dy


def _run(fn, x, w1, b1, w2, b2, dy, offsets, activation, dtype=None, weight_dtype=None):
    """Output and gradients (x, w1, b1, w2, b2; the biases' left out when None) of ``fn`` on leaf
    copies, x and dy cast to ``dtype``, the weights and biases to ``weight_dtype`` (both default
    to x's dtype)."""
    dtype = dtype or x.dtype
    weight_dtype = weight_dtype or dtype
    x = x.detach().to(dtype).requires_grad_()
    w1, b1, w2, b2 = (t.detach().to(weight_dtype).requires_grad_() if t is not None else None
                      for t in (w1, b1, w2, b2))
    y = fn(x, w1, b1, w2, b2, offsets, activation)
    wrt = [t for t in (x, w1, b1, w2, b2) if t is not None]
    return [y.detach(), *torch.autograd.grad(y, wrt, dy.to(y.dtype))]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_matches_float64_reference(dtype, activation):
    x, w1, b1, w2, b2, dy = _inputs(SIZES, dtype)
    offsets = _offsets(SIZES, torch.int32 if dtype == torch.bfloat16 else torch.int64)
    exact = _run(grouped_mlp_reference, x, w1, b1, w2, b2, dy, offsets, activation, dtype=torch.float64)
    low = _run(grouped_mlp_reference, x, w1, b1, w2, b2, dy, offsets, activation)
    with kernel_backend("triton"):
        got = _run(grouped_mlp, x, w1, b1, w2, b2, dy, offsets, activation)
    for name, a, lo, ex in zip(NAMES, got, low, exact, strict=True):
        assert a.dtype == dtype and a.shape == lo.shape, name
        _assert_within_torch_error(name, a, lo, ex)
    assert torch.all(got[2][1] == 0) and torch.all(got[4][1] == 0), "the empty group's weight gradients"


@needs_interpreter
def test_int32_and_int64_offsets_without_biases_give_identical_results():
    x, w1, _, w2, _, dy = _inputs(SIZES, torch.float32, with_bias=False, seed=3)
    exact = _run(grouped_mlp_reference, x, w1, None, w2, None, dy, _offsets(SIZES), "gelu_tanh",
                 dtype=torch.float64)
    with kernel_backend("triton"):
        runs = [_run(grouped_mlp, x, w1, None, w2, None, dy, _offsets(SIZES, dtype), "gelu_tanh")
                for dtype in (torch.int64, torch.int32)]
    for name, a, b, ex in zip(["y", "dx", "dw1", "dw2"], *runs, exact, strict=True):
        assert torch.equal(a, b), name
        torch.testing.assert_close(a.double(), ex, rtol=1e-5, atol=1e-5, msg=name)


@needs_interpreter
def test_fp32_master_weights_give_fp32_gradients_from_the_accumulators():
    """bf16 x with fp32 weights runs the products on the weights cast to bf16 (y and dx equal those
    of bf16 weights bit for bit) and returns dw1, db1, dw2, db2 in fp32, the accumulators that the
    bf16 run rounds: rounded to bf16 they equal that run's gradients exactly."""
    dtype = torch.bfloat16
    x, w1, b1, w2, b2, dy = _inputs(SIZES, torch.float32, seed=1)
    offsets = _offsets(SIZES)
    with kernel_backend("triton"):
        master = _run(grouped_mlp, x, w1, b1, w2, b2, dy, offsets, "gelu", dtype=dtype, weight_dtype=torch.float32)
        half = _run(grouped_mlp, x, w1, b1, w2, b2, dy, offsets, "gelu", dtype=dtype)
    reference = _run(grouped_mlp_reference, x, w1, b1, w2, b2, dy, offsets, "gelu", dtype=dtype,
                     weight_dtype=torch.float32)
    assert [t.dtype for t in master] == [dtype, dtype] + [torch.float32] * 4 == [t.dtype for t in reference]
    for name, a, b in zip(NAMES, master, half, strict=True):
        assert torch.equal(a.to(dtype), b), name
    for name, a in zip(NAMES[2:], master[2:]):
        assert not torch.equal(a, a.to(dtype).float()), f"{name} must keep fp32's precision"
    # accuracy against float64 on the bf16-rounded weights (the products' operands)
    rounded = [t.to(dtype) for t in (w1, b1, w2, b2)]
    exact = _run(grouped_mlp_reference, x.to(dtype), *rounded, dy, offsets, "gelu", dtype=torch.float64)
    low = _run(grouped_mlp_reference, x, *rounded, dy, offsets, "gelu", dtype=dtype)
    for name, a, lo, ex in zip(NAMES, master, low, exact, strict=True):
        _assert_within_torch_error(name, a.to(dtype), lo, ex)


@needs_interpreter
def test_only_the_gradients_needed():
    x, w1, b1, w2, b2, dy = _inputs(SIZES, torch.float32, seed=2)
    offsets = _offsets(SIZES)
    w1, b2 = w1.requires_grad_(), b2.requires_grad_()
    with kernel_backend("triton"):
        got = torch.autograd.grad(grouped_mlp(x, w1, b1, w2, b2, offsets, "silu"), [w1, b2], dy)
    w1_ref, b2_ref = w1.detach().double().requires_grad_(), b2.detach().double().requires_grad_()
    y_ref = grouped_mlp_reference(x.double(), w1_ref, b1.double(), w2.double(), b2_ref, offsets, "silu")
    for a, b in zip(got, torch.autograd.grad(y_ref, [w1_ref, b2_ref], dy.double()), strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_custom_ops_pass_opcheck():
    sizes = [5, 0, 9]
    x, w1, b1, w2, b2, dy = _inputs(sizes, torch.float32, seed=4)
    args = (x, w1, b1, w2, b2)
    torch.library.opcheck(torch.ops.dslab.grouped_mlp.default,
                          (*(t.requires_grad_() for t in args), _offsets(sizes), "gelu"))
    pre = torch.randn(sum(sizes), F, generator=torch.Generator().manual_seed(4))
    torch.library.opcheck(torch.ops.dslab.grouped_mlp_backward_hidden.default,
                          (dy, w2.detach(), _offsets(sizes, torch.int32), pre, "silu"))


@needs_interpreter
def test_torch_compile_traces_the_custom_ops():
    x, w1, b1, w2, b2, dy = _inputs([5, 0, 9], torch.float32, seed=4)
    offsets = _offsets([5, 0, 9])

    def expert_mlp(x, w1, b1, w2, b2, offsets, activation):
        return grouped_mlp(x, w1, b1, w2, b2, offsets, activation) * 2

    compiled = torch.compile(expert_mlp, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager = _run(expert_mlp, x, w1, b1, w2, b2, dy, offsets, "gelu")
        got = _run(compiled, x, w1, b1, w2, b2, dy, offsets, "gelu")
    for name, a, b in zip(NAMES, got, eager, strict=True):
        torch.testing.assert_close(a, b, msg=name)


def _experts(activation, seed=0):
    torch.manual_seed(seed)
    experts = Experts(MLPExpert(H, F, activation), num_local_experts=len(SIZES), expert_group_name="ep_size_1",
                      hidden_size=H)
    with torch.no_grad():
        for p in experts.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    assert experts.stacked
    return experts


def _experts_grads(experts, out, x, dy):
    return [out.detach(), *torch.autograd.grad(out, [x, *experts.parameters()], dy)]


@needs_interpreter
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_stacked_experts_equal_reference_forward(activation):
    experts = _experts(activation)
    x, *_, dy = _inputs(SIZES, torch.float32, seed=5)
    x.requires_grad_()
    with kernel_backend("triton"):
        got = _experts_grads(experts, experts(x, _offsets(SIZES)), x, dy)
    expected = _experts_grads(experts, experts.reference_forward(x, SIZES), x, dy)
    for name, a, b in zip(["out", "dx", "dw1", "db1", "dw2", "db2"], got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@needs_interpreter
def test_flops_profiler_counts_twelve_m_h_f_for_the_grouped_mlp():
    """The fused op is priced as the two GEMMs it runs (4 M H F), its d_pre GEMM 2 M H F, and the
    grouped GEMM's dx (2 M H F) and two weight gradients (4 M H F): 12 M H F, the unfused count."""
    from dslab.profilers.flops import FlopsProfiler

    experts = _experts("gelu_tanh")

    class FusedExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = experts

        def forward(self, x, offsets):
            e = self.experts
            return grouped_mlp(x, e.w1, e.b1, e.w2, e.b2, offsets, "gelu_tanh")

    x, *_ = _inputs(SIZES, torch.float32, seed=6)
    m = x.shape[0]
    model = FusedExperts()
    profiler = FlopsProfiler(model)
    with kernel_backend("triton"):
        profiler.start_profile()
        model(x.requires_grad_(), _offsets(SIZES)).sum().backward()
        profiler.stop_profile()
    records = profiler.records()
    mhf2 = 2 * m * H * F
    by_op = records["flops_by_op"]
    assert by_op["dslab::grouped_mlp"] == {"figure": "matmul", "flops": 2 * mhf2}
    assert by_op["dslab::grouped_mlp_backward_hidden"] == {"figure": "matmul", "flops": mhf2}
    assert by_op["dslab::grouped_gemm_backward_input"] == {"figure": "matmul", "flops": mhf2}
    assert by_op["dslab::grouped_gemm_backward_weight"] == {"figure": "matmul", "flops": 2 * mhf2}
    assert "dslab::bias_gelu" not in by_op and "dslab::grouped_gemm" not in by_op
    assert (records["forward_flops"], records["backward_flops"]) == (2 * mhf2, 4 * mhf2)
    assert records["total_flops"] == 6 * mhf2


def test_torch_backend_and_cpu_auto_run_the_reference():
    x, w1, b1, w2, b2, _ = _inputs(SIZES, torch.float32)
    offsets = _offsets(SIZES)
    expected = grouped_mlp_reference(x, w1, b1, w2, b2, offsets, "relu")
    bounds = offsets.tolist()
    by_hand = torch.cat([torch.relu(x[a:b] @ w1[g].T + b1[g]) @ w2[g].T + b2[g]
                         for g, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    torch.testing.assert_close(expected, by_hand)
    for name in ("torch", "auto"):
        with kernel_backend(name):
            assert torch.equal(grouped_mlp(x, w1, b1, w2, b2, offsets, "relu"), expected)


def _bad_arguments():
    x, off = torch.ones(6, 4), torch.tensor([0, 2, 6])
    w1, b1, w2, b2 = torch.ones(2, 3, 4), torch.ones(2, 3), torch.ones(2, 4, 3), torch.ones(2, 4)
    return [
        ((x, w1, b1, w2, b2, off, "tanh"), "activation must be one of"),
        ((x, torch.ones(3, 4), b1, w2, b2, off, "gelu"), "w1 must be 3-D"),
        ((x, torch.ones(2, 3, 5), b1, w2, b2, off, "gelu"), "w1's last dimension"),
        ((x, w1, torch.ones(3), w2, b2, off, "gelu"), r"b1 must have shape \(2, 3\)"),
        ((x, w1, b1, torch.ones(2, 3, 4), b2, off, "gelu"), r"w2 must have shape \(2, 4, 3\)"),
        ((x, w1, b1, w2.double(), b2, off, "gelu"), "w2 must have w1's dtype"),
        ((x, w1, b1, w2, torch.ones(2, 3), off, "gelu"), r"b2 must have shape \(2, 4\)"),
        ((x, w1, b1, w2, b2.half(), off, "gelu"), "b2 must have w2's dtype"),
        ((x, w1, b1, w2, b2, torch.tensor([0, 6]), "gelu"), r"group_offsets must have shape \(3,\)"),
        ((x, w1, b1, w2, b2, torch.tensor([0, 7, 6]), "gelu"), "nondecreasing"),
    ]


@pytest.mark.parametrize("args, match", _bad_arguments(), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        grouped_mlp(*args)
