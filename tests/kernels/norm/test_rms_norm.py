"""rms_norm: the Triton kernels (under the interpreter on CPU) against the PyTorch reference.

Errors are measured against the reference in float64 and must stay within twice PyTorch's own
error in the same precision, plus a floor of one unit in the last place at the output's scale.
"""

import pytest
import torch
import torch.nn as nn

import dslab.kernels.norm.rms_norm as rms_norm_module
from dslab.kernels import kernel_backend
from dslab.kernels.norm.rms_norm import MAX_FUSED_N, rms_norm, rms_norm_fork, rms_norm_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _assert_within_torch_error(name, actual, torch_low, exact):
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item()
    torch_err = (torch_low.double() - exact).abs().max().item()
    floor = torch.finfo(actual.dtype).eps * exact.abs().max().item()
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _inputs(shape, dtype, weight, residual, seed=0):
    """(x, residual, weight), dy, dh; ``weight`` is "same" (x's dtype), "fp32" or "none"."""
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=gen) * 2 + 0.5
    r = torch.randn(shape, generator=gen).to(dtype) if residual else None
    w = 1 + 0.3 * torch.randn(n, generator=gen)
    w = {"same": w.to(dtype), "fp32": w, "none": None}[weight]
    dy = torch.randn(shape, generator=gen).to(dtype)
    dh = torch.randn(shape, generator=gen).to(dtype) if residual else None
    return [x.to(dtype), r, w], dy, dh


def _run(fn, tensors, dy, dh, dtype=None):
    """Outputs and gradients of ``fn`` (rms_norm's signature) on leaf copies of ``tensors``."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() if t is not None else None for t in tensors]
    x, r, w = leaves
    out = fn(x, w, 1e-6, r)
    outs = out if isinstance(out, tuple) else (out,)
    grads_in = [dy] if r is None else [dy, dh]
    grads_in = [g.to(outs[0].dtype) for g in grads_in]
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(outs, wrt, grads_in)
    return [o.detach() for o in outs], list(grads)


# The weight in x's dtype, in fp32 beside a 16-bit x, or none.
DTYPE_WEIGHTS = [(dtype, weight) for dtype in DTYPES for weight in ("same", "fp32", "none")
                 if not (dtype == torch.float32 and weight == "fp32")]


@pytest.mark.parametrize("dtype, weight", DTYPE_WEIGHTS, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_triton_matches_float64_reference(dtype, weight, residual, monkeypatch):
    shape = (37, 129) if residual else (3, 5, 200)
    tensors, dy, dh = _inputs(shape, dtype, weight, residual)
    exact_outs, exact_grads = _run(rms_norm_reference, tensors, dy, dh, dtype=torch.float64)
    torch_outs, torch_grads = _run(rms_norm_reference, tensors, dy, dh)
    # The Triton path must not fall back to the reference.
    monkeypatch.setattr(rms_norm_module, "rms_norm_reference", None)
    with kernel_backend("triton"):
        outs, grads = _run(rms_norm, tensors, dy, dh)

    names = ["y", "h"][: len(outs)]
    for name, out, low, exact in zip(names, outs, torch_outs, exact_outs):
        assert out.dtype == dtype and out.shape == shape
        _assert_within_torch_error(name, out, low, exact)
    grad_names = ["dx", "dresidual"] if residual else ["dx"]
    grad_names += ["dweight"] if weight != "none" else []
    assert len(grads) == len(grad_names)
    for grad, leaf in zip(grads, [t for t in tensors if t is not None]):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape
    for name, grad, low, exact in zip(grad_names, grads, torch_grads, exact_grads):
        _assert_within_torch_error(name, grad, low, exact)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_strided_rows_and_many_row_tiles_per_program(residual):
    # 300 rows of 48 read in place with a row stride of 96 (x, residual and the output gradients):
    # 10 row tiles per step of the backward loop over 4 interpreter programs.
    gen = torch.Generator().manual_seed(3)
    x, r, dy, dh = (torch.randn(300, 96, generator=gen)[:, :48] for _ in range(4))
    assert x.stride() == (96, 1)
    w = torch.randn(48, generator=gen)
    tensors = [x, r if residual else None, w]
    dh = dh if residual else None
    exact_outs, exact_grads = _run(rms_norm_reference, tensors, dy, dh, dtype=torch.float64)
    with kernel_backend("triton"):
        outs, grads = _run(rms_norm, tensors, dy, dh)
    for out, exact in zip(outs + grads, exact_outs + exact_grads):
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_only_the_residual_stream_used_downstream():
    (x, r, w), _, dh = _inputs((7, 33), torch.float32, "same", residual=True)
    x, r, w = (t.clone().requires_grad_() for t in (x, r, w))
    with kernel_backend("triton"):
        _, h = rms_norm(x, w, residual=r)
    (h * dh).sum().backward()
    torch.testing.assert_close(x.grad, dh)
    torch.testing.assert_close(r.grad, dh)
    assert w.grad is None


def test_weight_gradient_is_deterministic():
    tensors, dy, _ = _inputs((64, 96), torch.bfloat16, "same", residual=False)
    with kernel_backend("triton"):
        first = _run(rms_norm, tensors, dy, None)[1]
        second = _run(rms_norm, tensors, dy, None)[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_agrees_with_transformers_llama_rms_norm_in_fp32(backend):
    # LlamaRMSNorm rounds the normalized value to the input dtype before the weight multiplies it,
    # a no-op in fp32 only: there the two compute the same thing.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(5)
    x, dy = torch.randn(2, 9, 72, generator=gen), torch.randn(2, 9, 72, generator=gen)
    llama = LlamaRMSNorm(72, eps=1e-5)
    with torch.no_grad():
        llama.weight.copy_(1 + 0.3 * torch.randn(72, generator=gen))
    x_ref = x.clone().requires_grad_()
    y_ref = llama(x_ref)
    y_ref.backward(dy)
    x_ours, w_ours = x.clone().requires_grad_(), llama.weight.detach().clone().requires_grad_()
    with kernel_backend(backend):
        y = rms_norm(x_ours, w_ours, eps=1e-5)
    y.backward(dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_ours.grad, llama.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("used", ["both", "norm_only", "input_only"])
def test_rms_norm_fork_gradients_match_autograds_sum(dtype, used):
    # A pre-norm layer's residual stream: one use through the RMS norm, one as the residual. The
    # fork's input gradient (the kernel adding the second use's gradient) equals autograd's sum.
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 7, 40, generator=gen).to(dtype)
    w = torch.randn(40, generator=gen).to(dtype)
    dy, d_other = torch.randn(3, 7, 40, generator=gen).to(dtype), torch.randn(3, 7, 40, generator=gen).to(dtype)
    results = []
    for triton in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        with kernel_backend("triton" if triton else "torch"):
            y, again = rms_norm_fork(*leaves, 1e-6)
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


def test_torch_backend_cpu_auto_and_wide_rows_run_the_reference():
    x, w = torch.randn(5, 16), torch.randn(16)
    expected = rms_norm_reference(x, w)
    with kernel_backend("torch"):
        assert torch.equal(rms_norm(x, w), expected)
    with kernel_backend("auto"):
        assert torch.equal(rms_norm(x, w), expected)
    n = MAX_FUSED_N + 8
    x, w = torch.randn(2, n), torch.randn(n)
    with kernel_backend("triton"):
        assert torch.equal(rms_norm(x, w), rms_norm_reference(x, w))


@pytest.mark.parametrize(
    "x, kwargs, match",
    [
        (torch.ones(()), {}, "x must have at least one dimension"),
        (torch.ones(3, 8, dtype=torch.int32), {}, "x must be a floating-point"),
        (torch.ones(3, 8), dict(weight=torch.ones(7)), "weight must have shape"),
        (torch.ones(3, 8), dict(weight=torch.ones(8, 1)), "weight must have shape"),
        (torch.ones(3, 8), dict(weight=torch.ones(8, dtype=torch.float16)), "weight must have x's dtype"),
        (torch.ones(3, 8, dtype=torch.bfloat16), dict(weight=torch.ones(8, dtype=torch.float16)), "weight"),
        (torch.ones(3, 8), dict(residual=torch.ones(3, 7)), "residual must have x's shape"),
        (torch.ones(3, 8), dict(residual=torch.ones(3, 8, dtype=torch.float64)), "residual must have x's dtype"),
        (torch.ones(3, 8), dict(eps=-1.0), "eps"),
        (torch.ones(3, 8), dict(eps=float("nan")), "eps"),
    ],
)
def test_bad_arguments_raise_value_error(x, kwargs, match):
    args = dict(weight=None, eps=1e-6, residual=None) | kwargs
    with pytest.raises(ValueError, match=match):
        rms_norm(x, **args)
    if args["residual"] is None:
        with pytest.raises(ValueError, match=match):
            rms_norm_fork(x, args["weight"], args["eps"])


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_custom_ops_pass_opcheck(residual):
    (x, r, w), _, _ = _inputs((7, 33), torch.float32, "same", residual)
    x, w = x.requires_grad_(), w.requires_grad_()
    if residual:
        op, args = torch.ops.dslab.add_rms_norm.default, (x, r.requires_grad_(), w, 1e-6)
    else:
        op, args = torch.ops.dslab.rms_norm.default, (x, w, 1e-6)
    torch.library.opcheck(op, args)
    torch.library.opcheck(torch.ops.dslab.rms_norm.default, (x, None, 1e-6))


def test_torch_compile_traces_the_custom_ops():
    tensors, dy, dh = _inputs((6, 40), torch.float32, "same", residual=True)

    def block(x, w, eps, r):
        y, h = rms_norm(x, w, eps, r)
        return y * 2, h

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager_outs, eager_grads = _run(block, tensors, dy, dh)
        outs, grads = _run(compiled, tensors, dy, dh)
    for a, b in zip(outs + grads, eager_outs + eager_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, dtype, weight",
    [((65536, 1024), torch.bfloat16, "fp32"), ((8192, 4096), torch.bfloat16, "same"),
     ((8192, 1024), torch.float16, "same"), ((8192, 1024), torch.float32, "same"),
     ((4096, 8192), torch.bfloat16, "fp32"), ((1000, 200), torch.float32, "none")],
    ids=str,
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_gpu_real_sizes(shape, dtype, weight, residual):
    tensors, dy, dh = _inputs(shape, dtype, weight, residual)
    tensors, dy = [t.cuda() if t is not None else None for t in tensors], dy.cuda()
    dh = dh.cuda() if dh is not None else None
    exact_outs, exact_grads = _run(rms_norm_reference, tensors, dy, dh, dtype=torch.float64)
    torch_outs, torch_grads = _run(rms_norm_reference, tensors, dy, dh)
    outs, grads = _run(rms_norm, tensors, dy, dh)
    for i, (out, low, exact) in enumerate(zip(outs + grads, torch_outs + torch_grads, exact_outs + exact_grads)):
        _assert_within_torch_error(f"output {i}", out, low, exact)
    again = _run(rms_norm, tensors, dy, dh)[1]
    for a, b in zip(grads, again):
        assert torch.equal(a, b), "gradients differ between two identical runs"


class _Call(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_flops_profiler_counts_the_custom_ops(residual):
    """Under the profiler's dispatch mode rms_norm runs its custom ops, priced elementwise: 4 / 9
    per element, plus 1 for the residual add and 1 for the residual stream's gradient."""
    from dslab.profilers.flops import FlopsProfiler

    rows, n = 6, 40
    (x, r, w), _, _ = _inputs((rows, n), torch.float32, "same", residual)
    x, w = x.requires_grad_(), w.requires_grad_()
    model = _Call(lambda x: rms_norm(x, w, 1e-6, r))
    profiler = FlopsProfiler(model)
    with kernel_backend("triton"):
        profiler.start_profile()
        out = model(x)
        sum(o.sum() for o in (out if residual else (out,))).backward()
        profiler.stop_profile()
    records = profiler.records()
    forward_op = "dslab::add_rms_norm" if residual else "dslab::rms_norm"
    assert records["total_flops"] == 0
    assert records["flops_by_op"][forward_op] == {"figure": "elementwise", "flops": (4 + residual) * rows * n}
    assert records["flops_by_op"]["dslab::rms_norm_backward"]["flops"] == (9 + residual) * rows * n
