"""suites/moe: a suite mixing the moe_layer and gpt2_moe families, its tiny scale end to end on
the CPU (the MoE records in the report and the summary), the compiled plain loop, and what the
arms refuse."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from dslab.bench import arms as arms_module
from dslab.bench.moe_report import stats_to_host
from dslab.bench.runner import run_suite
from dslab.bench.suite import load_suite
from dslab.bench.workloads import workloads_for
from dslab.report import read_report

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "suites" / "moe"


def test_suite_mixes_families_and_states_its_expert_flops():
    suite, _ = load_suite(SUITE)
    full = {w.case.name: w for w in workloads_for(suite, "full")}
    assert {n: (w.family, w.preset) for n, w in full.items()} == {
        "layer_top1": ("moe_layer", "moe_layer_1024h_8e"), "layer_top2": ("moe_layer", "moe_layer_1024h_8e"),
        "gpt2_moe_top1": ("gpt2_moe", "gpt2_moe_124m_8e"), "gpt2_moe_top2": ("gpt2_moe", "gpt2_moe_124m_8e")}
    layer = full["layer_top2"].model_config()
    assert (layer.hidden, layer.ffn, layer.num_experts, layer.k, layer.drop_tokens) == (1024, 4096, 8, 2, False)
    assert full["layer_top2"].samples_and_tokens() == (16, 16384)
    model = full["gpt2_moe_top1"].model_config()
    assert (model.num_experts, model.k, model.drop_tokens, model.vocab_pad_multiple) == (8, 1, False, 64)
    # 12 * H * F flops per assignment and MoE layer: 16,384 tokens x 2 choices, one layer
    assert full["layer_top2"].expert_flops_per_step() == 12 * 16384 * 2 * 1024 * 4096
    assert full["gpt2_moe_top1"].expert_flops_per_step() == 6 * 12 * 8192 * 768 * 3072
    # the hf arm's gated experts at H=1024: three 1024 x 2752 matrices
    assert full["layer_top1"].expert_flops_per_step(hf=True) == 18 * 16384 * 1024 * 2752
    assert {w.case.name for w in workloads_for(suite, "tiny")} == {"layer_top2", "gpt2_moe_top1"}
    assert suite.engine["cuda_graphs"] == {"enabled": True}


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "suite"
    path.mkdir(exist_ok=True)
    (path / "suite.json").write_text(json.dumps(data))
    return path


def test_mixed_family_cases_are_checked(tmp_path):
    data = json.loads((SUITE / "suite.json").read_text())
    case = data["scales"]["tiny"]["cases"][0]
    del case["preset"]
    with pytest.raises(ValueError, match="case 'layer_top2' has family 'moe_layer'.*must name its own 'preset'"):
        load_suite(_write(tmp_path, data))
    case["preset"], case["family"] = "moe_layer_tiny", "mixtral"
    with pytest.raises(ValueError, match="family"):
        load_suite(_write(tmp_path, data))
    case["family"], case["preset"] = "moe_layer", "gpt2_moe_tiny"
    suite, _ = load_suite(_write(tmp_path, data))
    with pytest.raises(ValueError, match="case 'layer_top2': unknown moe_layer preset 'gpt2_moe_tiny'"):
        workloads_for(suite, "tiny")
    case["preset"], case["model_options"] = "moe_layer_tiny", {"k": 3}
    suite, _ = load_suite(_write(tmp_path, data))
    with pytest.raises(ValueError, match="case 'layer_top2': k must be 1 or 2"):
        workloads_for(suite, "tiny")


def test_tiny_scale_end_to_end_writes_the_moe_records(tmp_path):
    stream = io.StringIO()
    report, path = run_suite(SUITE, scale="tiny", arms=["dslab", "torch", "hf"], trials=1, steps=2, warmup_steps=1,
                             out=tmp_path / "reports", stream=stream)
    back = read_report(path)
    assert back.status == "complete" and not back.missing
    assert all(r.status == "ok" for r in back.results), [(r.case, r.arm, r.error) for r in back.results]
    assert [c["family"] for c in back.config["cases"]] == ["moe_layer", "gpt2_moe"]
    for case, layers, experts, tokens, k in (("layer_top2", [0], 4, 128, 2), ("gpt2_moe_top1", [1], 4, 64, 1)):
        record = back.profilers["moe"][case]
        assert [layer["layer"] for layer in record["layers"]] == layers
        for layer in record["layers"]:
            assert len(layer["exp_counts"]) == experts and sum(layer["exp_counts"]) == tokens * k
            assert layer["dropped"] == 0 and layer["capacity"] is None
        assert record["dropped_fraction"] == 0.0 and record["drop_tokens"] is False
        assert set(record["expert_flops_per_step"]) == {"dslab", "torch", "hf"} and "all_to_all" not in record
        for arm in ("dslab", "torch", "hf"):
            metrics = back.result(case, arm).metrics
            flops = record["expert_flops_per_step"][arm]
            assert metrics["expert_tflops"] == pytest.approx(flops / (metrics["step_time_ms"] / 1e3) / 1e12)
    printed = stream.getvalue()
    assert "dslab routing after its last step" in printed and "expert TFLOP/s" in printed
    assert "routing of the dslab arm's last step (4 experts, top-2): dropped 0.00% of 256 assignments" in printed


@pytest.mark.slow
def test_compiled_plain_loop_trains_on_the_layer():
    """torch.compile over the naive loop (data-dependent sizes per expert) runs and learns."""
    suite, _ = load_suite(SUITE)
    (workload,) = workloads_for(suite, "tiny", ["layer_top2"])
    arm = arms_module.build_arm("torch-compile", workload, torch.device("cpu"), "bf16", suite.engine)
    try:
        losses = [float(arm.step().detach()) for _ in range(3)]
    finally:
        arm.close()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] != losses[0]


def test_plain_arms_skip_expert_parallelism_and_routing_is_read_once(tmp_path):
    suite, _ = load_suite(SUITE)
    (workload,) = workloads_for(suite, "tiny", ["gpt2_moe_top1"])
    workload.model_options = {**workload.model_options, "ep_size": 2}
    for arm in ("torch", "hf"):
        with pytest.raises(arms_module.ArmSkipped, match="ep_size=2"):
            arms_module.build_arm(arm, workload, torch.device("cpu"), "bf16", suite.engine)
    stats = [{"layer": 1, "exp_counts": torch.tensor([3, 1]), "dropped": torch.tensor(1), "tokens": 4, "k": 1,
              "capacity": 2}]
    assert stats_to_host(stats) == [{"layer": 1, "tokens": 4, "k": 1, "capacity": 2, "exp_counts": [3, 1],
                                     "dropped": 1}]
