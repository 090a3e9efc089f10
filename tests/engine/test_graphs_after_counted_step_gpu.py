"""A CUDA-graphed GPT-2 whose first capture comes after a step counted by the flops profiler.

A counted step runs the graphed layer stack eagerly (the profiler counts through a dispatch mode),
so when the count is of the first step the stack is captured only at the second. On one H200 an
autotuning experiment of GPT-2 355M (bf16, fused Adam, CUDA graphs) that counted its first step
failed at that capture: ``cudaErrorStreamCaptureInvalidated`` in the backward graph's
``capture_end``. These tests train a small GPT-2 through the engine with the count at step 1
(before the capture), at step 2 (after it) and not at all, and ask for the same losses; the
engine's own flops profiler at ``profile_step`` 0 takes the same path.
"""

from __future__ import annotations

import pytest
import torch

import dslab
from dslab.models.gpt2 import GPT2Config, GPT2LMHeadModel
from dslab.profilers.flops import FlopsProfiler

pytestmark = pytest.mark.gpu

STEPS = 4


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=1024, n_positions=256, hidden=256, layers=4, heads=4, dropout=0.0)
    return GPT2LMHeadModel(cfg, kernels="dslab").cuda()


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "gradient_clipping": 1.0, "cuda_graphs": {"enabled": True}, **extra}


def _train(engine, counted_step: int | None = None) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, 1024, (4, 128), generator=g).cuda()
        counter = FlopsProfiler(engine.module) if step == counted_step else None
        if counter is not None:
            counter.start_profile()
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        if counter is not None:
            counter.stop_profile()
            assert counter.get_total_flops() > 0
            counter.end_profile()
        losses.append(float(loss.detach()))
    torch.cuda.synchronize()
    return losses


def _engine(**extra):
    engine, *_ = dslab.initialize(model=_model(), config=_config(**extra))
    return engine


@pytest.mark.parametrize("counted_step", [1, 2])
def test_a_counted_step_before_or_after_the_capture_trains_as_without(counted_step):
    want = _train(_engine())
    engine = _engine()
    got = _train(engine, counted_step)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=2e-2)
    stats = engine.module.cuda_graph_stats
    assert stats["captures"] == 1 and stats["eager_dispatch_mode"] == 1, stats
    assert "captures_on_parameters" not in stats, stats  # the capture ran on stand-ins


def test_the_engines_flops_profiler_at_step_0_precedes_the_capture():
    want = _train(_engine())
    engine = _engine(flops_profiler={"enabled": True, "profile_step": 0})
    got = _train(engine)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=2e-2)
    assert engine.module.cuda_graph_stats["captures"] == 1
