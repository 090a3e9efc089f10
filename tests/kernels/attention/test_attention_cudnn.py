"""The cuDNN path of causal packed attention: when it is taken, the bias gradient it adds, and on a
Hopper GPU its results against dslab's Triton kernels and inside a CUDA graph."""

import dataclasses

import pytest
import torch
from test_attention_packed import _check_bias_gradient, _packed_inputs

from dslab.kernels.attention import attention_cudnn
from dslab.kernels.attention.attention_packed import attention_packed, attention_packed_reference
from dslab.kernels.dispatch import kernel_backend


@dataclasses.dataclass
class _Call:
    is_cuda: bool = True
    dtype: torch.dtype = torch.bfloat16
    head_dim: int = 64
    causal: bool = True
    has_padding_mask: bool = False
    has_seed: bool = False
    kernel_backend: str = "auto"
    deterministic: bool = False
    capability: tuple | None = (9, 0)


def test_a_causal_bf16_call_on_hopper_may_take_cudnn():
    assert attention_cudnn.ineligible_reason(**dataclasses.asdict(_Call())) is None
    assert attention_cudnn.ineligible_reason(**dataclasses.asdict(_Call(dtype=torch.float16, head_dim=128))) is None


@pytest.mark.parametrize("change,reason", [
    (dict(is_cuda=False, capability=None), "not a CUDA tensor"),
    (dict(kernel_backend="triton"), "kernel backend 'triton'"),
    (dict(kernel_backend="torch"), "kernel backend 'torch'"),
    (dict(capability=(8, 0)), "compute capability (8, 0)"),
    (dict(capability=(10, 0)), "compute capability (10, 0)"),
    (dict(dtype=torch.float32), "dtype torch.float32"),
    (dict(head_dim=32), "head dim 32"),
    (dict(causal=False), "not causal"),
    (dict(has_padding_mask=True), "key padding mask"),
    (dict(has_seed=True), "dropout seed"),
    (dict(deterministic=True), "deterministic"),
])
def test_each_condition_keeps_the_triton_kernels(change, reason):
    assert reason in attention_cudnn.ineligible_reason(**dataclasses.asdict(_Call(**change)))


def test_cpu_tensors_never_take_cudnn():
    qkv, _ = _packed_inputs(2, 2, 16, 64, torch.bfloat16)
    assert not attention_cudnn.eligible(qkv, 2, True, None, 0.0, None)


@pytest.mark.parametrize("batch,heads,seq,head_dim,layout", [
    (2, 3, 37, 64, "bhsd"),  # odd token count: the last row tile is partial
    (3, 2, 70, 32, "bshd"),  # gradients laid out [batch, seq, heads, dim], as cuDNN may write them
    (1, 1, 5, 64, "mixed"),  # one gradient with other strides: all are copied to one layout
])
def test_gather_packed_matches_autograds_packing_and_sums_the_bias(batch, heads, seq, head_dim, layout):
    """The backward's packing kernel (interpreter on CPU): the packed gradient equals the one
    autograd builds from the three heads' gradients (fresh random values, bit for bit), and the
    bias gradient is its column sums with the key block exactly 0."""
    gen = torch.Generator().manual_seed(seq)

    def grad():
        if layout == "bhsd" or (layout == "mixed" and seq % 2):
            return torch.randn(batch, heads, seq, head_dim, generator=gen)
        return torch.randn(batch, seq, heads, head_dim, generator=gen).transpose(1, 2)

    dq, dk, dv = grad(), grad(), torch.randn(batch, heads, seq, head_dim, generator=gen)
    if layout == "mixed":
        dk = torch.randn(batch, seq, heads, head_dim, generator=gen).transpose(1, 2)
    packed, dbias = attention_cudnn.gather_packed(dq, dk, dv, torch.float32)
    expected = torch.stack([dq, dk, dv], dim=2).transpose(1, 3).reshape(batch, seq, 3 * heads * head_dim)
    assert torch.equal(packed, expected)
    width = heads * head_dim
    sums = expected.reshape(-1, 3 * width).double().sum(0)
    torch.testing.assert_close(dbias[:width].double(), sums[:width], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dbias[2 * width:].double(), sums[2 * width:], rtol=1e-5, atol=1e-5)
    assert torch.equal(dbias[width:2 * width], torch.zeros(width))
    without, none = attention_cudnn.gather_packed(dq, dk, dv)
    assert none is None and torch.equal(without, expected)


def test_split_packed_gives_views_and_routes_gradients_to_qkv_and_bias():
    gen = torch.Generator().manual_seed(11)
    batch, heads, seq, head_dim = 2, 2, 9, 32
    qkv = torch.randn(batch, seq, 3 * heads * head_dim, generator=gen, requires_grad=True)
    bias = torch.zeros(3 * heads * head_dim, requires_grad=True)
    q, k, v = attention_cudnn._SplitPacked.apply(qkv, bias, heads)
    assert q.shape == (batch, heads, seq, head_dim) and q.data_ptr() == qkv.data_ptr()
    weights = [torch.randn(q.shape, generator=gen) for _ in range(3)]
    ((q * weights[0]).sum() + (k * weights[1]).sum() + (v * weights[2]).sum()).backward()
    expected = torch.stack(weights, dim=2).transpose(1, 3).reshape(qkv.shape)
    assert torch.equal(qkv.grad, expected)
    torch.testing.assert_close(bias.grad[:64], expected.reshape(-1, 192).sum(0)[:64], rtol=1e-5, atol=1e-5)
    assert torch.equal(bias.grad[64:128], torch.zeros(64))


# --- GPU -----------------------------------------------------------------------------------------


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _run(qkv, grad, heads, dropout_p, backend="auto"):
    leaf = qkv.detach().requires_grad_()
    bias = torch.zeros(qkv.shape[-1], device=qkv.device, dtype=qkv.dtype, requires_grad=True)
    with kernel_backend(backend):
        out = attention_packed(leaf, heads, causal=True, dropout_p=dropout_p, bias=bias)
    dqkv, dbias = torch.autograd.grad(out, (leaf, bias), grad)
    return out, dqkv, dbias


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,seq", [(16, 12, 1024), (4, 25, 1024), (2, 3, 200)])
def test_gpu_cudnn_path_matches_the_reference_and_the_triton_kernels(batch, heads, seq):
    """At the GPT-2 suite's shapes (and an odd length): the path is taken on Hopper, and without
    dropout its output, qkv gradient and bias gradient match the fp32 reference within bf16
    rounding, as the Triton kernels' do."""
    if not _hopper():
        pytest.skip("the cuDNN path runs on compute capability 9.x")
    qkv, grad = _packed_inputs(batch, heads, seq, 64, torch.bfloat16, device="cuda", seed=53)
    assert attention_cudnn.eligible(qkv, heads, True, None, 0.0, None)
    out, dqkv, dbias = _run(qkv, grad, heads, 0.0)
    ref_leaf = qkv.detach().float().requires_grad_()
    ref = attention_packed_reference(ref_leaf, heads, causal=True)
    (ref_dqkv,) = torch.autograd.grad(ref, (ref_leaf,), grad.float())
    t_out, t_dqkv, _ = _run(qkv, grad, heads, 0.0, backend="triton")

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    assert rel(out, ref) < 1e-2 and rel(dqkv, ref_dqkv) < 2e-2
    assert rel(out, ref) < 2 * rel(t_out, ref) + 1e-3 and rel(dqkv, ref_dqkv) < 2 * rel(t_dqkv, ref_dqkv) + 1e-3
    _check_bias_gradient(dbias.cpu(), dqkv.cpu(), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cudnn_dropout_is_unbiased_and_new_on_each_graph_replay():
    """With dropout 0.1: each call's mask differs, the mean of many outputs approaches the output
    without dropout (the 1 / (1 - p) rescaling), and a CUDA graph that captured forward and
    backward draws a new mask on each replay."""
    if not _hopper():
        pytest.skip("the cuDNN path runs on compute capability 9.x")
    batch, heads, seq = 4, 12, 512
    qkv, grad = _packed_inputs(batch, heads, seq, 64, torch.bfloat16, device="cuda", seed=59)
    plain = _run(qkv, grad, heads, 0.0)[0].float()
    outs = [_run(qkv, grad, heads, 0.1)[0].float() for _ in range(64)]
    single = ((outs[0] - plain).norm() / plain.norm()).item()
    mean = ((torch.stack(outs).mean(0) - plain).norm() / plain.norm()).item()
    assert single > 0.05 and not torch.equal(outs[0], outs[1])
    assert mean < single / 4

    leaf = qkv.detach().requires_grad_()
    static_grad = grad.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            out = attention_packed(leaf, heads, causal=True, dropout_p=0.1)
            torch.autograd.grad(out, (leaf,), static_grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_packed(leaf, heads, causal=True, dropout_p=0.1)
        (dqkv,) = torch.autograd.grad(out, (leaf,), static_grad)
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append((out.clone(), dqkv.clone()))
    assert not torch.equal(replays[0][0], replays[1][0]) and not torch.equal(replays[0][1], replays[1][1])
    assert torch.isfinite(replays[0][1]).all()


# --- separate q, k, v (grouped-query attention) ---------------------------------------------------


def _gqa_inputs(batch, heads, kv_heads, seq, head_dim, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=gen).transpose(1, 2)
    kv = torch.randn(batch, seq, 2, kv_heads, head_dim, generator=gen)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [b, s, h, d] views, as the Llama layer's
    grad = torch.randn(batch, heads, seq, head_dim, generator=gen)
    return [t.to(device=device, dtype=torch.bfloat16) for t in (q, k, v, grad)]


def test_split_path_needs_a_call_autograd_will_differentiate(monkeypatch):
    """With the device conditions met (stubbed on the CPU), a call whose inputs need no gradient,
    or one under no_grad, stays on dslab's kernels: the inference engine's prefill."""
    monkeypatch.setattr(attention_cudnn, "ineligible_reason", lambda **_: None)
    monkeypatch.setattr(attention_cudnn, "_cudnn_can_run", lambda *args, **kwargs: True)
    q, k, v, _ = _gqa_inputs(1, 4, 2, 8, 64)
    assert not attention_cudnn.eligible_split(q, k, v, True, None, 0.0, None)
    leaf = q.detach().requires_grad_()
    assert attention_cudnn.eligible_split(leaf, k, v, True, None, 0.0, None)
    with torch.no_grad():
        assert not attention_cudnn.eligible_split(leaf, k, v, True, None, 0.0, None)


def test_split_path_asks_cudnn_with_gqa_only_for_fewer_kv_heads(monkeypatch):
    asked = []
    monkeypatch.setattr(attention_cudnn, "ineligible_reason", lambda **_: None)
    monkeypatch.setattr(attention_cudnn, "_cudnn_can_run",
                        lambda q, k, v, p, causal, enable_gqa=False: asked.append(enable_gqa) or True)
    for kv_heads in (2, 4):
        q, k, v, _ = _gqa_inputs(1, 4, kv_heads, 8, 64)
        assert attention_cudnn.eligible_split(q.requires_grad_(), k, v, True, None, 0.0, None)
    assert asked == [True, False]


def test_attention_hands_an_eligible_call_to_cudnn(monkeypatch):
    """:func:`attention` calls :func:`attention_cudnn.attention` with its scale when
    :func:`attention_cudnn.eligible_split` accepts the call, and returns what it returns."""
    from dslab.kernels.attention.attention import attention, attention_reference

    calls = []

    def recorded(q, k, v, dropout_p, scale):
        calls.append((dropout_p, scale))
        return attention_reference(q, k, v, causal=True, scale=scale)

    monkeypatch.setattr(attention_cudnn, "eligible_split", lambda *args: True)
    monkeypatch.setattr(attention_cudnn, "attention", recorded)
    q, k, v, _ = (t.float() for t in _gqa_inputs(1, 4, 2, 8, 64, seed=3))
    out = attention(q, k, v, causal=True, scale=0.5)
    assert calls == [(0.0, 0.5)]
    assert torch.equal(out, attention_reference(q, k, v, causal=True, scale=0.5))


def _gqa_run(q, k, v, grad, backend="auto"):
    from dslab.kernels.attention.attention import attention

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with kernel_backend(backend):
        out = attention(q, k, v, causal=True)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,kv_heads,seq,head_dim", [
    (2, 32, 8, 512, 64),  # Llama-3.2-1B's heads
    (1, 24, 8, 333, 128),  # 3B's, an odd length
    (2, 4, 4, 200, 64),  # as many kv heads as query heads
    (1, 4, 2, 12289, 128),  # suites/long_context's heads on one of 4 Ulysses ranks, a long odd sequence
])
def test_gpu_split_path_matches_the_reference_and_the_triton_kernels(batch, heads, kv_heads, seq, head_dim):
    """On Hopper a differentiated causal call takes cuDNN; its output and dq, dk, dv (dk, dv summed
    over each group's query heads) match the fp32 reference within bf16 rounding, as the Triton
    kernels' do; a call without gradients stays on the Triton kernels (bit for bit theirs)."""
    from dslab.kernels.attention.attention import attention, attention_reference

    if not _hopper():
        pytest.skip("the cuDNN path runs on compute capability 9.x")
    q, k, v, grad = _gqa_inputs(batch, heads, kv_heads, seq, head_dim, device="cuda", seed=seq)
    assert attention_cudnn.eligible_split(q.detach().requires_grad_(), k, v, True, None, 0.0, None)
    got = _gqa_run(q, k, v, grad)
    triton_got = _gqa_run(q, k, v, grad, backend="triton")
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out = attention_reference(*leaves, causal=True)
    ref = (ref_out, *torch.autograd.grad(ref_out, leaves, grad.float()))

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    for name, g, t, r in zip(("out", "dq", "dk", "dv"), got, triton_got, ref):
        assert g.shape == r.shape, name
        assert rel(g, r) < 2e-2, name
        assert rel(g, r) < 2 * rel(t, r) + 1e-3, name
    assert not torch.equal(got[1], triton_got[1])  # two implementations: the path was taken
    with torch.no_grad():
        inference = attention(q, k, v, causal=True)
    assert torch.equal(inference, triton_got[0])


@pytest.mark.gpu
def test_gpu_split_path_inside_a_cuda_graph_equals_eager():
    if not _hopper():
        pytest.skip("the cuDNN path runs on compute capability 9.x")
    from dslab.kernels.attention.attention import attention

    q, k, v, grad = _gqa_inputs(2, 8, 2, 256, 64, device="cuda", seed=71)
    eager = _gqa_run(q, k, v, grad)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            out = attention(*leaves, causal=True)
            torch.autograd.grad(out, leaves, grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(*leaves, causal=True)
        grads = torch.autograd.grad(out, leaves, grad)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), eager):
        assert torch.equal(a, b), name
