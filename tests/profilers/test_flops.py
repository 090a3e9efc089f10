"""Flops profiler: exact counts of single ops against formulas derived by hand here, forward and
backward, and the split of the figures (matmul total, elementwise estimate, CPU fused attention)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dslab.profilers.flops import FlopsProfiler


class Call(nn.Module):
    """Runs ``fn(*inputs)`` so functional code can be profiled under a module."""

    def __init__(self, fn, *params):
        super().__init__()
        self.fn = fn
        self.params = nn.ParameterList(params)

    def forward(self, *inputs):
        return self.fn(*inputs)


def profile(model, *inputs, backward=True):
    """Forward (and backward of the output's sum) of ``model`` under the profiler."""
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    out = model(*inputs)
    if backward:
        out.float().sum().backward()
    profiler.stop_profile()
    return profiler


def fwd_bwd(profiler):
    return profiler.get_total_flops(phase="forward"), profiler.get_total_flops(phase="backward")


@pytest.mark.parametrize("input_grad", [True, False])
def test_linear_backward_is_counted_from_what_ran(input_grad):
    """nn.Linear(7 -> 5) on x [3, 11, 7]: forward 2*33*7*5; backward computes the weight gradient
    always and the input gradient only when x needs one: 2x or 1x the forward."""
    torch.manual_seed(0)
    layer = nn.Linear(7, 5)
    x = torch.randn(3, 11, 7, requires_grad=input_grad)
    forward = 2 * (3 * 11) * 7 * 5
    profiler = profile(layer, x)
    assert fwd_bwd(profiler) == (forward, (2 if input_grad else 1) * forward)
    assert profiler.get_total_flops() == forward * (3 if input_grad else 2)
    assert profiler.get_total_macs() == profiler.get_total_flops() // 2
    assert profiler.get_total_macs(phase="forward") == 3 * 11 * 7 * 5


def test_functional_calls_and_operators_are_counted():
    """F.linear, torch.matmul, @ on 4-d tensors, bmm and einsum, each written as the matmul it is."""
    torch.manual_seed(0)
    cases = [
        (lambda a, b: F.linear(a, b), (torch.randn(4, 6), torch.randn(3, 6)), 2 * 4 * 6 * 3),
        (torch.matmul, (torch.randn(2, 5, 6), torch.randn(6, 7)), 2 * (2 * 5) * 6 * 7),
        (lambda a, b: a @ b, (torch.randn(2, 3, 5, 6), torch.randn(2, 3, 6, 4)), 2 * (2 * 3) * 5 * 6 * 4),
        (torch.bmm, (torch.randn(3, 5, 6), torch.randn(3, 6, 2)), 2 * 3 * 5 * 6 * 2),
        (lambda a, b: torch.einsum("bhqd,bhkd->bhqk", a, b), (torch.randn(2, 3, 5, 8), torch.randn(2, 3, 9, 8)),
         2 * (2 * 3) * 5 * 9 * 8),
        (lambda a, b: torch.einsum("ij,jk->ik", a, b), (torch.randn(5, 6), torch.randn(6, 4)), 2 * 5 * 6 * 4),
    ]
    for fn, inputs, expected in cases:
        profiler = profile(Call(fn), *inputs, backward=False)
        assert profiler.get_total_flops() == expected, fn
        assert profiler.get_total_flops(phase="backward") == 0


def test_matmul_backward_counts_each_gradient_that_ran():
    """a @ b with a [5, 6] and b [6, 4]: forward 2*5*6*4; backward one matmul per input needing a
    gradient."""
    torch.manual_seed(0)
    forward = 2 * 5 * 6 * 4
    for a_grad, b_grad, matmuls in ((True, True, 2), (True, False, 1), (False, True, 1)):
        a = torch.randn(5, 6, requires_grad=a_grad)
        b = torch.randn(6, 4, requires_grad=b_grad)
        profiler = profile(Call(torch.matmul), a, b)
        assert fwd_bwd(profiler) == (forward, matmuls * forward)


@pytest.mark.parametrize("dims", [1, 2])
def test_convolution_forward_and_backward(dims):
    """conv{1,2}d: 2 * batch * output positions * C_out * C_in * kernel size; the backward's input
    and weight gradients cost the same again each."""
    torch.manual_seed(0)
    batch, c_in, c_out, kernel = 2, 3, 4, 3
    if dims == 1:
        conv, x, positions = nn.Conv1d(c_in, c_out, kernel), torch.randn(batch, c_in, 17), 17 - kernel + 1
    else:
        conv = nn.Conv2d(c_in, c_out, kernel, padding=1)
        x, positions = torch.randn(batch, c_in, 9, 7), 9 * 7
    x.requires_grad_(True)
    forward = 2 * batch * positions * c_out * c_in * kernel**dims
    assert fwd_bwd(profile(conv, x)) == (forward, 2 * forward)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_is_an_elementwise_estimate_outside_the_total(affine):
    """LayerNorm on x [6, 10]: 5 flops per element forward (4 without weight and bias), 10 (6)
    backward, reported as the elementwise figure; the matmul total stays 0."""
    torch.manual_seed(0)
    rows, n = 6, 10
    norm = nn.LayerNorm(n, elementwise_affine=affine)
    profiler = profile(norm, torch.randn(rows, n, requires_grad=True))
    ops = profiler.records()["flops_by_op"]
    assert profiler.get_total_flops() == 0
    assert ops["aten::native_layer_norm"] == {"figure": "elementwise", "flops": (5 if affine else 4) * rows * n}
    assert ops["aten::native_layer_norm_backward"]["flops"] == (10 if affine else 6) * rows * n
    # the forward phase also holds the .sum() of the output that profile() differentiates
    assert profiler.get_elementwise_flops(phase="forward") == (5 if affine else 4) * rows * n + rows * n


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_math_backend(causal):
    """SDPA's math backend materialises the [Sq, Sk] scores: 2 matmuls of 2*B*H*Sq*Sk*D forward,
    causal or not (the masked half is computed too), and 4 backward (dQ, dK, dV, dP)."""
    torch.manual_seed(0)
    b, h, sq, sk, d = 2, 3, 5, 7, 8
    q = torch.randn(b, h, sq, d, requires_grad=True)
    k, v = torch.randn(b, h, sk, d, requires_grad=True), torch.randn(b, h, sk, d, requires_grad=True)
    model = Call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    with sdpa_kernel(SDPBackend.MATH):
        profiler = profile(model, q, k, v)
    forward = 4 * b * h * sq * sk * d
    assert fwd_bwd(profiler) == (forward, 2 * forward)


def test_cpu_fused_attention_is_reported_beside_the_total():
    """The default CPU SDPA kernel has no formula in torch's counter: its flops (torch's SDPA
    formulas: 4*B*H*S*S*D forward, 2.5x that backward) are a separate figure, so the total still
    equals FlopCounterMode's."""
    torch.manual_seed(0)
    b, h, s, d = 1, 2, 16, 32
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    profiler = profile(Call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v)), q, k, v)
    records = profiler.records()
    if "aten::_scaled_dot_product_flash_attention_for_cpu" not in records["flops_by_op"]:
        pytest.skip("this torch build does not take the fused CPU attention kernel")
    forward = 4 * b * h * s * s * d
    assert profiler.get_total_flops() == 0
    assert records["cpu_attention_flops"]["forward"] == forward
    assert records["cpu_attention_flops"]["backward"] == forward * 5 // 2


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_fused_attention_counts_half_when_causal(causal):
    """The CPU fused kernel skips the blocks above the diagonal when causal: half of torch's
    formula, forward and backward."""
    torch.manual_seed(0)
    b, h, s, d = 1, 2, 16, 32
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    profiler = profile(Call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), q, k, v)
    records = profiler.records()
    if "aten::_scaled_dot_product_flash_attention_for_cpu" not in records["flops_by_op"]:
        pytest.skip("this torch build does not take the fused CPU attention kernel")
    forward = 4 * b * h * s * s * d // (2 if causal else 1)
    assert records["cpu_attention_flops"]["forward"] == forward
    assert records["cpu_attention_flops"]["backward"] == forward * 5 // 2


def _meta(*shape):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


def _gpu_attention_calls(q, k, v, causal):
    """(op overload, args, kwargs, out) of each fused GPU attention kernel torch's counter knows,
    forward and backward, at q, k, v's shapes (meta tensors: the formulas read shapes only)."""
    aten = torch.ops.aten
    b, h, s, d = q.shape
    lse, seed, offset = _meta(b, h, s).float(), _meta(2).long(), _meta(()).long()
    grads = (q, k, v)
    mask = 1 if causal else 0
    return [
        (aten._scaled_dot_product_flash_attention.default, (q, k, v, 0.0), {"is_causal": causal}, (q, lse)),
        (aten._scaled_dot_product_efficient_attention.default, (q, k, v, None, True, 0.0, causal), {}, (q, lse)),
        (aten._scaled_dot_product_cudnn_attention.default, (q, k, v, None, True, 0.0, causal, False), {}, (q, lse)),
        (aten._flash_attention_forward.default, (q, k, v, None, None, s, s, 0.0, causal, False), {}, (q, lse)),
        (aten._efficient_attention_forward.default, (q, k, v, None, None, None, s, s, 0.0, mask), {}, (q, lse)),
        (aten._scaled_dot_product_flash_attention_backward.default,
         (q, q, k, v, q, lse, None, None, s, s, 0.0, causal, seed, offset), {}, grads),
        (aten._scaled_dot_product_efficient_attention_backward.default,
         (q, q, k, v, None, q, lse, seed, offset, 0.0, [True, True, True, False], causal), {}, grads),
        (aten._scaled_dot_product_cudnn_attention_backward.default,
         (q, q, k, v, q, lse, seed, offset, None, None, None, s, s, 0.0, causal), {}, grads),
        (aten._flash_attention_backward.default,
         (q, q, k, v, q, lse, None, None, s, s, 0.0, causal, seed, offset), {}, grads),
        (aten._efficient_attention_backward.default,
         (q, q, k, v, None, q, None, None, s, s, lse, 0.0, seed, offset, mask, False), {}, grads),
    ]


def test_fused_gpu_attention_counts_half_when_causal():
    """SDPA's flash, efficient and cuDNN kernels (and the flash/efficient entry points under them):
    torch's formula prices the whole score square; called causal they count half of it, as
    dslab's own attention does, forward (4*B*H*S*S*D / 2) and backward (2.5x that). The formulas
    read shapes only (the entry points' as [B, H, S, D], as torch's counter does), so the ops are
    priced on meta tensors, on any machine."""
    from dslab.profilers import flops_causal, flops_formulas

    b, h, s, d = 2, 3, 16, 8
    q, k, v = _meta(b, h, s, d), _meta(b, h, s, d), _meta(b, h, s, d)
    full = 4 * b * h * s * s * d
    for causal in (False, True):
        expected_forward = full // 2 if causal else full
        assert flops_formulas.attention_flops(q.shape, k.shape, causal) == expected_forward
        for func, args, kwargs, out in _gpu_attention_calls(q, k, v, causal):
            name = func.name()
            assert flops_causal.runs_causal(func, args, kwargs) is causal, name
            figure, flops = flops_formulas.count(func, args, kwargs, out)
            assert figure == flops_formulas.MATMUL
            assert flops == (expected_forward * 5 // 2 if name.endswith("backward") else expected_forward), name


def test_flop_counter_mapping_agrees_on_causal_attention():
    """``causal_aware_formulas`` (what the benchmark's flops per step count with) prices every
    fused attention call as the profiler does, and FlopCounterMode honours it on a real call."""
    from torch.utils.flop_counter import FlopCounterMode

    from dslab.profilers import flops_causal, flops_formulas

    mapping = flops_causal.causal_aware_formulas()
    q, k, v = _meta(2, 3, 16, 8), _meta(2, 3, 16, 8), _meta(2, 3, 16, 8)
    for causal in (False, True):
        for func, args, kwargs, out in _gpu_attention_calls(q, k, v, causal):
            expected = flops_formulas.count(func, args, kwargs, out)[1]
            assert mapping[func._overloadpacket](*args, **kwargs, out_val=out) == expected, func.name()
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
        assert counter.get_total_flops() == flops_formulas.attention_flops(q.shape, k.shape, causal)


def test_elementwise_constants_for_pointwise_and_softmax():
    """x * y + z: 1 flop per output element per op; softmax 5 per element forward, 4 backward; the
    .sum() that profile() differentiates 1 per element."""
    torch.manual_seed(0)
    x, y, z = (torch.randn(4, 9, requires_grad=True) for _ in range(3))
    profiler = profile(Call(lambda x, y, z: torch.softmax(x * y + z, dim=-1)), x, y, z)
    ops = profiler.records()["flops_by_op"]
    assert ops["aten::_softmax"]["flops"] == 5 * 36
    assert ops["aten::_softmax_backward_data"]["flops"] == 4 * 36
    assert profiler.get_elementwise_flops(phase="forward") == 36 + 36 + 5 * 36 + 36
    assert profiler.get_total_flops() == 0


def test_custom_autograd_function_the_dispatcher_cannot_see_is_named():
    """A Function whose backward computes outside torch's ops is listed, so a missing count is
    visible instead of silent."""

    class Opaque(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.detach().clone()

        @staticmethod
        def backward(ctx, grad):
            return torch.from_numpy(grad.numpy() * 2.0)

    x = torch.randn(3, 4, requires_grad=True)
    profiler = profile(Call(Opaque.apply), x)
    assert profiler.records()["uncounted_autograd_functions"] == ["Opaque"]


def test_phase_argument_is_checked():
    profiler = profile(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(ValueError, match="phase"):
        profiler.get_total_flops(phase="fwd")


def test_grouped_query_attention_is_priced_per_query_head():
    """SDPA with ``enable_gqa`` (fewer key/value heads than query heads): torch's formulas refuse
    unequal head counts; each query head still meets a whole key and value sequence, so the call
    costs what it would with the key/value heads repeated, forward and backward, in the profiler
    and in the benchmark's counter alike."""
    from torch.utils.flop_counter import FlopCounterMode

    from dslab.profilers import flops_causal, flops_formulas

    b, hq, hkv, s, d = 2, 6, 2, 16, 8
    q, k, v = _meta(b, hq, s, d), _meta(b, hkv, s, d), _meta(b, hkv, s, d)
    wide_k, wide_v = _meta(b, hq, s, d), _meta(b, hq, s, d)
    mapping = flops_causal.causal_aware_formulas()
    for causal in (False, True):
        expected = flops_formulas.attention_flops(q.shape, wide_k.shape, causal)
        for (func, args, kwargs, out), (_, wide_args, _, wide_out) in zip(
                _gpu_attention_calls(q, k, v, causal), _gpu_attention_calls(q, wide_k, wide_v, causal)):
            name = func.name()
            figure, flops = flops_formulas.count(func, args, kwargs, out)
            assert flops == flops_formulas.count(func, wide_args, kwargs, wide_out)[1], name
            assert flops == (expected * 5 // 2 if name.endswith("backward") else expected), name
            assert mapping[func._overloadpacket](*args, **kwargs, out_val=out) == flops, name
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
        assert counter.get_total_flops() == expected
    cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert flops_formulas.count(cpu, (q, k, v, 0.0, False), {}, None)[1] == 4 * b * hq * s * s * d
