"""The layers' residual adds fused with the layer norms that read them (``dropout_add_layer_norm``:
inside a layer, and across two pre-LN layers through ``run_layer_stack``) train the model the
unfused ops do: with dropout on and the same torch seed, the loss is bit-identical and every
gradient matches (the parameter gradients' fp32 partial sums are added in another order).

The unfused model is the same one with ``LayerNorm.after_residual_add`` as the residual add
followed by ``layer_norm_fork``, and the layers called one by one. Both run the dslab kernel set on
Triton's interpreter.
"""

import importlib

import pytest
import torch

import dslab.models.graphs as graphs_module
from dslab.kernels import kernel_backend
from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.ops import LayerNorm, TransformerLayer

# The package attribute is the function; the module holds its autograd.Function.
fused_module = importlib.import_module("dslab.kernels.norm.dropout_add_layer_norm")


def _unfuse(monkeypatch):
    def after_residual_add(self, x, bias, residual, p, training):
        h = self.ops.bias_dropout_residual(x, bias, residual, p, training)
        return self.ops.layer_norm_fork(h, self.weight, self.bias, self.eps)

    def one_by_one(layers, x, key_padding_mask=None):
        for layer in layers:
            x = layer(x, key_padding_mask)
        return x

    monkeypatch.setattr(LayerNorm, "after_residual_add", after_residual_add)
    monkeypatch.setattr(graphs_module, "run_layer_stack", one_by_one)


def _count_fused_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = fused_module._EagerDropoutAddLayerNorm.forward

    def counted(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(fused_module._EagerDropoutAddLayerNorm, "forward", staticmethod(counted))
    return calls


def _train_step(model, batch):
    torch.manual_seed(11)
    with kernel_backend("triton"):
        loss = model(*batch)
        loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _compare(build, batch, monkeypatch, fused_calls_expected):
    torch.manual_seed(0)
    state = build().state_dict()

    def fresh():
        model = build().train()
        model.load_state_dict(state)
        return model

    calls = _count_fused_calls(monkeypatch)
    loss, grads = _train_step(fresh(), batch)
    assert calls[0] == fused_calls_expected
    with monkeypatch.context() as m:
        _unfuse(m)
        loss_ref, grads_ref = _train_step(fresh(), batch)
    assert calls[0] == fused_calls_expected  # the unfused run made no fused call
    assert torch.equal(loss, loss_ref)
    for name, ref in grads_ref.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item(), msg=name)


def test_gpt2_pre_ln_layers_chain_their_norms(monkeypatch):
    """Two layers: each fuses its attention's residual add with its MLP norm, and the first layer's
    MLP residual add computes the second layer's attention norm (3 fused calls); the last layer's
    residual add stays apart from the final norm."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (2, 12), generator=g)
    _compare(lambda: GPT2LMHeadModel(gpt2_tiny(dropout=0.1), kernels="dslab"), (ids, ids.clone()), monkeypatch, 3)


def test_bert_post_ln_layers_fuse_both_norms(monkeypatch):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 1000, (2, 12), generator=g)
    labels = torch.where(torch.rand(2, 12, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 1] = ids[0, 1]
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    batch = (ids, None, mask, labels, torch.tensor([0, 1]))
    _compare(lambda: BertForPreTraining(bert_tiny(), kernels="dslab"), batch, monkeypatch, 4)


def test_post_ln_layer_refuses_chaining_arguments():
    layer = TransformerLayer(32, 1, 64, 0.0, 0.0, 1e-5, pre_ln=False, causal=False, gelu_approximate="none",
                             ops=GPT2LMHeadModel(gpt2_tiny(), kernels="dslab").ops)
    with pytest.raises(ValueError, match="pre-LN"):
        layer(torch.randn(1, 4, 32), normed=torch.randn(1, 4, 32))


@pytest.mark.parametrize("build", [lambda: GPT2LMHeadModel(gpt2_tiny(dropout=0.1), kernels="dslab"),
                                   lambda: BertForPreTraining(bert_tiny(), kernels="dslab")], ids=["gpt2", "bert"])
def test_every_norm_runs_as_a_module_call(build):
    """Module hooks (the profilers' per-module records) see each layer norm run once per forward,
    fused or forked, inside the module that runs it."""
    model = build().train()
    seen, stack = [], []

    def enter(module, args):
        stack.append(module)

    def leave(module, args, output):
        stack.pop()
        if isinstance(module, LayerNorm):
            seen.append((module, stack[-1] if stack else None))

    for module in model.modules():
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    with kernel_backend("triton"):
        model(ids, ids.clone()) if isinstance(model, GPT2LMHeadModel) else model(ids)
    norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
    assert sorted(map(id, (m for m, _ in seen))) == sorted(map(id, norms))
    layers = list(model.layers)
    if isinstance(model, GPT2LMHeadModel):
        # Layer 1's attention norm runs inside layer 0's MLP (its residual add), the MLP norms
        # inside their layer's attention.
        parents = {id(m): parent for m, parent in seen}
        assert parents[id(layers[1].attention_norm)] is layers[0].mlp
        assert parents[id(layers[0].mlp_norm)] is layers[0].attention
