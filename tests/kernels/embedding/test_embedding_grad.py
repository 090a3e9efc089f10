"""The embedding weight gradient (dslab/kernels/embedding/embedding.py): the Triton kernels (under the
interpreter on CPU) against the reference and fp64 sums on fresh random inputs at odd shapes,
bitwise determinism, the tied head's gradient folded in, and the tie's protocol on the bare ops.

Tolerances: a row's fp32 sum of k gradient rows differs from the exact sum by at most about
k * eps * (sum of the magnitudes); rows with at most two tokens are summed exactly alike by the
kernel and the reference (0 + a + b), so there the two must agree bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels import kernel_backend

from dslab.kernels.embedding.embedding import EmbeddingTie, embedding, embedding_grad, embedding_grad_reference
from dslab.kernels.embedding.embedding_triton import SMALL_VOCAB
from dslab.kernels.loss.linear_cross_entropy import linear_cross_entropy
from dispatch_recorder import DispatchRecorder

EPS32 = torch.finfo(torch.float32).eps


def _ids(n, vocab, seed, hot=True):
    """``n`` ids over ``[0, vocab)`` drawn from its first two thirds (the rest never used), a
    third of them one hot id (a segment over many chunks)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(1, 2 * vocab // 3), (n,), generator=gen)
    if hot:
        ids[torch.rand(n, generator=gen) < 1 / 3] = vocab // 2
    return ids


def _rows(n, h, dtype, seed):
    return torch.randn(n, h, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _few_token_rows(ids, vocab):
    return torch.bincount(ids, minlength=vocab) <= 2


def _assert_within_sum_error(got, ids, rows, vocab, head_term=None):
    """|got - exact| <= 2 k eps sum|rows| + eps |exact| per element (k: the row's token count)."""
    exact = torch.zeros(vocab, rows.shape[1], dtype=torch.float64).index_add_(0, ids, rows.double())
    magnitude = torch.zeros_like(exact).index_add_(0, ids, rows.double().abs())
    if head_term is not None:
        exact += head_term.double()
        magnitude += head_term.double().abs()
    count = torch.bincount(ids, minlength=vocab).double()[:, None]
    bound = 2 * (count + 1) * EPS32 * magnitude + torch.finfo(got.dtype).eps * exact.abs()
    assert torch.all((got.double() - exact).abs() <= bound), (got.double() - exact).abs().max()


# (N, V, H): N not a multiple of any block, odd V and H, V just above the small-vocabulary limit.
SHAPES = [(37, 101, 40), (130, 17, 72), (9, 333, 40), (1, 7, 72), (64, 2048, 3)]


@pytest.mark.parametrize("n,vocab,h", SHAPES, ids=str)
@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_reference_without_head(n, vocab, h, rows_dtype):
    ids, rows = _ids(n, vocab, seed=n + vocab), _rows(n, h, rows_dtype, seed=h)
    with kernel_backend("triton"), DispatchRecorder() as recorder:
        got = embedding_grad(ids, rows, vocab, torch.float32)
    assert "aten::index_add_" not in recorder.names()
    want = embedding_grad_reference(ids, rows, vocab, torch.float32)
    assert got.shape == (vocab, h) and got.dtype == torch.float32
    few = _few_token_rows(ids, vocab)
    assert torch.equal(got[few], want[few])
    _assert_within_sum_error(got, ids, rows.float(), vocab)
    assert torch.all(got[torch.bincount(ids, minlength=vocab) == 0] == 0)


@pytest.mark.parametrize("n,vocab,h", SHAPES, ids=str)
@pytest.mark.parametrize("head_dtype,scale", [(torch.bfloat16, 2.7), (torch.bfloat16, None), (torch.float32, 0.3)],
                         ids=str)
def test_triton_folds_in_the_head_gradient(n, vocab, h, head_dtype, scale):
    """``out = round(head * scale) + segment sums``: the head term rounded to the head's dtype as
    ``head * scale`` rounds in PyTorch, so rows with few tokens match the reference bitwise."""
    ids, rows = _ids(n, vocab, seed=3 * n + vocab, hot=False), _rows(n, h, torch.float32, seed=h + 1)
    head = _rows(vocab, h, head_dtype, seed=vocab)
    head_scale = None if scale is None else torch.tensor(scale)
    with kernel_backend("triton"):
        got = embedding_grad(ids, rows, vocab, torch.float32, head, head_scale)
    want = embedding_grad_reference(ids, rows, vocab, torch.float32, head, head_scale)
    head_term = head if head_scale is None else head * head_scale
    unused = torch.bincount(ids, minlength=vocab) == 0
    assert torch.equal(got[unused], head_term[unused].float())
    few = _few_token_rows(ids, vocab)
    assert torch.equal(got[few], want[few])
    _assert_within_sum_error(got, ids, rows, vocab, head_term)


def test_half_precision_output_is_rounded_once():
    """A bf16 model: bf16 rows, head and output; the fp32 sum is rounded once (to nearest even,
    as the reference's cast), so rows with few tokens match bitwise."""
    vocab, h = 53, 40
    ids, rows = _ids(71, vocab, seed=5, hot=False), _rows(71, h, torch.bfloat16, seed=6)
    head, scale = _rows(vocab, h, torch.bfloat16, seed=7), torch.tensor(1.7)
    with kernel_backend("triton"):
        got = embedding_grad(ids, rows, vocab, torch.bfloat16, head, scale)
    want = embedding_grad_reference(ids, rows, vocab, torch.bfloat16, head, scale)
    assert got.dtype == torch.bfloat16
    few = _few_token_rows(ids, vocab)
    assert torch.equal(got[few], want[few])
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("n,vocab,h", [(101, 2, 72), (37, 5, 40), (9, SMALL_VOCAB, 3)], ids=str)
def test_small_vocabulary_kernel(n, vocab, h):
    """Token types: few rows, each summed over many token tiles by several programs whose
    partials are added in a fixed order."""
    gen = torch.Generator().manual_seed(n)
    ids, rows = torch.randint(0, vocab, (n,), generator=gen), _rows(n, h, torch.float32, seed=n + 1)
    with kernel_backend("triton"), DispatchRecorder() as recorder:
        got = embedding_grad(ids, rows, vocab)
        again = embedding_grad(ids, rows, vocab)
    assert "aten::sort" not in recorder.names()
    assert torch.equal(got, again)
    _assert_within_sum_error(got, ids, rows, vocab)


def test_results_are_bitwise_reproducible():
    """A hot id (segments over many chunks and blocks): no atomics, the same bits every run."""
    vocab, h = 257, 72
    ids, rows = _ids(997, vocab, seed=11), _rows(997, h, torch.float32, seed=12)
    head, scale = _rows(vocab, h, torch.bfloat16, seed=13), torch.tensor(0.9)
    with kernel_backend("triton"):
        runs = [embedding_grad(ids, rows, vocab, torch.float32, head, scale) for _ in range(3)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    _assert_within_sum_error(runs[0], ids, rows, vocab, head * scale)


def test_reference_runs_on_cpu_by_default_and_for_fp64():
    ids, rows = _ids(20, 30, seed=1), _rows(20, 8, torch.float64, seed=2)
    with kernel_backend("triton"), DispatchRecorder() as recorder:
        got = embedding_grad(ids, rows, 30)
    assert "aten::index_add_" in recorder.names() and got.dtype == torch.float64
    with kernel_backend("auto"), DispatchRecorder() as recorder:
        embedding_grad(ids, rows.float(), 30)
    assert "aten::index_add_" in recorder.names()


def _grad_args(**changes):
    args = dict(ids=torch.tensor([0, 2, 2]), grad_rows=torch.ones(3, 4), num_rows=5, out_dtype=torch.float32,
                head_grad=None, head_scale=None)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,match", [
    (dict(ids=torch.tensor([[0, 2, 2]])), "ids"),
    (dict(ids=torch.tensor([0.0, 2.0, 2.0])), "ids"),
    (dict(ids=torch.tensor([0, 5, 2])), "ids"),
    (dict(ids=torch.tensor([0, -1, 2])), "ids"),
    (dict(grad_rows=torch.ones(2, 4)), "grad_rows"),
    (dict(grad_rows=torch.ones(3, 4, dtype=torch.int64)), "grad_rows"),
    (dict(num_rows=0), "num_rows"),
    (dict(num_rows=5.0), "num_rows"),
    (dict(out_dtype=torch.int32), "out_dtype"),
    (dict(head_grad=torch.ones(5, 3)), "head_grad"),
    (dict(head_scale=torch.tensor(2.0)), "head_scale"),
    (dict(head_grad=torch.ones(5, 4), head_scale=torch.ones(2)), "head_scale"),
])
def test_bad_inputs_raise_value_error(changes, match):
    with pytest.raises(ValueError, match=match):
        embedding_grad(**_grad_args(**changes))


def test_bad_lookups_raise_value_error():
    weight = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(ValueError, match="weight"):
        embedding(torch.randn(5), torch.tensor([1]))
    with pytest.raises(ValueError, match="ids"):
        embedding(weight, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="tie"):
        embedding(weight, torch.tensor([1]), EmbeddingTie.arm(torch.randn(5, 4, requires_grad=True)))


def test_custom_op_registration():
    ids, rows = _ids(11, 20, seed=4), _rows(11, 8, torch.float32, seed=5)
    head, scale = _rows(20, 8, torch.bfloat16, seed=6), torch.tensor(1.5)
    torch.library.opcheck(torch.ops.dslab.embedding_backward.default, (ids, rows, 20, torch.float32, head, scale),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# The lookup and the tie, on the bare ops: a "model" of one lookup, a transform and a tied head.
# ---------------------------------------------------------------------------------------------

VOCAB, HIDDEN = 37, 40


def _tied_step(weight, ids, targets, tie_on, grad_scale=1.0, fused=False):
    """loss = CE(linear(tanh(weight[ids]), weight)) * grad_scale; backward. With ``tie_on``, the
    lookup and the head meet on an EmbeddingTie; ``fused`` takes linear_cross_entropy's head."""
    tie = EmbeddingTie.arm(weight) if tie_on else None
    hidden = torch.tanh(embedding(weight, ids, tie) if tie_on else F.embedding(ids, weight))
    if fused:
        loss = linear_cross_entropy(hidden, weight, targets, tie=tie)
    else:
        head = tie.head_weight() if tie_on else weight
        loss = F.cross_entropy(F.linear(hidden, head).float(), targets)
    (loss * grad_scale).backward()
    return loss.detach()


def _weight_and_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen).requires_grad_()
    ids = torch.randint(0, VOCAB, (29,), generator=gen)
    return weight, ids, torch.randint(0, VOCAB, (29,), generator=gen)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_tie_gives_the_plain_gradient(backend, autocast, fused):
    """Under bf16 autocast the fused loss's weight gradient is scaled in the lookup's kernel
    (g = 2.5, not a power of two, rounded to bf16 as the plain path rounds it) and no [V, H]
    add, scale or cast runs in the backward."""
    weight, ids, targets = _weight_and_batch(seed=1)
    grads = []
    for tie_on in (False, True):
        weight.grad = None
        with (kernel_backend(backend), torch.autocast("cpu", torch.bfloat16, enabled=autocast),
              DispatchRecorder() as rec):
            loss = _tied_step(weight, ids, targets, tie_on, grad_scale=2.5, fused=fused)
        grads.append((loss, weight.grad.clone(), rec))
    (plain_loss, plain, _), (loss, tied, recorder) = grads
    assert torch.equal(loss, plain_loss)
    few = _few_token_rows(ids, VOCAB)
    assert torch.equal(tied[few], plain[few])
    torch.testing.assert_close(tied, plain, rtol=1e-5, atol=1e-6)
    assert "aten::embedding_dense_backward" not in recorder.names()
    if backend == "torch":  # the reference: index_add_ and its own add of the head's gradient
        assert recorder.names().count("aten::index_add_") == 1
        return
    assert recorder.names().count("dslab::embedding_backward") == 1
    dense = [n for n in recorder.shaped((VOCAB, HIDDEN)) if n in ("aten::add", "aten::add_", "aten::_to_copy",
                                                                   "aten::mul")]
    assert dense == (["aten::_to_copy"] if autocast else [])  # the forward's cast of the head, only


def test_gradients_accumulate_over_micro_steps():
    weight, ids, targets = _weight_and_batch(seed=2)
    _, ids2, targets2 = _weight_and_batch(seed=3)
    results = []
    for tie_on in (False, True):
        weight.grad = None
        with kernel_backend("triton"):
            _tied_step(weight, ids, targets, tie_on)
            _tied_step(weight, ids2, targets2, tie_on)
        results.append(weight.grad.clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_a_forward_without_backward_leaves_nothing_behind():
    """The tie belongs to its forward: a discarded forward, then a fresh forward and backward."""
    weight, ids, targets = _weight_and_batch(seed=4)
    with kernel_backend("triton"):
        _tied_step(weight, ids, targets, tie_on=False)
        plain = weight.grad.clone()
        weight.grad = None
        tie = EmbeddingTie.arm(weight)
        F.linear(torch.tanh(embedding(weight, ids, tie)), tie.head_weight()).sum()  # no backward
        _tied_step(weight, ids, targets, tie_on=True)
    torch.testing.assert_close(weight.grad, plain, rtol=1e-5, atol=1e-6)


def test_a_retained_graph_backs_up_twice_through_the_plain_path():
    weight, ids, targets = _weight_and_batch(seed=5)
    with kernel_backend("triton"):
        _tied_step(weight, ids, targets, tie_on=False)
        once = weight.grad.clone()
        weight.grad = None
        tie = EmbeddingTie.arm(weight)
        logits = F.linear(torch.tanh(embedding(weight, ids, tie)), tie.head_weight())
        loss = F.cross_entropy(logits, targets)
        loss.backward(retain_graph=True)
        loss.backward()
    torch.testing.assert_close(weight.grad, 2 * once, rtol=1e-5, atol=1e-6)


def test_the_head_keeps_its_gradient_when_the_lookup_is_not_in_the_pass():
    """A loss of the head alone: the lookup's backward never runs, so the tie refuses the offer."""
    weight, ids, targets = _weight_and_batch(seed=6)
    tie = EmbeddingTie.arm(weight)
    looked_up = embedding(weight, ids, tie)
    hidden = torch.randn(29, HIDDEN)
    (grad,) = torch.autograd.grad(F.cross_entropy(F.linear(hidden, tie.head_weight()), targets), weight)
    (want,) = torch.autograd.grad(F.cross_entropy(F.linear(hidden, weight), targets), weight)
    assert torch.equal(grad, want)
    (lookup_grad,) = torch.autograd.grad(looked_up.sum(), weight)  # the tie holds no offer for it
    assert torch.equal(lookup_grad, torch.zeros_like(weight).index_add_(0, ids, torch.ones(29, HIDDEN)))


def test_no_tie_without_autograd_or_while_compiling(monkeypatch):
    weight = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    assert isinstance(EmbeddingTie.arm(weight), EmbeddingTie)
    assert EmbeddingTie.arm(weight.detach()) is None
    with torch.no_grad():
        assert EmbeddingTie.arm(weight) is None
        assert embedding(weight, torch.tensor([3, 1])).grad_fn is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert EmbeddingTie.arm(weight) is None
