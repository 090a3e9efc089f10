"""The engine's bf16 weight copies (dslab/engine/weight_copies.py): the model computes with bf16
copies the optimizer keeps, and trains as the same model under plain autocast does.

On CPU the copies run only when the config asks for them (``bf16.weight_copies: true``); FusedAdam
takes its reference path there (and its Triton kernel under the interpreter in
tests/kernels/optim/test_fused_adam.py). The GPU test at the end runs them where ``"auto"`` turns them
on, with the layers in CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

import dslab
from dslab.bench.parking import park_training_state, unpark_training_state
from dslab.kernels.optim.fused_adam import FusedAdam
from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.weight_cast import weights_read_through
from dslab.profilers.model_states import count_storages

NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)


def _config(weight_copies, **extra):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True, "weight_copies": weight_copies},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
    }
    config.update(extra)
    return config


def _bert(device="cpu"):
    torch.manual_seed(0)
    return BertForPreTraining(bert_tiny(**NO_DROPOUT), kernels="dslab").to(device)


def _bert_batch(device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (4, 32), generator=g)
    labels = torch.where(torch.rand(4, 32, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]  # at least one labelled position per row
    nsp = torch.randint(0, 2, (4,), generator=g)
    return ids.to(device), labels.to(device), nsp.to(device)


def _train(engine, batch, steps):
    ids, labels, nsp = batch
    losses = []
    for _ in range(steps):
        loss = engine(ids, masked_lm_labels=labels, next_sentence_label=nsp)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _engine(model, weight_copies, **extra):
    engine, *_ = dslab.initialize(model=model, config=_config(weight_copies, **extra))
    return engine


def test_bert_with_copies_trains_as_under_autocast():
    batch = _bert_batch()
    plain = _engine(_bert(), False)
    copies = _engine(_bert(), True)
    assert plain.weight_copies is None and not isinstance(plain.optimizer, FusedAdam)
    assert isinstance(copies.optimizer, FusedAdam)

    # One step: the same forward and gradients, so the updated parameters differ by the two
    # optimizers' rounding alone.
    first_plain, first_copies = _train(plain, batch, 1), _train(copies, batch, 1)
    assert first_plain == first_copies
    for (name, a), b in zip(plain.module.named_parameters(), copies.module.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-6, msg=name)

    later_plain, later_copies = _train(plain, batch, 5), _train(copies, batch, 5)
    torch.testing.assert_close(torch.tensor(later_copies), torch.tensor(later_plain), rtol=2e-4, atol=0)
    assert later_copies[-1] < first_copies[0] - 0.5  # it trains


def test_gpt2_with_copies_trains_as_under_autocast():
    def run(weight_copies):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="dslab")
        engine = _engine(model, weight_copies)
        ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(3))
        out = []
        for _ in range(4):
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            out.append(float(loss.detach()))
        return out

    plain, copies = run(False), run(True)
    assert plain[0] == copies[0]
    torch.testing.assert_close(torch.tensor(copies), torch.tensor(plain), rtol=2e-4, atol=0)
    assert copies[-1] < copies[0]


def test_the_model_reads_the_copies_and_the_optimizer_writes_them():
    engine = _engine(_bert(), True)
    copied = weights_read_through(engine.module)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    copied_names = {names[id(p)] for p in copied}
    # The layers' matmul weights and separate biases, the heads' dense layers; not the layer
    # norms nor the embeddings (the tied MLM decoder reads the word embeddings in fp32).
    assert "layers.0.attention.qkv.weight" in copied_names and "layers.1.mlp.fc_in_bias" in copied_names
    assert "mlm_dense_bias" in copied_names and "pooler.weight" in copied_names
    assert not any("norm" in n or "embeddings" in n for n in copied_names)

    ids, labels, nsp = _bert_batch()
    loss = engine(ids, masked_lm_labels=labels, next_sentence_label=nsp)
    engine.backward(loss)
    for p in copied:
        copy = engine.weight_copies.copy_of(p)
        assert p.grad is None, names[id(p)]
        assert copy.grad is not None and copy.grad.dtype == torch.bfloat16, names[id(p)]
    assert engine.module.embeddings.norm.weight.grad.dtype == torch.float32

    before = [p.detach().clone() for p in copied]
    engine.step()
    for p, old in zip(copied, before):
        copy = engine.weight_copies.copy_of(p)
        assert not torch.equal(p.detach(), old), names[id(p)]
        assert torch.equal(copy.detach(), p.detach().to(torch.bfloat16)), names[id(p)]
        assert copy.grad is None

    # The model-states profiler counts the copies and their gradients.
    loss = engine(ids, masked_lm_labels=labels, next_sentence_label=nsp)
    engine.backward(loss)
    counted = count_storages(engine.module, engine.optimizer)
    n_copied = sum(p.numel() for p in copied)
    n_all = sum(p.numel() for p in engine.module.parameters())
    assert counted.bytes["params"] == 4 * n_all + 2 * n_copied
    assert counted.bytes["grads"] == 4 * (n_all - n_copied) + 2 * n_copied


@pytest.mark.parametrize("extra, message", [
    ({"gradient_accumulation_steps": 2, "train_batch_size": 8}, "gradient_accumulation_steps"),
    ({"zero_optimization": {"stage": 1}}, "zero_optimization.stage"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "Lamb"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "amsgrad"),
    ({"bf16": {"enabled": False, "weight_copies": True}}, "bf16.enabled"),
])
def test_true_names_the_condition_that_fails(extra, message):
    with pytest.raises(ValueError, match=f"bf16.weight_copies.*{message}"):
        dslab.initialize(model=_bert(), config=_config(True, **extra))


def test_auto_stays_with_autocast_off_cuda_and_bad_values_are_refused():
    engine = _engine(_bert(), "auto")
    assert engine.weight_copies is None and not isinstance(engine.optimizer, FusedAdam)
    with pytest.raises(ValueError, match="weight_copies"):
        dslab.initialize(model=_bert(), config=_config("always"))


def test_a_model_reading_nothing_through_weight_is_refused_by_true():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="reads no parameter through"):
        dslab.initialize(model=model, config=_config(True))


def test_checkpoint_load_refreshes_the_copies(tmp_path):
    batch = _bert_batch()
    engine = _engine(_bert(), True)
    _train(engine, batch, 2)
    engine.save_checkpoint(tmp_path, tag="two")
    expected = _train(engine, batch, 2)

    other = _engine(_bert(), True)
    _train(other, _bert_batch(seed=7), 3)  # moves the parameters and copies elsewhere
    other.load_checkpoint(tmp_path, tag="two")
    for p in weights_read_through(other.module):
        assert torch.equal(other.weight_copies.copy_of(p).detach(), p.detach().to(torch.bfloat16))
    assert _train(other, batch, 2) == expected


def test_param_groups_and_checkpoints_cross_between_the_two_paths(tmp_path):
    # A user's param groups (no weight decay on biases and norms) work with the copies, and a
    # checkpoint written with copies resumes in an autocast-only engine (and back): the states
    # are the same fp32 parameters and torch-layout Adam states either way.
    def groups(model):
        decay = [p for n, p in model.named_parameters() if p.dim() > 1]
        rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
        return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]

    batch = _bert_batch()
    runs = {}
    for copies in (True, False):
        model = _bert()
        engine, *_ = dslab.initialize(model=model, model_parameters=groups(model), config=_config(copies))
        assert (engine.weight_copies is not None) == copies
        assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.01, 0.0]
        runs[copies] = (engine, _train(engine, batch, 3))
    torch.testing.assert_close(torch.tensor(runs[True][1]), torch.tensor(runs[False][1]), rtol=2e-4, atol=0)

    runs[True][0].save_checkpoint(tmp_path, tag="copies")
    expected = _train(runs[True][0], batch, 2)
    model = _bert()
    resumed, *_ = dslab.initialize(model=model, model_parameters=groups(model), config=_config(False))
    resumed.load_checkpoint(tmp_path, tag="copies")
    torch.testing.assert_close(torch.tensor(_train(resumed, batch, 2)), torch.tensor(expected), rtol=2e-4, atol=0)

    runs[False][0].save_checkpoint(tmp_path, tag="autocast")
    expected = _train(runs[False][0], batch, 2)
    model = _bert()
    resumed, *_ = dslab.initialize(model=model, model_parameters=groups(model), config=_config(True))
    resumed.load_checkpoint(tmp_path, tag="autocast")
    for p in weights_read_through(resumed.module):
        assert torch.equal(resumed.weight_copies.copy_of(p).detach(), p.detach().to(torch.bfloat16))
    torch.testing.assert_close(torch.tensor(_train(resumed, batch, 2)), torch.tensor(expected), rtol=2e-4, atol=0)


def test_parking_moves_the_copies_and_training_goes_on():
    batch = _bert_batch()
    reference = _engine(_bert(), True)
    expected = _train(reference, batch, 3)

    engine = _engine(_bert(), True)
    got = _train(engine, batch, 1)
    parked = park_training_state(engine.module, engine.optimizer)
    copies = engine.weight_copies.copies
    assert all(parked.holds(c) for c in copies)
    unpark_training_state(engine.module, engine.optimizer, parked, torch.device("cpu"))
    assert not any(parked.holds(c) for c in copies)
    got += _train(engine, batch, 2)
    assert got == expected


def test_torch_compile_traces_the_layers_without_a_graph_break():
    # Outside the engine's scope weight() is a global read: the plain arms' compiled models
    # must not break their graphs on it.
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="torch")
    ids = torch.randint(0, 1000, (2, 16))
    explained = torch._dynamo.explain(model)(ids, ids)
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.gpu
def test_gpu_graphed_layers_with_copies_train_as_under_autocast():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")

    def run(weight_copies):
        engine, *_ = dslab.initialize(model=_bert("cuda"), config=_config(weight_copies, cuda_graphs={"enabled": True}))
        losses = _train(engine, _bert_batch("cuda"), 8)
        return losses, engine

    plain, plain_engine = run(False)
    copies, engine = run("auto")
    assert engine.weight_copies is not None and plain_engine.weight_copies is None
    stats = engine.module.cuda_graph_stats
    assert stats.get("replays", 0) >= 6, stats
    torch.testing.assert_close(torch.tensor(copies), torch.tensor(plain), rtol=2e-3, atol=0)
    assert copies[-1] < copies[0] - 0.5
    for p in weights_read_through(engine.module):
        assert torch.equal(engine.weight_copies.copy_of(p).detach(), p.detach().to(torch.bfloat16))
