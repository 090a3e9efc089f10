"""``zero_optimization.overlap_param_gather`` (dslab/engine/zero/param_gather.py): stages 1 and 2
wait for each unit's post-step all-gather where the next forward first reads it, and train exactly
as when every gather is waited at the end of the step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dslab
from dslab.engine.zero.param_gather import BEFORE_STACK, DeferredGathers, segment_of_units
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

HERE = Path(__file__).parent


@pytest.mark.world_size(2)
def test_deferred_gathers_train_exactly_as_gathers_waited_at_the_step(tmp_path):
    out = tmp_path / "gather.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "gather_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(out, weights_only=True)
    for stage in (1, 2):
        waited, deferred = results[f"{stage}-False"], results[f"{stage}-True"]
        assert deferred["losses"] == waited["losses"], stage
        assert deferred["losses"][-1] < deferred["losses"][0]
        for name, value in waited["params"].items():
            assert torch.equal(deferred["params"][name], value), (stage, name)
        # the gathers were still pending when step() returned, and were waited in the forward:
        # the units outside the stack before it, the stack's before their segments
        assert waited["pending_after_step"] == [0] * 4 and not waited["stats"]
        assert all(n > 0 for n in deferred["pending_after_step"]), deferred["pending_after_step"]
        assert deferred["segments"] == [BEFORE_STACK, 0, 1], deferred["segments"]
        assert deferred["stats"]["before_forward"] > 0 and deferred["stats"]["before_segment"] > 0
        # every gather waited once; the last step's by the state dict, which settles them
        assert deferred["stats"]["settle"] == deferred["pending_after_step"][-1]
        assert sum(deferred["stats"].values()) == sum(deferred["pending_after_step"])


class FakeHandle:
    def __init__(self, log, index):
        self.log, self.index = log, index

    def wait(self):
        self.log.append(self.index)


def test_each_unit_is_waited_before_the_first_segment_that_reads_it():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0, layers=4), kernels="torch")
    model.enable_cuda_graphs(segments=2)

    class Unit:
        def __init__(self, index, params):
            self.index, self.params = index, params

    layers = list(model.layers)
    units = [Unit(0, list(layers[3].parameters())), Unit(1, list(layers[0].parameters())),
             Unit(2, [model.wte.weight] + list(layers[1].parameters())), Unit(3, list(layers[2].parameters())),
             Unit(4, list(model.final_norm.parameters()))]
    assert segment_of_units(model, units) == {0: 1, 1: 0, 2: BEFORE_STACK, 3: 1, 4: BEFORE_STACK}
    deferred = DeferredGathers(model, units)
    assert [u.index for u in deferred.issue_order(units)] == [2, 4, 1, 0, 3]
    log, seen = [], []
    for unit in units:
        deferred.add(unit, FakeHandle(log, unit.index))
    for k, segment in enumerate(model._layer_graphs.segments):  # what was waited when each segment began
        segment.layers[0].register_forward_pre_hook(lambda _m, _a, k=k: seen.append((k, list(log))))
    ids = torch.randint(0, 1000, (2, 16))
    deferred.before_forward()  # the engine's forward begins
    model(ids, labels=ids)
    assert seen == [(0, [2, 4, 1]), (1, [2, 4, 1, 0, 3])], seen
    assert deferred.pending == 0 and deferred.stats == {"before_forward": 2, "before_segment": 3}
    deferred.remove()
    assert model._layer_graphs.before_segment is None


def test_a_model_without_segments_waits_every_unit_when_the_forward_begins():
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="torch")

    class Unit:
        def __init__(self, index, params):
            self.index, self.params = index, params

    units = [Unit(0, list(model.layers[0].parameters())), Unit(1, [model.wte.weight])]
    deferred = DeferredGathers(model, units)
    log = []
    for unit in units:
        deferred.add(unit, FakeHandle(log, unit.index))
    deferred.before_forward()
    assert sorted(log) == [0, 1] and deferred.stats == {"before_forward": 2}
    deferred.remove()


@pytest.mark.parametrize("zero, extra, message", [
    ({"stage": 0}, {}, "stages 1 and 2"),
    ({"stage": 3}, {}, "stages 1 and 2"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {}, "offload"),
    ({"stage": 2}, {"compile": {"enabled": True}}, "compile.enabled"),
])
def test_overlap_param_gather_is_refused_where_it_does_not_apply(zero, extra, message):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {**zero, "overlap_param_gather": True}, **extra}
    with pytest.raises(ValueError, match=rf"overlap_param_gather.*{message}"):
        dslab.initialize(model=GPT2LMHeadModel(gpt2_tiny()), config=config)


def test_gathers_are_deferred_on_cuda_devices_and_waited_at_the_step_on_a_host():
    from dslab.engine.zero.param_gather import defers_on

    assert defers_on(torch.device("cuda", 0)) and not defers_on(torch.device("cpu"))
