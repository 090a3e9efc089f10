"""dslab.estimate_zero_memory against hand-derived bytes, and the memory tracer's ZeRO estimate."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import dslab
from dslab.engine.zero_estimate import count_unique_params, largest_layer_params
from dslab.profilers.memory import MemoryTracer, model_state_bytes
from dslab.profilers.zero_memory_model import format_table

PSI = 1_000_000  # parameters
N = 4            # GPUs on one node


def one(stage, **kwargs):
    (row,) = dslab.estimate_zero_memory(PSI, N, stage, **kwargs)
    return row


def test_mixed_precision_per_stage_by_hand():
    # bf16 params 2 + grads 2 + fp32 master 4 + Adam m 4 + v 4 = 2 + 2 + 12 bytes per parameter
    expected = {
        0: (2_000_000, 2_000_000, 12_000_000),
        1: (2_000_000, 2_000_000, 3_000_000),   # optimizer states / 4
        2: (2_000_000, 500_000, 3_000_000),     # gradients / 4 too
        3: (500_000, 500_000, 3_000_000),       # parameters / 4 too
    }
    for stage, (params, grads, states) in expected.items():
        row = one(stage, precision="bf16")
        assert (row.gpu_params, row.gpu_grads, row.gpu_optimizer_states) == (params, grads, states)
        assert row.gpu_buffer == 0  # a count has no largest layer unless given
        assert row.gpu_total == params + grads + states
        # no offload: each of the 4 processes builds the fp32 model on the CPU, x 1.5 slack
        assert (row.cpu_init, row.cpu_offload, row.cpu_total) == (16_000_000, 0, 24_000_000)


def test_fp32_per_stage_and_stage3_buffer_by_hand():
    # fp32: 4 + 4 + 8 bytes per parameter
    assert one(0, precision="fp32").gpu_total == 16_000_000
    assert one(1, precision="fp32").gpu_total == 4_000_000 + 4_000_000 + 2_000_000
    assert one(2, precision="fp32").gpu_total == 4_000_000 + 1_000_000 + 2_000_000
    row = one(3, precision="fp32", largest_layer=10_000)
    # the gathered layer: its fp32 params and fp32 grads, 8 bytes each
    assert row.gpu_buffer == 80_000
    assert row.gpu_total == 1_000_000 + 1_000_000 + 2_000_000 + 80_000
    assert one(2, precision="fp32", largest_layer=10_000).gpu_buffer == 0  # stage 3 only
    # SGD with momentum: one state tensor
    assert one(0, precision="fp32", optimizer_states=1).gpu_optimizer_states == 4_000_000


def test_nodes_offload_and_buffer_factor_by_hand():
    rows = dslab.estimate_zero_memory(PSI, 2, 2, num_nodes=2, offload_optimizer=None,
                                      additional_buffer_factor=2.0)
    assert [(r.stage, r.offload_optimizer) for r in rows] == [(2, "none"), (2, "cpu")]
    plain, offloaded = rows
    # 4 ranks over 2 nodes: gradients and states / 4
    assert plain.gpu_total == 2_000_000 + 500_000 + 3_000_000
    assert plain.cpu_total == 2 * (4 * PSI * 2)  # 2 processes per node build the fp32 model
    # offload: the GPU keeps its bf16 params; fp32 grads + 12 bytes of states go to the CPUs
    assert (offloaded.gpu_grads, offloaded.gpu_optimizer_states, offloaded.gpu_total) == (0, 0, 2_000_000)
    assert offloaded.cpu_offload == (4 + 12) * PSI // 2
    assert offloaded.cpu_total == 2 * 8_000_000
    stage1 = one(1, offload_optimizer="cpu")  # stage 1 all-reduces whole gradients on the GPU
    assert (stage1.gpu_grads, stage1.gpu_optimizer_states) == (2_000_000, 0)
    assert one(3, offload_optimizer=True).gpu_total == 500_000


def test_all_stages_default_and_table(capsys):
    rows = dslab.estimate_zero_memory(PSI, N, print_table=True, offload_optimizer=None)
    assert [(r.stage, r.offload_optimizer) for r in rows] == [
        (0, "none"), (1, "none"), (1, "cpu"), (2, "none"), (2, "cpu"), (3, "none"), (3, "cpu")]
    out = capsys.readouterr().out
    assert out == format_table(rows)
    assert "1 node(s) x 4 GPU(s) per node" in out and "1.00M parameters" in out
    lines = out.splitlines()
    assert len(lines) == 4 + len(rows)
    assert lines[4].split()[:3] == ["0", "none", f"{16_000_000 / 2**30:.2f}GiB"]
    json.dumps([r.to_dict() for r in rows])


class Tied(nn.Module):
    def __init__(self, vocab=50, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight


def test_module_counts_tied_weights_once_and_finds_the_largest_layer():
    model = Tied()
    n = 50 * 8 + 8 * 8 + 8
    assert count_unique_params(model) == n
    assert largest_layer_params(model) == 50 * 8
    (row,) = dslab.estimate_zero_memory(model, 2, 3, precision="fp16")
    assert row.num_params == n and row.largest_layer_params == 400
    assert row.gpu_total == (2 + 2 + 12) * n // 2 + 4 * 400
    assert row.gpu_params == n and row.gpu_grads == n and row.gpu_optimizer_states == 6 * n
    assert row.gpu_buffer == (2 + 2) * 400


@pytest.mark.parametrize("kwargs, match", [
    ({"stage": 5}, "stage must be one of 0, 1, 2, 3"),
    ({"stage": -1}, "stage must be one of"),
    ({"num_gpus": 0}, "num_gpus must be an int >= 1, got 0"),
    ({"num_nodes": 0}, "num_nodes must be an int >= 1"),
    ({"precision": "fp8"}, "precision must be one of bf16, fp16, fp32"),
    ({"offload_optimizer": "gpu"}, "offload_optimizer must be one of none, cpu, nvme"),
    ({"offload_param": "disk"}, "offload_param must be one of none, cpu, nvme"),
    ({"stage": 0, "offload_optimizer": "cpu"}, "offload_optimizer needs ZeRO stage 1, 2 or 3"),
    ({"additional_buffer_factor": 0.5}, "additional_buffer_factor must be a number >= 1"),
    ({"largest_layer": 2 * PSI}, "largest_layer_params .* exceeds num_params"),
    ({"optimizer_states": -1}, "optimizer_states must be an int >= 0"),
])
def test_bad_input_is_a_clear_value_error(kwargs, match):
    args = {"num_gpus": N, "stage": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        dslab.estimate_zero_memory(PSI, **args)


@pytest.mark.parametrize("bad", [-5, 1.5, "7B", None])
def test_bad_model_argument(bad):
    with pytest.raises(ValueError, match="model_or_num_params must be an nn.Module or an int"):
        dslab.estimate_zero_memory(bad, 1, 0)


def test_memory_tracer_puts_the_zero_estimate_beside_its_measurement():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    n = 6 * 10 + 10 + 10 * 3 + 3
    optimizer = torch.optim.Adam(model.parameters())
    tracer = MemoryTracer(profile_step=0)
    tracer.attach(model, optimizer)
    tracer.set_zero_stage(2)
    tracer.on_step_begin(0)
    tracer.on_forward_begin()
    loss = model(torch.randn(2, 6)).sum()
    tracer.on_forward_end()
    loss.backward()
    tracer.on_backward_end()
    tracer.on_optimizer_step_begin()
    optimizer.step()
    tracer.on_optimizer_step_end()
    tracer.on_step_end(0)
    states = tracer.records()["model_states"]
    zero = states["zero_estimate"]
    assert zero["world_size"] == 1 and zero["stage"] == 2
    totals = [row["total"] for row in zero["per_gpu"]]
    # one rank: stages 0-2 partition nothing; stage 3 adds the largest layer (fc1: 70 params) gathered
    assert totals == [16 * n, 16 * n, 16 * n, 16 * n + 8 * 70]
    assert states["total"] - 4 * 4 == totals[0]  # measured, less Adam's four step counters
    json.dumps(tracer.records())
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        tracer.set_zero_stage(4)


def test_model_state_bytes_partitions_over_a_given_world_size():
    model = nn.Linear(7, 5)  # 40 parameters
    optimizer = torch.optim.AdamW(model.parameters())
    zero = model_state_bytes(model, optimizer, world_size=4)["zero_estimate"]
    by_stage = {row["stage"]: row for row in zero["per_gpu"]}
    assert by_stage[0]["total"] == 16 * 40
    assert (by_stage[1]["params"], by_stage[1]["grads"], by_stage[1]["optimizer_states"]) == (160, 160, 80)
    assert (by_stage[2]["grads"], by_stage[3]["params"]) == (40, 40)
    assert by_stage[3]["buffer"] == 8 * 40


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_resident_gradient_sum_stays_on_the_gpu_by_hand(stage):
    """offload_optimizer.accumulate_on "gpu_resident": the offloaded fraction of this rank's
    gradient partition (4-byte sums of dslab's fp32 parameters, ratio 0.5 of PSI / N) is added to
    the GPU's gradients; the CPU side and the other modes are unchanged."""
    common = dict(offload_optimizer="cpu", param_bytes=4, master_bytes=0, offload_ratio=0.5)
    plain = one(stage, **common)
    host = one(stage, accumulate_on="cpu", **common)
    resident = one(stage, accumulate_on="gpu_resident", **common)
    assert host == plain
    assert resident.gpu_grads - plain.gpu_grads == 4 * PSI // N // 2
    assert resident.gpu_total - plain.gpu_total == 4 * PSI // N // 2
    assert (resident.cpu_offload, resident.cpu_total) == (plain.cpu_offload, plain.cpu_total)
    assert one(stage, accumulate_on="gpu_resident", param_bytes=4, master_bytes=0) == \
        one(stage, param_bytes=4, master_bytes=0)  # no offload: nothing to keep
    with pytest.raises(ValueError, match="accumulate_on"):
        one(stage, accumulate_on="host", **common)
