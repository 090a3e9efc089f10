"""layer_norm: the Triton kernels (under the interpreter on CPU) against the PyTorch reference.

Errors are measured against the reference in float64 and must stay within twice PyTorch's own
error in the same precision, plus a floor of one unit in the last place at the output's scale.
"""

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels import kernel_backend
from dslab.kernels.norm.layer_norm import MAX_FUSED_N, layer_norm, layer_norm_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _assert_within_torch_error(name, actual, torch_low, exact):
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item()
    torch_err = (torch_low.double() - exact).abs().max().item()
    floor = torch.finfo(actual.dtype).eps * exact.abs().max().item()
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _inputs(shape, dtype, affine, residual, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=gen) * 2 + 0.5
    r = torch.randn(shape, generator=gen) if residual else None
    w = 1 + 0.3 * torch.randn(n, generator=gen) if affine in ("both", "weight") else None
    b = 0.3 * torch.randn(n, generator=gen) if affine in ("both", "bias") else None
    dy = torch.randn(shape, generator=gen)
    dh = torch.randn(shape, generator=gen) if residual else None
    cast = lambda t: t.to(dtype) if t is not None else None  # noqa: E731
    return [cast(t) for t in (x, r, w, b)], cast(dy), cast(dh)


def _run(fn, tensors, dy, dh, dtype=None):
    """Outputs and gradients of ``fn`` (layer_norm's signature) on leaf copies of ``tensors``."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() if t is not None else None for t in tensors]
    x, r, w, b = leaves
    out = fn(x, w, b, 1e-5, r)
    outs = out if isinstance(out, tuple) else (out,)
    grads_in = [dy] if r is None else [dy, dh]
    grads_in = [g.to(outs[0].dtype) for g in grads_in]
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(outs, wrt, grads_in)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 129), (3, 5, 200)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_triton_matches_float64_reference(dtype, shape, residual):
    tensors, dy, dh = _inputs(shape, dtype, "both", residual)
    exact_outs, exact_grads = _run(layer_norm_reference, tensors, dy, dh, dtype=torch.float64)
    torch_outs, torch_grads = _run(layer_norm_reference, tensors, dy, dh)
    with kernel_backend("triton"):
        outs, grads = _run(layer_norm, tensors, dy, dh)

    names = ["y", "h"][: len(outs)]
    for name, out, low, exact in zip(names, outs, torch_outs, exact_outs):
        assert out.dtype == dtype and out.shape == shape
        _assert_within_torch_error(name, out, low, exact)
    grad_names = ["dx", "dresidual", "dweight", "dbias"] if residual else ["dx", "dweight", "dbias"]
    for name, grad, low, exact in zip(grad_names, grads, torch_grads, exact_grads):
        assert grad.dtype == dtype
        _assert_within_torch_error(name, grad, low, exact)


@pytest.mark.parametrize("affine", ["weight", "bias", "none"])
def test_without_bias_or_affine(affine):
    tensors, dy, dh = _inputs((45, 64), torch.float32, affine, residual=True, seed=1)
    exact_outs, exact_grads = _run(layer_norm_reference, tensors, dy, dh, dtype=torch.float64)
    with kernel_backend("triton"):
        outs, grads = _run(layer_norm, tensors, dy, dh)
    assert len(grads) == len(exact_grads) == (2 if affine == "none" else 3)
    for out, exact in zip(outs + grads, exact_outs + exact_grads):
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_many_row_tiles_per_program_and_strided_rows():
    # 300 rows of 48: 10 row tiles per step of the backward loop over 4 interpreter programs.
    wide = torch.randn(300, 96, dtype=torch.float32)
    x = wide[:, :48]  # row stride 96, read in place
    w, b = torch.randn(48), torch.randn(48)
    tensors, dy = [x, None, w, b], torch.randn(300, 48)
    exact_outs, exact_grads = _run(layer_norm_reference, tensors, dy, None, dtype=torch.float64)
    with kernel_backend("triton"):
        outs, grads = _run(layer_norm, tensors, dy, None)
    for out, exact in zip(outs + grads, exact_outs + exact_grads):
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_only_the_residual_stream_used_downstream():
    tensors, _, dh = _inputs((7, 33), torch.float32, "both", residual=True)
    x, r, w, b = [t.clone().requires_grad_() for t in tensors]
    with kernel_backend("triton"):
        _, h = layer_norm(x, w, b, residual=r)
    (h * dh).sum().backward()
    torch.testing.assert_close(x.grad, dh)
    torch.testing.assert_close(r.grad, dh)
    assert w.grad is None and b.grad is None


def test_weight_gradient_is_deterministic():
    tensors, dy, _ = _inputs((64, 96), torch.bfloat16, "both", residual=False)
    with kernel_backend("triton"):
        first = _run(layer_norm, tensors, dy, None)[1]
        second = _run(layer_norm, tensors, dy, None)[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float16,)], ids=str)
def test_partial_sums_reduce_over_many_programs(dtypes):
    from dslab.kernels._grid import column_sums

    # More programs than one 256-row step of the reduction, and columns past one 16-wide strip.
    partials = torch.randn(len(dtypes), 600, 40)
    sums = column_sums(partials, dtypes)
    assert len(sums) == len(dtypes)
    for total, part, dtype in zip(sums, partials, dtypes):
        assert total.dtype == dtype and total.shape == (40,)
        rtol = 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(total.double(), part.double().sum(0), rtol=rtol, atol=1e-4)


def test_torch_backend_and_cpu_auto_run_the_reference():
    x, w, b = torch.randn(5, 16), torch.randn(16), torch.randn(16)
    expected = F.layer_norm(x, (16,), w, b, 1e-5)
    with kernel_backend("torch"):
        assert torch.equal(layer_norm(x, w, b), expected)
    with kernel_backend("auto"):
        assert torch.equal(layer_norm(x, w, b), expected)


def test_rows_wider_than_the_fused_limit_use_the_reference():
    n = MAX_FUSED_N + 8
    x, w = torch.randn(2, n), torch.randn(n)
    with kernel_backend("triton"):
        y = layer_norm(x, w, None)
    assert torch.equal(y, F.layer_norm(x, (n,), w, None, 1e-5))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weight=torch.ones(7)), "weight"),
        (dict(bias=torch.ones(8, 1)), "bias"),
        (dict(residual=torch.ones(3, 7)), "residual"),
        (dict(residual=torch.ones(3, 8, dtype=torch.float64)), "residual"),
        (dict(eps=-1.0), "eps"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    args = dict(weight=None, bias=None, eps=1e-5, residual=None) | kwargs
    with pytest.raises(ValueError, match=match):
        layer_norm(torch.ones(3, 8), **args)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_custom_ops_pass_opcheck(residual):
    (x, r, w, b), _, _ = _inputs((7, 33), torch.float32, "both", residual)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    if residual:
        op, args = torch.ops.dslab.add_layer_norm.default, (x, r.requires_grad_(), w, b, 1e-5)
    else:
        op, args = torch.ops.dslab.layer_norm.default, (x, w, b, 1e-5)
    torch.library.opcheck(op, args)
    torch.library.opcheck(torch.ops.dslab.layer_norm.default, (x, None, None, 1e-5))


def test_torch_compile_traces_the_custom_ops():
    tensors, dy, dh = _inputs((6, 40), torch.float32, "both", residual=True)

    def block(x, w, b, eps, r):
        y, h = layer_norm(x, w, b, eps, r)
        return y * 2, h

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager_outs, eager_grads = _run(block, tensors, dy, dh)
        outs, grads = _run(compiled, tensors, dy, dh)
    for a, b in zip(outs + grads, eager_outs + eager_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, dtype",
    [((65536, 1024), torch.bfloat16), ((8192, 4096), torch.bfloat16), ((8192, 1024), torch.float16),
     ((8192, 1024), torch.float32), ((4096, 8192), torch.bfloat16), ((1000, 200), torch.float32)],
    ids=str,
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_gpu_real_sizes(shape, dtype, residual):
    tensors, dy, dh = _inputs(shape, dtype, "both", residual)
    tensors, dy = [t.cuda() if t is not None else None for t in tensors], dy.cuda()
    dh = dh.cuda() if dh is not None else None
    exact_outs, exact_grads = _run(layer_norm_reference, tensors, dy, dh, dtype=torch.float64)
    torch_outs, torch_grads = _run(layer_norm_reference, tensors, dy, dh)
    outs, grads = _run(layer_norm, tensors, dy, dh)
    for i, (out, low, exact) in enumerate(zip(outs + grads, torch_outs + torch_grads, exact_outs + exact_grads)):
        _assert_within_torch_error(f"output {i}", out, low, exact)
    again = _run(layer_norm, tensors, dy, dh)[1]
    for a, b in zip(grads, again):
        assert torch.equal(a, b), "gradients differ between two identical runs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("used", ["both", "norm_only", "input_only"])
def test_layer_norm_fork_gradients_match_autograds_sum(dtype, used):
    # A pre-LN layer's residual stream: one use through the layer norm, one as the residual. The
    # fork's input gradient (the kernel adding the second use's gradient) equals autograd's sum.
    from dslab.kernels.norm.layer_norm import layer_norm_fork

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 7, 40, generator=gen).to(dtype)
    w, b = torch.randn(40, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    dy, d_other = torch.randn(3, 7, 40, generator=gen).to(dtype), torch.randn(3, 7, 40, generator=gen).to(dtype)
    results = []
    for triton in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with kernel_backend("triton" if triton else "torch"):
            y, again = layer_norm_fork(*leaves, 1e-5)
        assert torch.equal(again.detach(), x) and y.dtype == dtype
        outs, grads = {"both": ([y, again], [dy, d_other]), "norm_only": ([y], [dy]),
                       "input_only": ([again], [d_other])}[used]
        got = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
        results.append([y.detach(), *got])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in zip(*results):
        if want is None:
            assert got is None or not got.any()
            continue
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
def test_backward_pipeline_fits_hopper_shared_memory_for_wide_rows():
    """Rows of 5120 (GPT-3 13B) with four pipelined stages asked for 288 KB of shared memory and
    did not compile on an H200: the stages shrink with the tile, and every width keeps its
    buffered loads (stages - 1 tiles of three 4-byte inputs) within one program's 227 KB."""
    from dslab.kernels.norm.layer_norm_triton import _backward_config

    assert _backward_config(1024)[3] == 4 and _backward_config(4096)[3] == 4
    for n in (768, 1600, 2560, 4096, 5120, 6144, 8192, 12288, 16384):
        block_m, block_n, _, stages = _backward_config(n)
        assert 1 <= stages <= 4
        assert (stages - 1) * block_m * block_n * 12 <= 227 * 1024, n
    assert _backward_config(5120)[3] < 4
