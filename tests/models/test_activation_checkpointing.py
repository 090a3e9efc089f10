"""Activation checkpointing (dslab/models/checkpoint.py, DeepSpeed's ``checkpointing``): dslab's
GPT-2 and BERT in checkpointed segments of ``checkpoint_layers`` layers give the losses and the
gradients of the plain run with dropout on (the recompute replays the forward's random state),
both kernel sets, with the kept inputs on the host too (``cpu_checkpointing``); the engine's
``activation_checkpointing`` section and ``dslab.checkpointing.configure``; ZeRO stage 3 through
its per-module hooks; what is refused, by name."""

import pytest
import torch

import dslab
import dslab.checkpointing as checkpointing
from dslab.engine.config import load_config
from dslab.models import checkpoint as model_checkpoint
from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.gpt2_moe import gpt2_moe_tiny


@pytest.fixture(autouse=True)
def fresh_settings():
    model_checkpoint.reset()
    yield
    model_checkpoint.reset()


def _batch(family):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (2, 24), generator=g)
    if family == "gpt2":
        return {"input_ids": ids, "labels": ids}
    mask = torch.ones_like(ids)
    mask[0, 18:] = 0
    mlm = torch.full_like(ids, -100)
    mlm[:, ::4] = ids[:, ::4]
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask,
            "masked_lm_labels": mlm, "next_sentence_label": torch.tensor([1, 0])}


def _loss_and_grads(family, kernels, every, seed=11):
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(gpt2_tiny(layers=3, checkpoint_layers=every), kernels=kernels)
    else:
        model = BertForPreTraining(bert_tiny(layers=3, checkpoint_layers=every), kernels=kernels)
    model.train()
    torch.manual_seed(seed)  # the dropout masks of the forward
    loss = model(**_batch(family))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family, kernels", [("gpt2", "dslab"), ("gpt2", "torch"), ("bert", "dslab")])
@pytest.mark.parametrize("every", [1, 2])
def test_checkpointed_segments_give_the_plain_gradients_with_dropout(family, kernels, every, monkeypatch):
    from dslab.models import ops

    loss, grads = _loss_and_grads(family, kernels, 0)
    calls, recomputes = [], []

    def counted(function, *args):
        calls.append(1)

        def run(*inner):
            if torch.is_grad_enabled() and len(recomputes) < len(calls) * 2:
                recomputes.append(1)
            return function(*inner)
        return model_checkpoint.checkpoint(run, *args)

    monkeypatch.setattr(ops, "checkpoint", counted)
    loss_ck, grads_ck = _loss_and_grads(family, kernels, every)
    assert len(calls) == -(-3 // every)  # one checkpoint per segment of the 3 layers
    assert len(recomputes) == 2 * len(calls)  # each segment ran in the forward and again in the backward
    assert torch.equal(loss_ck, loss)
    assert grads_ck.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ck[name], grad, rtol=0, atol=1e-6, msg=name)
    # dropout is on: another seed gives another loss, so equality above is not by accident
    assert not torch.equal(_loss_and_grads(family, kernels, every, seed=12)[0], loss)


def test_kept_inputs_on_the_host_give_the_same_gradients():
    loss, grads = _loss_and_grads("gpt2", "dslab", 0)
    with model_checkpoint.settings_for(checkpoint_in_cpu=True):
        loss_ck, grads_ck = _loss_and_grads("gpt2", "dslab", 1)
    assert torch.equal(loss_ck, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ck[name], grad, rtol=0, atol=1e-6, msg=name)


def test_checkpoint_of_a_function_replays_its_random_state():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)

    def f(a, b):
        return torch.nn.functional.dropout(a @ b, 0.5, training=True).tanh()

    torch.manual_seed(5)
    f(x, w).sum().backward()
    plain = (x.grad.clone(), w.grad.clone())
    for cpu in (False, True):
        x.grad = w.grad = None
        checkpointing.configure(checkpoint_in_cpu=cpu)
        torch.manual_seed(5)
        checkpointing.checkpoint(f, x, w).sum().backward()
        assert torch.equal(x.grad, plain[0]) and torch.equal(w.grad, plain[1])


def test_configure_and_the_engine_section():
    assert not checkpointing.is_configured()
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    assert checkpointing.is_configured() and model_checkpoint.settings().checkpoint_in_cpu
    checkpointing.configure(None, synchronize=True, checkpoint_in_cpu=False)  # keywords win
    assert model_checkpoint.settings() == model_checkpoint.CheckpointSettings(False, True)
    checkpointing.reset()
    assert not checkpointing.is_configured()
    with pytest.raises(ValueError, match="mpu_"):
        checkpointing.configure(object())
    for key in ("partition_activations", "contiguous_memory_optimization", "profile"):
        with pytest.raises(ValueError, match=f"activation_checkpointing.{key}: not supported"):
            load_config({"activation_checkpointing": {key: True}})
    assert load_config({"activation_checkpointing": {"number_checkpoints": 4}}).activation_checkpointing.number_checkpoints == 4
    with pytest.raises(ValueError, match="checkpoint_layers"):
        gpt2_tiny(checkpoint_layers=-1)
    with pytest.raises(ValueError, match="GPT-2-MoE does not checkpoint"):
        gpt2_moe_tiny(checkpoint_layers=1)


def _engine_losses(stage, every, cuda_graphs=False, section=None, zero=None):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(checkpoint_layers=every))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **(zero or {})},
              "steps_per_print": 10**6, "cuda_graphs": {"enabled": cuda_graphs}}
    if section is not None:
        config["activation_checkpointing"] = section
    engine, _, _, _ = dslab.initialize(model=model, config=config)
    losses = []
    for step in range(3):
        torch.manual_seed(100 + step)
        loss = engine(**_batch("gpt2"))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    stats = dict(getattr(engine.module, "cuda_graph_stats", {}) or {})
    if engine.zero is not None and engine.zero.gatherer is not None:
        stats["gathers"] = engine.zero.gatherer.gathers
    engine.destroy()
    return losses, stats


def test_engine_trains_checkpointed_layers_as_plain_ones_at_stage_0_and_3():
    plain, _ = _engine_losses(0, 0)
    assert _engine_losses(0, 1, section={"cpu_checkpointing": True})[0] == pytest.approx(plain, abs=1e-6)
    assert model_checkpoint.settings().checkpoint_in_cpu  # the engine set the process's settings
    # stage 3 with graphs on: checkpointing keeps the per-module hooks (no graphed stage 3 stack)
    losses, stats = _engine_losses(3, 1, cuda_graphs=True)
    assert losses == pytest.approx(plain, abs=1e-5)
    assert stats["eager_activation_checkpointing"] == 3


def test_the_config_key_checkpoints_the_model_with_no_code_change():
    """``activation_checkpointing.checkpoint_layers`` sets the model's field when the engine is built:
    the same losses as the plain model, and the layers recomputed (the graphed stack's count)."""
    plain, _ = _engine_losses(0, 0)
    losses, stats = _engine_losses(3, 0, cuda_graphs=True, section={"checkpoint_layers": 1})
    assert losses == pytest.approx(plain, abs=1e-5)
    assert stats["eager_activation_checkpointing"] == 3
    with pytest.raises(ValueError, match="activation_checkpointing.checkpoint_layers: the model"):
        dslab.initialize(model=torch.nn.Linear(4, 4), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "activation_checkpointing": {"checkpoint_layers": 1}})
    with pytest.raises(ValueError, match="checkpoint_layers"):
        load_config({"activation_checkpointing": {"checkpoint_layers": -1}})


def test_stage3_keeps_a_recomputed_layer_gathered_for_its_backward(monkeypatch):
    """Checkpointed layers at stage 3 with every module released after its forward: inside a
    backward each unit is gathered once, for its layer's recompute, and that gather serves the
    layer's backward too (released again once its gradients are reduced); a recompute prefetches
    the layers before it, not the ones whose backward is done."""
    from dslab.engine.zero.stage3 import ParameterGatherer

    events = []
    start = ParameterGatherer._start_gather

    def recording(self, unit, async_op):
        events.append((unit.layout.names, torch._C._current_graph_task_id() != -1))
        return start(self, unit, async_op)

    monkeypatch.setattr(ParameterGatherer, "_start_gather", recording)
    plain, _ = _engine_losses(0, 0)
    losses, stats = _engine_losses(3, 1, zero={"stage3_max_reuse_distance": 0})
    assert losses == pytest.approx(plain, abs=1e-5)
    in_backward = [names for names, backward in events if backward]
    assert in_backward and stats["gathers"] == len(events)
    per_unit = {names: in_backward.count(names) for names in set(in_backward)}
    # at most once per backward over three steps (twice for the qkv projection, which the
    # attention module reads again after calling it: held through the first step, adopted by
    # the attention module after it); a LayerNorm is read again by the recompute of the layer
    # before it (chained norms), after its own backward released it
    linear = {names: n for names, n in per_unit.items() if not any("norm" in x for x in names)}
    assert len(linear) >= 8 and set(linear.values()) <= {2, 3} and 3 in linear.values(), per_unit
    assert all(n == 2 for names, n in linear.items() if "qkv" in names[0]), per_unit
