"""dslab.kernels.attention.attention: the Triton flash attention against the PyTorch reference.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (forced with ``kernel_backend("triton")``)
at small irregular shapes, in bf16 and fp16 (bf16 dot operands are upcast to fp32 inside the same
kernels there, see ``attention_triton._dot``). Accuracy follows STYLE.md #4: against the float64
reference, the kernel's error must be at most twice PyTorch's own error in the same low precision
(the reference run in that dtype), plus a small floor. One exception: the interpreter converts
fp32 to bf16 by truncation where the GPU rounds to nearest, which doubles the kernel's last-bit
error, so bf16 checks under the interpreter allow four times PyTorch's error.

Dropout seeds are int64 ``[1]`` tensors on q's device that the kernels read there (ints are
accepted and give the same masks); the reference replays the Triton mask
(``triton_dropout_keep_mask``) through its ``dropout_mask``.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels.attention import attention_triton_bwd
from dslab.kernels.attention.attention import (
    attention,
    attention_reference,
    draw_dropout_seed,
    triton_dropout_keep_mask,
)
from dslab.kernels.dispatch import interpreting, kernel_backend
from philox_reference import sixteen_bit_draws

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(batch, heads, seq_q, seq_k, head_dim, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, head_dim, generator=gen)
    k = torch.randn(batch, heads, seq_k, head_dim, generator=gen)
    v = torch.randn(batch, heads, seq_k, head_dim, generator=gen)
    grad = torch.randn(batch, heads, seq_q, head_dim, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, grad)]


def _padding(kind, batch, seq_k, device="cpu", seed=1):
    """None, or a mask with random padding; 'full' pads every key of the last batch element, and
    'first' also pads key 0 of batch 0 (with causal, query 0 of batch 0 then sees nothing)."""
    if kind is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, seq_k, generator=gen) < 0.3
    mask[-1] = True
    if kind == "first":
        mask[0, 0] = True
    return mask.to(device)


def _forward_backward(q, k, v, grad, backend=None, **kwargs):
    """(out, dq, dk, dv) of :func:`attention`; ``backend`` "triton" keeps a causal call on Hopper on
    dslab's kernels instead of cuDNN's (:mod:`dslab.kernels.attention.attention_cudnn`)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if backend is None:
        out = attention(q, k, v, **kwargs)
    else:
        with kernel_backend(backend):
            out = attention(q, k, v, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def _reference_forward_backward(q, k, v, grad, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention_reference(q, k, v, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def _check_against_reference(got, q, k, v, grad, floor, **kwargs):
    """got = (out, dq, dk, dv) from dslab in low precision; compare with the reference in float64
    and in the inputs' own dtype."""
    exact = _reference_forward_backward(*(t.double() for t in (q, k, v, grad)), **kwargs)
    low = _reference_forward_backward(q, k, v, grad, **kwargs)
    factor = 4 if interpreting() and q.dtype == torch.bfloat16 else 2
    for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
        assert g.dtype == q.dtype and g.shape == e.shape, name
        assert torch.isfinite(g).all(), name
        err = (g.double() - e).abs().max().item()
        torch_err = (lo.double() - e).abs().max().item()
        assert err <= factor * torch_err + floor, f"{name}: dslab err {err:.3g} vs torch err {torch_err:.3g}"


def force_plan(monkeypatch, plan: str | None) -> None:
    """Make the interpreter's small problems take the backward's ``"split"`` (DQ_ONLY + DKDV_ONLY)
    or ``"atomic"`` (ATOMIC) plan; None leaves the plan alone (FUSED or BOTH)."""
    if plan is not None:
        monkeypatch.setattr(attention_triton_bwd, "BOTH_MAX_WORK", -1)
    if plan == "split":
        monkeypatch.setattr(attention_triton_bwd, "ATOMIC_MIN_WORK", 2**62)


# (batch, heads, seq_q, seq_k, head_dim, dtype, causal, padding). The interpreter tiles are 32x16
# forward and 32-key blocks backward: seq_k <= 32 takes the one-key-block backward.
CASES = [
    (2, 3, 37, 53, 64, "fp16", False, None),
    (2, 3, 37, 53, 32, "bf16", True, "first"),
    (2, 3, 53, 37, 128, "bf16", False, "full"),
    (2, 3, 53, 37, 64, "fp16", True, None),
    (2, 3, 45, 29, 64, "bf16", True, "first"),
    (2, 3, 20, 29, 128, "fp16", False, None),
    (2, 2, 40, 32, 32, "fp16", False, "full"),
]


@pytest.mark.parametrize("batch,heads,seq_q,seq_k,head_dim,dtype,causal,padding", CASES)
def test_triton_matches_reference(batch, heads, seq_q, seq_k, head_dim, dtype, causal, padding):
    dtype = LOW_PRECISION[dtype]
    q, k, v, grad = _inputs(batch, heads, seq_q, seq_k, head_dim, dtype)
    mask = _padding(padding, batch, seq_k)
    kwargs = dict(causal=causal, key_padding_mask=mask)
    with kernel_backend("triton"):
        got = _forward_backward(q, k, v, grad, **kwargs)
    _check_against_reference(got, q, k, v, grad, floor=1e-3, **kwargs)
    if padding is not None:
        # Every key of the last batch element is padding: zeros everywhere, no NaN.
        for t in got:
            assert torch.equal(t[-1], torch.zeros_like(t[-1]))
    if padding == "first" and causal:
        assert torch.equal(got[0][0, :, 0], torch.zeros_like(got[0][0, :, 0]))
        assert torch.equal(got[1][0, :, 0], torch.zeros_like(got[1][0, :, 0]))


# Backward plans beyond the interpreter's FUSED and BOTH, run on a subset of CASES.
PLAN_CASES = [(CASES[1], "atomic"), (CASES[2], "atomic"), (CASES[3], "split"), (CASES[3], "atomic")]


@pytest.mark.parametrize("case,plan", PLAN_CASES)
def test_triton_backward_plans_match_reference(case, plan, monkeypatch):
    """The split (DQ_ONLY + DKDV_ONLY) and ATOMIC plans, several key blocks, fully padded rows."""
    force_plan(monkeypatch, plan)
    batch, heads, seq_q, seq_k, head_dim, dtype, causal, padding = case
    q, k, v, grad = _inputs(batch, heads, seq_q, seq_k, head_dim, LOW_PRECISION[dtype])
    kwargs = dict(causal=causal, key_padding_mask=_padding(padding, batch, seq_k))
    bwd = attention_triton_bwd
    expected = (bwd.ATOMIC,) if plan == "atomic" else (bwd.DQ_ONLY, bwd.DKDV_ONLY)
    assert bwd.backward_roles(batch * heads, seq_q, seq_k, head_dim, causal) == expected
    with kernel_backend("triton"):
        got = _forward_backward(q, k, v, grad, **kwargs)
    _check_against_reference(got, q, k, v, grad, floor=1e-3, **kwargs)
    if padding == "full":
        for t in got:
            assert torch.equal(t[-1], torch.zeros_like(t[-1]))


@pytest.mark.parametrize("seq_q,seq_k,head_dim,dtype,causal,dropout_p,plan", [
    (37, 53, 64, "bf16", True, 0.3, None),
    (37, 53, 64, "bf16", True, 0.3, "split"),
    (37, 53, 64, "bf16", True, 0.3, "atomic"),
    (45, 29, 32, "fp16", False, 0.2, None),
])
def test_triton_dropout_matches_reference_with_its_mask(
    seq_q, seq_k, head_dim, dtype, causal, dropout_p, plan, monkeypatch
):
    """With key padding too, whichever backward plan runs (``force_plan``)."""
    force_plan(monkeypatch, plan)
    dtype = LOW_PRECISION[dtype]
    batch, heads = 2, 3
    q, k, v, grad = _inputs(batch, heads, seq_q, seq_k, head_dim, dtype, seed=3)
    mask = _padding("first", batch, seq_k)
    torch.manual_seed(11)
    seed = draw_dropout_seed("cpu")
    with kernel_backend("triton"):
        keep = triton_dropout_keep_mask(seed, batch, heads, seq_q, seq_k, dropout_p, "cpu")
        torch.manual_seed(11)
        got = _forward_backward(q, k, v, grad, causal=causal, key_padding_mask=mask, dropout_p=dropout_p)
    kwargs = dict(causal=causal, key_padding_mask=mask, dropout_p=dropout_p, dropout_mask=keep)
    _check_against_reference(got, q, k, v, grad, floor=1e-3, **kwargs)


def test_dropout_mask_statistics_and_reproducibility():
    with kernel_backend("triton"):
        keep = triton_dropout_keep_mask(2**40 + 7, 2, 3, 64, 96, 0.3, "cpu")
        again = triton_dropout_keep_mask(2**40 + 7, 2, 3, 64, 96, 0.3, "cpu")
        other = triton_dropout_keep_mask(2**40 + 8, 2, 3, 64, 96, 0.3, "cpu")
    assert torch.equal(keep, again)
    # 36,864 draws: the kept fraction's standard deviation is 0.0024.
    assert abs(keep.float().mean().item() - 0.7) < 0.015
    assert (keep != other).float().mean().item() > 0.3
    flat = keep.view(6, -1)
    for i in range(1, 6):  # every (batch, head) gets its own stream
        assert (flat[0] != flat[i]).float().mean().item() > 0.3
    # Keys and queries are not correlated along rows or columns.
    assert abs(keep.float().mean(dim=(0, 1, 2)) - 0.7).max().item() < 0.15
    assert abs(keep.float().mean(dim=(0, 1, 3)) - 0.7).max().item() < 0.15


def test_dropout_draws_within_a_key_group_are_independent_and_tile_free():
    """Eight adjacent keys share one Philox call (two 16-bit draws from each 32-bit output): each
    pair of them is kept together at the rate of independent draws, and the mask does not depend
    on the tile sizes the kernels run (the forward and the backward roles use different ones)."""
    from dslab.kernels.attention.attention_triton import _dropout_mask_kernel, kernel_dropout_p

    seed = torch.tensor([2**33 + 5])
    with kernel_backend("triton"):
        keep = triton_dropout_keep_mask(seed, 1, 4, 128, 256, 0.5, "cpu")
        small_tiles = torch.empty((4, 128, 256), dtype=torch.uint8)
        _dropout_mask_kernel[(128 // 16, 256 // 32, 4)](small_tiles, seed, 128, 256, 0.5, BLOCK_M=16, BLOCK_N=32)
        # Key blocks wider than 64 expand the bits another way (no 64-bit word per row).
        wide_tiles = torch.empty((4, 128, 256), dtype=torch.uint8)
        _dropout_mask_kernel[(128 // 32, 256 // 128, 4)](wide_tiles, seed, 128, 256, 0.5, BLOCK_M=32, BLOCK_N=128)
    assert torch.equal(keep.view(4, 128, 256), small_tiles.bool())
    assert torch.equal(keep.view(4, 128, 256), wide_tiles.bool())
    groups = keep.reshape(-1, 8).float()  # 16,384 groups of 8 adjacent keys
    assert abs(groups.mean().item() - 0.5) < 0.01
    for i in range(8):
        for j in range(i + 1, 8):  # 16,384 pairs each: the joint rate's standard deviation is 0.0034
            assert abs((groups[:, i] * groups[:, j]).mean().item() - 0.25) < 0.02, (i, j)
    assert kernel_dropout_p(0.1) == 6554 / 65536
    assert kernel_dropout_p(0.0) == 0.0
    assert kernel_dropout_p(1 - 1e-7) == 65535 / 65536  # never 1: the kernels divide by 1 - p


def test_dropout_mask_is_the_documented_philox_draw():
    """Each kept bit is the documented draw, computed here from the Philox definition itself: key
    ``n`` of query ``i`` in head ``bh`` uses 16-bit half ``n % 2`` of output ``(n % 8) // 2`` of the
    call with counter ``(n // 8, i, bh, 0)``, kept when at least ``p * 2**16``."""
    from dslab.kernels.attention.attention_triton import kernel_dropout_p

    seed, heads, seq_q, seq_k, dropout_p = 2**37 + 12345, 2, 24, 40, 0.3
    with kernel_backend("triton"):
        keep = triton_dropout_keep_mask(torch.tensor([seed]), 1, heads, seq_q, seq_k, dropout_p, "cpu")
    threshold = round(kernel_dropout_p(dropout_p) * 65536)
    expected = torch.empty((heads, seq_q, seq_k), dtype=torch.bool)
    for bh in range(heads):
        for i in range(seq_q):
            for group in range(seq_k // 8):
                for j, draw in enumerate(sixteen_bit_draws(seed, (group, i, bh, 0))):
                    expected[bh, i, 8 * group + j] = draw >= threshold
    assert torch.equal(keep.view(heads, seq_q, seq_k), expected)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_loads_the_dropout_bits_the_forward_stored(causal):
    """The forward stores a bit per probability; the backward that loads them gives exactly the
    gradients of the one that draws the mask again, and the bits are the debug mask's."""
    from dslab.kernels.attention import attention_triton

    batch, heads, seq_q, seq_k, dim = 2, 3, 40, 56, 32
    q, k, v, grad = _inputs(batch, heads, seq_q, seq_k, dim, torch.bfloat16, seed=9)
    seed, scale = torch.tensor([2**35 + 1]), dim**-0.5
    with kernel_backend("triton"):
        keep = attention_triton.empty_keep_bits(q, seq_k)
        assert keep.shape == (batch * heads, seq_q, 7) and keep.dtype == torch.uint8
        out, lse = attention_triton.attention_forward(q, k, v, None, seed, causal, 0.3, scale, keep=keep)
        args = (grad, q, k, v, out, lse, None, seed, causal, 0.3, scale)
        loaded = attention_triton_bwd.attention_backward(*args, keep=keep)
        drawn = attention_triton_bwd.attention_backward(*args)
        mask = triton_dropout_keep_mask(seed, batch, heads, seq_q, seq_k, 0.3, "cpu").view(-1, seq_q, seq_k)
    for a, b in zip(loaded, drawn):
        assert torch.equal(a, b)
    bits = ((keep[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().reshape(-1, seq_q, 56)
    written = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if causal:  # the forward writes the key blocks it visits: every key at or below the diagonal
        written = torch.ones(seq_q, seq_k, dtype=torch.bool).tril()
    assert torch.equal(bits[:, written], mask[:, written])
    assert 0.6 < mask.float().mean().item() < 0.8


def test_dropout_seed_comes_from_torch_generator():
    q, k, v, _ = _inputs(1, 2, 20, 24, 32, torch.float16)
    with kernel_backend("triton"):
        torch.manual_seed(5)
        first = attention(q, k, v, dropout_p=0.5)
        torch.manual_seed(5)
        second = attention(q, k, v, dropout_p=0.5)
        third = attention(q, k, v, dropout_p=0.5)
    assert torch.equal(first, second)
    assert not torch.equal(first, third)


def test_explicit_seeds_int_and_tensor_agree_and_differ_between_values():
    """Same seed value (int, [1] tensor or 0-d tensor) -> same output and gradients; another value
    -> another mask. The forward's mask is the debug helper's; the backward uses it too."""
    q, k, v, grad = _inputs(2, 2, 21, 19, 32, torch.float16, seed=6)
    with kernel_backend("triton"):
        from_int = _forward_backward(q, k, v, grad, dropout_p=0.4, seed=2**45 + 9)
        for seed in (torch.tensor([2**45 + 9]), torch.tensor(2**45 + 9)):
            for a, b in zip(from_int, _forward_backward(q, k, v, grad, dropout_p=0.4, seed=seed)):
                assert torch.equal(a, b)
        other = _forward_backward(q, k, v, grad, dropout_p=0.4, seed=torch.tensor([3]))
        keep = triton_dropout_keep_mask(torch.tensor([2**45 + 9]), 2, 2, 21, 19, 0.4, "cpu")
    assert not torch.equal(from_int[0], other[0])
    kwargs = dict(dropout_p=0.4, dropout_mask=keep)
    _check_against_reference(from_int, q, k, v, grad, floor=1e-3, **kwargs)
    # The reference with a seed: a generator-seeded mask, the same for int and tensor seeds.
    q32, k32, v32 = (t.float() for t in (q, k, v))
    first = attention(q32, k32, v32, dropout_p=0.4, seed=7)
    assert torch.equal(first, attention(q32, k32, v32, dropout_p=0.4, seed=torch.tensor([7])))
    assert not torch.equal(first, attention(q32, k32, v32, dropout_p=0.4, seed=8))


def test_seed_tensor_is_read_on_the_device_not_the_host(monkeypatch):
    """With a seed tensor (or a drawn one) the Triton path never turns it into a Python number
    (a host synchronisation on a GPU, and a value baked into a captured CUDA graph)."""
    q, k, v, grad = _inputs(1, 2, 17, 23, 32, torch.bfloat16, seed=7)
    seed = draw_dropout_seed("cpu")
    assert seed.dtype == torch.int64 and seed.shape == (1,) and seed.device.type == "cpu"
    assert draw_dropout_seed("meta").device.type == "meta"

    def reads_host(self, *args):
        raise AssertionError("an int64 tensor was read on the host")

    with kernel_backend("triton"):
        keep = triton_dropout_keep_mask(seed, 1, 2, 17, 23, 0.25, "cpu")
        for name in ("item", "__int__", "__index__", "tolist"):
            monkeypatch.setattr(torch.Tensor, name, reads_host)
        got = _forward_backward(q, k, v, grad, dropout_p=0.25, seed=seed)
        drawn = _forward_backward(q, k, v, grad, dropout_p=0.25)  # seed drawn inside
        monkeypatch.undo()
    _check_against_reference(got, q, k, v, grad, floor=1e-3, dropout_p=0.25, dropout_mask=keep)
    assert all(torch.isfinite(t).all() for t in drawn)


@pytest.mark.parametrize("seed, match", [
    (torch.tensor([1], dtype=torch.int32), "seed"),
    (torch.tensor([1, 2]), "seed"),
    (torch.tensor([1], device="meta"), "seed"),
    (-3, "seed"),
    (1.5, "seed"),
])
def test_bad_seed_raises_value_error(seed, match):
    q, k, v, _ = _inputs(1, 1, 5, 7, 32, torch.float16)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, dropout_p=0.1, seed=seed)


def test_strided_layouts_and_output_layout():
    """q, k, v as [batch, seq, heads, dim] views and an expanded (stride 0) output gradient."""
    batch, heads, seq_q, seq_k, dim = 2, 3, 37, 21, 32
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(batch, seq_q, heads, dim, generator=gen).half().transpose(1, 2)
    kv = torch.randn(batch, seq_k, 2, heads, dim, generator=gen).half()
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    grad = torch.ones(1, 1, 1, 1, dtype=torch.float16).expand(batch, heads, seq_q, dim)
    with kernel_backend("triton"):
        got = _forward_backward(q, k, v, grad, causal=True)
    assert got[0].stride() == q.stride()  # the output keeps q's [batch, seq, heads, dim] layout
    _check_against_reference(got, q, k, v, grad, floor=1e-3, causal=True)


def test_a_captured_backward_splits_from_less_work():
    # Inside a CUDA graph the split's second launch costs no host time: GPT-2 1.5B's layer
    # (batch 4 x 25 heads, seq 1024 causal) runs BOTH eagerly and ATOMIC captured.
    bwd = attention_triton_bwd
    assert bwd.backward_roles(100, 1024, 1024, 64, True, interpret=False) == (bwd.BOTH,)
    assert bwd.backward_roles(100, 1024, 1024, 64, True, interpret=False, capturing=True) == (bwd.ATOMIC,)
    assert bwd.backward_roles(192, 1024, 1024, 64, True, interpret=False) == (bwd.ATOMIC,)
    # The deterministic plan for the same work: two launches, no atomics.
    assert bwd.backward_roles(192, 1024, 1024, 64, True, interpret=False, deterministic=True) == (bwd.DQ_ONLY,
                                                                                                bwd.DKDV_ONLY)
    torch.use_deterministic_algorithms(True)
    try:
        assert bwd.backward_roles(192, 1024, 1024, 64, True, interpret=False) == (bwd.DQ_ONLY, bwd.DKDV_ONLY)
    finally:
        torch.use_deterministic_algorithms(False)
    # Short keys stay on the one-program-per-head FUSED path either way.
    assert bwd.backward_roles(1024, 128, 128, 64, False, interpret=False, capturing=True) == (bwd.FUSED,)
    # The warm-up runs before a capture rehearse the capture's plan (so that its kernels autotune
    # there, not inside the capture).
    from dslab.kernels.dispatch import graphed_launches, launches_graphed

    assert not launches_graphed()
    with graphed_launches():
        assert launches_graphed()
    assert not launches_graphed()


def test_backward_paths_agree():
    """The same inputs through the FUSED, BOTH, ATOMIC and DQ_ONLY + DKDV_ONLY backward launches
    give the same gradients (several key blocks and a causal diagonal in the last three)."""
    q, k, v, grad = _inputs(1, 2, 33, 29, 64, torch.float16, seed=8)
    bwd = attention_triton_bwd
    assert bwd.backward_roles(2, 33, 29, 64, True) == (bwd.FUSED,)
    results = {}
    with kernel_backend("triton"):
        results["fused"] = _forward_backward(q, k, v, grad, causal=True)
        limit, max_work = bwd._BWD_INTERPRET_TILE, bwd.BOTH_MAX_WORK
        try:
            bwd._BWD_INTERPRET_TILE = (16, 16, 32, 16)
            bwd.reset_kernels()
            assert bwd.backward_roles(2, 33, 29, 64, True) == (bwd.BOTH,)
            results["both"] = _forward_backward(q, k, v, grad, causal=True)
            bwd.BOTH_MAX_WORK = -1
            assert bwd.backward_roles(2, 33, 29, 64, True) == (bwd.ATOMIC,)
            results["atomic"] = _forward_backward(q, k, v, grad, causal=True)
            torch.use_deterministic_algorithms(True)
            try:
                assert bwd.backward_roles(2, 33, 29, 64, True) == (bwd.DQ_ONLY, bwd.DKDV_ONLY)
                results["split"] = _forward_backward(q, k, v, grad, causal=True)
            finally:
                torch.use_deterministic_algorithms(False)
        finally:
            bwd._BWD_INTERPRET_TILE, bwd.BOTH_MAX_WORK = limit, max_work
            bwd.reset_kernels()
    _check_against_reference(results["split"], q, k, v, grad, floor=1e-3, causal=True)
    for name in ("fused", "both", "atomic"):
        for a, b in zip(results[name], results["split"]):
            assert (a.float() - b.float()).abs().max().item() < 2e-3, name


def test_double_backward_raises():
    """The Triton backward is not differentiable: with create_graph=True the gradients carry a node
    that raises when differentiated (``once_differentiable``), rather than silently being constants."""
    q, k, v, grad = (t.requires_grad_() for t in _inputs(1, 1, 9, 12, 32, torch.float16, seed=15))
    with kernel_backend("triton"):
        out = attention(q, k, v)
        (dq,) = torch.autograd.grad(out, (q,), grad, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.float().sum().backward()


def test_torch_compile_fullgraph_traces_the_custom_op():
    q, k, v, grad = _inputs(1, 2, 21, 40, 32, torch.bfloat16, seed=9)
    mask = _padding("first", 1, 40)
    torch._dynamo.reset()

    def f(q, k, v):
        return attention(q, k, v, causal=True, key_padding_mask=mask)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager = _forward_backward(q, k, v, grad, causal=True, key_padding_mask=mask)
        qc, kc, vc = (t.detach().requires_grad_() for t in (q, k, v))
        out = compiled(qc, kc, vc)
        grads = torch.autograd.grad(out, (qc, kc, vc), grad)
    for a, b in zip(eager, (out, *grads)):
        assert torch.equal(a, b)
    # With dropout the seed is drawn inside the graph: each compiled call gets a fresh mask.
    with_dropout = torch.compile(lambda q: attention(q, k, v, dropout_p=0.3), backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        first, second = with_dropout(q), with_dropout(q)
    torch._dynamo.reset()
    assert torch.isfinite(first).all() and not torch.equal(first, second)


def test_fake_kernels_match_real_ones():
    q, k, v, grad = _inputs(1, 1, 17, 20, 32, torch.float16, seed=10)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [batch, seq, heads, dim] layout
    with kernel_backend("triton"):
        for seed, dropout_p in ((None, 0.0), (torch.tensor([5]), 0.2)):
            args = (q, k, v, None, seed, True, dropout_p, 0.125)
            torch.library.opcheck(
                torch.ops.dslab.attention_forward.default, args, test_utils=("test_schema", "test_faketensor")
            )


def test_auto_backend_on_cpu_and_fp32_use_the_reference():
    q, k, v, _ = _inputs(2, 2, 19, 23, 64, torch.float32, seed=12)
    mask = _padding("first", 2, 23)
    expected = attention_reference(q, k, v, causal=True, key_padding_mask=mask)
    assert torch.equal(attention(q, k, v, causal=True, key_padding_mask=mask), expected)
    with kernel_backend("triton"):  # fp32 always takes the reference
        assert torch.equal(attention(q, k, v, causal=True, key_padding_mask=mask), expected)


@pytest.mark.parametrize("causal,padding", [(False, None), (True, "first"), (False, "full")])
def test_reference_matches_sdpa(causal, padding):
    q, k, v, _ = _inputs(2, 3, 13, 13, 32, torch.float64, seed=13)
    mask = _padding(padding, 2, 13)
    got = attention_reference(q, k, v, causal=causal, key_padding_mask=mask, scale=0.3)
    allowed = torch.ones(13, 13, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if mask is not None:
        allowed = allowed & ~mask[:, None, None, :]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3)
    live = allowed.expand(2, 3, 13, 13).any(-1, keepdim=True).expand_as(got)
    torch.testing.assert_close(got[live], expected[live])
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, _ = _inputs(1, 1, 5, 7, 64, torch.float64, seed=14)
    assert torch.allclose(attention(q, k, v), attention(q, k, v, scale=1 / math.sqrt(64)))


@pytest.mark.parametrize("change,argument", [
    (lambda a: {**a, "q": a["q"][0]}, "q"),
    (lambda a: {**a, "k": a["k"].int()}, "k"),
    (lambda a: {**a, "v": a["v"].double()}, "v"),
    (lambda a: {**a, "q": a["q"][..., :48], "k": a["k"][..., :48], "v": a["v"][..., :48]}, "head_dim"),
    (lambda a: {**a, "k": a["k"][:, :1]}, "k"),
    (lambda a: {**a, "v": a["v"][:, :, :3]}, "v"),
    (lambda a: {**a, "key_padding_mask": torch.zeros(2, 5, dtype=torch.bool)}, "key_padding_mask"),
    (lambda a: {**a, "key_padding_mask": torch.zeros(2, 7)}, "key_padding_mask"),
    (lambda a: {**a, "dropout_p": 1.0}, "dropout_p"),
    (lambda a: {**a, "scale": -1.0}, "scale"),
])
def test_bad_input_raises_value_error_naming_the_argument(change, argument):
    q, k, v, _ = _inputs(2, 2, 5, 7, 64, torch.float32)
    args = change(dict(q=q, k=k, v=v))
    with pytest.raises(ValueError, match=argument):
        attention(**args)


BENCH_SHAPES = [  # (batch, heads, seq, head_dim, causal): benchmarks/kernels/bench_attention.py
    (64, 16, 128, 64, False),
    (16, 16, 512, 64, False),
    (16, 12, 1024, 64, True),
    (4, 16, 4096, 128, True),
]


def _sdpa_forward_backward(q, k, v, grad, causal, backend):
    from torch.nn.attention import sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,seq,head_dim,causal", BENCH_SHAPES)
def test_gpu_benchmark_shapes_against_sdpa(batch, heads, seq, head_dim, causal):
    """Error against fp32 SDPA at most twice that of SDPA's flash kernel in bf16."""
    from torch.nn.attention import SDPBackend

    q, k, v, grad = _inputs(batch, heads, seq, seq, head_dim, torch.bfloat16, device="cuda", seed=20)
    got = _forward_backward(q, k, v, grad, backend="triton", causal=causal)
    exact = _sdpa_forward_backward(*(t.float() for t in (q, k, v, grad)), causal, SDPBackend.EFFICIENT_ATTENTION)
    flash = _sdpa_forward_backward(q, k, v, grad, causal, SDPBackend.FLASH_ATTENTION)
    for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, flash):
        err = (g.float() - e).abs().max().item()
        torch_err = (lo.float() - e).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, f"{name}: dslab err {err:.3g} vs flash err {torch_err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("seq_q,seq_k,head_dim,dtype,causal,dropout_p", [
    (300, 517, 64, "bf16", True, 0.0),
    (517, 300, 128, "fp16", False, 0.1),
    (100, 77, 32, "bf16", True, 0.2),
    (129, 128, 64, "fp16", False, 0.0),
])
def test_gpu_masks_and_dropout_against_reference(seq_q, seq_k, head_dim, dtype, causal, dropout_p):
    dtype = LOW_PRECISION[dtype]
    batch, heads = 2, 4
    q, k, v, grad = _inputs(batch, heads, seq_q, seq_k, head_dim, dtype, device="cuda", seed=21)
    mask = _padding("first", batch, seq_k, device="cuda")
    torch.manual_seed(3)
    seed = draw_dropout_seed("cuda")
    keep = triton_dropout_keep_mask(seed, batch, heads, seq_q, seq_k, dropout_p, "cuda")
    torch.manual_seed(3)
    got = _forward_backward(q, k, v, grad, causal=causal, key_padding_mask=mask, dropout_p=dropout_p)
    kwargs = dict(causal=causal, key_padding_mask=mask, dropout_p=dropout_p, dropout_mask=keep)
    _check_against_reference(got, q, k, v, grad, floor=1e-3, **kwargs)
    for t in got:
        assert torch.equal(t[-1], torch.zeros_like(t[-1]))


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    q, k, v, grad = _inputs(4, 8, 1000, 1000, 64, torch.bfloat16, device="cuda", seed=22)
    first = _forward_backward(q, k, v, grad, backend="triton", causal=True)
    second = _forward_backward(q, k, v, grad, backend="triton", causal=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_q,seq_k,head_dim,causal,padding,dropout_p", [
    (300, 517, 64, True, "first", 0.1),  # dQ + dK/dV kernels
    (128, 128, 64, False, None, 0.0),  # one-key-block backward
    (200, 200, 128, True, None, 0.0),
])
def test_gpu_cached_launch_matches_triton_launch(seq_q, seq_k, head_dim, causal, padding, dropout_p):
    """Calls after the first with the same key launch the kept compiled kernels directly
    (``attention_triton.CachedLaunch``); on the same inputs they must give exactly what Triton's
    own launch path gives."""
    from dslab.kernels.attention import attention_triton

    batch, heads = 2, 3
    mask = _padding(padding, batch, seq_k, device="cuda")
    kwargs = dict(causal=causal, key_padding_mask=mask, dropout_p=dropout_p, backend="triton")
    first = _inputs(batch, heads, seq_q, seq_k, head_dim, torch.bfloat16, device="cuda", seed=30)
    second = _inputs(batch, heads, seq_q, seq_k, head_dim, torch.bfloat16, device="cuda", seed=31)
    attention_triton.clear_launch_caches()
    torch.manual_seed(1)
    _forward_backward(*first, **kwargs)  # Triton's path; the launchers keep the kernels
    kept = {id(c): len(c.entries) for c in attention_triton.CachedLaunch.instances}
    assert sum(kept.values()) >= 2
    torch.manual_seed(2)
    cached = _forward_backward(*second, **kwargs)
    assert {id(c): len(c.entries) for c in attention_triton.CachedLaunch.instances} == kept  # no new keys
    attention_triton.clear_launch_caches()
    torch.manual_seed(2)
    direct = _forward_backward(*second, **kwargs)
    for name, a, b in zip(("out", "dq", "dk", "dv"), cached, direct):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_gpu_cached_launch_grid_follows_the_batch():
    """The launch cache's key leaves the batch out (the strides of ``[batch, heads, seq, dim]``
    tensors do not depend on it, nor does the compiled kernel), so every call must launch its own
    grid. Batch 2, then 1, then 4 through one key per kernel: the forward of each, written into
    the middle of a NaN buffer, leaves the rest of the buffer NaN (a grid kept from batch 2 would
    store batch 1's second, absent, batch past it), and forward and backward equal Triton's own
    launch of the same inputs (a kept grid would leave batches 2 and 3 of the batch-4 call
    unwritten)."""
    from dslab.kernels.attention import attention_triton

    heads, seq, head_dim, pad = 3, 200, 64, 3
    batches = (2, 1, 4)
    inputs = {b: _inputs(b, heads, seq, seq, head_dim, torch.bfloat16, device="cuda", seed=50 + b) for b in batches}
    attention_triton.clear_launch_caches()
    cached = {}
    for index, batch in enumerate(batches):
        q, k, v, grad = inputs[batch]
        buffer = torch.full((batch + 2 * pad, heads, seq, head_dim), float("nan"), dtype=torch.bfloat16,
                            device="cuda")
        out = buffer[pad:pad + batch]
        attention_triton.attention_forward(q, k, v, None, None, True, 0.0, head_dim**-0.5, out=out)
        cached[batch] = (out, *_forward_backward(q, k, v, grad, backend="triton", causal=True))
        torch.cuda.synchronize()
        assert torch.isnan(buffer[:pad]).all() and torch.isnan(buffer[pad + batch:]).all(), f"batch {batch}"
        keys = {id(c): len(c.entries) for c in attention_triton.CachedLaunch.instances}
        if index == 0:
            first_keys = keys
        assert keys == first_keys  # later batches take the kept launches: the same keys
    attention_triton.clear_launch_caches()
    for batch in batches:
        q, k, v, grad = inputs[batch]
        direct = _forward_backward(q, k, v, grad, backend="triton", causal=True)
        for name, a, b in zip(("out (into a view)", "out", "dq", "dk", "dv"), cached[batch], (direct[0], *direct)):
            assert torch.equal(a, b), f"batch {batch}: {name}"


@pytest.mark.gpu
def test_gpu_dropout_without_host_sync_and_new_masks_on_cuda_graph_replays():
    """Attention dropout (seed drawn on the device, read by the kernels) runs forward and backward
    with CUDA's sync debug mode set to error; captured in a CUDA graph, each replay draws a new
    seed, hence a new mask, and torch.manual_seed replays the sequence."""
    q, k, v, grad = _inputs(2, 4, 200, 200, 64, torch.bfloat16, device="cuda", seed=40)
    _forward_backward(q, k, v, grad, dropout_p=0.2)  # compile and autotune outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _forward_backward(q, k, v, grad, dropout_p=0.2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(t).all() for t in got)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention(q, k, v, dropout_p=0.5)
    outs = []
    for _ in range(2):
        torch.manual_seed(9)
        for _ in range(2):
            graph.replay()
            outs.append(captured.clone())
    assert not torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
