"""The engine's ``cuda_graphs`` section hands the layer stack to CUDA graphs, or refuses a model
that cannot have them."""

import pytest
import torch

import dslab
from dslab.models import GPT2LMHeadModel, gpt2_tiny

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_enabled_section_switches_the_models_graphs_on():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny())
    engine, *_ = dslab.initialize(model=model, config={**CONFIG, "cuda_graphs": {"enabled": True}})
    ids = torch.randint(0, 1000, (2, 16))
    loss = engine(input_ids=ids, labels=ids)
    engine.backward(loss)
    engine.step()
    # On a CPU the stack cannot be captured: it ran eagerly and says so.
    expected = "eager_not_cuda" if engine.device.type == "cpu" else "replays"
    assert model.cuda_graph_stats.get(expected) == 1
    engine.destroy()


def test_off_by_default():
    model = GPT2LMHeadModel(gpt2_tiny())
    engine, *_ = dslab.initialize(model=model, config=CONFIG)
    assert model.cuda_graph_stats == {}
    engine.destroy()


def test_a_model_without_graphs_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"cuda_graphs\.enabled.*Linear"):
        dslab.initialize(model=torch.nn.Linear(4, 4), config={**CONFIG, "cuda_graphs": {"enabled": True}})


def test_unknown_key_in_the_section_is_named():
    with pytest.raises(ValueError, match="cuda_graphs"):
        dslab.initialize(model=torch.nn.Linear(4, 4), config={**CONFIG, "cuda_graphs": {"enable": True}})
