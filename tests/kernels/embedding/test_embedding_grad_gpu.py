"""The embedding weight gradient on the GPU at GPT-2's and BERT-large's shapes (16384 ids over
50304 x 768; 8192 over 30522 x 1024; BERT's two token types): the Triton kernels against fp64
sums, bitwise reproducible, and the tie at those shapes against the untied path."""

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels.embedding.embedding import EmbeddingTie, embedding, embedding_grad
from dslab.kernels.loss.linear_cross_entropy import linear_cross_entropy

pytestmark = pytest.mark.gpu

EPS32 = torch.finfo(torch.float32).eps


def _skewed_ids(n, vocab, gen):
    """Uniform ids with a few frequent ones (a padding-like id 0 at 10%, id 13 at 3%, id 50 at 1%):
    segments of hundreds of rows beside rows of one."""
    ids = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    u = torch.rand(n, device="cuda", generator=gen)
    ids = torch.where(u < 0.10, 0, ids)
    ids = torch.where((u >= 0.10) & (u < 0.13), min(13, vocab - 1), ids)
    return torch.where((u >= 0.13) & (u < 0.14), min(50, vocab - 1), ids)


def _assert_within_sum_error(got, ids, rows, vocab, head_term=None):
    exact = torch.zeros(vocab, rows.shape[1], dtype=torch.float64, device="cuda").index_add_(0, ids, rows.double())
    magnitude = torch.zeros_like(exact).index_add_(0, ids, rows.double().abs())
    if head_term is not None:
        exact += head_term.double()
        magnitude += head_term.double().abs()
    count = torch.bincount(ids, minlength=vocab).double()[:, None]
    bound = 2 * (count + 1) * EPS32 * magnitude + EPS32 * exact.abs()
    excess = ((got.double() - exact).abs() - bound).max().item()
    assert excess <= 0, excess


@pytest.mark.parametrize("n,vocab,h,head", [(16384, 50304, 768, "scaled"), (8192, 30522, 1024, "plain"),
                                            (8192, 2, 1024, None)], ids=str)
def test_gpu_matches_fp64_sums_and_is_reproducible(n, vocab, h, head):
    gen = torch.Generator(device="cuda").manual_seed(n + vocab)
    ids = _skewed_ids(n, vocab, gen)
    rows = torch.randn(n, h, device="cuda", generator=gen)
    head_grad = None if head is None else (torch.randn(vocab, h, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    scale = torch.tensor(0.37, device="cuda") if head == "scaled" else None
    runs = [embedding_grad(ids, rows, vocab, torch.float32, head_grad, scale) for _ in range(2)]
    assert runs[0].shape == (vocab, h) and runs[0].dtype == torch.float32
    assert torch.equal(runs[0], runs[1])
    head_term = None if head_grad is None else (head_grad if scale is None else head_grad * scale)
    _assert_within_sum_error(runs[0], ids, rows, vocab, head_term)


@pytest.mark.parametrize("n,vocab,h,fused", [(16384, 50304, 768, True), (8192, 30522, 1024, False)], ids=str)
def test_gpu_tie_gives_the_untied_gradient(n, vocab, h, fused):
    """A lookup, a transform and the tied head under bf16 autocast: GPT-2's fused loss (its
    unscaled weight gradient scaled in the lookup's kernel, g = 2.5) and BERT's F.linear. Rows of
    at most two tokens are summed alike, so there the two paths agree bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    weight = (torch.randn(vocab, h, device="cuda", generator=gen) * 0.02).requires_grad_()
    ids = _skewed_ids(n, vocab, gen)
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    grads = []
    for tie_on in (False, True):
        weight.grad = None
        with torch.autocast("cuda", torch.bfloat16):
            tie = EmbeddingTie.arm(weight) if tie_on else None
            hidden = torch.tanh(embedding(weight, ids, tie) if tie_on else F.embedding(ids, weight))
            if fused:
                loss = linear_cross_entropy(hidden, weight, targets, tie=tie)
            else:
                head = tie.head_weight() if tie_on else weight
                loss = F.cross_entropy(F.linear(hidden, head).float(), targets)
        (loss * 2.5).backward()
        grads.append(weight.grad.clone())
    plain, tied = grads
    few = torch.bincount(ids, minlength=vocab) <= 2
    assert torch.equal(tied[few], plain[few])
    torch.testing.assert_close(tied, plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())
