"""OuterProductMean on the dslab kernel set, its projection forced onto the Triton
``outer_product_linear`` (interpreted on CPU), against the torch set from the same weights:
outputs, the MSA gradient and every parameter gradient, in fp32 and under bf16 autocast; and the
flops profiler seeing the fused op in place of the permuted copy's addmm."""

import pytest
import torch

from dslab.kernels import dispatch, kernel_backend
from dslab.models.evoformer_blocks import OuterProductMean
from dslab.models.ops import op_set
from dslab.profilers.flops import FlopsProfiler

pytestmark = pytest.mark.skipif(not (dispatch.triton_available() and (dispatch.interpreting()
                                                                       or torch.cuda.is_available())),
                                reason="needs triton and a GPU or TRITON_INTERPRET=1")

BATCH, SEQS, RES, C_M, C_Z = 2, 6, 9, 16, 12


def _modules(c_hidden: int) -> dict[str, OuterProductMean]:
    """One OuterProductMean per kernel set, the torch set's weights (a wide init) in both."""
    torch.manual_seed(0)
    modules = {name: OuterProductMean(C_M, C_Z, c_hidden, op_set(name)) for name in ("torch", "dslab")}
    with torch.no_grad():
        for p in modules["torch"].parameters():
            p.normal_(0.0, 0.3)
    modules["dslab"].load_state_dict(modules["torch"].state_dict())
    return modules


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(BATCH, SEQS, RES, C_M, generator=g)
    msa_mask = (torch.rand(BATCH, SEQS, RES, generator=g) > 0.3).float()
    msa_mask[:, 0, :] = 1
    assert (msa_mask == 0).any()
    return m, msa_mask


def _run(module, m, msa_mask, seed=99):
    """The update and the gradients of a random linear function of it (m and every parameter)."""
    leaf = m.clone().requires_grad_()
    out = module(leaf, msa_mask)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    module.zero_grad(set_to_none=True)
    (out.float() * weights).sum().backward()
    grads = {"m": leaf.grad, **{name: p.grad for name, p in module.named_parameters()}}
    return out.detach(), grads


@pytest.mark.parametrize("c_hidden", [5, 8], ids=lambda c: f"c_hidden={c}")
def test_dslab_opm_matches_the_torch_set(c_hidden):
    modules = _modules(c_hidden)
    m, msa_mask = _inputs(1)
    with kernel_backend("torch"):
        ref_out, ref_grads = _run(modules["torch"], m, msa_mask)
    with kernel_backend("triton"):
        out, grads = _run(modules["dslab"], m, msa_mask)
    assert ref_out.abs().mean() > 1e-2
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert ref is not None and ref.abs().sum() > 0, name
        atol = 1e-5 * max(1.0, ref.abs().max().item())
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=atol, msg=lambda s, n=name: f"{n}: {s}")


def test_dslab_opm_under_bf16_autocast_stays_near_the_torch_set():
    modules = _modules(8)
    m, msa_mask = _inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with kernel_backend("torch"):
            ref_out, ref_grads = _run(modules["torch"], m, msa_mask)
        with kernel_backend("triton"):
            out, grads = _run(modules["dslab"], m, msa_mask)
    assert out.dtype == ref_out.dtype == torch.bfloat16
    assert (out.float() - ref_out.float()).abs().max() <= 0.03 * ref_out.float().abs().max()
    for name, ref in ref_grads.items():
        assert grads[name].dtype == ref.dtype == torch.float32, name
        assert (grads[name] - ref).abs().max() <= 0.05 * ref.abs().max(), name


def test_flops_profiler_sees_the_fused_projection():
    """The fused op replaces linear_out's addmm at the same flops: 2 B R^2 C^2 c_z forward."""
    c_hidden = 5
    module = _modules(c_hidden)["dslab"]
    m, msa_mask = _inputs(3)
    profiler = FlopsProfiler(module)
    with kernel_backend("triton"):
        profiler.start_profile()
        module(m, msa_mask)
        profiler.stop_profile()
    flops = profiler.records()["flops_by_op"]
    assert flops["dslab::outer_product_linear"]["flops"] == 2 * BATCH * RES * RES * c_hidden ** 2 * C_Z
