"""The tied token embeddings of GPT-2 and BERT on the dslab set (dslab/kernels/embedding/embedding.py):
the lookup's backward writes the tied matrix's gradient once, the head's included, and the
positions are sliced rather than looked up.

The A/B: the same model with every module's op set replaced by the dslab set whose
``embedding``, ``position_embedding`` and ``embedding_tie`` are the torch set's (the lookups as
``F.embedding``, no tie: the path before the tie). Both compute the same forward bit for bit, so
the loss and every gradient but the embeddings' must be equal, and the embeddings' gradients may
differ only by the fp32 summation order of their segment sums (fp32 and bf16 autocast alike).
Against the torch set, in fp32, within the fp32 tolerances of the model tests.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.ops import TORCH_OPS, op_set

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from dispatch_recorder import DispatchRecorder  # noqa: E402

EMBEDDINGS = ("wte.weight", "wpe.weight", "embeddings.word_embeddings.weight",
              "embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight")


def _model(family, kernels="dslab"):
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(gpt2_tiny(dropout=0.0, vocab_pad_multiple=64), kernels=kernels)
    return BertForPreTraining(bert_tiny(hidden_dropout=0.0, attention_dropout=0.0), kernels=kernels)


def _batch(family, seed, batch=2, seq=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (batch, seq), generator=g)
    ids[:, ::4] = 7  # a frequent token: rows with many tokens
    if family == "gpt2":
        return dict(input_ids=ids, labels=ids)
    labels = torch.where(torch.rand(batch, seq, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 1] = ids[:, 1]
    return dict(input_ids=ids, token_type_ids=torch.randint(0, 2, (batch, seq), generator=g),
                masked_lm_labels=labels, next_sentence_label=torch.randint(0, 2, (batch,), generator=g))


def _untie(model):
    """Every module's op set -> the dslab set with the torch set's lookups and no tie."""
    untied = dataclasses.replace(op_set("dslab"), embedding=TORCH_OPS.embedding,
                                 position_embedding=TORCH_OPS.position_embedding, embedding_tie=TORCH_OPS.embedding_tie)
    for module in model.modules():
        if getattr(module, "ops", None) is op_set("dslab"):
            module.ops = untied
    return model


def _step(model, batch, backend="auto", autocast=False, backward=True):
    """(loss, {name: grad}) of one forward and backward."""
    with kernel_backend(backend), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(**batch)
        if backward:
            loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_but_summation_order(got, want, what):
    loss, grads = got
    want_loss, want_grads = want
    assert torch.equal(loss, want_loss), what
    for name, grad in want_grads.items():
        if grad is None:
            assert grads[name] is None, f"{what} {name}"
        elif name in EMBEDDINGS:
            scale = grad.abs().max().item()
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6 * scale, msg=f"{what} {name}")
        else:
            assert torch.equal(grads[name], grad), f"{what} {name}"


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("autocast", [False, True])
def test_tie_computes_what_the_untied_path_does(family, backend, autocast):
    """``auto`` on CPU: the references; ``triton``: the kernels under the interpreter (for GPT-2
    under bf16 autocast, the fused loss hands its unscaled weight gradient to the tie)."""
    batch = _batch(family, seed=1)
    tied = _step(_model(family), batch, backend, autocast)
    untied = _step(_untie(_model(family)), batch, backend, autocast)
    _assert_same_but_summation_order(tied, untied, f"{family} {backend} autocast={autocast}")
    assert all(g is not None and g.dtype == torch.float32 for g in tied[1].values())


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_dslab_set_matches_torch_set_in_fp32(family):
    batch = _batch(family, seed=2)
    loss, grads = _step(_model(family), batch)
    want_loss, want_grads = _step(_model(family, kernels="torch"), batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_gradients_accumulate_over_two_backward_calls(family):
    first, second = _batch(family, seed=3), _batch(family, seed=4)
    results = []
    for model in (_model(family), _untie(_model(family))):
        _step(model, first, "triton")
        results.append(_step(model, second, "triton"))
    _assert_same_but_summation_order(*results, family)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_forward_without_backward_leaves_nothing_for_the_next_step(family):
    """A discarded forward with autograd on arms a tie that no backward consumes; the next
    forward and backward get their own tie and the gradient of their batch alone."""
    model = _model(family)
    _step(model, _batch(family, seed=5), "triton", backward=False)
    got = _step(model, _batch(family, seed=6), "triton")
    _assert_same_but_summation_order(got, _step(_untie(_model(family)), _batch(family, seed=6), "triton"), family)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_without_autograd_and_with_frozen_embeddings(family):
    batch = _batch(family, seed=7)
    with torch.no_grad():
        loss, grads = _step(_model(family), batch, "triton", backward=False)
    assert torch.equal(loss, _step(_untie(_model(family)), batch, "triton", backward=False)[0])
    assert all(g is None for g in grads.values())

    frozen, untied = _model(family), _untie(_model(family))
    for model in (frozen, untied):
        (model.wte if family == "gpt2" else model.embeddings.word_embeddings).weight.requires_grad_(False)
    got, want = _step(frozen, batch, "triton"), _step(untied, batch, "triton")
    _assert_same_but_summation_order(got, want, family)
    assert got[1]["wte.weight" if family == "gpt2" else "embeddings.word_embeddings.weight"] is None


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_backward_writes_the_tied_gradient_once(family):
    """Under bf16 autocast on the kernels: no embedding_dense_backward, and no op in the backward
    scales, casts or adds a tensor of the tied matrix's shape; the lookups' kernel writes it."""
    model, batch = _model(family), _batch(family, seed=8)
    tied = model.wte.weight if family == "gpt2" else model.embeddings.word_embeddings.weight
    with kernel_backend("triton"):
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(**batch)
        with DispatchRecorder() as recorder:
            loss.backward()
    names = recorder.names()
    assert "aten::embedding_dense_backward" not in names
    assert names.count("dslab::embedding_backward") == (1 if family == "gpt2" else 2)  # BERT: token types too
    dense = [name for name in recorder.shaped(tied.shape)
             if name in ("aten::add", "aten::add_", "aten::mul", "aten::_to_copy")]
    assert dense == []
    assert tied.grad.dtype == torch.float32 and tied.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_gpu_tie_under_bf16_autocast(family):
    """On the GPU's kernels: the same loss, and every gradient within bf16 rounding of the untied
    path's (the GPU's kernels need not reduce the layers' gradients in the same order twice)."""
    batch = {name: t.cuda() for name, t in _batch(family, seed=9, batch=4, seq=64).items()}
    results = []
    for model in (_model(family).cuda(), _untie(_model(family)).cuda()):
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(**batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (want_loss, want_grads) = results
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for name, want in want_grads.items():
        assert grads[name].dtype == torch.float32, name
        torch.testing.assert_close(grads[name], want, rtol=1e-2, atol=1e-2 * want.abs().max().item(), msg=name)
