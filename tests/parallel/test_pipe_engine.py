"""The pipeline engine in one process: GPT-2's pipeline layers compute the dense model, the engine
refuses what it does not run, and the comms analysis pairs a send with its receive."""

import pytest
import torch

import dslab
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.gpt2_pipe import gpt2_pipeline_module, load_dense_state_dict
from dslab.pipe import PipelineError
from dslab.profilers.comms_analysis import analyze_stragglers, bus_factor


def test_gpt2_pipeline_layers_compute_the_dense_model():
    torch.manual_seed(0)
    config = gpt2_tiny(dropout=0.0, layers=3, vocab_size=96)
    dense = GPT2LMHeadModel(config, "torch")
    pipe = gpt2_pipeline_module(config, "torch", num_stages=1)
    load_dense_state_dict(pipe, dense.state_dict())
    ids = torch.randint(0, 96, (2, 20))
    loss_dense = dense(ids, labels=ids)
    loss_pipe = pipe.loss_fn(pipe(ids), ids)
    torch.testing.assert_close(loss_pipe, loss_dense, rtol=1e-6, atol=1e-6)
    loss_dense.backward()
    loss_pipe.backward()
    dense_grads = dict(dense.named_parameters())
    torch.testing.assert_close(pipe.tied_modules["embed"].wte.weight.grad, dense_grads["wte.weight"].grad,
                               rtol=1e-5, atol=1e-6)
    for i in range(3):
        torch.testing.assert_close(pipe.get_submodule(f"{i + 1}").layer.mlp.fc_in.weight.grad,
                                   dense_grads[f"layers.{i}.mlp.fc_in.weight"].grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="has no 'layers.0.attention.qkv.weight'"):
        state = dense.state_dict()
        del state["layers.0.attention.qkv.weight"]
        load_dense_state_dict(pipe, state)


def config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}


def test_pipeline_engine_trains_in_one_process_and_refuses_the_loop_calls():
    torch.manual_seed(0)
    cfg = gpt2_tiny(dropout=0.0, layers=2, vocab_size=64, n_positions=16)
    engine, _, _, _ = dslab.initialize(model=gpt2_pipeline_module(cfg, "torch", num_stages=1), config=config())
    ids = torch.randint(0, 64, (2, 16))
    data = iter([(ids, ids)] * 8)
    first = float(engine.train_batch(data))
    for _ in range(3):
        last = float(engine.train_batch(data))
    assert last < first  # the same batch over and over: the loss must fall
    for call in (lambda: engine(ids), lambda: engine.backward(torch.tensor(1.0)), engine.step):
        with pytest.raises(PipelineError, match="train_batch"):
            call()
    stats = engine.pipeline_stats()
    assert stats["stages"] == 1 and len(stats["batches"]) == 4 and stats["bubble_fraction"] == 0.0
    # the latest batch keeps its timeline: one stage alternates forward and backward
    assert all("timeline" not in b for b in stats["batches"][:-1])
    last = stats["batches"][-1]
    assert [(kind, i) for kind, i, _, _ in last["timeline"]] == [
        ("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]
    starts = [t[2] for t in last["timeline"]]
    assert starts == sorted(starts) and all(0 <= a <= b <= last["wall_ms"] for _, _, a, b in last["timeline"])


@pytest.mark.parametrize("extra, message", [
    ({"zero_optimization": {"stage": 2}}, "'zero_optimization.stage' is 2"),
    ({"compile": {"enabled": True}}, "'compile.enabled'"),
])
def test_pipeline_engine_refuses_by_config_key(extra, message):
    cfg = gpt2_tiny(dropout=0.0, layers=2, vocab_size=64, n_positions=16)
    with pytest.raises(ValueError, match=message):
        dslab.initialize(model=gpt2_pipeline_module(cfg, "torch", num_stages=1), config=config(**extra))


def test_comms_analysis_pairs_sends_with_receives():
    assert bus_factor("send", 2) == 1.0 and bus_factor("recv", 2) == 1.0
    records = {
        0: [{"op": "send", "group": "0,1", "seq": 0, "arrival_ns": 1_000_000, "bytes": 64, "latency_ms": 5.0}],
        1: [{"op": "recv", "group": "0,1", "seq": 0, "arrival_ns": 4_000_000, "bytes": 64, "latency_ms": 2.0}],
    }
    result = analyze_stragglers(records)
    assert result["matched"] == 1 and result["unmatched"] == 0
    assert result["ranks"][0]["total_wait_ms"] == pytest.approx(3.0)  # the sender waited for the receiver
    assert result["ranks"][1]["times_last"] == 1


def test_a_short_data_iterator_is_an_error_not_a_hang():
    torch.manual_seed(0)
    cfg = gpt2_tiny(dropout=0.0, layers=2, vocab_size=64, n_positions=16)
    engine, _, _, _ = dslab.initialize(model=gpt2_pipeline_module(cfg, "torch", num_stages=1), config=config())
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(ValueError, match="data_iter gave 1 of the batch's 2 micro-batches"):
        engine.train_batch(iter([(ids, ids)]))
    assert engine.global_steps == 0


def test_deepspeeds_pipeline_section_loads_with_its_defaults_and_checks_stages():
    from dslab.engine.config import load_config

    section = load_config(config()).pipeline
    assert (section.stages, section.partition, section.seed_layers, section.activation_checkpoint_interval,
            section.pipe_partitioned, section.grad_partitioned) == ("auto", "best", False, 0, True, True)
    for bad in (0, True, "some"):
        with pytest.raises(ValueError, match="pipeline.stages"):
            load_config(config(pipeline={"stages": bad}))
    with pytest.raises(ValueError, match="pipeline.activation_checkpoint_interval"):
        load_config(config(pipeline={"activation_checkpoint_interval": -1}))
    cfg = gpt2_tiny(dropout=0.0, layers=2, vocab_size=64, n_positions=16)
    with pytest.raises(ValueError, match="'pipeline.stages' is 2, but the PipelineModule has 1 stages"):
        dslab.initialize(model=gpt2_pipeline_module(cfg, "torch", num_stages=1), config=config(pipeline={"stages": 2}))
    # a model that is not a PipelineModule ignores the section, as DeepSpeed's engine does
    engine, *_ = dslab.initialize(model=GPT2LMHeadModel(cfg, "torch"),
                                  config=config(pipeline={"stages": 4, "pipe_partitioned": False}))
    engine.destroy()


def test_the_sections_checkpoint_interval_checkpoints_and_trains_as_without():
    cfg = gpt2_tiny(dropout=0.0, layers=2, vocab_size=64, n_positions=16)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    losses = {}
    for interval in (0, 1):
        torch.manual_seed(0)
        module = gpt2_pipeline_module(cfg, "torch", num_stages=1)
        engine, *_ = dslab.initialize(model=module, config=config(
            pipeline={"stages": 1, "activation_checkpoint_interval": interval, "partition": "parameters",
                      "seed_layers": True, "use_reentrant": False}))
        assert module.activation_checkpoint_interval == interval
        assert (module.activation_checkpoint_func is not None) == bool(interval)
        data = iter([(ids, ids)] * 6)
        losses[interval] = [float(engine.train_batch(data)) for _ in range(3)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
