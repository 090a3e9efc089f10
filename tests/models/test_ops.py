"""The model op sets: both kernel sets against hand-written formulas on fresh random fp32 inputs
at irregular shapes (on CPU the dslab set runs its kernels' references), their dropout, their
dtypes under autocast, and the choice of set."""

import math

import pytest
import torch

from dslab.models.ops import KERNEL_SETS, check_head_dim, op_set

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(params=KERNEL_SETS)
def ops(request):
    return op_set(request.param)


def _gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _layer_norm(h, w, b, eps):
    mean = h.mean(-1, keepdim=True)
    var = ((h - mean) ** 2).mean(-1, keepdim=True)
    return (h - mean) / torch.sqrt(var + eps) * w + b


def test_unknown_kernel_set_names_kernels():
    with pytest.raises(ValueError, match="kernels='fast'"):
        op_set("fast")


def test_op_set_names():
    assert op_set("dslab").name == "dslab" and op_set("torch").name == "torch"


def test_layer_norm(ops):
    x, r = torch.randn(3, 5, 72), torch.randn(3, 5, 72)
    w, b = torch.randn(72), torch.randn(72)
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), _layer_norm(x, w, b, 1e-5), **TOL)
    y, h = ops.layer_norm(x, w, b, 1e-3, residual=r)
    torch.testing.assert_close(h, x + r, **TOL)
    torch.testing.assert_close(y, _layer_norm(x + r, w, b, 1e-3), **TOL)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(ops, approximate):
    x, b = torch.randn(7, 33) * 3, torch.randn(33)
    torch.testing.assert_close(ops.bias_gelu(x, b, approximate), _gelu(x + b, approximate), **TOL)


def test_bias_dropout_residual_without_dropout(ops):
    x, b, r = torch.randn(4, 9, 40), torch.randn(40), torch.randn(4, 9, 40)
    torch.testing.assert_close(ops.bias_dropout_residual(x, b, r, 0.3, False), r + x + b, **TOL)
    torch.testing.assert_close(ops.bias_dropout_residual(x, b, r, 0.0, True), r + x + b, **TOL)


def test_bias_dropout_residual_drops_and_scales(ops):
    p = 0.25
    x, b, r = torch.randn(64, 96), torch.randn(96), torch.randn(64, 96)
    out = ops.bias_dropout_residual(x, b, r, p, True)
    kept = (out - r).abs() > 1e-6
    torch.testing.assert_close(out[kept], (r + (x + b) / (1 - p))[kept], **TOL)
    torch.testing.assert_close(out[~kept], r[~kept], **TOL)
    assert abs((~kept).float().mean().item() - p) < 0.03  # 6144 draws: 5 sigma is 0.028


def test_dropout_follows_torch_seed(ops):
    x, b, r = torch.randn(16, 64), torch.randn(64), torch.zeros(16, 64)
    torch.manual_seed(3)
    first = ops.bias_dropout_residual(x, b, r, 0.5, True)
    second = ops.bias_dropout_residual(x, b, r, 0.5, True)
    torch.manual_seed(3)
    again = ops.bias_dropout_residual(x, b, r, 0.5, True)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def _attention(q, k, v, causal, key_padding_mask, scale):
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), -math.inf)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], -math.inf)
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_attention(ops, causal, padded):
    batch, heads, seq, dim = 2, 3, 11, 32
    q, k, v = (torch.randn(batch, heads, seq, dim) for _ in range(3))
    mask = None
    if padded:
        mask = torch.zeros(batch, seq, dtype=torch.bool)
        mask[1, 7:] = True
    expected = _attention(q, k, v, causal, mask, 1 / math.sqrt(dim))
    torch.testing.assert_close(ops.attention(q, k, v, causal=causal, key_padding_mask=mask), expected, **TOL)
    torch.testing.assert_close(
        ops.attention(q, k, v, causal=causal, key_padding_mask=mask, scale=0.3),
        _attention(q, k, v, causal, mask, 0.3), **TOL,
    )


@pytest.mark.parametrize("causal", [False, True])
def test_attention_packed(ops, causal):
    """qkv [batch, seq, 3 * hidden] (q, k, v column blocks, heads in order) -> [batch, seq, hidden]."""
    batch, heads, seq, dim = 2, 3, 11, 32
    qkv = torch.randn(batch, seq, 3 * heads * dim)
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[1, 7:] = True
    q, k, v = qkv.view(batch, seq, 3, heads, dim).permute(2, 0, 3, 1, 4)
    expected = _attention(q, k, v, causal, mask, 0.3).transpose(1, 2).reshape(batch, seq, heads * dim)
    got = ops.attention_packed(qkv, heads, causal=causal, key_padding_mask=mask, scale=0.3)
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_softmax_cross_entropy(ops, smoothing):
    logits, target = torch.randn(13, 37) * 2, torch.randint(0, 37, (13,))
    target[[2, 5]] = -100
    logp = torch.log_softmax(logits, -1)
    valid = target != -100
    nll = -logp[valid].gather(1, target[valid, None]).squeeze(1)
    expected = ((1 - smoothing) * nll - smoothing * logp[valid].mean(-1)).mean()
    loss = ops.softmax_cross_entropy(logits, target, -100, smoothing)
    torch.testing.assert_close(loss, expected, **TOL)
    loss_bf16 = ops.softmax_cross_entropy(logits.bfloat16(), target, -100, smoothing)
    assert loss_bf16.dtype == torch.float32
    torch.testing.assert_close(loss_bf16, expected, rtol=2e-2, atol=2e-2)


def test_dtypes_under_autocast():
    """bf16 matmul outputs with fp32 parameters and residual: dslab keeps bf16, torch promotes."""
    x, r = torch.randn(6, 64).bfloat16(), torch.randn(6, 64)
    b, w = torch.randn(64), torch.ones(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dslab, torch_ops = op_set("dslab"), op_set("torch")
        assert dslab.bias_gelu(x, b).dtype == torch.bfloat16
        assert torch_ops.bias_gelu(x, b).dtype == torch.bfloat16
        assert dslab.bias_dropout_residual(x, b, r, 0.1, True).dtype == torch.bfloat16
        assert torch_ops.bias_dropout_residual(x, b, r, 0.1, True).dtype == torch.float32
        assert dslab.layer_norm(x, w, b, 1e-5, residual=r)[1].dtype == torch.bfloat16


def test_gradients_reach_bias_and_residual(ops):
    x = torch.randn(5, 48, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    r = torch.randn(5, 48, requires_grad=True)
    ops.bias_dropout_residual(ops.bias_gelu(x, b, "tanh"), b, r, 0.0, True).sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (x, b, r))


def test_head_dims():
    check_head_dim(op_set("torch"), 64, 4)  # head dim 16: SDPA takes any
    with pytest.raises(ValueError, match="head dim"):
        check_head_dim(op_set("dslab"), 64, 4)
    check_head_dim(op_set("dslab"), 128, 4)
    with pytest.raises(ValueError, match="heads=3"):
        check_head_dim(op_set("torch"), 64, 3)


def test_op_sets_pickle_by_name(ops):
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(ops)) is ops
    assert copy.deepcopy(ops) is ops


def test_embeddings_and_the_tie(ops):
    """Lookups and positions are rows of the table; a head read through the set's tie (the dslab
    set's; the torch set never ties) gets the table the same gradient as an untied head."""
    weight = torch.randn(11, 40, requires_grad=True)
    ids, hidden_grad = torch.randint(0, 11, (3, 5)), torch.randn(3, 5, 11)
    torch.testing.assert_close(ops.position_embedding(weight, 7), weight[:7], rtol=0, atol=0)
    whole = ops.position_embedding(weight, 11)
    assert whole is not weight and torch.equal(whole, weight)
    (whole_grad,) = torch.autograd.grad(whole, weight, torch.ones(11, 40))
    assert torch.equal(whole_grad, torch.ones(11, 40))
    tie = ops.embedding_tie(weight)
    assert (tie is None) == (ops.name == "torch")
    looked_up = ops.embedding(weight, ids, tie)
    torch.testing.assert_close(looked_up, weight[ids], rtol=0, atol=0)
    logits = torch.nn.functional.linear(torch.tanh(looked_up), weight if tie is None else tie.head_weight())
    (grad,) = torch.autograd.grad(logits, weight, hidden_grad)
    plain = weight.detach().requires_grad_()
    (want,) = torch.autograd.grad(torch.nn.functional.linear(torch.tanh(plain[ids]), plain), plain, hidden_grad)
    torch.testing.assert_close(grad, want, **TOL)
    if ops.name == "torch":
        with pytest.raises(ValueError, match="tie"):
            ops.embedding(weight, ids, object())
