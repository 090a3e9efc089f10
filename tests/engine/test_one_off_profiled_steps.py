"""The steps each profiler instruments once (``Profiler.one_off_steps``) and how many steps a
benchmark has left to warm up through them (``ProfilerHooks.one_off_steps_left``)."""

import pytest
import torch

import dslab
from dslab.engine.profiling import ProfilerHooks
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny


def _engine(**sections):
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0, layers=2), kernels="torch")
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              **sections}
    engine, *_ = dslab.initialize(model=model, config=config)
    return engine


@pytest.mark.parametrize("sections, steps", [
    ({}, ()),
    ({"flops_profiler": {"enabled": True, "profile_step": 2}}, (2, 3, 4)),
    ({"flops_profiler": {"enabled": True, "profile_step": 2, "device_time": False}}, (2,)),
    ({"memory_tracer": {"enabled": True, "profile_step": 5}, "comms_logger": {"enabled": True},
      "wall_clock_breakdown": True}, (5,)),
    ({"flops_profiler": {"enabled": True, "profile_step": 1, "every_n_steps": 10},
      "memory_tracer": {"enabled": True, "profile_step": 7}}, (1, 2, 3, 7)),
])
def test_one_off_steps_of_each_profiler_and_the_steps_left(sections, steps):
    engine = _engine(**sections)
    try:
        hooks = engine.profilers
        assert isinstance(hooks, ProfilerHooks)
        assert sorted(s for p in hooks.profilers for s in p.one_off_steps()) == sorted(steps)
        last = max(steps, default=-1)
        assert hooks.one_off_steps_left(0) == last + 1
        ids = torch.randint(0, 1000, (2, 16))
        for done in range(1, 3):  # the engine's steps count down what is left
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            assert hooks.one_off_steps_left(engine.global_steps) == max(0, last + 1 - done)
        assert hooks.one_off_steps_left(last + 1) == 0 and hooks.one_off_steps_left(last + 50) == 0
    finally:
        engine.destroy()
