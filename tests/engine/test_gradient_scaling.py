"""DeepSpeed's ``prescale_gradients`` and ``gradient_predivide_factor``: where the division of
data-parallel gradients by the group's size happens (engine/data_parallel.py: GradientScaling).
On gloo ranks at ZeRO stages 0-3 each option hands the collectives gradients at the scale it
names, and trains to the default's losses and parameters (the same average, rounded elsewhere)."""

from pathlib import Path

import pytest
import torch

from dslab import comm
from dslab.engine.config import load_config
from dslab.engine.data_parallel import GradientScaling

HERE = Path(__file__).parent
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_the_keys_load_and_a_bad_factor_is_refused_by_name():
    config = load_config(BASE)
    assert config.gradient_scaling == GradientScaling(prescale=False, predivide=1.0)
    config = load_config({**BASE, "prescale_gradients": True, "gradient_predivide_factor": 8})
    assert config.gradient_scaling == GradientScaling(prescale=True, predivide=8.0)
    for bad in (0, -2.0, float("inf")):
        with pytest.raises(ValueError, match="'gradient_predivide_factor': must be a positive number"):
            load_config({**BASE, "gradient_predivide_factor": bad})


def test_the_plan_for_each_option():
    avg = comm.ReduceOp.AVG
    assert GradientScaling().plan(4, avg) == (avg, None, None)  # the collective averages
    assert GradientScaling().plan(4, None) == (comm.ReduceOp.SUM, 4, None)  # gloo: divided, summed
    assert GradientScaling(prescale=True).plan(4, avg) == (comm.ReduceOp.SUM, 4, None)
    assert GradientScaling(prescale=True, predivide=8.0).plan(4, avg) == (comm.ReduceOp.SUM, 4, None)
    assert GradientScaling(predivide=8.0).plan(4, avg) == (comm.ReduceOp.SUM, 8.0, 2.0)  # /8, sum, *8/4
    assert GradientScaling(predivide=4.0).plan(4, None) == (comm.ReduceOp.SUM, 4.0, None)
    assert GradientScaling(predivide=2.0).plan(1, None) == (comm.ReduceOp.SUM, 2.0, 2.0)  # a group of one


@pytest.mark.world_size(2)
def test_each_option_reduces_at_its_scale_and_trains_as_the_default(tmp_path, torchrun):
    out = tmp_path / "scaling.pt"
    torchrun(HERE / "gradient_scaling_worker.py", out)
    results = torch.load(out, weights_only=True)
    world = results["world"]
    for stage in (0, 1, 2, 3):
        plain = results[f"{stage}-plain"]
        # gloo has no AVG: by default every bucket is divided by the world size, then summed
        assert plain["collectives"] and {op for op, _ in plain["collectives"]} == {"SUM"}
        for name, scale in (("prescale", 1.0), ("f4", world / 4.0), ("fworld", 1.0)):
            run = results[f"{stage}-{name}"]
            assert [op for op, _ in run["collectives"]] == [op for op, _ in plain["collectives"]], (stage, name)
            # the first step's collectives carry the same gradients: their magnitudes scale
            first = len(plain["collectives"]) // 3
            for (_, got), (_, base) in zip(run["collectives"][:first], plain["collectives"][:first]):
                assert got == pytest.approx(base * scale, rel=1e-5), (stage, name)
            assert run["losses"] == pytest.approx(plain["losses"], rel=1e-5), (stage, name)
            for key, value in plain["params"].items():
                torch.testing.assert_close(run["params"][key], value, rtol=1e-4, atol=1e-6)
