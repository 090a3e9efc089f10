"""ZeRO stages 1-3 on real gloo process groups (torchrun): the same parameters as stage 0, the
collectives the comms logger sees, sharded checkpoints that resume bit for bit, consolidation,
and loading at another world size. One 2-rank and one 3-rank launch run every scenario
(zero_worker.py); the tests read their results."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dslab import cli
from dslab.engine.checkpoint_io import CheckpointError
from dslab.engine.zero.consolidate import (
    consolidated_state_dict,
    full_optimizer_states,
    full_param_values,
    load_shards,
)

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from zero_worker import CKPT, SCENARIOS, build  # noqa: E402

pytestmark = pytest.mark.world_size(2)


def _launch(nproc, mode, out, ckpt_root):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), str(HERE / "zero_worker.py"), mode, str(out), str(ckpt_root)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("zero-ckpt")


@pytest.fixture(scope="module")
def two_ranks(ckpt_root):
    return _launch(2, "main", ckpt_root.parent / "main.pt", ckpt_root)


@pytest.fixture(scope="module")
def three_ranks(two_ranks, ckpt_root):
    return _launch(3, "reload", ckpt_root.parent / "reload.pt", ckpt_root)


def _assert_states_close(actual, expected, **tol):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, msg=key, **(tol or {"rtol": 1e-5, "atol": 1e-6}))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_stage_ends_where_stage0_ends(two_ranks, scenario):
    reference = two_ranks[f"{scenario}/stage0"]
    fresh = build(0, tied=SCENARIOS[scenario].get("tied", False))
    initial = fresh.module.state_dict()
    fresh.destroy()
    assert any(not torch.equal(initial[k], v) for k, v in reference["state"].items())
    for stage in (1, 2, 3):
        result = two_ranks[f"{scenario}/stage{stage}"]
        _assert_states_close(result["state"], reference["state"])
        assert result["ranks_agree"], f"stage {stage}: ranks hold different parameters"
        assert result["skipped"] == reference["skipped"]
    if scenario in ("fp16", "offload_fp16"):
        assert 0 < reference["skipped"] < 3  # overflow skipped some steps, not all


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", ["cpu", "cpu_reuse_chunks", "nvme", "nvme_both", "nvme_both_host_add",
                                  "cpu_ratio", "cpu_host_add_ratio", "cpu_resident_add", "nvme_ratio",
                                  "nvme_cached", "cpu_overlap", "cpu_overlap_ratio"])
def test_stage3_with_parameter_offload_ends_where_stage0_ends(two_ranks, name, tied):
    """offload_param on the CPU or in files (with the optimizer offloaded to the CPU or NVMe):
    the losses of every step and the final parameters are stage 0's; the shards live off the
    device (or in files: the placeholders are empty), and the files go when the engine does."""
    reference = two_ranks[f"param_offload/tied{tied}/stage0"]
    result = two_ranks[f"param_offload/tied{tied}/{name}"]
    expected_losses = two_ranks[f"param_offload/tied{tied}/losses/stage0"]
    for step, (loss, expected) in enumerate(zip(result["losses"], expected_losses)):
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6, msg=f"micro-step {step}")
    _assert_states_close(result["state"], reference)
    assert result["ranks_agree"]
    stats = result["stats"]
    assert stats["fetches"] > 0 and stats["h2d_bytes"] > 0
    if name.endswith("ratio"):  # some units step on the device and keep their parameters there
        assert 0 < result["on_device"] and 0 < result["held"] < result["released"]
    else:
        assert result["on_device"] == 0 and result["held"] == result["released"]
    if name == "nvme_cached":  # max_in_cpu: the first units in CPU memory, the others in files
        assert 0 < result["cached"] < result["held"] and result["files"] == result["held"] - result["cached"]
        assert 0 < stats["disk_read_bytes"] and 0 < stats["cached_numel"] <= 40 and result["removed"]
    elif name.startswith("nvme"):
        assert result["files"] == result["held"] > 0 and result["removed"] and result["cached"] == 0
        assert stats["disk_read_bytes"] >= stats["h2d_bytes"] > 0
    if name in ("nvme", "nvme_both", "nvme_both_host_add"):
        assert result["shard_sizes"] == [0]  # every unit released: its shard is in its file
    elif name in ("cpu", "cpu_reuse_chunks", "cpu_resident_add", "cpu_overlap"):
        assert result["shard_devices"] == ["cpu"] and 0 not in result["shard_sizes"]


@pytest.mark.parametrize("tied", [False, True])
def test_parameters_fetched_from_bf16_copies_train_like_stage0_within_their_rounding(two_ranks, tied):
    """offload_param.fetch_dtype bf16: every fetch moves half the bytes of the fp32 run's, the
    copies follow the masters through the optimizer steps, and the run ends where stage 0 does
    within the weights' bf16 rounding (the tiny model computes in fp32 from the rounded weights)."""
    result = two_ranks[f"param_offload/tied{tied}/cpu_fetch_bf16"]
    fp32 = two_ranks[f"param_offload/tied{tied}/cpu"]
    assert result["copies"] > 0 and result["copies_current"] and result["ranks_agree"]
    assert result["stats"]["fetches"] == fp32["stats"]["fetches"] > 0
    assert 2 * result["stats"]["h2d_bytes"] == fp32["stats"]["h2d_bytes"]
    expected = two_ranks[f"param_offload/tied{tied}/losses/stage0"]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-2, atol=1e-2)
    _assert_states_close(result["state"], two_ranks[f"param_offload/tied{tied}/stage0"], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tied", [False, True])
def test_a_background_step_with_bf16_fetch_copies_is_the_serial_steps_bit_for_bit(two_ranks, tied):
    """offload_optimizer.overlap_step with fetch_dtype bf16 on 2 ranks: the worker refreshes each
    unit's bf16 copy before its fetch may read it, so the losses and final parameters are the
    serial run's exactly, and the copies follow the masters."""
    result = two_ranks[f"param_offload/tied{tied}/cpu_fetch_bf16_overlap"]
    serial = two_ranks[f"param_offload/tied{tied}/cpu_fetch_bf16"]
    assert result["losses"] == serial["losses"]
    _assert_states_close(result["state"], serial["state"], rtol=0, atol=0)
    assert result["copies_current"] and result["stats"]["overlap_step_s"] > 0
    assert result["stats"]["fetches"] == serial["stats"]["fetches"]


@pytest.mark.parametrize("tied", [False, True])
def test_gradients_staged_in_bf16_train_like_stage0_within_their_rounding(two_ranks, tied):
    """offload_optimizer.staging_dtype bf16: the later micro-step's shards reach the host adds
    through bf16 staging buffers, and the run ends where stage 0 does within that rounding."""
    result = two_ranks[f"param_offload/tied{tied}/cpu_staging_bf16"]
    assert result["staging_dtypes"] == ["torch.bfloat16"] and result["ranks_agree"]
    assert result["stats"]["host_adds"] > 0 and result["stats"]["grad_h2d_bytes"] == 0
    expected = two_ranks[f"param_offload/tied{tied}/losses/stage0"]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-2, atol=1e-2)
    _assert_states_close(result["state"], two_ranks[f"param_offload/tied{tied}/stage0"], rtol=1e-2, atol=1e-2)


def test_parameter_offload_to_nvme_resumes_from_a_checkpoint(two_ranks):
    _assert_states_close(two_ranks["param_offload/ckpt/resumed"],
                         two_ranks["param_offload/ckpt/straight"])


def test_granularity_threshold_gathers_the_block_whole(two_ranks):
    units = two_ranks["nested_granularity/stage3"]["units"]
    assert sorted(map(sorted, units)) == [["block.emb.weight", "block.fc.bias", "block.fc.weight"],
                                          ["out_bias"], ["proj.bias", "proj.weight"]]


def test_save_16bit_model_gathers_stage3_weights_on_rank0(two_ranks, ckpt_root):
    assert two_ranks["16bit/saved"] is True
    saved = torch.load(ckpt_root / "16bit" / "pytorch_model.bin", weights_only=True)
    full = two_ranks["16bit/state"]
    assert saved.keys() == full.keys() and saved["fc1.weight"].shape == full["fc1.weight"].shape
    for key, value in full.items():
        assert saved[key].dtype == torch.bfloat16
        assert torch.equal(saved[key], value.to(torch.bfloat16)), key


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_rank_starts_from_rank0_weights(two_ranks, stage):
    result = two_ranks[f"init/stage{stage}"]
    assert result["ranks_agree"]
    fresh = build(0, seed=10)  # rank 0's seed
    expected = fresh.module.state_dict()
    fresh.destroy()
    assert all(torch.equal(result["state"][k], v) for k, v in expected.items())


def test_comms_logger_sees_reduce_scatter_and_all_gather_with_their_bytes(two_ranks):
    # 2 optimizer steps x 2 micro-steps; stage 2 and 3 reduce-scatter every backward
    stage2 = two_ranks["comms/stage2"]
    units = stage2["padded_bytes"]
    assert sorted(units) == [160, 472]  # TinyNet(13, 9, 3) in buckets of <= 100 elements, padded
    assert stage2["logged"]["reduce_scatter"] == {b: 4 for b in units}
    assert stage2["logged"]["all_gather"] == {b: 2 for b in units}  # after each step
    stage3 = two_ranks["comms/stage3"]
    units = stage3["padded_bytes"]
    assert sorted(units) == [120, 504]  # one unit per Linear
    assert stage3["logged"]["reduce_scatter"] == {b: 4 for b in units}
    assert stage3["logged"]["all_gather"] == {b: 8 for b in units}  # forward and backward
    assert stage2["logged"]["all_reduce"] == stage3["logged"]["all_reduce"] == {}
    reuse = two_ranks["comms/stage3_reuse"]
    assert reuse["logged"]["reduce_scatter"] == {b: 4 for b in units}
    # 4 forwards, and 1 backward: only the first, whose forward was still recording the order,
    # released its units; later backwards find them kept
    assert reuse["logged"]["all_gather"] == {b: 5 for b in units}
    for result in (stage2, stage3, reuse, two_ranks["comms/stage2_allreduce_pieces"]):
        observed = {}
        for op, nbytes in result["calls"]:
            observed.setdefault(op, {}).setdefault(nbytes, 0)
            observed[op][nbytes] += 1
        assert observed == {op: sizes for op, sizes in result["logged"].items() if sizes}


def test_reduce_scatter_false_all_reduces_and_allgather_bucket_caps_each_gather(two_ranks):
    result = two_ranks["comms/stage2_allreduce_pieces"]
    assert sorted(result["padded_bytes"]) == [160, 472]
    assert result["logged"]["reduce_scatter"] == {}
    assert result["logged"]["all_reduce"] == {160: 4, 472: 4}  # whole units, every backward
    # allgather_bucket_size 40 over 2 ranks: the 40-element unit in one gather; the 118-element
    # unit's 59-element shards in pieces of 20, 20 and 19 per rank; after each of the 2 steps
    assert result["logged"]["all_gather"] == {160: 2 + 2 * 2, 152: 2}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_resume_equals_uninterrupted_run(two_ranks, stage):
    straight = two_ranks[f"ckpt/stage{stage}/straight"]
    resumed = two_ranks[f"ckpt/stage{stage}/resumed"]
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert two_ranks[f"ckpt/stage{stage}/losses_equal"]
    assert two_ranks[f"ckpt/stage{stage}/client"] == {"stage": stage}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_rank_saves_its_shard(two_ranks, ckpt_root, stage):
    path = ckpt_root / f"stage{stage}" / "global_step2"
    names = sorted(p.name for p in path.iterdir())
    assert names == ["client_state.pt", "engine.pt", "manifest.json", "model.pt", "scheduler.pt",
                     "zero_shard_rank00000.pt", "zero_shard_rank00001.pt"]
    shards = load_shards(path.parent, path.name, 2)
    assert [s["rank"] for s in shards] == [0, 1]
    state = full_optimizer_states(shards)[0]
    assert set(state["fc1.weight"]["elementwise"]) == {"exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_to_fp32_equals_module_state_dict(two_ranks, ckpt_root, tmp_path, stage):
    saved = two_ranks[f"ckpt/stage{stage}/saved"]
    consolidated = consolidated_state_dict(ckpt_root / f"stage{stage}")
    assert consolidated.keys() == saved.keys()
    assert all(torch.equal(consolidated[k], saved[k]) for k in saved)
    out = tmp_path / "full.pt"
    assert cli.main(["zero-to-fp32", str(ckpt_root / f"stage{stage}" / "global_step2"), str(out)]) == 0
    from_cli = torch.load(out, weights_only=True)
    assert all(torch.equal(from_cli[k], saved[k]) for k in saved)


def test_zero_to_fp32_names_a_missing_shard(two_ranks, ckpt_root, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(ckpt_root / "stage3", broken)
    (broken / "global_step2" / "zero_shard_rank00001.pt").unlink()
    assert cli.main(["zero-to-fp32", str(broken), str(tmp_path / "out.pt")]) == 1
    assert "zero_shard_rank00001.pt" in capsys.readouterr().err


@pytest.mark.world_size(3)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_three_ranks_load_two_rank_checkpoint_by_repartitioning(two_ranks, three_ranks, ckpt_root,
                                                                stage):
    saved = two_ranks[f"ckpt/stage{stage}/saved"]
    loaded = three_ranks[f"reload/stage{stage}/state"]
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert three_ranks[f"reload/stage{stage}/finite"]
    two = load_shards(ckpt_root / f"stage{stage}", "global_step2", 2)
    three = load_shards(ckpt_root / f"stage{stage}-3ranks", "global_step2", 3)
    values2, values3 = full_param_values(two), full_param_values(three)
    assert all(torch.equal(values2[k], values3[k]) for k in values2)
    states2, states3 = full_optimizer_states(two)[0], full_optimizer_states(three)[0]
    for name, entry in states2.items():
        for key, value in entry["elementwise"].items():
            assert torch.equal(states3[name]["elementwise"][key], value), (name, key)
        assert states3[name]["scalar"] == entry["scalar"]


@pytest.mark.world_size(3)
def test_three_ranks_stage2_matches_stage0(three_ranks):
    _assert_states_close(three_ranks["three/stage2"], three_ranks["three/stage0"])


@pytest.mark.parametrize("stage", [1, 3])
def test_one_process_loads_two_rank_checkpoint(two_ranks, ckpt_root, stage):
    engine = build(stage, **CKPT)
    engine.load_checkpoint(ckpt_root / f"stage{stage}")
    saved = two_ranks[f"ckpt/stage{stage}/saved"]
    state = engine.module_state_dict()
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    engine.destroy()


def test_stage0_engine_refuses_sharded_states(two_ranks, ckpt_root):
    engine = build(0, **CKPT)
    with pytest.raises(CheckpointError, match="ZeRO stage 3 by 2 ranks.*parameters are sharded"):
        engine.load_checkpoint(ckpt_root / "stage3")
    with pytest.raises(CheckpointError, match="ZeRO stage 2 by 2 ranks.*optimizer states are sharded"):
        engine.load_checkpoint(ckpt_root / "stage2")
    engine.load_checkpoint(ckpt_root / "stage2", load_optimizer_states=False)
    saved = two_ranks["ckpt/stage2/saved"]
    assert all(torch.equal(engine.module.state_dict()[k], saved[k]) for k in saved)
