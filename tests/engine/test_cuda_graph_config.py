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
    ids = torch.randint(0, 1000, (2, 16), device=engine.device)
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


def test_auto_segments_cut_the_stack_where_data_parallel_reductions_run_in_backward():
    from dslab.engine.cuda_graph_config import AUTO_DATA_PARALLEL_SEGMENTS, CudaGraphConfig

    auto = CudaGraphConfig(enabled=True)
    assert auto.segment_count(data_parallel_world=1, zero_stage=0) == 1
    for stage in (0, 1, 2):
        assert auto.segment_count(data_parallel_world=2, zero_stage=stage) == AUTO_DATA_PARALLEL_SEGMENTS
    assert auto.segment_count(data_parallel_world=4, zero_stage=3) == 1
    assert auto.segment_count(data_parallel_world=4, zero_stage=0, model_parallel=True) == 1
    assert CudaGraphConfig(enabled=True, segments=3).segment_count(data_parallel_world=1, zero_stage=0) == 3
    with pytest.raises(ValueError, match=r"cuda_graphs\.segments.*stage' 3"):
        CudaGraphConfig(enabled=True, segments=2).segment_count(data_parallel_world=2, zero_stage=3)


def test_segments_reach_the_model_and_bad_values_are_named():
    from dslab.models.graphs import LayerStackGraphs, SegmentedLayerGraphs

    model = GPT2LMHeadModel(gpt2_tiny())
    engine, *_ = dslab.initialize(model=model, config={**CONFIG, "cuda_graphs": {"enabled": True, "segments": 2}})
    assert isinstance(model._layer_graphs, SegmentedLayerGraphs) and len(model._layer_graphs.segments) == 2
    engine.destroy()
    model = GPT2LMHeadModel(gpt2_tiny())
    engine, *_ = dslab.initialize(model=model, config={**CONFIG, "cuda_graphs": {"enabled": True}})
    assert isinstance(model._layer_graphs, LayerStackGraphs)  # one rank: "auto" keeps one graph
    engine.destroy()
    with pytest.raises(ValueError, match="cuda_graphs.segments"):
        dslab.initialize(model=GPT2LMHeadModel(gpt2_tiny()),
                         config={**CONFIG, "cuda_graphs": {"enabled": True, "segments": 0}})
