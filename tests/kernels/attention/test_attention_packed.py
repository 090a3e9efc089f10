"""attention_packed: q, k, v read from one [batch, seq, 3 * hidden] projection, against the
reference (CPU, Triton interpreter) and, on a GPU, against the split-heads op without copies."""

import pytest
import torch
from test_attention import _forward_backward, _padding, force_plan

from dslab.kernels.attention import attention_triton_bwd
from dslab.kernels.attention.attention import draw_dropout_seed, triton_dropout_keep_mask
from dslab.kernels.attention.attention_packed import attention_packed, attention_packed_reference
from dslab.kernels.dispatch import interpreting, kernel_backend


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _packed_inputs(batch, heads, seq, head_dim, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, seq, 3 * heads * head_dim, generator=gen)
    grad = torch.randn(batch, seq, heads * head_dim, generator=gen)
    return qkv.to(device=device, dtype=dtype), grad.to(device=device, dtype=dtype)


def _packed_forward_backward(fn, qkv, grad, heads, **kwargs):
    qkv = qkv.detach().requires_grad_()
    out = fn(qkv, heads, **kwargs)
    return out, *torch.autograd.grad(out, (qkv,), grad)


def _check_packed_against_reference(got, qkv, grad, heads, floor, **kwargs):
    """got = (out, dqkv) of attention_packed in qkv's dtype, against the packed reference in float64
    and in that dtype (STYLE.md #4, as ``_check_against_reference``)."""
    exact = _packed_forward_backward(attention_packed_reference, qkv.double(), grad.double(), heads, **kwargs)
    low = _packed_forward_backward(attention_packed_reference, qkv, grad, heads, **kwargs)
    factor = 4 if interpreting() and qkv.dtype == torch.bfloat16 else 2
    for name, g, e, lo in zip(("out", "dqkv"), got, exact, low):
        assert g.dtype == qkv.dtype and g.shape == e.shape and g.is_contiguous(), name
        assert torch.isfinite(g).all(), name
        err = (g.double() - e).abs().max().item()
        torch_err = (lo.double() - e).abs().max().item()
        assert err <= factor * torch_err + floor, f"{name}: dslab err {err:.3g} vs torch err {torch_err:.3g}"


# (seq, head_dim, dtype, causal, padding, dropout_p); heads 3, batch 2. seq 37 takes the BOTH
# backward under the interpreter, seq 29 the FUSED one. fp32 runs the reference path.
PACKED_CASES = [
    (37, 32, "bf16", False, None, 0.0),
    (37, 64, "bf16", True, "first", 0.0),
    (37, 32, "bf16", True, "full", 0.25),
    (29, 64, "bf16", False, "first", 0.25),
    (37, 64, "fp32", True, "first", 0.0),
    (37, 32, "fp32", False, "full", 0.25),
]


@pytest.mark.parametrize("seq,head_dim,dtype,causal,padding,dropout_p", PACKED_CASES)
def test_attention_packed_matches_reference(seq, head_dim, dtype, causal, padding, dropout_p):
    """Output and qkv gradient against the packed reference; with dropout both use the Triton
    kernels' mask of one seed (fp32: the reference's generator mask of that seed, both ways)."""
    batch, heads = 2, 3
    qkv, grad = _packed_inputs(batch, heads, seq, head_dim, DTYPES[dtype], seed=seq + head_dim)
    mask = _padding(padding, batch, seq)
    kwargs = dict(causal=causal, key_padding_mask=mask, dropout_p=dropout_p)
    seed = torch.tensor([2**33 + seq])
    with kernel_backend("triton"):
        got = _packed_forward_backward(attention_packed, qkv, grad, heads, seed=seed, **kwargs)
        if dropout_p > 0 and dtype != "fp32":
            kwargs["dropout_mask"] = triton_dropout_keep_mask(seed, batch, heads, seq, seq, dropout_p, "cpu")
        elif dropout_p > 0:
            kwargs["seed"] = seed
    _check_packed_against_reference(got, qkv, grad, heads, floor=1e-3, **kwargs)
    if padding == "full":  # every key of the last batch element is padding: zeros, no NaN
        assert torch.equal(got[0][-1], torch.zeros_like(got[0][-1]))
        assert torch.equal(got[1][-1], torch.zeros_like(got[1][-1]))


@pytest.mark.parametrize("plan", [None, "split", "atomic"])
def test_attention_packed_equals_attention_on_split_heads(plan, monkeypatch):
    """The Triton kernels on the packed layouts give bit for bit what they give on the split heads
    (same tiles, same seed, only strides differ), whichever backward plan runs."""
    force_plan(monkeypatch, plan)
    batch, heads, seq, head_dim = 2, 3, 37, 32
    qkv, grad = _packed_inputs(batch, heads, seq, head_dim, torch.bfloat16, seed=5)
    mask = _padding("first", batch, seq)
    kwargs = dict(causal=True, key_padding_mask=mask, dropout_p=0.2, seed=torch.tensor([77]))
    with kernel_backend("triton"):
        out, dqkv = _packed_forward_backward(attention_packed, qkv, grad, heads, **kwargs)
        q, k, v = qkv.view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        grad_heads = grad.view(batch, seq, heads, head_dim).transpose(1, 2)
        split_out, dq, dk, dv = _forward_backward(q, k, v, grad_heads, **kwargs)
    assert out.stride() == (seq * heads * head_dim, heads * head_dim, 1)
    assert torch.equal(out, split_out.transpose(1, 2).reshape(batch, seq, heads * head_dim))
    expected = torch.stack([dq, dk, dv], dim=2).transpose(1, 3).reshape(batch, seq, 3 * heads * head_dim)
    assert torch.equal(dqkv, expected)


def test_attention_packed_custom_ops_and_compile():
    qkv, grad = _packed_inputs(1, 2, 19, 32, torch.bfloat16, seed=16)
    seed = torch.tensor([3])
    with kernel_backend("triton"):
        for args in ((qkv, None, None, 2, True, 0.0, 0.2), (qkv, _padding("first", 1, 19), seed, 2, False, 0.3, 0.2)):
            torch.library.opcheck(
                torch.ops.dslab.attention_packed_forward.default, args, test_utils=("test_schema", "test_faketensor")
            )
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: attention_packed(t, 2, causal=True, dropout_p=0.3, seed=seed),
                                 backend="aot_eager", fullgraph=True)
        eager = _packed_forward_backward(attention_packed, qkv, grad, 2, causal=True, dropout_p=0.3, seed=seed)
        qkv_leaf = qkv.detach().requires_grad_()
        out = compiled(qkv_leaf)
        (dqkv,) = torch.autograd.grad(out, (qkv_leaf,), grad)
        torch._dynamo.reset()
    assert torch.equal(out, eager[0]) and torch.equal(dqkv, eager[1])


def _bias_case(qkv, grad, heads, bias_dtype, **kwargs):
    """(out, dqkv, dbias) with a bias handed to attention_packed, and (out, dqkv) without one."""
    leaf = qkv.detach().requires_grad_()
    bias = torch.randn(qkv.shape[-1], generator=torch.Generator().manual_seed(9)).to(qkv.device, bias_dtype)
    bias.requires_grad_()
    out = attention_packed(leaf, heads, bias=bias, **kwargs)
    dqkv, dbias = torch.autograd.grad(out, (leaf, bias), grad)
    return (out, dqkv, dbias), _packed_forward_backward(attention_packed, qkv, grad, heads, **kwargs)


def _check_bias_gradient(dbias, dqkv, bias_dtype):
    """dbias is the column sum of dqkv for the q and v blocks: the kernels add up the fp32 values
    whose rounding to dqkv's dtype moved each by at most half an ulp (2**-8 relative in bf16), so
    the sums may differ by that much of the column's absolute sum (bound with a factor 2 of
    margin; fp32 far less). The k block's gradient is exactly 0 (softmax ignores a shift shared by
    a query's scores), and dqkv's k columns do sum to rounding noise at that level."""
    assert dbias.dtype == bias_dtype and dbias.shape == dqkv.shape[-1:]
    rows = dqkv.double().reshape(-1, 3, dqkv.shape[-1] // 3)
    expected, scale = rows.sum(0), rows.abs().sum(0)
    rel = 2**-7 if dqkv.dtype == torch.bfloat16 else 1e-5
    got = dbias.double().view(3, -1)
    for part in (0, 2):
        err = (got[part] - expected[part]).abs()
        assert (err <= rel * scale[part] + 1e-6).all(), f"part {part}: max err {err.max().item():.3g}"
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert (expected[1].abs() <= 2 * rel * scale[1] + 1e-6).all()
    assert expected[[0, 2]].abs().max() > 0.1  # the check sees real gradients


# (seq, causal, padding, dropout_p, plan): seq 29 takes the FUSED backward under the interpreter,
# 37 and 70 (three 32-row slots) BOTH, or the plan named (force_plan).
BIAS_CASES = [
    (29, False, "first", 0.25, None),
    (29, True, None, 0.0, None),
    (37, True, "full", 0.25, None),
    (70, False, "first", 0.0, None),
    (70, True, "first", 0.25, "split"),
    (37, False, None, 0.25, "split"),
    (70, True, "first", 0.25, "atomic"),
    (37, False, "full", 0.0, "atomic"),
]


@pytest.mark.parametrize("seq,causal,padding,dropout_p,plan", BIAS_CASES)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_attention_packed_bias_gets_the_column_sums_of_the_qkv_gradient(seq, causal, padding, dropout_p, plan,
                                                                        bias_dtype, monkeypatch):
    """With ``bias``, the output and qkv's gradient are unchanged (bit for bit) and the bias's
    gradient, from the kernels' partial sums, is qkv's gradient summed over rows."""
    force_plan(monkeypatch, plan)
    batch, heads, head_dim = 2, 3, 32
    qkv, grad = _packed_inputs(batch, heads, seq, head_dim, torch.bfloat16, seed=seq)
    kwargs = dict(causal=causal, key_padding_mask=_padding(padding, batch, seq), dropout_p=dropout_p,
                  seed=torch.tensor([seq]))
    with kernel_backend("triton"):
        (out, dqkv, dbias), (plain_out, plain_dqkv) = _bias_case(qkv, grad, heads, bias_dtype, **kwargs)
    assert torch.equal(out, plain_out) and torch.equal(dqkv, plain_dqkv)
    _check_bias_gradient(dbias, dqkv, bias_dtype)


def test_attention_packed_bias_on_the_reference_path():
    """fp32 takes the reference: the same contract (the bias adds zeros, its gradient is the sum)."""
    qkv, grad = _packed_inputs(2, 2, 11, 32, torch.float32, seed=4)
    with kernel_backend("triton"):
        (out, dqkv, dbias), (plain_out, plain_dqkv) = _bias_case(qkv, grad, 2, torch.float32, causal=True)
    assert torch.equal(out, plain_out) and torch.equal(dqkv, plain_dqkv)
    _check_bias_gradient(dbias, dqkv, torch.float32)


def test_attention_packed_bias_through_the_custom_ops():
    qkv, grad = _packed_inputs(1, 2, 19, 32, torch.bfloat16, seed=6)
    bias = torch.randn(qkv.shape[-1]).requires_grad_()
    with kernel_backend("triton"):
        torch.library.opcheck(torch.ops.dslab.attention_packed_forward.default,
                              (qkv, None, None, 2, True, 0.0, 0.2, bias), test_utils=("test_schema", "test_faketensor"))
        torch._dynamo.reset()
        compiled = torch.compile(lambda t, b: attention_packed(t, 2, causal=True, bias=b), backend="aot_eager",
                                 fullgraph=True)
        leaf = qkv.detach().requires_grad_()
        dqkv, dbias = torch.autograd.grad(compiled(leaf, bias), (leaf, bias), grad)
        torch._dynamo.reset()
        (_, eager_dqkv, eager_dbias), _ = _bias_case(qkv, grad, 2, torch.float32, causal=True)
    assert torch.equal(dqkv, eager_dqkv)
    _check_bias_gradient(dbias, dqkv, torch.float32)


@pytest.mark.parametrize("change,argument", [
    (lambda a: {**a, "qkv": a["qkv"][0]}, "qkv"),
    (lambda a: {**a, "qkv": a["qkv"].int()}, "qkv"),
    (lambda a: {**a, "heads": 5}, "heads"),
    (lambda a: {**a, "heads": 0}, "heads"),
    (lambda a: {**a, "qkv": torch.zeros(2, 5, 3 * 2 * 48)}, "head_dim"),
    (lambda a: {**a, "key_padding_mask": torch.zeros(2, 6, dtype=torch.bool)}, "key_padding_mask"),
    (lambda a: {**a, "dropout_p": 1.0}, "dropout_p"),
    (lambda a: {**a, "seed": 2.5, "dropout_p": 0.1}, "seed"),
    (lambda a: {**a, "bias": torch.zeros(3 * 2 * 32 + 1)}, "bias"),
    (lambda a: {**a, "bias": torch.zeros(3 * 2 * 32, dtype=torch.int32)}, "bias"),
])
def test_attention_packed_bad_input_raises_value_error(change, argument):
    args = change(dict(qkv=torch.zeros(2, 5, 3 * 2 * 32), heads=2))
    with pytest.raises(ValueError, match=argument):
        attention_packed(**args)


# --- GPU, real sizes -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,seq,head_dim,causal,padding,dropout_p", [
    (8, 16, 128, 64, False, "first", 0.1),  # BERT-large, FUSED backward
    (4, 16, 512, 64, False, None, 0.1),  # BERT-large seq 512
    (2, 12, 1024, 64, True, None, 0.0),  # GPT-2, DQ_ONLY + DKDV_ONLY
])
def test_gpu_attention_packed_matches_split_heads_without_copies(batch, heads, seq, head_dim, causal, padding,
                                                                 dropout_p, monkeypatch):
    """On the GPU the packed op equals the split-heads op bit for bit (one seed; the deterministic
    plans), and its forward and backward launch no copy, fill or contiguous kernel around the
    attention kernels (the ATOMIC plan's accumulator is zeroed by its own kernel)."""
    monkeypatch.setattr(attention_triton_bwd, "ATOMIC_MIN_WORK", 2**62)
    qkv, grad = _packed_inputs(batch, heads, seq, head_dim, torch.bfloat16, device="cuda", seed=41)
    mask = _padding(padding, batch, seq, device="cuda")
    kwargs = dict(causal=causal, key_padding_mask=mask, dropout_p=dropout_p, seed=draw_dropout_seed("cuda"))
    out, dqkv = _packed_forward_backward(attention_packed, qkv, grad, heads, **kwargs)
    q, k, v = qkv.view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    grad_heads = grad.view(batch, seq, heads, head_dim).transpose(1, 2)
    split_out, dq, dk, dv = _forward_backward(q, k, v, grad_heads, **kwargs)
    assert torch.equal(out, split_out.transpose(1, 2).reshape(out.shape))
    assert torch.equal(dqkv, torch.stack([dq, dk, dv], dim=2).transpose(1, 3).reshape(dqkv.shape))
    monkeypatch.setattr(attention_triton_bwd, "ATOMIC_MIN_WORK", 0)
    leaf = qkv.detach().requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.autograd.grad(attention_packed(leaf, heads, **kwargs), (leaf,), grad)
    names = {event.key for event in prof.key_averages()}
    assert not names & {"aten::copy_", "aten::clone", "aten::contiguous", "aten::fill_", "aten::zero_"}, names


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,seq,causal,dropout_p,bias_dtype", [
    (64, 16, 128, False, 0.1, torch.bfloat16),  # BERT-large seq 128 (FUSED), the copies' bias
    (16, 16, 512, False, 0.1, torch.float32),  # BERT-large seq 512 (autocast's fp32 bias)
    (16, 12, 1024, True, 0.1, torch.bfloat16),  # GPT-2 124M (DQ_ONLY + DKDV_ONLY)
])
def test_gpu_attention_packed_bias_gradient_at_suite_shapes(batch, heads, seq, causal, dropout_p, bias_dtype,
                                                           monkeypatch):
    monkeypatch.setattr(attention_triton_bwd, "ATOMIC_MIN_WORK", 2**62)  # bit for bit: deterministic plans
    qkv, grad = _packed_inputs(batch, heads, seq, 64, torch.bfloat16, device="cuda", seed=43)
    kwargs = dict(causal=causal, dropout_p=dropout_p, seed=draw_dropout_seed("cuda"))
    (out, dqkv, dbias), (plain_out, plain_dqkv) = _bias_case(qkv, grad, heads, bias_dtype, **kwargs)
    assert torch.equal(out, plain_out) and torch.equal(dqkv, plain_dqkv)
    _check_bias_gradient(dbias.cpu(), dqkv.cpu(), bias_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,seq,causal,padding,dropout_p", [
    (16, 16, 512, False, "first", 0.1),  # BERT-large seq 512
    (16, 12, 1024, True, None, 0.1),  # GPT-2 124M
    (4, 25, 1024, True, None, 0.1),  # GPT-2 1.5B
])
def test_gpu_atomic_plan_matches_the_split_plan(batch, heads, seq, causal, padding, dropout_p, monkeypatch):
    """The ATOMIC plan against the deterministic split at the suites' shapes, with the qkv bias, as
    planned inside a CUDA graph: the output bit for bit; dQ, dK, dV up to the order of their fp32
    sums (dQ's adds land in any order, and the launches' tiles may differ); the bias gradient the
    column sums of the qkv gradient. Twice, as the adds' order differs run to run."""
    from dslab.kernels.dispatch import graphed_launches

    qkv, grad = _packed_inputs(batch, heads, seq, 64, torch.bfloat16, device="cuda", seed=47)
    kwargs = dict(causal=causal, key_padding_mask=_padding(padding, batch, seq, device="cuda"),
                  dropout_p=dropout_p, seed=draw_dropout_seed("cuda"))
    width = heads * 64
    runs = {}
    for plan, min_work in (("split", 2**62), ("atomic", 0), ("atomic again", 0)):
        monkeypatch.setattr(attention_triton_bwd, "ATOMIC_MIN_WORK", min_work)
        with graphed_launches():
            roles = attention_triton_bwd.backward_roles(batch * heads, seq, seq, 64, causal, capturing=True)
            assert (roles == (attention_triton_bwd.ATOMIC,)) == plan.startswith("atomic")
            (out, dqkv, dbias), _ = _bias_case(qkv, grad, heads, torch.float32, **kwargs)
        runs[plan] = (out, dqkv, dbias)
    out, dqkv, dbias = runs["split"]
    for plan in ("atomic", "atomic again"):
        a_out, a_dqkv, a_dbias = runs[plan]
        assert torch.equal(a_out, out)
        for part, name in enumerate(("dq", "dk", "dv")):
            expected = dqkv[..., part * width:(part + 1) * width].float()
            err = (a_dqkv[..., part * width:(part + 1) * width].float() - expected).abs()
            assert err.max() <= 2**-6 * expected.abs().max(), (plan, name)
            assert err.mean() <= 2**-9 * expected.abs().mean(), (plan, name)
        _check_bias_gradient(a_dbias.cpu(), a_dqkv.cpu(), torch.float32)
