"""gate_linear, the MoE gate's fp32 scores read from half-precision tokens: the Triton kernels
(under the interpreter on CPU) against float64 products, with the upcast-and-F.linear reference's
own error as the yardstick; the custom op under opcheck and torch.compile; argument errors."""

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.moe.gate_linear import gate_linear, gate_linear_reference


def _inputs(tokens, hidden, experts, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w = torch.randn(experts, hidden, generator=gen) / hidden ** 0.5
    dl = torch.randn(tokens, experts, generator=gen)
    return x, w, dl


def _run(fn, x, w, dl):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = fn(x, w)
    return [logits.detach(), *torch.autograd.grad(logits, (x, w), dl)]


@pytest.mark.parametrize("tokens,hidden,experts", [(77, 70, 5), (130, 64, 8), (3, 200, 16)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_float64_within_the_references_error(tokens, hidden, experts, dtype):
    x, w, dl = _inputs(tokens, hidden, experts, dtype)
    with kernel_backend("triton"):
        got = _run(gate_linear, x, w, dl)
    ref = _run(gate_linear_reference, x, w, dl)
    xd, wd = x.double(), w.double()
    exact = [xd @ wd.T, (dl.double() @ wd), dl.double().T @ xd]
    for name, a, r, e in zip(["logits", "dx", "dw"], got, ref, exact):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        err = (a.double() - e).abs().max().item()
        ref_err = (r.double() - e).abs().max().item()
        floor = 4 * torch.finfo(a.dtype).eps * e.abs().max().item()
        assert err <= 2 * ref_err + floor, f"{name}: error {err:.3g} vs the reference's {ref_err:.3g}"
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype and got[2].dtype == torch.float32


def test_strided_tokens_and_autocast_leave_the_scores_in_fp32():
    x, w, _ = _inputs(40, 96, 8, torch.bfloat16)
    wide = torch.cat([x, x], dim=1)[:, 96:]
    with kernel_backend("triton"), torch.autocast("cpu", dtype=torch.bfloat16):
        got = gate_linear(wide, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, gate_linear_reference(x, w), rtol=1e-5, atol=1e-5)


def test_custom_op_passes_opcheck_and_compiles():
    x, w, _ = _inputs(33, 48, 8, torch.bfloat16)
    with kernel_backend("triton"):
        torch.library.opcheck(torch.ops.dslab.gate_linear.default, (x, w.requires_grad_()),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
        compiled = torch.compile(lambda a, b: gate_linear(a, b).sum(), backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x, w), gate_linear_reference(x, w).sum(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("x_shape,w,match", [
    ((4, 8, 2), torch.zeros(3, 8), "x must be"),
    ((4, 8), torch.zeros(3, 9), "weight must be \\[experts, 8\\]"),
    ((4, 8), torch.zeros(3, 8, dtype=torch.bfloat16), "weight must be fp32"),
], ids=["x_rank", "hidden", "weight_dtype"])
def test_bad_arguments_name_the_argument(x_shape, w, match):
    with pytest.raises(ValueError, match=match):
        gate_linear(torch.zeros(x_shape), w)


def test_flops_profiler_counts_the_gate_products():
    """dslab::gate_linear 2*T*H*E forward; its backward (dx and dw) 4*T*H*E."""
    from torch import nn

    from dslab.profilers.flops import FlopsProfiler

    x, w, _ = _inputs(37, 48, 8, torch.bfloat16)

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(w)

        def forward(self, tokens):
            return gate_linear(tokens, self.weight)

    model = Gate()
    profiler = FlopsProfiler(model)
    with kernel_backend("triton"):
        profiler.start_profile()
        model(x.requires_grad_()).sum().backward()
        profiler.stop_profile()
    records = profiler.records()
    forward = 2 * 37 * 48 * 8
    assert records["flops_by_op"]["dslab::gate_linear"] == {"figure": "matmul", "flops": forward}
    assert records["flops_by_op"]["dslab::gate_linear_backward"] == {"figure": "matmul", "flops": 2 * forward}
    assert (records["forward_flops"], records["backward_flops"]) == (forward, 2 * forward)
    assert records["uncounted_autograd_functions"] == []
