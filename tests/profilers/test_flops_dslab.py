"""Flops profiler on dslab's own ops: the custom ops (``dslab::attention_forward`` ...) priced by
their registered formulas, Triton kernels running under the interpreter on CPU, and a tiny GPT-2
built on dslab's kernels on both backends."""

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import dslab.kernels.activation.bias_gelu  # noqa: F401
import dslab.kernels.attention.attention  # noqa: F401  (registers dslab::attention_*)
import dslab.kernels.attention.attention_packed  # noqa: F401  (registers dslab::attention_packed_*)
import dslab.kernels.dropout.bias_dropout_residual  # noqa: F401
import dslab.kernels.loss.cross_entropy  # noqa: F401
import dslab.kernels.loss.linear_cross_entropy  # noqa: F401
import dslab.kernels.norm.layer_norm  # noqa: F401
from dslab.kernels.dispatch import interpreting, kernel_backend
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.profilers.flops import FlopsProfiler

needs_interpreter = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton kernels need a GPU or TRITON_INTERPRET=1"
)


class Call(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def profile(fn, *inputs):
    """Forward and backward (of the sum of the first output) of ``fn`` under the profiler."""
    model = Call(fn)
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    out = model(*inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.float().sum().backward()
    profiler.stop_profile()
    return profiler.records()


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_attention_custom_ops(causal):
    """dslab::attention_forward: 4*B*H*Sq*Sk*D, halved when causal; dslab::attention_backward 2.5x."""
    torch.manual_seed(0)
    b, h, s, d = 1, 2, 16, 32
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    records = profile(lambda q, k, v: torch.ops.dslab.attention_forward(q, k, v, None, None, causal, 0.0, d**-0.5),
                      q, k, v)
    forward = 4 * b * h * s * s * d // (2 if causal else 1)
    assert records["flops_by_op"]["dslab::attention_forward"] == {"figure": "matmul", "flops": forward}
    assert records["flops_by_op"]["dslab::attention_backward"]["flops"] == forward * 5 // 2
    assert (records["forward_flops"], records["backward_flops"]) == (forward, forward * 5 // 2)
    assert records["uncounted_autograd_functions"] == []


@needs_interpreter
def test_linear_cross_entropy_counts_the_lm_head_matmul_in_both_directions():
    """dslab::linear_cross_entropy_forward holds the LM head's matmul, 2*N*Vp*H; its backward is
    two plain matmuls of the same size (dhidden, dweight): the fused op hides none of the head."""
    from dslab.kernels.loss.linear_cross_entropy import linear_cross_entropy

    torch.manual_seed(0)
    n, h, vp, vocab = 12, 32, 64, 50
    hidden = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    weight = (0.1 * torch.randn(vp, h)).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (n,))
    with kernel_backend("triton"):
        records = profile(lambda x, w: linear_cross_entropy(x, w, target, vocab), hidden, weight)
    head = 2 * n * vp * h
    assert records["flops_by_op"]["dslab::linear_cross_entropy_forward"] == {"figure": "matmul", "flops": head}
    assert records["forward_flops"] == head
    assert records["backward_flops"] == 2 * head


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_attention_packed_custom_ops(causal):
    """dslab::attention_packed_forward on qkv [B, S, 3*H*D] is priced like dslab::attention_forward on
    its [B, H, S, D] heads (4*B*H*S*S*D, halved when causal); its backward 2.5x. Also through the
    public op, which takes the custom op under the profiler's dispatch mode."""
    from dslab.kernels.attention.attention_packed import attention_packed

    torch.manual_seed(0)
    b, h, s, d = 2, 3, 17, 32
    qkv = torch.randn(b, s, 3 * h * d, dtype=torch.bfloat16, requires_grad=True)
    forward = 4 * b * h * s * s * d // (2 if causal else 1)
    calls = [
        lambda qkv: torch.ops.dslab.attention_packed_forward(qkv, None, None, h, causal, 0.0, d**-0.5),
        lambda qkv: attention_packed(qkv, h, causal=causal, dropout_p=0.1),
    ]
    for call in calls:
        with kernel_backend("triton"):
            records = profile(call, qkv)
        assert records["flops_by_op"]["dslab::attention_packed_forward"] == {"figure": "matmul", "flops": forward}
        assert records["flops_by_op"]["dslab::attention_packed_backward"]["flops"] == forward * 5 // 2
        assert (records["forward_flops"], records["backward_flops"]) == (forward, forward * 5 // 2)
        assert records["uncounted_autograd_functions"] == []


@needs_interpreter
def test_elementwise_custom_ops():
    """layer_norm 5 / 10 per element, bias_gelu 2 / 4, bias_dropout_residual (p > 0) 3 / 2,
    cross_entropy 5 / 4 per logit: the elementwise figure, never the total."""
    torch.manual_seed(0)
    rows, n = 6, 64
    x = torch.randn(rows, n, requires_grad=True)
    weight, bias = torch.randn(n, requires_grad=True), torch.randn(n, requires_grad=True)
    cases = [
        (lambda x: torch.ops.dslab.layer_norm(x, weight, bias, 1e-5), "dslab::layer_norm", 5, 10),
        (lambda x: torch.ops.dslab.bias_gelu(x, bias, "tanh"), "dslab::bias_gelu", 2, 4),
        (lambda x: torch.ops.dslab.bias_dropout_residual(x, bias, torch.randn(rows, n), 0.25, torch.tensor([1234])),
         "dslab::bias_dropout_residual", 3, 2),
    ]
    for fn, name, forward, backward in cases:
        records = profile(fn, x)
        assert records["total_flops"] == 0
        assert records["flops_by_op"][name] == {"figure": "elementwise", "flops": forward * rows * n}
        assert records["flops_by_op"][f"{name}_backward"]["flops"] == backward * rows * n
    target = torch.randint(0, n, (rows,))
    records = profile(lambda x: torch.ops.dslab.cross_entropy_forward(x, target, -100, 0.0), x)
    assert records["flops_by_op"]["dslab::cross_entropy_forward"]["flops"] == 5 * rows * n
    assert records["flops_by_op"]["dslab::cross_entropy_backward"]["flops"] == 4 * rows * n


def _gpt2_step(model, ids):
    model(ids, ids).backward()


def _profile_gpt2(model, ids):
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    _gpt2_step(model, ids)
    profiler.stop_profile()
    return profiler.records()


def test_gpt2_on_dslab_kernels_reference_path():
    """kernels="dslab" on CPU runs the references: the total equals FlopCounterMode's, the
    attention's matmuls land on the attention module, the tied LM head's parameters count once."""
    torch.manual_seed(0)
    config = gpt2_tiny(vocab_size=96, hidden=64, heads=2, layers=1, n_positions=16, dropout=0.0)
    model = GPT2LMHeadModel(config, kernels="dslab")
    batch, seq, hidden, heads = 2, 8, 64, 2
    ids = torch.randint(0, 96, (batch, seq))
    with kernel_backend("torch"):
        records = _profile_gpt2(model, ids)
        with FlopCounterMode(display=False) as reference:
            _gpt2_step(model, ids)
    assert records["total_flops"] == reference.get_total_flops()
    assert records["params"] == sum(p.numel() for p in model.parameters())
    attention = {m["name"]: m for m in records["modules"]}["layers.0.attention"]
    tokens, head_dim = batch * seq, hidden // heads
    qkv, out_proj = 2 * tokens * hidden * 3 * hidden, 2 * tokens * hidden * hidden
    expected = qkv + 4 * batch * heads * seq * seq * head_dim + out_proj  # causal: the reference computes all
    assert attention["forward_flops"] == expected
    assert records["flops_by_op"]["aten::_log_softmax"]["flops"] == 5 * tokens * 96


@needs_interpreter
def test_gpt2_cross_entropy_is_priced_alike_on_both_backends():
    """The Triton cross-entropy (a custom op in eager mode too) and the reference log-softmax get
    the same elementwise price; the matmul totals agree (fp32 attention takes the reference on
    both)."""
    torch.manual_seed(0)
    config = gpt2_tiny(vocab_size=96, hidden=64, heads=2, layers=1, n_positions=16, dropout=0.0)
    model = GPT2LMHeadModel(config, kernels="dslab")
    ids = torch.randint(0, 96, (2, 8))
    with kernel_backend("torch"):
        reference = _profile_gpt2(model, ids)
    model.zero_grad(set_to_none=True)
    with kernel_backend("triton"):
        triton = _profile_gpt2(model, ids)
    assert triton["total_flops"] == reference["total_flops"]
    fused, plain = triton["flops_by_op"], reference["flops_by_op"]
    assert fused["dslab::cross_entropy_forward"]["flops"] == plain["aten::_log_softmax"]["flops"] == 5 * 16 * 96
    assert fused["dslab::cross_entropy_backward"]["flops"] == plain["aten::_log_softmax_backward_data"]["flops"]


@needs_interpreter
def test_embedding_backward_is_priced_as_the_dense_backward_and_the_add():
    """One add per element of the output gradient, as ``embedding_dense_backward``; with a tied
    head's gradient folded in, one more per element of it (the add autograd no longer makes)."""
    from dslab.kernels.embedding.embedding import EmbeddingTie, embedding

    vocab, hidden, tokens = 50, 24, 14
    weight = torch.randn(vocab, hidden, requires_grad=True)
    ids = torch.randint(0, vocab, (2, 7))

    def tied(weight):
        tie = EmbeddingTie.arm(weight)
        return torch.nn.functional.linear(embedding(weight, ids, tie), tie.head_weight())

    with kernel_backend("triton"):
        plain = profile(lambda w: torch.nn.functional.embedding(ids, w), weight)
        lookup = profile(lambda w: embedding(w, ids), weight)
        folded = profile(tied, weight)
    assert plain["flops_by_op"]["aten::embedding_dense_backward"]["flops"] == tokens * hidden
    assert lookup["flops_by_op"]["dslab::embedding_backward"] == {"figure": "elementwise", "flops": tokens * hidden}
    assert folded["flops_by_op"]["dslab::embedding_backward"]["flops"] == (tokens + vocab) * hidden
