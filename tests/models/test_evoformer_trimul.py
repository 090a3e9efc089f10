"""The Evoformer's triangle multiplication (outgoing and incoming) on the dslab set with its kernels
forced onto Triton (interpreted on CPU: sigmoid gates, layer norms and the channels-first layer
norm of the product) against the torch set, from one state dict: outputs, the input gradient and
every parameter gradient in fp32, with a pair mask holding zeros; and the same under bf16 autocast.
"""

import pytest
import torch

from dslab.kernels import dispatch, kernel_backend
from dslab.models.evoformer_blocks import TriangleMultiplication
from dslab.models.ops import op_set
from dslab.profilers.flops import FlopsProfiler

pytestmark = pytest.mark.skipif(not (dispatch.triton_available() and dispatch.interpreting()),
                                reason="needs triton and TRITON_INTERPRET=1")

C_Z, C_HIDDEN, BATCH, RES = 16, 12, 2, 9  # c_hidden not a power of two: masked channels


def _modules(outgoing: bool) -> dict[str, TriangleMultiplication]:
    """One module per set, both holding the torch set's weights: a wide init, and layer-norm
    parameters away from 1 and 0 so that their gradients and their use show."""
    torch.manual_seed(0)
    ref = TriangleMultiplication(C_Z, C_HIDDEN, outgoing, op_set("torch"))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.startswith("layer_norm"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    ours = TriangleMultiplication(C_Z, C_HIDDEN, outgoing, op_set("dslab"))
    ours.load_state_dict(ref.state_dict())
    return {"torch": ref, "dslab": ours}


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(BATCH, RES, RES, C_Z, generator=g)
    pair_mask = (torch.rand(BATCH, RES, RES, generator=g) > 0.3).float()
    assert (pair_mask == 0).any()
    return z, pair_mask


def _run(module, z, pair_mask, seed=99):
    z = z.clone().requires_grad_()
    out = module(z, pair_mask)
    g = torch.Generator().manual_seed(seed)
    module.zero_grad(set_to_none=True)
    (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {"z": z.grad, **{name: p.grad for name, p in module.named_parameters()}}
    return out.detach(), grads


def _assert_close(ours, ref, name):
    atol = 1e-5 * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=atol, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_dslab_set_matches_the_torch_set(outgoing):
    modules = _modules(outgoing)
    z, pair_mask = _inputs(1)
    with kernel_backend("torch"):
        ref_out, ref_grads = _run(modules["torch"], z, pair_mask)
    with kernel_backend("triton"):
        out, grads = _run(modules["dslab"], z, pair_mask)
    assert ref_out.abs().mean() > 1e-2  # a real update, not a near-zero one
    _assert_close(out, ref_out, "output")
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert ref is not None and ref.abs().sum() > 0, name
        _assert_close(grads[name], ref, name)


@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_mixed_precision_stays_near_the_torch_set(outgoing):
    """bf16 autocast over fp32 parameters: the product is bf16, the layer norm's weights fp32."""
    modules = _modules(outgoing)
    z, pair_mask = _inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with kernel_backend("torch"):
            ref_out, ref_grads = _run(modules["torch"], z, pair_mask)
        with kernel_backend("triton"):
            out, grads = _run(modules["dslab"], z, pair_mask)
    assert out.dtype == ref_out.dtype == torch.bfloat16
    scale = ref_out.float().abs().max()
    assert (out.float() - ref_out.float()).abs().max() <= 0.05 * scale
    for name in ("z", "layer_norm_out.weight", "layer_norm_out.bias", "linear_a_p.weight"):
        ref, ours = ref_grads[name].float(), grads[name].float()
        assert grads[name].dtype == ref_grads[name].dtype, name
        assert (ours - ref).abs().max() <= 0.05 * ref.abs().max(), name


def test_product_is_normalised_by_the_channels_first_op():
    """The dslab set's forward and backward run dslab::layer_norm_channels_first(_backward) on the
    [B, c, R, R] product, and no aten layer norm."""
    module = _modules(True)["dslab"]
    z, pair_mask = _inputs(3)
    profiler = FlopsProfiler(module)
    profiler.start_profile()
    with kernel_backend("triton"):
        _run(module, z, pair_mask)
    profiler.stop_profile()
    ops = profiler.records()["flops_by_op"]
    numel = BATCH * RES * RES * C_HIDDEN
    assert ops["dslab::layer_norm_channels_first"]["flops"] == 5 * numel
    assert ops["dslab::layer_norm_channels_first_backward"]["flops"] == 10 * numel
    assert not any(name.startswith("aten::native_layer_norm") for name in ops)


@pytest.mark.parametrize("outgoing", [True, False])
def test_triangle_product_gradients_are_contiguous_gemms(outgoing):
    """The dslab set's product (``_TriangleProduct``) gives autograd's matmul gradients, each in its
    input's own (contiguous) layout: no transposed gradient for the gates' views to copy."""
    from dslab.models.evoformer_blocks import _TriangleProduct

    torch.manual_seed(4)
    a, b = (torch.randn(BATCH, C_HIDDEN, RES, RES, dtype=torch.float64, requires_grad=True) for _ in range(2))
    g = torch.randn(BATCH, C_HIDDEN, RES, RES, dtype=torch.float64)
    ref = torch.matmul(a, b.transpose(-1, -2)) if outgoing else torch.matmul(a.transpose(-1, -2), b)
    ref_da, ref_db = torch.autograd.grad(ref, (a, b), g)
    out = _TriangleProduct.apply(a, b, outgoing)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    da, db = torch.autograd.grad(out, (a, b), g)
    torch.testing.assert_close(da, ref_da, rtol=0, atol=1e-12)
    torch.testing.assert_close(db, ref_db, rtol=0, atol=1e-12)
    assert da.is_contiguous() and db.is_contiguous()
    assert not (ref_db if outgoing else ref_da).is_contiguous()  # what autograd's matmul hands back
