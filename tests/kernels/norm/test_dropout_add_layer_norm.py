"""dropout_add_layer_norm: the fused Triton kernels (under the interpreter on CPU) against the unfused
pair they replace (bias_dropout_residual's kernel, then layer_norm_fork's) and against the PyTorch
reference.

The fused forward draws the pair's dropout mask for the same seed and rounds h as the pair does,
so y and h are bit-identical; so are the activation gradients (the residual add's two inputs get
the stored gradient of h and its masked, scaled copy). The parameter gradients are fp32 sums of
the same terms in another order, so they match to fp32 rounding.
"""

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels import kernel_backend
from dslab.kernels.dropout.bias_dropout_residual import bias_dropout_residual
from dslab.kernels.dropout.bias_dropout_residual_triton import kernel_p
from dslab.kernels.norm.dropout_add_layer_norm import dropout_add_layer_norm, dropout_add_layer_norm_reference
from dslab.kernels.norm.layer_norm import layer_norm_fork

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(m, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, residual, dy, dh = (torch.randn(m, n, generator=gen).to(dtype) for _ in range(4))
    x_bias = torch.randn(n, generator=gen).to(dtype)
    weight = 1 + 0.5 * torch.randn(n, generator=gen)
    bias = 0.5 * torch.randn(n, generator=gen)
    return x, x_bias, residual, weight, bias, dy, dh


def _pair(x, x_bias, residual, p, training, seed, weight, bias, eps=1e-5):
    """The unfused pair as a pre-LN layer ran it: the layer norm's backward adds h's other gradient."""
    return layer_norm_fork(bias_dropout_residual(x, x_bias, residual, p, training, seed), weight, bias, eps)


def _run(fn, inputs, p, seed, use_y=True, use_h=True, training=True):
    x, x_bias, residual, weight, bias, dy, dh = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (x, x_bias, residual, weight, bias)]
    y, h = fn(leaves[0], leaves[1], leaves[2], p, training, seed, leaves[3], leaves[4])
    outs, grads = [], []
    if use_y:
        outs.append(y)
        grads.append(dy)
    if use_h:
        outs.append(h)
        grads.append(dh)
    got = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    return y.detach(), h.detach(), got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(37, 100), (5, 33)], ids=str)
def test_fused_matches_the_unfused_pair(dtype, p, shape):
    inputs = _inputs(*shape, dtype)
    seed = torch.tensor([2**40 + 3])
    with kernel_backend("triton"):
        y, h, grads = _run(dropout_add_layer_norm, inputs, p, seed)
        y_ref, h_ref, grads_ref = _run(_pair, inputs, p, seed)
    assert y.dtype == dtype and h.dtype == dtype
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
    names = ["dx", "dx_bias", "dresidual", "dweight", "dbias"]
    for name, a, b in zip(names, grads, grads_ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name in ("dx", "dresidual"):
            assert torch.equal(a, b), name
        else:
            # fp32 partial sums in another order (dx_bias then rounds to x's dtype)
            tol = 1e-5 if name != "dx_bias" or dtype == torch.float32 else 2 * torch.finfo(dtype).eps
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * a.abs().max().item(), msg=name)
    if p > 0:
        dropped = (grads[0] == 0) & (grads[2] != 0)
        assert 0.03 < dropped.float().mean() < 0.2


@pytest.mark.parametrize("use_y, use_h", [(True, False), (False, True)])
def test_one_output_alone(use_y, use_h):
    """Post-LN keeps only y (no gradient reaches h directly); only h reaching the loss runs the
    residual add's backward alone."""
    inputs = _inputs(21, 70, torch.bfloat16, seed=1)
    seed = torch.tensor([99])
    with kernel_backend("triton"):
        *_, grads = _run(dropout_add_layer_norm, inputs, 0.2, seed, use_y, use_h)
        *_, grads_ref = _run(_pair, inputs, 0.2, seed, use_y, use_h)
    for name, a, b in zip(["dx", "dx_bias", "dresidual", "dweight", "dbias"], grads, grads_ref):
        if b is None:
            assert a is None or not a.any(), name
            continue
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item(), msg=name)


def test_against_the_reference_in_float64_with_the_kernels_mask():
    """The fp32 fused op against the float64 reference, replaying the kernel's mask (read off the
    residual add's kernel with x = 1, residual = 0, the same seed)."""
    m, n, p, seed = 29, 96, 0.25, 4321
    inputs = _inputs(m, n, torch.float32, seed=2)
    with kernel_backend("triton"):
        ones = bias_dropout_residual(torch.ones(m, n), None, torch.zeros(m, n), p, True, seed)
        y, h, grads = _run(dropout_add_layer_norm, inputs, p, torch.tensor([seed]))
    keep = ones != 0

    def reference(x, x_bias, residual, p_, training, seed_, weight, bias):
        return dropout_add_layer_norm_reference(x, x_bias, residual, kernel_p(p), training, None, weight, bias,
                                                keep_mask=keep)

    exact = _run(reference, [t.double() for t in inputs], p, None)
    torch.testing.assert_close(y, exact[0].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, exact[1].float(), rtol=1e-6, atol=1e-6)
    for name, a, b in zip(["dx", "dx_bias", "dresidual", "dweight", "dbias"], grads, exact[2]):
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-4 * b.abs().max().item(), msg=name)


def test_eval_mode_and_no_bias_on_the_reference_path():
    """Without dropout (eval) and without biases, the reference path is layer_norm(residual + x)."""
    inputs = _inputs(8, 48, torch.float32, seed=3)
    x, _, residual, weight, _, _, _ = inputs
    y, h = dropout_add_layer_norm(x, None, residual, 0.5, False, None, weight, None)
    torch.testing.assert_close(h, x + residual)
    torch.testing.assert_close(y, F.layer_norm(x + residual, (48,), weight, None, 1e-5))
    with kernel_backend("triton"):
        y_t, h_t = dropout_add_layer_norm(x, None, residual, 0.5, False, None, weight, None)
    torch.testing.assert_close(y_t, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_t, h)


def test_bad_inputs_name_the_problem():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        dropout_add_layer_norm(x, None, torch.randn(4, 8), 0.1, True, 1, None, None)
    with pytest.raises(ValueError, match="seed must be an int"):
        dropout_add_layer_norm(x, None, torch.randn(4, 16), 0.1, True, None, None, None)
    with pytest.raises(ValueError, match="weight must have shape"):
        dropout_add_layer_norm(x, None, torch.randn(4, 16), 0.1, True, 1, torch.ones(8), None)
