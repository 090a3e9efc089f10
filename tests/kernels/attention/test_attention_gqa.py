"""Grouped-query attention in dslab.kernels.attention.attention: k and v with a divisor of q's heads.

Query head ``h`` attends with kv head ``h // (heads // kv_heads)`` (transformers' ``repeat_kv``).
The Triton kernels run under TRITON_INTERPRET=1 at small odd shapes, head_dim 32, in bf16 and
fp16, against the float64 reference (which repeats k and v), forward and dq, dk, dv, with the
tolerance of ``test_attention.py``: at most twice PyTorch's own error in the same dtype (four
times for bf16 under the interpreter, which truncates fp32 to bf16), plus a small floor. Every
backward plan runs: FUSED (seq_k <= 32 under the interpreter), BOTH (whose dK/dV programs for a kv
head's key blocks are dealt over its group's rows, some left idle when the group is larger than the
key blocks), ATOMIC and the split one. With dropout each query head has its own mask, which the
backward's dK/dV programs draw again identically. dK and dV are sums over a group's query heads
computed in one program, in a fixed order: two runs give the same bits, and out and dq equal
bitwise those of plain multi-head attention over k and v repeated to q's heads.
"""

import pytest
import torch

from dslab.kernels.attention import attention_triton_bwd
from dslab.kernels.attention.attention import (
    attention,
    attention_reference,
    draw_dropout_seed,
    triton_dropout_keep_mask,
)
from dslab.kernels.dispatch import interpreting, kernel_backend

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIM = 32


def _inputs(batch, heads, kv_heads, seq_q, seq_k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, HEAD_DIM, generator=gen)
    k = torch.randn(batch, kv_heads, seq_k, HEAD_DIM, generator=gen)
    v = torch.randn(batch, kv_heads, seq_k, HEAD_DIM, generator=gen)
    grad = torch.randn(batch, heads, seq_q, HEAD_DIM, generator=gen)
    return [t.to(dtype) for t in (q, k, v, grad)]


def _padding(kind, batch, seq_k, seed=1):
    """None; 'some': random padding, and key 0 of batch 0 (with causal, query 0 of batch 0 then
    sees nothing); 'full': 'some', and every key of the last batch element."""
    if kind is None:
        return None
    mask = torch.rand(batch, seq_k, generator=torch.Generator().manual_seed(seed)) < 0.3
    mask[0, 0] = True
    if kind == "full":
        mask[-1] = True
    return mask


def _repeat_kv(t, group):
    """transformers' repeat_kv: [B, Hkv, S, D] -> [B, Hkv * group, S, D], each kv head ``group`` times."""
    batch, kv_heads, seq, dim = t.shape
    return t[:, :, None].expand(batch, kv_heads, group, seq, dim).reshape(batch, kv_heads * group, seq, dim)


def _forward_backward(fn, q, k, v, grad, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def _check_against_reference(got, q, k, v, grad, floor=1e-3, **kwargs):
    """got = (out, dq, dk, dv) from the Triton path; against the float64 reference, and the
    reference in the inputs' dtype as PyTorch's baseline error."""
    exact = _forward_backward(attention_reference, *(t.double() for t in (q, k, v, grad)), **kwargs)
    low = _forward_backward(attention_reference, q, k, v, grad, **kwargs)
    factor = 4 if interpreting() and q.dtype == torch.bfloat16 else 2
    for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
        assert g.dtype == q.dtype and g.shape == e.shape, name
        assert torch.isfinite(g).all(), name
        err = (g.double() - e).abs().max().item()
        torch_err = (lo.double() - e).abs().max().item()
        assert err <= factor * torch_err + floor, f"{name}: dslab err {err:.3g} vs torch err {torch_err:.3g}"


def _force_plan(monkeypatch, plan):
    """The interpreter's small problems take FUSED or BOTH; 'split' and 'atomic' force the others."""
    if plan is not None:
        monkeypatch.setattr(attention_triton_bwd, "BOTH_MAX_WORK", -1)
    if plan == "split":
        monkeypatch.setattr(attention_triton_bwd, "ATOMIC_MIN_WORK", 2**62)


def test_reference_is_attention_over_repeated_kv_heads():
    """In float64: the same output as k, v repeated to q's heads, and dk, dv the group sums."""
    q, k, v, grad = _inputs(2, 6, 2, 9, 11, torch.float64)
    got = _forward_backward(attention_reference, q, k, v, grad, causal=True)
    repeated = _forward_backward(attention_reference, q, _repeat_kv(k, 3), _repeat_kv(v, 3), grad, causal=True)
    torch.testing.assert_close(got[0], repeated[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], repeated[1], rtol=0, atol=0)
    for g, r in zip(got[2:], repeated[2:]):
        torch.testing.assert_close(g, r.view(2, 2, 3, 11, HEAD_DIM).sum(2))


# (batch, heads, kv_heads, seq_q, seq_k, dtype, causal, padding). seq_k <= 32: FUSED; 37 and 41:
# BOTH with 2 key blocks of 32, dealt over groups of 3 and 4.
CASES = [
    (1, 6, 2, 37, 37, "bf16", True, None),
    (2, 6, 2, 37, 37, "fp16", False, "some"),
    (2, 4, 1, 37, 29, "fp16", True, "full"),
    (1, 4, 1, 23, 41, "bf16", False, None),
    (1, 6, 3, 45, 29, "bf16", True, None),
]


@pytest.mark.parametrize("batch,heads,kv_heads,seq_q,seq_k,dtype,causal,padding", CASES)
def test_triton_matches_reference(batch, heads, kv_heads, seq_q, seq_k, dtype, causal, padding):
    q, k, v, grad = _inputs(batch, heads, kv_heads, seq_q, seq_k, LOW_PRECISION[dtype])
    kwargs = dict(causal=causal, key_padding_mask=_padding(padding, batch, seq_k))
    with kernel_backend("triton"):
        got = _forward_backward(attention, q, k, v, grad, **kwargs)
    _check_against_reference(got, q, k, v, grad, **kwargs)
    if padding == "full":
        for t in got:
            assert torch.equal(t[-1], torch.zeros_like(t[-1]))


@pytest.mark.parametrize("case,plan", [(CASES[0], "split"), (CASES[0], "atomic"), (CASES[3], "atomic")])
def test_triton_backward_plans_match_reference(case, plan, monkeypatch):
    """The DQ_ONLY + DKDV_ONLY and ATOMIC launches, whose dK/dV programs are one per (batch, kv head)."""
    _force_plan(monkeypatch, plan)
    batch, heads, kv_heads, seq_q, seq_k, dtype, causal, padding = case
    q, k, v, grad = _inputs(batch, heads, kv_heads, seq_q, seq_k, LOW_PRECISION[dtype], seed=2)
    bwd = attention_triton_bwd
    expected = (bwd.ATOMIC,) if plan == "atomic" else (bwd.DQ_ONLY, bwd.DKDV_ONLY)
    assert bwd.backward_roles(batch * heads, seq_q, seq_k, 32, causal, kv_group=heads // kv_heads) == expected
    with kernel_backend("triton"):
        got = _forward_backward(attention, q, k, v, grad, causal=causal)
    _check_against_reference(got, q, k, v, grad, causal=causal)


@pytest.mark.parametrize("seq_q,seq_k,dtype,causal,plan", [
    (37, 37, "bf16", True, None),
    (37, 37, "fp16", True, "split"),
    (33, 29, "fp16", False, None),
])
def test_triton_dropout_matches_reference_with_its_mask(seq_q, seq_k, dtype, causal, plan, monkeypatch):
    """Each query head draws its own mask (``triton_dropout_keep_mask`` over q's heads), with key
    padding too; the reference replays it over the repeated k and v."""
    _force_plan(monkeypatch, plan)
    batch, heads, kv_heads, dropout_p = 2, 4, 2, 0.3
    q, k, v, grad = _inputs(batch, heads, kv_heads, seq_q, seq_k, LOW_PRECISION[dtype], seed=3)
    mask = _padding("some", batch, seq_k)
    torch.manual_seed(11)
    seed = draw_dropout_seed("cpu")
    with kernel_backend("triton"):
        keep = triton_dropout_keep_mask(seed, batch, heads, seq_q, seq_k, dropout_p, "cpu")
        got = _forward_backward(attention, q, k, v, grad, causal=causal, key_padding_mask=mask,
                                dropout_p=dropout_p, seed=seed)
    kwargs = dict(causal=causal, key_padding_mask=mask, dropout_p=dropout_p, dropout_mask=keep)
    _check_against_reference(got, q, k, v, grad, **kwargs)


@pytest.mark.parametrize("seq_k,plan", [(37, None), (29, None), (37, "split")])
def test_backward_draws_the_dropout_bits_the_forward_stored(seq_k, plan, monkeypatch):
    """Without the forward's bits the backward draws each query head's mask again (keyed by the
    query head, also in the dK/dV programs that walk a group): exactly the same gradients."""
    from dslab.kernels.attention import attention_triton

    _force_plan(monkeypatch, plan)
    q, k, v, grad = _inputs(1, 6, 2, 37, seq_k, torch.float16, seed=8)
    seed, scale = torch.tensor([2**35 + 1]), HEAD_DIM**-0.5
    with kernel_backend("triton"):
        keep = attention_triton.empty_keep_bits(q, seq_k)
        out, lse = attention_triton.attention_forward(q, k, v, None, seed, True, 0.3, scale, keep=keep)
        args = (grad, q, k, v, out, lse, None, seed, True, 0.3, scale)
        loaded = attention_triton_bwd.attention_backward(*args, keep=keep)
        drawn = attention_triton_bwd.attention_backward(*args)
    for a, b in zip(loaded, drawn):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seq_k,dropout_p", [(37, 0.0), (29, 0.25)])
def test_same_bits_as_multi_head_attention_over_repeated_kv(seq_k, dropout_p):
    """On the Triton path, out and dq equal bitwise those of plain attention over k and v repeated
    to q's heads (the same tiles read the same values, the dropout draws are per query head);
    dk, dv match the sums of its per-head gradients, and a second run gives the same bits.
    q is a [batch, seq, heads, dim] view and k, v views of one [batch, seq, 2, kv_heads, dim] buffer."""
    batch, heads, kv_heads, seq_q, group = 2, 6, 2, 31, 3
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(batch, seq_q, heads, HEAD_DIM, generator=gen).half().transpose(1, 2)
    kv = torch.randn(batch, seq_k, 2, kv_heads, HEAD_DIM, generator=gen).half()
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    grad = torch.randn(batch, heads, seq_q, HEAD_DIM, generator=gen).half()
    kwargs = dict(causal=True, dropout_p=dropout_p, seed=2**40 + 3 if dropout_p else None)
    with kernel_backend("triton"):
        grouped = _forward_backward(attention, q, k, v, grad, **kwargs)
        again = _forward_backward(attention, q, k, v, grad, **kwargs)
        repeated = _forward_backward(attention, q, _repeat_kv(k, group).contiguous(),
                                     _repeat_kv(v, group).contiguous(), grad, **kwargs)
    for a, b in zip(grouped, again):
        assert torch.equal(a, b)
    assert grouped[0].stride() == q.stride()
    assert grouped[2].shape == k.shape and grouped[3].shape == v.shape
    assert torch.equal(grouped[0], repeated[0])
    assert torch.equal(grouped[1], repeated[1])
    for g, r in zip(grouped[2:], repeated[2:]):
        summed = r.float().view(batch, kv_heads, group, seq_k, HEAD_DIM).sum(2)
        torch.testing.assert_close(g.float(), summed, rtol=2e-3, atol=2e-3)


def test_fused_backward_counts_a_groups_rows():
    """FUSED has one program per (batch, kv head) over the rows of the group's query heads: long
    groups over few kv heads go to the other plans; without grouping nothing changes."""
    bwd = attention_triton_bwd
    assert bwd.backward_roles(64, 256, 128, 64, False, interpret=False) == (bwd.FUSED,)
    assert bwd.backward_roles(64, 256, 128, 64, False, interpret=False, kv_group=2) == (bwd.FUSED,)
    assert bwd.backward_roles(64, 256, 128, 64, False, interpret=False, kv_group=4) == (bwd.BOTH,)
    assert bwd.backward_roles(1024, 256, 128, 64, False, interpret=False, kv_group=4) == (bwd.FUSED,)


def test_torch_compile_fullgraph_and_fake_kernels():
    """The custom ops traced with grouped k, v (the backward's fake gives dk, dv k's and v's
    shapes) give the eager launches' bits; opcheck on the forward."""
    q, k, v, grad = _inputs(1, 4, 2, 21, 19, torch.bfloat16, seed=5)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, causal=True), backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager = _forward_backward(attention, q, k, v, grad, causal=True)
        traced = _forward_backward(compiled, q, k, v, grad)
        torch.library.opcheck(torch.ops.dslab.attention_forward.default, (q, k, v, None, None, True, 0.0, 0.125),
                              test_utils=("test_schema", "test_faketensor"))
    torch._dynamo.reset()
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)


def test_flops_profiler_counts_query_heads():
    """dslab::attention_forward with 4 query heads over 1 kv head: 4*B*Hq*Sq*Sk*D (the matmuls run
    per query head), halved when causal; its backward 2.5x."""
    import torch.nn as nn

    from dslab.profilers.flops import FlopsProfiler

    b, hq, hkv, s, d = 1, 4, 1, 16, HEAD_DIM
    q, k, v, _ = _inputs(b, hq, hkv, s, s, torch.bfloat16, seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    class Call(nn.Module):
        def forward(self, q, k, v):
            return torch.ops.dslab.attention_forward(q, k, v, None, None, True, 0.0, d**-0.5)[0]

    model = Call()
    profiler = FlopsProfiler(model)
    with kernel_backend("triton"):
        profiler.start_profile()
        model(q, k, v).float().sum().backward()
        profiler.stop_profile()
    records = profiler.records()
    forward = 4 * b * hq * s * s * d // 2
    assert records["flops_by_op"]["dslab::attention_forward"] == {"figure": "matmul", "flops": forward}
    assert records["flops_by_op"]["dslab::attention_backward"]["flops"] == forward * 5 // 2


@pytest.mark.parametrize("heads,k_heads,v_heads,match", [
    (6, 4, 4, "q has 6 heads and k, v have 4"),
    (4, 3, 3, "q has 4 heads and k, v have 3"),
    (4, 2, 1, "v has 1 heads but k has 2"),
    (4, 0, 0, "q has 4 heads and k, v have 0"),
])
def test_heads_that_do_not_divide_raise_value_error(heads, k_heads, v_heads, match):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, heads, 5, HEAD_DIM, generator=gen)
    k = torch.randn(2, k_heads, 7, HEAD_DIM, generator=gen)
    v = torch.randn(2, v_heads, 7, HEAD_DIM, generator=gen)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v)
