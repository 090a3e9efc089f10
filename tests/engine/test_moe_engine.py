"""The engine with expert-parallel (MoE) parameters, on real gloo process groups (torchrun).

ep_size 2 and 4 give the losses and (gathered) parameters of ep_size 1 at ZeRO stages 0-2, with
accumulation and clipping too; the fp16 overflow check sees one rank's expert gradients; the
optimizer gets the experts in param groups of their own; checkpoints save the experts per
expert-parallel rank, resume exactly and load only at their own layout. One 4-rank and one
2-rank launch (moe_worker.py, model in moe_model.py) run every scenario; the tests read their
results. The single-process tests at the end need no process group.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dslab
from dslab.engine.checkpoint_io import CheckpointError
from dslab.engine.expert_checkpoint import expert_model_file, expert_optim_file
from dslab.engine.expert_parallel import split_param_groups
from dslab.engine.zero.consolidate import consolidated_state_dict
from dslab.moe.groups import reset_expert_groups

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from helpers import base_config, make_data  # noqa: E402
from moe_model import CLASSES, DIM, MoENet, dense_and_expert_groups  # noqa: E402

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _launch(nproc, mode, out, ckpt_root):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), str(HERE / "moe_worker.py"), mode, str(out), str(ckpt_root)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-ckpt")


@pytest.fixture(scope="module")
def four_ranks(ckpt_root):
    return _launch(4, "four", ckpt_root.parent / "moe-four.pt", ckpt_root)


@pytest.fixture(scope="module")
def two_ranks(four_ranks, ckpt_root):
    return _launch(2, "two", ckpt_root.parent / "moe-two.pt", ckpt_root)


def _assert_run_matches(result, reference):
    """The same losses on every rank and step, the same whole parameters, and every rank holding
    what it should (non-expert values everywhere, each expert shard on its ep rank's group)."""
    assert result["consistent"]
    torch.testing.assert_close(torch.stack(result["losses"]), torch.stack(reference["losses"]),
                               **TOL)
    assert result["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        torch.testing.assert_close(result["state"][key], value, msg=key, **TOL)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("scenario", ["fp32", "accum_clip"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_every_ep_size_and_stage_ends_where_ep1_stage0_ends(four_ranks, scenario, stage, ep_size):
    reference = four_ranks[f"{scenario}/stage0/ep1"]
    assert reference["consistent"]
    moved = [k for k, v in four_ranks["initial"].items() if not torch.equal(reference["state"][k], v)]
    assert moved == list(reference["state"])  # every parameter trained, experts included
    _assert_run_matches(four_ranks[f"{scenario}/stage{stage}/ep{ep_size}"], reference)


@pytest.mark.world_size(4)
def test_clipping_engages(four_ranks):
    clipped, unclipped = four_ranks["accum_clip/stage0/ep1"], four_ranks["accum_noclip/stage0/ep1"]
    differ = [k for k, v in clipped["state"].items()
              if not torch.allclose(v, unclipped["state"][k], rtol=1e-3, atol=1e-4)]
    assert differ == list(clipped["state"])


@pytest.mark.world_size(4)
@pytest.mark.parametrize("variant", ["deepspeed_groups/stage0", "deepspeed_groups/stage2",
                                     "offload/stage2"])
def test_deepspeed_param_groups_and_offload_match_ep1(four_ranks, variant):
    _assert_run_matches(four_ranks[f"{variant}/ep2"], four_ranks["accum_clip/stage0/ep1"])


@pytest.mark.world_size(4)
def test_optimizer_gets_the_experts_in_moe_groups(four_ranks):
    # plain model.parameters(): the engine splits them (6 dense tensors, the experts' 2)
    assert four_ranks["fp32/stage0/ep2"]["groups"] == [(None, False, 6), ("ep_size_2", True, 2)]
    assert four_ranks["deepspeed_groups/stage0/ep2"]["groups"] == [
        ("dense_params", False, 6), ("ep_size_2", True, 2)]
    # ZeRO: one master per unit (buckets of <= 50 elements), the experts' units in their group
    assert four_ranks["deepspeed_groups/stage2/ep2"]["groups"] == [
        ("dense_params", False, 3), ("ep_size_2", True, 2)]
    assert four_ranks["fp32/stage2/ep4"]["groups"] == [(None, False, 3), ("ep_size_4", True, 1)]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_in_one_ranks_experts_skips_the_step_everywhere(four_ranks, stage):
    result = four_ranks[f"overflow/stage{stage}"]
    assert result["skipped"] == [1, 1, 1, 1]
    assert result["consistent"]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_resume_at_the_same_layout_equals_uninterrupted_run(four_ranks, stage):
    straight = four_ranks[f"ckpt/stage{stage}/straight"]
    resumed = four_ranks[f"ckpt/stage{stage}/resumed"]
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert four_ranks[f"ckpt/stage{stage}/losses_equal"]
    assert four_ranks[f"ckpt/stage{stage}/client"] == {"stage": stage}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_experts_are_saved_per_ep_rank_and_the_rest_once(four_ranks, ckpt_root, stage):
    path = ckpt_root / f"stage{stage}" / "global_step2"
    experts = [expert_model_file("ep_size_2", r) + ".pt" for r in (0, 1)]
    if stage == 0:
        rest = ["optimizer.pt"] + [expert_optim_file("ep_size_2", r) + ".pt" for r in (0, 1)]
    else:
        rest = [f"zero_shard_rank{r:05d}.pt" for r in range(4)]
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["client_state.pt", "engine.pt", "manifest.json", "model.pt", "scheduler.pt"]
        + experts + rest)
    saved = four_ranks[f"ckpt/stage{stage}/saved"]
    model = torch.load(path / "model.pt", weights_only=True)
    assert sorted(model) == sorted(k for k in saved if not k.startswith("experts."))
    for ep_rank in (0, 1):
        expert = torch.load(path / experts[ep_rank], weights_only=True)
        assert (expert["group_name"], expert["ep_size"], expert["ep_rank"]) == ("ep_size_2", 2, ep_rank)
        for key in ("experts.weight", "experts.bias"):
            assert torch.equal(expert["state"][key], saved[key][2 * ep_rank: 2 * ep_rank + 2])
    if stage == 0:
        optimizer = torch.load(path / "optimizer.pt", weights_only=True)
        assert sorted(optimizer["state"]) == [0, 1, 2, 3, 4, 5]  # the dense parameters only
        experts_optim = torch.load(path / rest[1], weights_only=True)
        assert sorted(experts_optim["state"]) == [6, 7]
        assert experts_optim["state"][6]["exp_avg"].shape == (2, 5, 7)
    layout = {"world_size": 4, "expert_groups": {"ep_size_2": 2}}
    assert torch.load(path / "engine.pt", weights_only=True)["expert_layout"] == layout


@pytest.mark.world_size(4)
def test_weights_load_into_another_stage(four_ranks):
    for stage, source in ((0, 2), (1, 0)):
        loaded = four_ranks[f"ckpt/weights/stage{stage}_from_stage{source}"]
        saved = four_ranks[f"ckpt/stage{source}/saved"]
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        assert "load_optimizer_states=False" in \
            four_ranks[f"ckpt/weights/stage{stage}_from_stage{source}/optimizer_error"]


@pytest.mark.world_size(4)
def test_another_layout_is_refused_naming_both(four_ranks, two_ranks):
    saved = "world size 4 with expert groups {ep_size_2: ep_size 2}"
    assert saved in four_ranks["ckpt/error/ep4"]
    assert "world size 4 with expert groups {ep_size_4: ep_size 4}" in four_ranks["ckpt/error/ep4"]
    assert saved in four_ranks["ckpt/error/dense"]
    assert "(no expert parameters)" in four_ranks["ckpt/error/dense"]
    assert saved in two_ranks["ckpt/error/world"]
    assert "world size 2 with expert groups {ep_size_2: ep_size 2}" in two_ranks["ckpt/error/world"]


@pytest.mark.world_size(4)
def test_single_file_exports_refuse_spread_experts(four_ranks, ckpt_root):
    assert "expert-parallel ranks" in four_ranks["16bit/error"]
    with pytest.raises(CheckpointError, match="holds expert parameters"):
        consolidated_state_dict(ckpt_root / "stage2")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_two_ranks_ep2_ends_where_ep1_ends(two_ranks, stage, ep_size):
    _assert_run_matches(two_ranks[f"accum_clip/stage{stage}/ep{ep_size}"],
                        two_ranks["accum_clip/stage0/ep1"])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_dslab_moe_layer_trains_the_same_at_ep2(two_ranks, stage):
    reference = two_ranks["real_moe/stage0/ep1"]
    experts = [k for k in reference["state"] if ".experts." in k]
    assert experts and all(not torch.equal(reference["state"][k], two_ranks["real_moe/initial"][k])
                           for k in experts)
    _assert_run_matches(two_ranks[f"real_moe/stage{stage}/ep2"], reference)


# -- one process --------------------------------------------------------------------------------


@pytest.fixture
def fresh_groups():
    reset_expert_groups()
    yield
    reset_expert_groups()


def test_stage3_with_experts_trains_as_stage0_in_one_process(fresh_groups):
    def losses(stage):
        reset_expert_groups()
        torch.manual_seed(0)
        cfg = base_config(train_micro_batch_size_per_gpu=4, zero_optimization={
            "stage": stage, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0})
        engine, _, _, _ = dslab.initialize(model=MoENet(1, expert_seed=1), config=cfg)
        x, y = make_data(12, dim=DIM, classes=CLASSES, seed=7)
        out = []
        for i in range(3):
            loss = engine(x[4 * i:4 * i + 4], y[4 * i:4 * i + 4])
            engine.backward(loss)
            engine.step()
            out.append(float(loss.detach()))
        engine.destroy()
        return out

    reference = losses(0)
    assert losses(3) == pytest.approx(reference, rel=1e-6) and reference[0] != reference[-1]


def test_split_param_groups(fresh_groups):
    model = MoENet(1)
    dense = [model.inp.weight, model.inp.bias, model.gate.weight, model.gate.bias,
             model.head.weight, model.head.bias]
    experts = [model.experts.weight, model.experts.bias]
    plain = split_param_groups(model.parameters())
    assert [(g.get("name"), g.get("moe", False)) for g in plain] == [(None, False), ("ep_size_1", True)]
    assert plain[0]["params"] == dense and plain[1]["params"] == experts
    options = split_param_groups([{"params": list(model.parameters()), "lr": 0.5}])
    assert [g["lr"] for g in options] == [0.5, 0.5]
    already = dense_and_expert_groups(model, "ep_size_1")
    assert split_param_groups(already) == already
    from dslab.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense_params"})
    assert split_param_groups(deepspeed) == list(deepspeed)
    tensors = [torch.nn.Parameter(torch.zeros(2))]
    assert split_param_groups(tensors) == tensors  # no experts: unchanged
    with pytest.raises(ValueError, match="param group 0 is marked 'moe': True and holds non-expert"):
        split_param_groups([{"params": dense, "moe": True}])


def test_one_process_trains_with_experts_and_clipping(fresh_groups):
    """No process group: the expert rules reduce to plain training (ep_size 1)."""
    results = []
    for stage in (0, 2):
        cfg = base_config(train_micro_batch_size_per_gpu=4, gradient_clipping=0.05,
                          zero_optimization={"stage": stage})
        torch.manual_seed(0)
        engine, _, _, _ = dslab.initialize(model=MoENet(1), config=cfg)
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 7, generator=g), torch.randint(0, 3, (4,), generator=g)))
            engine.step()
        results.append({k: v.clone() for k, v in engine.module_state_dict().items()})
        engine.destroy()
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, msg=key, **TOL)


@pytest.mark.parametrize("stage", [0, 2])
def test_one_process_checkpoint_round_trip_with_experts(fresh_groups, tmp_path, stage):
    def build(seed):
        torch.manual_seed(seed)
        cfg = base_config(train_micro_batch_size_per_gpu=4, zero_optimization={"stage": stage})
        return dslab.initialize(model=MoENet(1, expert_seed=seed + 1), config=cfg)[0]

    def step(engine, seed):
        g = torch.Generator().manual_seed(seed)
        loss = engine(torch.randn(4, 7, generator=g), torch.randint(0, 3, (4,), generator=g))
        engine.backward(loss)
        engine.step()
        return loss.detach()

    first = build(0)
    step(first, 1)
    first.save_checkpoint(tmp_path)
    expected = step(first, 2)
    resumed = build(5)
    resumed.load_checkpoint(tmp_path)
    assert torch.equal(step(resumed, 2), expected)
    assert (tmp_path / "global_step1" / (expert_model_file("ep_size_1", 0) + ".pt")).is_file()
    state, resumed_state = first.module_state_dict(), resumed.module_state_dict()
    assert all(torch.equal(state[k], resumed_state[k]) for k in state)
    first.destroy()
    resumed.destroy()
