"""moe_gating: the Triton kernels (under the interpreter on CPU) against the PyTorch reference.

Integer outputs must match exactly (the logits are built without ties; tie-breaking has its own
test), positions also against a brute-force loop over the choice-major rule. Floating outputs
match the fp32 reference within fp32 rounding; the logits' gradient is measured against a float64
evaluation and must stay within twice the fp32 reference's error, plus two units in the last place
at the gradient's scale (the kernel rounds its probabilities and the gate's denominator on its own).
"""

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.moe.moe_gating import GatingOutput, moe_gating, moe_gating_reference

FLOAT_OUTPUTS = ("probs", "gate_weight")
INT_OUTPUTS = ("expert_index", "position", "expert_counts")


def _logits(tokens, experts, dtype=torch.float32, seed=0):
    """Rows of distinct logits (a shuffled ladder of step 0.37 plus jitter below 0.01), so that the
    choices have no ties in any dtype used here."""
    gen = torch.Generator().manual_seed(seed)
    ladder = torch.rand(tokens, experts, generator=gen).argsort(dim=1).float() * 0.37 - 1.0
    return (ladder + 0.01 * torch.rand(tokens, experts, generator=gen)).to(dtype)


def _gumbel(tokens, experts, seed=1):
    gen = torch.Generator().manual_seed(seed)
    uniform = torch.rand(tokens, experts, generator=gen).clamp(1e-6, 1 - 1e-6)
    return -torch.log(-torch.log(uniform))


def _upstream(tokens, experts, k, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=gen), torch.randn(tokens, k, generator=gen)


def _brute_force_positions(expert_index, experts):
    """Position and count per the choice-major rule, one assignment at a time."""
    tokens, k = expert_index.shape
    seen = [0] * experts
    position = torch.empty(tokens, k, dtype=torch.int32)
    for choice in range(k):
        for token in range(tokens):
            expert = int(expert_index[token, choice])
            position[token, choice] = seen[expert]
            seen[expert] += 1
    return position, torch.tensor(seen, dtype=torch.int32)


def _float64_gate(logits, expert_index):
    """probs and gate_weight in float64 for fixed choices: the differentiable part of the gate."""
    probs = torch.softmax(logits, dim=1)
    chosen = probs.gather(1, expert_index.long())
    if expert_index.shape[1] == 2:
        chosen = chosen / chosen.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
    return probs, chosen


def _run(fn, logits, k, noise, dprobs, dgate, dtype=None):
    """Outputs of ``fn`` and d logits for the loss <probs, dprobs> + <gate_weight, dgate>."""
    logits = logits.detach().to(dtype or logits.dtype).requires_grad_()
    out = fn(logits, k, noise)
    loss = (out.probs * dprobs).sum() + (out.gate_weight * dgate).sum()
    (dlogits,) = torch.autograd.grad(loss, logits)
    return out, dlogits


def _assert_within_reference_error(actual, reference, exact):
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item()
    ref_err = (reference.double() - exact).abs().max().item()
    floor = 2 * torch.finfo(actual.dtype).eps * exact.abs().max().item()
    assert err <= 2 * ref_err + floor, f"error {err:.3g} vs the reference's {ref_err:.3g} (floor {floor:.2g})"


CASES = [(k, noise) for k in (1, 2) for noise in (False, True) if not (noise and k == 1)]


@pytest.mark.parametrize("k, noisy", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("experts", [2, 3, 8, 16])
@pytest.mark.parametrize("tokens", [1, 37, 301])
def test_triton_matches_reference(tokens, experts, k, noisy):
    logits = _logits(tokens, experts)
    noise = _gumbel(tokens, experts) if noisy else None
    dprobs, dgate = _upstream(tokens, experts, k)
    ref, ref_dlogits = _run(moe_gating_reference, logits, k, noise, dprobs, dgate)
    with kernel_backend("triton"):
        got, dlogits = _run(moe_gating, logits, k, noise, dprobs, dgate)
    assert isinstance(got, GatingOutput)
    for name in INT_OUTPUTS:
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == torch.int32 and torch.equal(a, b), name
    for name in FLOAT_OUTPUTS:
        a = getattr(got, name)
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, getattr(ref, name), rtol=1e-6, atol=1e-7)
    position, counts = _brute_force_positions(got.expert_index, experts)
    assert torch.equal(got.position, position) and torch.equal(got.expert_counts, counts)

    exact_logits = logits.double().requires_grad_()
    probs64, gate64 = _float64_gate(exact_logits, ref.expert_index)
    (exact,) = torch.autograd.grad((probs64 * dprobs).sum() + (gate64 * dgate).sum(), exact_logits)
    _assert_within_reference_error(dlogits, ref_dlogits, exact)


@pytest.mark.parametrize("experts", [100, 128])
def test_many_experts_span_segments_of_several_tiles(experts):
    # 16 rows per tile at E > 64: 301 tokens make 19 tiles, 4 interpreter segments of 5 tiles.
    logits = _logits(301, experts, seed=5)
    noise = _gumbel(301, experts, seed=6)
    dprobs, dgate = _upstream(301, experts, 2)
    ref, ref_dlogits = _run(moe_gating_reference, logits, 2, noise, dprobs, dgate)
    with kernel_backend("triton"):
        got, dlogits = _run(moe_gating, logits, 2, noise, dprobs, dgate)
    for name in INT_OUTPUTS:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    torch.testing.assert_close(got.gate_weight, ref.gate_weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dlogits, ref_dlogits, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_logits(dtype):
    logits = _logits(37, 8, dtype=dtype)
    noise = _gumbel(37, 8)
    dprobs, dgate = _upstream(37, 8, 2)
    ref, ref_dlogits = _run(moe_gating_reference, logits, 2, noise, dprobs, dgate)
    with kernel_backend("triton"):
        got, dlogits = _run(moe_gating, logits, 2, noise, dprobs, dgate)
    assert dlogits.dtype == dtype
    for name in INT_OUTPUTS:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    torch.testing.assert_close(got.probs, ref.probs, rtol=1e-6, atol=1e-7)
    exact_logits = logits.double().requires_grad_()
    probs64, gate64 = _float64_gate(exact_logits, ref.expert_index)
    (exact,) = torch.autograd.grad((probs64 * dprobs).sum() + (gate64 * dgate).sum(), exact_logits)
    _assert_within_reference_error(dlogits, ref_dlogits, exact)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("used", ["probs", "gate_weight"])
def test_gradient_from_one_output_alone(k, used):
    logits = _logits(37, 3, seed=3)
    upstream = torch.randn(37, 3 if used == "probs" else k)

    def grad(fn):
        x = logits.clone().requires_grad_()
        return torch.autograd.grad((getattr(fn(x, k), used) * upstream).sum(), x)[0]

    expected = grad(moe_gating_reference)
    with kernel_backend("triton"):
        got = grad(moe_gating)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_ties_break_to_the_lowest_index_as_torch_argmax():
    logits = torch.tensor([
        [0.0, 0.0, 0.0, 0.0],  # all equal: first 0, second 1
        [1.0, 3.0, 2.0, 3.0],  # max at 1 and 3: first 1, second 3
        [2.0, 1.0, 2.0, 2.0],  # first 0, second 2
        [0.5, 1.5, 1.5, 0.5],  # first 1, second 2
    ])
    noise = torch.tensor([[0.0, 0.3, 0.3, 0.0]] * 4)  # second choices tied after the noise
    with kernel_backend("triton"):
        plain, noisy = moe_gating(logits, 2), moe_gating(logits, 2, noise)
    assert plain.expert_index.tolist() == [[0, 1], [1, 3], [0, 2], [1, 2]]
    for got, ref in ((plain, moe_gating_reference(logits, 2)), (noisy, moe_gating_reference(logits, 2, noise))):
        for name in INT_OUTPUTS:
            assert torch.equal(getattr(got, name), getattr(ref, name)), name


def test_positions_are_choice_major():
    # Both tokens pick expert 1 then expert 0; the second choices rank after every first choice.
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    with kernel_backend("triton"):
        out = moe_gating(logits, 2)
    assert out.expert_index.tolist() == [[1, 0], [1, 0]]
    assert out.position.tolist() == [[0, 0], [1, 1]]
    assert out.expert_counts.tolist() == [2, 2]


def test_no_tokens():
    with kernel_backend("triton"):
        out = moe_gating(torch.empty(0, 4), 2)
    assert out.probs.shape == (0, 4) and out.position.shape == (0, 2)
    assert out.expert_counts.tolist() == [0, 0, 0, 0]


def test_torch_backend_and_cpu_auto_run_the_reference():
    logits, noise = _logits(11, 5), _gumbel(11, 5)
    expected = moe_gating_reference(logits, 2, noise)
    for name in ("torch", "auto"):
        with kernel_backend(name):
            got = moe_gating(logits, 2, noise)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.ones(3, 8, 2), 2), "logits"),
        ((torch.ones(3, 8, dtype=torch.int64), 2), "floating"),
        ((torch.ones(3, 8), 3), "k must be"),
        ((torch.ones(3, 129), 2), "experts"),
        ((torch.ones(3, 1), 2), "experts"),
        ((torch.ones(3, 8), 1, torch.zeros(3, 8)), "k=2"),
        ((torch.ones(3, 8), 2, torch.zeros(3, 7)), "second_choice_noise"),
        ((torch.ones(3, 8), 2, torch.zeros(3, 8, dtype=torch.float64)), "second_choice_noise"),
    ],
)
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        moe_gating(*args)


@pytest.mark.parametrize("noisy", [False, True])
def test_custom_op_passes_opcheck(noisy):
    logits = _logits(9, 5).requires_grad_()
    noise = _gumbel(9, 5) if noisy else None
    torch.library.opcheck(torch.ops.dslab.moe_gating.default, (logits, 2, noise))


def test_torch_compile_traces_the_custom_op():
    logits, noise = _logits(37, 8), _gumbel(37, 8)
    dprobs, dgate = _upstream(37, 8, 2)

    def gate(logits, k, noise):
        out = moe_gating(logits, k, noise)
        return out._replace(probs=out.probs * 2)

    compiled = torch.compile(gate, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager, eager_grad = _run(gate, logits, 2, noise, dprobs, dgate)
        got, got_grad = _run(compiled, logits, 2, noise, dprobs, dgate)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got_grad, eager_grad)
