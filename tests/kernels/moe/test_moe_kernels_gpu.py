"""On a GPU: the MoE gating and permute/unpermute kernels at GPT-2-MoE's sizes (16384 tokens, top-2
over 8 experts, hidden 1024, capacity factor 1.0 so that some assignments are dropped) against the
PyTorch references, forward and backward, and run-to-run determinism."""

import math

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.moe.moe_gating import moe_gating, moe_gating_reference
from dslab.kernels.moe.moe_permute import (
    moe_permute,
    moe_permute_reference,
    moe_unpermute,
    moe_unpermute_reference,
)

pytestmark = pytest.mark.gpu

TOKENS, EXPERTS, HIDDEN, TOP_K = 16384, 8, 1024, 2
CAPACITY = math.ceil(TOP_K * TOKENS / EXPERTS)  # capacity factor 1.0


def _generator(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _gating_inputs(dtype, seed=0):
    gen = _generator(seed)
    logits = (2 * torch.randn(TOKENS, EXPERTS, generator=gen, device="cuda")).to(dtype)
    uniform = torch.rand(TOKENS, EXPERTS, generator=gen, device="cuda").clamp(1e-6, 1 - 1e-6)
    noise = -torch.log(-torch.log(uniform))
    dprobs = torch.randn(TOKENS, EXPERTS, generator=gen, device="cuda")
    dgate = torch.randn(TOKENS, TOP_K, generator=gen, device="cuda")
    return logits, noise, dprobs, dgate


def _run_gating(fn, logits, noise, dprobs, dgate):
    logits = logits.detach().clone().requires_grad_()
    out = fn(logits, TOP_K, noise)
    (dlogits,) = torch.autograd.grad((out.probs * dprobs).sum() + (out.gate_weight * dgate).sum(), logits)
    return out, dlogits


def _exact(logits, expert_index, dprobs, dgate):
    """probs, gate weights and d logits in float64 for the given choices."""
    x = logits.detach().double().requires_grad_()
    probs = torch.softmax(x, dim=1)
    chosen = probs.gather(1, expert_index.long())
    gate_weight = chosen / chosen.sum(dim=1, keepdim=True) if TOP_K == 2 else chosen
    (dx,) = torch.autograd.grad((probs * dprobs.double()).sum() + (gate_weight * dgate.double()).sum(), x)
    return probs.detach(), gate_weight.detach(), dx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("noisy", [False, True])
def test_gating_real_size(dtype, noisy):
    logits, noise, dprobs, dgate = _gating_inputs(dtype)
    noise = noise if noisy else None
    ref, ref_dlogits = _run_gating(moe_gating_reference, logits, noise, dprobs, dgate)
    with kernel_backend("triton"):
        got, dlogits = _run_gating(moe_gating, logits, noise, dprobs, dgate)
        again, dlogits_again = _run_gating(moe_gating, logits, noise, dprobs, dgate)
    for name in ("expert_index", "position", "expert_counts"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert int(got.expert_counts.sum()) == TOP_K * TOKENS
    # Floats against float64, within twice the fp32 reference's own error plus one unit in the
    # last place at the result's scale (Triton's exp and torch's expf differ by a few ulp).
    exact = _exact(logits, ref.expert_index, dprobs, dgate)
    for name, a, r, ex in zip(("probs", "gate_weight", "dlogits"), (got.probs, got.gate_weight, dlogits),
                              (ref.probs, ref.gate_weight, ref_dlogits), exact):
        err = (a.double() - ex).abs().max().item()
        ref_err = (r.double() - ex).abs().max().item()
        floor = torch.finfo(a.dtype).eps * ex.abs().max().item()
        assert err <= 2 * ref_err + floor, f"{name}: error {err:.3g} vs the reference's {ref_err:.3g}"
    for a, b in zip((*got, dlogits), (*again, dlogits_again)):
        assert torch.equal(a, b), "two identical runs differ"


def _row_index():
    """DeepSpeed's dispatch at capacity factor 1.0: expert * capacity + position, -1 past capacity."""
    logits, noise, _, _ = _gating_inputs(torch.float32, seed=1)
    gate = moe_gating_reference(logits, TOP_K, noise)
    row_index = torch.where(gate.position < CAPACITY, gate.expert_index * CAPACITY + gate.position, -1)
    assert (row_index < 0).any() and (gate.expert_counts < CAPACITY).any()  # drops and padding
    return row_index.to(torch.int32), gate.gate_weight


def _run_data_path(permute, unpermute, x, row_index, gate_weight, dy, dx_perm):
    x = x.detach().clone().requires_grad_()
    gate_weight = gate_weight.detach().clone().requires_grad_()
    x_perm = permute(x, row_index, EXPERTS * CAPACITY)
    y_perm = (x_perm * 2).detach().requires_grad_()
    y = unpermute(y_perm, row_index, gate_weight)
    loss = (y.float() * dy.float()).sum() + (x_perm.float() * dx_perm).sum()
    grads = torch.autograd.grad(loss, [x, gate_weight, y_perm])
    return [x_perm.detach(), y.detach(), *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_permute_and_unpermute_real_size(dtype):
    row_index, gate_weight = _row_index()
    gen = _generator(2)
    x = torch.randn(TOKENS, HIDDEN, generator=gen, device="cuda").to(dtype)
    dy = torch.randn(TOKENS, HIDDEN, generator=gen, device="cuda").to(dtype)
    dx_perm = torch.randn(EXPERTS * CAPACITY, HIDDEN, generator=gen, device="cuda")
    args = (x, row_index, gate_weight, dy, dx_perm)
    ref = _run_data_path(moe_permute_reference, moe_unpermute_reference, *args)
    with kernel_backend("triton"):
        got = _run_data_path(moe_permute, moe_unpermute, *args)
        again = _run_data_path(moe_permute, moe_unpermute, *args)
    names = ["x_perm", "y", "dx", "dgate", "dy_perm"]
    assert torch.equal(got[0], ref[0]), "x_perm"
    eps = torch.finfo(dtype).eps
    for name, a, b in zip(names[1:], got[1:], ref[1:]):
        if name == "dgate":  # an fp32 dot product over 1024 elements, summed in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4, msg=name)
        else:
            torch.testing.assert_close(a, b, rtol=eps, atol=eps * b.abs().max().item(), msg=name)
    for name, a, b in zip(names, got, again):
        assert torch.equal(a, b), f"{name} differs between two identical runs"
