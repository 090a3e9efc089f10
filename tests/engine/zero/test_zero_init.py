"""``dslab.zero.Init`` and ``GatheredParameters`` on 2 gloo processes (init_worker.py, one
torchrun launch), and in one process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dslab
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

HERE = Path(__file__).parent
MODELS = ["gpt2", "bert", "gpt2_moe"]

pytestmark = pytest.mark.world_size(2)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero-init")
    out = root / "out.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "init_worker.py"), str(out), str(root)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("name", MODELS)
def test_modules_are_built_holding_only_their_shard(results, name):
    held = results[f"{name}/held"]
    total = sum(full for _, _, full, _, _ in held.values())
    assert all(data == 0 for data, _, _, _, _ in held.values())  # no whole parameter stays
    for data, shard, full, shape, _ in held.values():
        assert shard == -(-full // 2) and full == torch.Size(shape).numel()
    assert sum(shard for _, shard, _, _, _ in held.values()) <= total // 2 + len(held)
    assert results[f"{name}/after_read"] == 0  # released again after the read


@pytest.mark.parametrize("name", MODELS)
def test_gathered_weights_are_a_plain_builds(results, name):
    whole, plain = results[f"{name}/whole"], results[f"{name}/plain"]
    assert whole.keys() == plain.keys()
    for key, value in plain.items():
        assert torch.equal(whole[key], value), key


@pytest.mark.parametrize("name", MODELS)
def test_built_partitioned_trains_to_stage0s_losses(results, name):
    losses, expected = results[f"{name}/losses/init_stage3"], results[f"{name}/losses/plain_stage0"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert losses[-1] != losses[0]
    state, reference = results[f"{name}/state/init_stage3"], results[f"{name}/state/plain_stage0"]
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=2e-4, msg=key)


def test_gathered_parameters_reads_and_writes_the_engines_parameters(results):
    assert results["access/read_shape"] == (512, 128)
    assert results["access/released"] == 0
    assert torch.equal(results["access/after_write"], torch.full((512, 128), 2.0))


def test_checkpoint_of_a_built_partitioned_model_consolidates(results):
    consolidated, state = results["access/consolidated"], results["access/state"]
    assert consolidated.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(consolidated[key].float(), value.float()), key


def test_cpu_shards_and_nvme_parameter_offload(results):
    assert results["cpu/devices"] == ["cpu"]
    torch.testing.assert_close(torch.tensor(results["nvme/losses"]),
                               torch.tensor(results["gpt2/losses/plain_stage0"]), rtol=1e-5, atol=1e-5)


def test_refusals_name_the_problem(results):
    assert "'wte.weight' was built partitioned" in results["refuse/stage2"]
    assert "'zero_optimization.stage' = 2" in results["refuse/stage2"]
    assert "remote_device 'nvme' is not supported" in results["refuse/nvme"]


def test_one_process_init_matches_a_plain_build_and_trains():
    torch.manual_seed(0)
    plain = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="torch")
    torch.manual_seed(0)
    with dslab.zero.Init(config_dict_or_path={"zero_optimization": {
            "offload_param": {"device": "cpu"}}}):
        model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="torch")
    params = dict(model.named_parameters())
    assert all(p.data.numel() == 0 and p.ds_tensor.device.type == "cpu" for p in params.values())
    with dslab.zero.GatheredParameters(list(params.values())):
        for name, p in plain.named_parameters():
            assert torch.equal(params[name], p), name
    # modules defined inside the context are partitioned too, and the patching is undone after
    with dslab.zero.Init():
        class Late(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(5))
        late = Late()
    assert late.w.numel() == 0 and late.w.ds_numel == 5
    assert Late().w.numel() == 5 and torch.nn.Linear(3, 3).weight.numel() == 9
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}}}
    engine, _, _, _ = dslab.initialize(model=model, config=cfg)
    reference, _, _, _ = dslab.initialize(model=plain, config=dict(cfg, zero_optimization={"stage": 0}))
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        for e in (engine, reference):
            loss = e(ids, labels=ids)
            e.backward(loss)
            e.step()
        torch.testing.assert_close(engine(ids, labels=ids), reference(ids, labels=ids),
                                   rtol=1e-5, atol=1e-5)
    assert engine.zero.param_home.stats()["fetches"] > 0
    engine.destroy()
    reference.destroy()


def test_init_refuses_mpu_and_unknown_devices():
    with pytest.raises(ValueError, match="mpu"):
        dslab.zero.Init(mpu=object())
    with pytest.raises(ValueError, match="remote_device 'tpu'"):
        dslab.zero.Init(remote_device="tpu")
