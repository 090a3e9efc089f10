"""The peer arms (dslab/bench/peers.py) on 2 gloo processes: ``ddp``, ``fsdp2`` and
``fsdp2-compile`` train the tiny GPT-2 of a suite as the plain single-process loop does (fp32:
to the last bits the sharded reductions allow), and in bf16 and fp16 near it. One launch
(peers_worker.py) runs every arm; the tests read its results. DeepSpeed is not installed here:
its arms are checked to be skipped with the reason, and their config by reading it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dslab import comm
from dslab.bench import peers
from dslab.bench.common import ArmSkipped
from dslab.bench.suite import CaseConfig
from dslab.bench.workloads import Workload

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from peers_worker import ENGINE, workload  # noqa: E402

pytestmark = pytest.mark.world_size(2)

# (arm, precision, the reference precision it is held to, rtol of the losses, atol of the parameters)
CHECKS = [
    ("ddp", "fp32", "fp32", 1e-6, 1e-6),
    ("fsdp2", "fp32", "fp32", 1e-6, 2e-5),  # the clipping norm's partial sums are reduced across shards
    ("fsdp2-compile", "fp32", "fp32", 1e-5, 1e-4),  # Inductor's fused kernels sum in their own order
    ("ddp", "bf16", "bf16", 1e-5, 1e-5),  # the same autocast as the reference
    ("fsdp2", "bf16", "fp32", 5e-3, 5e-3),  # FSDP2 computes in bf16 parameters, the reference in fp32
    ("fsdp2", "fp16", "fp32", 5e-3, 5e-3),
]
PAIRS = list(dict.fromkeys(f"{arm}:{precision}" for arm, precision, *_ in CHECKS))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers") / "results.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "peers_worker.py"), str(out), *PAIRS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("arm, precision, against, loss_rtol, param_atol", CHECKS,
                         ids=[f"{a}-{p}" for a, p, *_ in CHECKS])
def test_peer_arm_trains_like_the_plain_loop(results, arm, precision, against, loss_rtol, param_atol):
    result, reference = results[f"{arm}:{precision}"], results[f"reference:{against}"]
    assert results["world_size"] == 2
    assert result["name"] == arm
    assert result["ranks_agree"], "the ranks' losses differ"
    assert result["closed"], "close() kept the model or the optimizer"
    losses = torch.tensor(result["losses"])
    assert torch.isfinite(losses).all() and losses[-1] < losses[0]
    torch.testing.assert_close(losses, torch.tensor(reference["losses"]), rtol=loss_rtol, atol=0.0)
    assert result["state"].keys() == reference["state"].keys()
    for name, expected in reference["state"].items():
        torch.testing.assert_close(result["state"][name], expected, rtol=0.0, atol=param_atol, msg=name)


def test_unknown_arm_names_the_choices():
    with pytest.raises(ValueError, match="unknown peer arm 'fsdp1'; choose one of ddp, fsdp2, fsdp2-compile, "
                                         "deepspeed-zero1, deepspeed-zero2, deepspeed-zero3"):
        peers.build_peer_arm("fsdp1", workload("fp32"), torch.device("cpu"), "fp32", ENGINE)


def test_peers_need_a_process_group():
    assert not comm.is_initialized()
    with pytest.raises(ArmSkipped, match="needs an initialized torch.distributed process group"):
        peers.build_peer_arm("ddp", workload("fp32"), torch.device("cpu"), "fp32", ENGINE)


def test_expert_parallelism_is_left_to_dslab(monkeypatch):
    monkeypatch.setattr(comm, "is_initialized", lambda: True)
    moe = Workload(family="gpt2_moe", preset="gpt2_moe_tiny", case=CaseConfig(name="a", seq_len=16, micro_batch=2),
                   model_options={"ep_size": 2}, seed=0)
    with pytest.raises(ArmSkipped, match="ep_size=2: expert parallelism is the dslab arm's"):
        peers.build_peer_arm("fsdp2", moe, torch.device("cpu"), "fp32", ENGINE)


@pytest.mark.parametrize("name", ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"])
def test_deepspeed_arms_are_skipped_without_deepspeed(monkeypatch, name):
    monkeypatch.setattr(comm, "is_initialized", lambda: True)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    reason = r"deepspeed is not installed \((ModuleNotFound|Import)Error: .*\); pip install deepspeed"
    with pytest.raises(ArmSkipped, match=reason):
        peers.build_peer_arm(name, workload("bf16"), torch.device("cpu"), "bf16", ENGINE)


def test_deepspeed_config():
    config = peers.deepspeed_config(workload("bf16"), "bf16", ENGINE, stage=3)
    assert config == {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
        "wall_clock_breakdown": False, "bf16": {"enabled": True},
    }
    fp32 = peers.deepspeed_config(workload("fp32"), "fp32", {"optimizer": {"type": "Adam"}}, stage=1)
    assert "bf16" not in fp32 and "fp16" not in fp32 and fp32["gradient_clipping"] == 0.0
    assert fp32["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4}}
    assert peers.deepspeed_config(workload("fp16"), "fp16", ENGINE, stage=2)["fp16"] == {"enabled": True}


def test_expert_marks_are_dropped_for_deepspeed():
    moe = Workload(family="gpt2_moe", preset="gpt2_moe_tiny", case=CaseConfig(name="a", seq_len=16, micro_batch=2),
                   model_options={}, seed=0)
    model = moe.build_model(kernels="dslab")
    assert any(getattr(p, "allreduce", True) is False for p in model.parameters())
    peers.drop_expert_marks(model)
    assert not any(hasattr(p, mark) for p in model.parameters() for mark in peers.DEEPSPEED_EXPERT_MARKS)


def test_workload_overrides_reach_the_model_config():
    w = workload("fp32")
    assert w.model_config().chain_layer_norms is True
    assert w.model_config(overrides={"chain_layer_norms": False}).chain_layer_norms is False
    model = w.build_model(kernels="torch", overrides={"chain_layer_norms": False})
    assert all(not layer.chain_layer_norms for layer in model.layers)
    with pytest.raises(ValueError, match="'no_such_field' is not a field of GPT2Config"):
        w.model_config(overrides={"no_such_field": 1})
