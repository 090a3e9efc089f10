"""Checkpoints of model-parallel engines (dslab/engine/model_parallel_checkpoint.py): GPT-2 at
TP2 x DP2 with ZeRO-1 and ZeRO-2 (plain engine), PP2 x DP2 with ZeRO-1 and TP2 x PP2 (pipeline engine) save
per coordinate, resume in a fresh launch to the uninterrupted run's losses bit for bit, and refuse
by name to load at another layout (mp_checkpoint_worker.py on gloo processes: one 4-rank launch
saves, one 4-rank launch resumes and tries PP4 and ZeRO 0, one 2-rank launch tries PP2 x DP1); a
one-stage pipeline resumes in one process and refuses another layer list."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dslab
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.gpt2_pipe import gpt2_pipeline_module

from shared_launch import shared_directory

HERE = Path(__file__).parent
CASES = ("tp2_dp2_zero1", "tp2_dp2_zero2", "pp2_dp2_zero1", "tp2_pp2")
STEPS = 2  # mp_checkpoint_worker.STEPS
PHASES = (("save", 4), ("resume", 4), ("refuse", 2))  # mp_checkpoint_worker.py's phases, in order, and their ranks


def launch(out: Path, phase: str, world: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(HERE / "mp_checkpoint_worker.py"), str(out), phase]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]


def launch_phases(out: Path) -> None:
    for phase, world in PHASES:
        launch(out, phase, world)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three launches, once per session: the tests of this module may run on both of
    pytest-xdist's workers, which then read one set of checkpoints (shared_launch.py)."""
    out = shared_directory(tmp_path_factory, "mp-checkpoints", launch_phases)
    saved, resumed, refused = ([torch.load(out / f"{phase}_rank{r}.pt", weights_only=True) for r in range(world)]
                               for phase, world in PHASES)
    return out, saved, resumed, refused


def layout_text(tp, pp, dp, world, zero, parts=None):
    text = f"tp {tp} x pp {pp} x dp {dp} (world {world}), ZeRO stage {zero}"
    return text if parts is None else text + f", pipeline of 7 layers cut at {parts}"


@pytest.mark.world_size(4)
def test_resumed_runs_give_the_uninterrupted_losses_exactly(runs):
    _, saved, resumed, _ = runs
    for case in CASES:
        for rank, (first, second) in enumerate(zip(saved, resumed)):
            assert second[case]["after"] == first[case]["after"], (case, rank)
            assert second[case]["client"] == {"case": case, "steps": STEPS}
            assert second[case]["global_steps"] == STEPS
            assert second[case]["path"] == first[case]["path"]
        assert saved[0][case]["after"] != saved[0][case]["before"]
    # the weights alone, at ZeRO 0 from a ZeRO-1 checkpoint and into a ZeRO-1 engine: the first
    # loss after the load is computed before any update, so it is the uninterrupted run's
    for rank in range(4):
        assert resumed[rank]["weights_at_zero0"]["after"] == saved[rank]["pp2_dp2_zero1"]["after"][:1]
        assert resumed[rank]["weights_tp2_dp2_zero1"]["after"] == saved[rank]["tp2_dp2_zero1"]["after"][:1]


@pytest.mark.world_size(4)
def test_checkpoint_files_per_coordinate_and_the_recorded_layout(runs):
    out, _, _, _ = runs
    shared = {"engine.pt", "scheduler.pt", "client_state.pt", "manifest.json"}
    expected = {
        "tp2_dp2_zero1": {f"mp_rank_{t:02d}_pp_00_model_states.pt" for t in range(2)}
        | {f"zero_dp_rank_{d:02d}_mp_rank_{t:02d}_pp_00_optim_states.pt" for d in range(2) for t in range(2)},
        "pp2_dp2_zero1": {f"mp_rank_00_pp_{p:02d}_model_states.pt" for p in range(2)}
        | {f"zero_dp_rank_{d:02d}_mp_rank_00_pp_{p:02d}_optim_states.pt" for d in range(2) for p in range(2)},
        "tp2_pp2": {f"mp_rank_{t:02d}_pp_{p:02d}_{kind}_states.pt" for t in range(2) for p in range(2)
                    for kind in ("model", "optim")},
    }
    layouts = {
        "tp2_dp2_zero1": {"world_size": 4, "tensor_parallel": 2, "pipeline_parallel": 1, "data_parallel": 2,
                          "zero_stage": 1, "pipeline": None},
        "pp2_dp2_zero1": {"world_size": 4, "tensor_parallel": 1, "pipeline_parallel": 2, "data_parallel": 2,
                          "zero_stage": 1, "pipeline": {"num_layers": 7, "parts": [0, 3, 7]}},
        "tp2_pp2": {"world_size": 4, "tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel": 1,
                    "zero_stage": 0, "pipeline": {"num_layers": 7, "parts": [0, 3, 7]}},
    }
    for case in expected:
        root = out / case
        assert (root / "latest").read_text() == f"global_step{STEPS}"
        ckpt = root / f"global_step{STEPS}"
        assert {f.name for f in ckpt.iterdir()} == shared | expected[case], case
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["metadata"]["model_parallel_layout"] == layouts[case]
        assert set(manifest["files"]) == {n.removesuffix(".pt") for n in expected[case] | shared} - {"manifest.json"}
        engine = torch.load(ckpt / "engine.pt", weights_only=True)
        assert engine["model_parallel_layout"] == layouts[case] and len(engine["rng"]) == 4
    # the tied embedding is saved by its owner (stage 0) only; the last stage's copy is not state
    for case, tp in (("pp2_dp2_zero1", 1), ("tp2_pp2", 2)):
        for t in range(tp):
            first = torch.load(out / case / f"global_step{STEPS}" / f"mp_rank_{t:02d}_pp_00_model_states.pt",
                               weights_only=True)
            last = torch.load(out / case / f"global_step{STEPS}" / f"mp_rank_{t:02d}_pp_01_model_states.pt",
                              weights_only=True)
            assert {"tied_modules.embed.wte.weight", "tied_modules.embed.wpe.weight"} <= set(first)
            assert not any(k.startswith("tied_modules.") for k in last)
            assert {k.split(".")[0] for k in first} == {"tied_modules", "1", "2"}
            assert {k.split(".")[0] for k in last} == {"3", "4", "5"}
    # tensor-parallel ranks hold different shards of the same keys
    shards = [torch.load(out / "tp2_dp2_zero1" / f"global_step{STEPS}" / f"mp_rank_{t:02d}_pp_00_model_states.pt",
                         weights_only=True) for t in range(2)]
    assert set(shards[0]) == set(shards[1])
    assert any(not torch.equal(shards[0][k], shards[1][k]) for k in shards[0])


@pytest.mark.world_size(4)
def test_another_layout_is_refused_naming_both(runs):
    out, _, resumed, refused = runs
    path = str(out / "pp2_dp2_zero1" / f"global_step{STEPS}")
    saved = layout_text(1, 2, 2, 4, 1, [0, 3, 7])
    for result, current in ((resumed[0]["at_pp4"], layout_text(1, 4, 1, 4, 1, [0, 2, 3, 4, 7])),
                            (refused[0]["at_pp2_dp1"], layout_text(1, 2, 1, 2, 1, [0, 3, 7])),
                            (resumed[0]["at_zero0"], layout_text(1, 2, 2, 4, 0, [0, 3, 7]))):
        assert result["type"] == "ModelParallelLayoutError" and result["is_value_error"]
        assert path in result["message"]
        assert f"saved at layout ({saved})" in result["message"]
        assert f"this engine runs ({current})" in result["message"]
    assert "load_optimizer_states=False" in resumed[0]["at_zero0"]["message"]
    dp_into_tp = refused[1]["dp_checkpoint_at_tp2"]
    assert dp_into_tp["is_value_error"]
    assert "no model parallelism: data parallel over 2 ranks" in dp_into_tp["message"]
    assert layout_text(2, 1, 1, 2, 0) in dp_into_tp["message"]


@pytest.mark.world_size(4)
def test_an_engine_without_model_parallelism_refuses_a_model_parallel_checkpoint(runs):
    out, _, _, _ = runs
    engine, _, _, _ = dslab.initialize(
        model=GPT2LMHeadModel(gpt2_tiny(dropout=0.0, layers=4, vocab_size=64, n_positions=16), "torch"),
        config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    with pytest.raises(ValueError, match=r"saved at layout \(tp 2 x pp 1 x dp 2 \(world 4\), ZeRO stage 1\) "
                                         r"and this engine runs no model parallelism"):
        engine.load_checkpoint(out / "tp2_dp2_zero1")


def test_one_stage_pipeline_resumes_in_one_process_and_refuses_another_layer_list(tmp_path):
    def build(seed: int, layers: int = 2):
        torch.manual_seed(seed)
        cfg = gpt2_tiny(dropout=0.0, layers=layers, vocab_size=64, n_positions=16)
        engine, _, _, _ = dslab.initialize(
            model=gpt2_pipeline_module(cfg, "torch", num_stages=1, base_seed=seed),
            config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
        return engine

    def train(engine, steps):
        out = []
        for step in steps:
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 64, (4, 16), generator=g)
            out.append(float(engine.train_batch(iter([(ids[:2], ids[:2]), (ids[2:], ids[2:])]))))
        return out

    first = build(0)
    train(first, range(2))
    first.save_checkpoint(tmp_path, client_state={"k": 1})
    assert sorted(f.name for f in (tmp_path / "global_step2").iterdir()) == [
        "client_state.pt", "engine.pt", "manifest.json", "mp_rank_00_pp_00_model_states.pt",
        "mp_rank_00_pp_00_optim_states.pt"]
    expected = train(first, range(2, 4))
    resumed = build(7)
    assert resumed.load_checkpoint(tmp_path) == (tmp_path / "global_step2", {"k": 1})
    assert train(resumed, range(2, 4)) == expected
    with pytest.raises(ValueError, match=r"pipeline of 5 layers cut at \[0, 5\]\) and this engine runs "
                                         r"\(.*pipeline of 6 layers cut at \[0, 6\]\)"):
        build(0, layers=3).load_checkpoint(tmp_path)
