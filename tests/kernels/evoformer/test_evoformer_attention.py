"""evoformer_attention: the Triton kernels (under the interpreter on CPU) against the PyTorch reference.

Shapes are small and odd (N_res 5, 17, 33 against 16- and 32-residue blocks, so partial blocks at
both ends), with no bias, the mask bias, the pair bias or both, and biases broadcasting over batch
dims and heads. Accuracy follows STYLE.md #4: against the reference in float64, the kernels' error
must be at most twice PyTorch's own error in the same precision (the reference run in that dtype)
plus a floor; bf16 under the interpreter allows four times, as the interpreter truncates fp32 to
bf16 where the GPU rounds to nearest (see test_attention.py). The mask bias holds OpenFold's
``-1e9`` on masked keys plus small random values elsewhere, so its gradient is checked too.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.kernels import kernel_backend
from dslab.kernels.dispatch import interpreting
from dslab.kernels.evoformer import evoformer_attention_triton_bwd
from dslab.kernels.evoformer.evoformer_attention import (
    DS4Sci_EvoformerAttention,
    evoformer_attention,
    evoformer_attention_reference,
)

needs_interpreter = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton kernels need a GPU or TRITON_INTERPRET=1"
)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
GRAD_NAMES = ("out", "dq", "dk", "dv", "dmask", "dpair")


def _inputs(batch, n_seq, n_res, heads, dim, seed, mask_shape="full", pair_shape="full"):
    """fp32 q, k, v, grad ``[*batch, n_seq, n_res, heads, dim]`` and the biases: shape "full" is the
    bias's unbroadcast layout, None leaves it out, a tuple gives its shape."""
    gen = torch.Generator().manual_seed(seed)
    shape = (*batch, n_seq, n_res, heads, dim)
    q, k, v, grad = (torch.randn(shape, generator=gen) for _ in range(4))
    mask = pair = None
    if mask_shape is not None:
        mask_shape = (*batch, n_seq, 1, 1, n_res) if mask_shape == "full" else mask_shape
        keep = torch.rand(mask_shape, generator=gen) > 0.25
        keep[..., 0] = True  # every row sees at least one key
        mask = 0.5 * torch.randn(mask_shape, generator=gen) + 1e9 * (keep.float() - 1)
    if pair_shape is not None:
        pair_shape = (*batch, 1, heads, n_res, n_res) if pair_shape == "full" else pair_shape
        pair = torch.randn(pair_shape, generator=gen)
    return q, k, v, grad, mask, pair


def _run(fn, q, k, v, grad, mask, pair, dtype, mask_requires_grad=True):
    """(out, dq, dk, dv, dmask, dpair) of ``fn`` on leaf copies in ``dtype`` (None for a missing bias
    or one that does not require a gradient)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    mask = None if mask is None else mask.detach().to(dtype).requires_grad_(mask_requires_grad)
    pair = None if pair is None else pair.detach().to(dtype).requires_grad_()
    out = fn(q, k, v, [mask, pair])
    wrt = [t for t in (q, k, v, mask, pair) if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(out, wrt, grad.to(dtype)))
    return [out.detach()] + [next(grads) if t is not None and t.requires_grad else None for t in (q, k, v, mask, pair)]


def _check(got, inputs, dtype, floor=None):
    exact = _run(evoformer_attention_reference, *inputs, torch.float64)
    low = _run(evoformer_attention_reference, *inputs, dtype)
    factor = 4 if interpreting() and dtype == torch.bfloat16 else 2
    for name, g, e, lo in zip(GRAD_NAMES, got, exact, low):
        if e is None:
            assert g is None, name
            continue
        assert g.dtype == dtype and g.shape == e.shape, name
        assert torch.isfinite(g).all(), name
        scale = max(1.0, e.abs().max().item())
        err = (g.double() - e).abs().max().item()
        torch_err = (lo.double() - e).abs().max().item()
        limit = factor * torch_err + (floor if floor is not None else 1e-5 if dtype == torch.float32 else 1e-3) * scale
        assert err <= limit, f"{name}: dslab err {err:.3g} vs torch err {torch_err:.3g} (limit {limit:.3g})"


# (batch, n_seq, n_res, heads, dim, dtype, mask shape, pair shape): "full" is the unbroadcast layout.
CASES = {
    "no_bias": ((1,), 3, 5, 2, 16, "fp32", None, None),
    "mask_only": ((1,), 3, 17, 2, 32, "fp32", "full", None),
    "pair_only": ((1,), 3, 33, 2, 16, "fp32", None, "full"),
    "both": ((1,), 3, 33, 2, 32, "fp32", "full", "full"),
    "no_batch_dims": ((), 3, 17, 2, 16, "fp32", "full", "full"),
    "pair_over_batch": ((2,), 3, 17, 2, 16, "fp32", "full", (1, 1, 2, 17, 17)),
    "two_batch_dims_broadcast": ((2, 2), 2, 17, 2, 16, "fp32", (2, 1, 2, 1, 1, 17), (2, 17, 17)),
    "pair_over_heads_mask_over_seq": ((1,), 3, 17, 2, 16, "fp32", (1, 1, 1, 1, 17), (1, 1, 1, 17, 17)),
    "bf16": ((1,), 3, 17, 2, 32, "bf16", "full", "full"),
    "fp16": ((1,), 3, 33, 2, 16, "fp16", "full", "full"),
    "bf16_d64": ((1,), 2, 17, 2, 64, "bf16", "full", "full"),
    "fp16_d128": ((1,), 2, 17, 1, 128, "fp16", "full", "full"),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case):
    batch, n_seq, n_res, heads, dim, dtype, mask_shape, pair_shape = CASES[case]
    dtype = DTYPES[dtype]
    inputs = _inputs(batch, n_seq, n_res, heads, dim, seed=len(case), mask_shape=mask_shape, pair_shape=pair_shape)
    with kernel_backend("triton"):
        got = _run(evoformer_attention, *inputs, dtype)
    assert got[0].is_contiguous()
    _check(got, inputs, dtype)


@needs_interpreter
@pytest.mark.parametrize("mode", evoformer_attention_triton_bwd.PAIR_GRAD_MODES)
def test_pair_grad_modes_match_reference(mode, monkeypatch):
    """Both reductions of the pair-bias gradient over sequences (and over a broadcast batch dim):
    atomics in the dK/dV kernel, or the recompute kernel summing two sequence chunks."""
    monkeypatch.setattr(evoformer_attention_triton_bwd, "pair_grad_mode", mode)
    inputs = _inputs((2,), 3, 17, 2, 16, seed=21, pair_shape=(1, 1, 2, 17, 17))
    with kernel_backend("triton"):
        got = _run(evoformer_attention, *inputs, torch.float32)
    _check(got, inputs, torch.float32)


@needs_interpreter
def test_mask_without_grad_gets_none_and_the_rest_is_unchanged():
    """OpenFold's usage: the mask bias needs no gradient (no mask-gradient buffer is written)."""
    inputs = _inputs((1,), 3, 17, 2, 16, seed=3)
    with kernel_backend("triton"):
        without = _run(evoformer_attention, *inputs, torch.float32, mask_requires_grad=False)
        with_grad = _run(evoformer_attention, *inputs, torch.float32)
    assert without[4] is None and with_grad[4] is not None
    for name, a, b in zip(GRAD_NAMES, without, with_grad):
        if a is not None:
            assert torch.equal(a, b), name


@needs_interpreter
def test_strided_inputs_and_expanded_grad():
    """q, k, v as transposed views (column attention swaps N_seq and N_res) and the stride-0
    output gradient of ``out.sum()``."""
    gen = torch.Generator().manual_seed(4)
    n_seq, n_res, heads, dim = 3, 17, 2, 16
    q, k, v = (torch.randn(1, n_res, n_seq, heads, dim, generator=gen).transpose(1, 2) for _ in range(3))
    pair = torch.randn(1, 1, heads, n_res, n_res, generator=gen)
    results = []
    for fn, backend in ((evoformer_attention, "triton"), (evoformer_attention_reference, "torch")):
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v, pair)]
        if fn is evoformer_attention:
            leaves = [t.detach().float().requires_grad_() for t in leaves]
            leaves[:3] = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in leaves[:3]]
        with kernel_backend(backend):
            out = fn(*leaves[:3], [None, leaves[3]])
        results.append([out, *torch.autograd.grad(out.sum(), leaves)])
        if fn is evoformer_attention:
            # Outputs in the inputs' (transposed) layout: their inverse transposes are contiguous.
            for name, got, leaf in zip(("out", "dq", "dk", "dv"), results[-1], [leaves[0], *leaves[:3]]):
                assert got.stride() == leaf.stride(), name
                assert got.transpose(1, 2).is_contiguous(), name
    for name, got, exact in zip(("out", "dq", "dk", "dv", "dpair"), *results):
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5, msg=name)


def test_torch_and_cpu_auto_backends_run_the_reference():
    q, k, v, _, mask, pair = _inputs((1,), 3, 7, 2, 16, seed=5)
    expected = evoformer_attention_reference(q, k, v, [mask, pair])
    for name in ("torch", "auto"):
        with kernel_backend(name):
            assert torch.equal(evoformer_attention(q, k, v, [mask, pair]), expected)


def test_empty_input_runs_the_reference():
    q = torch.randn(1, 0, 5, 2, 16)
    with kernel_backend("triton"):
        assert evoformer_attention(q, q, q).shape == q.shape


@pytest.mark.parametrize("with_mask, with_pair", [(False, False), (True, False), (False, True), (True, True)])
def test_reference_matches_sdpa(with_mask, with_pair):
    """The reference's semantics: scale D**-0.5, the biases added to the scores, per (sequence,
    head) over residues; SDPA with the biases summed into one float mask."""
    q, k, v, _, mask, pair = (t.double() for t in _inputs((2,), 3, 9, 2, 16, seed=6))
    biases = [mask if with_mask else None, pair if with_pair else None]
    got = evoformer_attention_reference(q, k, v, biases)
    attn_mask = sum(b for b in biases if b is not None) if with_mask or with_pair else None
    heads = [t.transpose(-2, -3) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*heads, attn_mask=attn_mask).transpose(-2, -3)
    torch.testing.assert_close(got, expected)


@needs_interpreter
def test_ds4sci_name_and_ops_reexport():
    from dslab.ops.deepspeed4science import DS4Sci_EvoformerAttention as reexported

    assert reexported is DS4Sci_EvoformerAttention
    q, k, v, _, mask, pair = _inputs((1,), 3, 17, 2, 32, seed=7)
    biases = [mask]
    with kernel_backend("triton"):
        ds = reexported(q, k, v, biases)
        assert len(biases) == 1  # DeepSpeed pads the caller's list in place; dslab leaves it alone
        torch.testing.assert_close(ds, evoformer_attention(q, k, v, [mask, None]), rtol=0, atol=0)
        with_pair = reexported(Q=q, K=k, V=v, biases=[mask, pair])
    torch.testing.assert_close(with_pair, evoformer_attention_reference(q, k, v, [mask, pair]), rtol=1e-5, atol=1e-5)


def _bad_arguments():
    q = torch.randn(1, 3, 5, 2, 16)
    mask, pair = torch.zeros(1, 3, 1, 1, 5), torch.zeros(1, 1, 2, 5, 5)
    return [
        ((q[0, 0], q, q, []), "q must be a tensor"),
        ((q.double(), q.double(), q.double(), []), "q has dtype torch.float64"),
        ((q.int(), q.int(), q.int(), []), "q has dtype torch.int32"),
        ((q[..., :8].repeat(1, 1, 1, 1, 3),) * 3 + ([],), r"head dim D = 24"),
        ((q, q[:, :2], q, []), r"k must have q's shape .* \(1, 3, 5, 2, 16\)"),
        ((q, q, q.half(), []), "v has dtype torch.float16"),
        ((q, q.to("meta"), q, []), "k is on meta"),
        ((q, q, q, [mask, pair, pair]), "biases must be a list of at most 2"),
        ((q, q, q, mask), "biases must be a list"),
        ((q, q, q, [1.0]), r"biases\[0\] \(the mask bias\) must be a tensor or None"),
        ((q, q, q, [torch.zeros(1, 3, 1, 1, 4)]), r"biases\[0\] \(the mask bias\) has shape \(1, 3, 1, 1, 4\); "
                                                  r"expected a shape broadcastable to \[\*, N_seq, 1, 1, N_res\] = "
                                                  r"\(1, 3, 1, 1, 5\)"),
        ((q, q, q, [torch.zeros(1, 3, 2, 1, 5)]), r"biases\[0\] \(the mask bias\) has shape"),
        ((q, q, q, [torch.zeros(1, 1, 3, 1, 1, 5)]), r"biases\[0\] \(the mask bias\) has shape"),
        ((q, q, q, [mask.half()]), r"biases\[0\] \(the mask bias\) has dtype torch.float16"),
        ((q, q, q, [None, torch.zeros(1, 3, 2, 5, 5)]), r"biases\[1\] \(the pair bias\) has shape .* "
                                                        r"\[\*, 1, H, N_res, N_res\] = \(1, 1, 2, 5, 5\)"),
        ((q, q, q, [None, torch.zeros(1, 1, 2, 5, 4)]), r"biases\[1\] \(the pair bias\) has shape"),
        ((q, q, q, [None, pair.bfloat16()]), r"biases\[1\] \(the pair bias\) has dtype"),
        ((q, q, q, [mask, pair.to("meta")]), r"biases\[1\] \(the pair bias\) is on meta"),
    ]


@pytest.mark.parametrize("args, match", _bad_arguments(), ids=lambda a: a if isinstance(a, str) else "")
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        evoformer_attention(*args)


@needs_interpreter
def test_custom_ops_pass_opcheck():
    q, k, v, grad, mask, pair = _inputs((1,), 2, 5, 2, 16, seed=8)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), mask, pair.requires_grad_())
    with kernel_backend("triton"):
        torch.library.opcheck(torch.ops.dslab.evoformer_attention.default, args)
        out, lse = torch.ops.dslab.evoformer_attention(*(t.detach() for t in args))
        backward_args = (grad, q.detach(), k.detach(), v.detach(), out, lse, mask, pair.detach(), True, True)
        torch.library.opcheck(
            torch.ops.dslab.evoformer_attention_backward.default, backward_args,
            test_utils=("test_schema", "test_faketensor"),
        )
    assert lse.shape == (1, 2, 2, 5) and lse.dtype == torch.float32


@needs_interpreter
def test_torch_compile_traces_the_custom_op():
    inputs = _inputs((1,), 3, 17, 2, 16, seed=9)

    def gated(q, k, v, biases):
        return torch.sigmoid(q) * evoformer_attention(q, k, v, biases)

    compiled = torch.compile(gated, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with kernel_backend("triton"):
        eager = _run(gated, *inputs, torch.float32)
        got = _run(compiled, *inputs, torch.float32)
    torch._dynamo.reset()
    for name, a, b in zip(GRAD_NAMES, got, eager):
        torch.testing.assert_close(a, b, msg=name)


class _RowAttention(nn.Module):
    def __init__(self, pair):
        super().__init__()
        self.pair = nn.Parameter(pair)

    def forward(self, q, k, v, mask):
        return evoformer_attention(q, k, v, [mask, self.pair])


@needs_interpreter
def test_flops_profiler_counts_the_custom_ops():
    """dslab::evoformer_attention: 4 B N_seq N_res^2 H D; its backward 2.5x that."""
    from dslab.profilers.flops import FlopsProfiler

    batch, n_seq, n_res, heads, dim = (2,), 3, 17, 2, 16
    q, k, v, _, mask, pair = _inputs(batch, n_seq, n_res, heads, dim, seed=10, pair_shape=(1, 1, heads, n_res, n_res))
    model = _RowAttention(pair)
    profiler = FlopsProfiler(model)
    with kernel_backend("triton"):
        profiler.start_profile()
        model(q.requires_grad_(), k, v, mask).sum().backward()
        profiler.stop_profile()
    records = profiler.records()
    forward = 4 * 2 * n_seq * n_res * n_res * heads * dim
    by_op = records["flops_by_op"]
    assert by_op["dslab::evoformer_attention"] == {"figure": "matmul", "flops": forward}
    assert by_op["dslab::evoformer_attention_backward"] == {"figure": "matmul", "flops": forward * 5 // 2}
    assert (records["forward_flops"], records["backward_flops"]) == (forward, forward * 5 // 2)
    assert records["uncounted_autograd_functions"] == []
