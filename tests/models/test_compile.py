"""A model built on dslab's kernels traces under torch.compile: the custom ops are opaque nodes
in one graph, and the compiled model computes what the eager one does."""

import pytest
import torch

from dslab.kernels.dispatch import kernel_backend
from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny


def _gpt2_batch(device, vocab=1000, batch=2, seq=24):
    g = torch.Generator(device="cpu").manual_seed(3)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    return ids


def _train_step(model, ids):
    loss = model(ids, labels=ids)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_gpt2_on_dslab_kernels_compiles_to_one_graph_cpu():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="dslab")
    ids = _gpt2_batch("cpu")
    with kernel_backend("triton"):  # the Triton kernels, under the interpreter on CPU
        eager_loss, eager_grads = _train_step(model, ids)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        loss, grads = _train_step(compiled, ids)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_models_on_dslab_kernels_under_inductor_gpu(family):
    torch.manual_seed(0)
    device = torch.device("cuda")
    if family == "gpt2":
        model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="dslab").to(device)
        ids = _gpt2_batch(device)
        run = lambda m: m(ids, labels=ids)  # noqa: E731
    else:
        model = BertForPreTraining(bert_tiny(hidden_dropout=0.0, attention_dropout=0.0, sparse_mlm=False),
                                   kernels="dslab").to(device)
        ids = _gpt2_batch(device, seq=32)
        labels = torch.where(torch.rand(ids.shape, device=device) < 0.15, ids, torch.full_like(ids, -100))
        nsp = torch.zeros(ids.shape[0], dtype=torch.long, device=device)
        run = lambda m: m(ids, masked_lm_labels=labels, next_sentence_label=nsp)  # noqa: E731
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = run(model)
        got = run(compiled)
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
    got.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
