"""3D parallelism through ``dslab.initialize``: GPT-2 split over tensor-parallel ranks (with and
without sequence parallelism), times data-parallel replicas with ZeRO-1, and tensor-parallel
pipeline stages, each trains as the unsplit model does (grid_worker.py on gloo processes)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dslab
from dslab.engine.model_parallel import ModelParallelLayout
from dslab.engine.config import load_config
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

HERE = Path(__file__).parent


def run(tmp_path, tp: int, pp: int, dp: int, *options, micro: int = 4, accum: int = 2) -> list[dict]:
    out = tmp_path / f"tp{tp}-pp{pp}-dp{dp}-{'-'.join(options) or 'plain'}".replace("=", "")
    out.mkdir()
    world = tp * pp * dp
    args = [str(out), str(tp), str(pp), str(dp), "3", str(micro), str(accum), *options]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if world == 1:
        cmd = [sys.executable, str(HERE / "grid_worker.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               str(HERE / "grid_worker.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


def assert_trains_as(reference: dict, ranks: list[dict], rtol=2e-5, atol=2e-6):
    seen = set()
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=atol)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=rtol, atol=atol, msg=name)
            seen.add(name)
    assert seen == set(reference["params"])


@pytest.mark.world_size(2)
def test_tensor_parallel_engine_trains_as_the_dense_model(tmp_path):
    dense = run(tmp_path, 1, 1, 1, "clip=0.3")[0]
    unclipped = run(tmp_path, 1, 1, 1)[0]
    assert unclipped["losses"][1:] != dense["losses"][1:]  # the clipping is in play
    assert_trains_as(dense, run(tmp_path, 2, 1, 1, "clip=0.3"))
    assert_trains_as(dense, run(tmp_path, 2, 1, 1, "clip=0.3", "sp=1"))


@pytest.mark.world_size(4)
def test_tensor_times_data_parallel_with_zero1_trains_as_the_dense_model(tmp_path):
    dense = run(tmp_path, 1, 1, 1, "clip=0.3", micro=4)[0]
    ranks = run(tmp_path, 2, 1, 2, "clip=0.3", "zero=1", micro=2)
    assert sorted(r["coord"] for r in ranks) == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert_trains_as(dense, ranks)


@pytest.mark.world_size(4)
def test_tensor_parallel_pipeline_stages_train_as_one_stage(tmp_path):
    one = run(tmp_path, 1, 1, 1, "clip=0.3", "pipeline=1")[0]
    ranks = run(tmp_path, 2, 2, 1, "clip=0.3")
    assert_trains_as(one, ranks)


class PartialMpu:
    def get_data_parallel_group(self):
        return None


class TooBigMpu(PartialMpu):
    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_group(self):
        return None

    def get_model_parallel_world_size(self):
        return 2

    def get_model_parallel_rank(self):
        return 0


def test_mpu_is_checked_by_name():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1})
    with pytest.raises(ValueError, match="lacks get_data_parallel_world_size"):
        ModelParallelLayout(PartialMpu(), cfg)
    with pytest.raises(ValueError, match=r"model-parallel size 2 x pipeline size 1 != world size 1"):
        ModelParallelLayout(TooBigMpu(), cfg)
    with pytest.raises(ValueError, match="tp_size=2 needs a process group"):
        GPT2LMHeadModel(gpt2_tiny(tp_size=2), "torch")
    engine, _, _, _ = dslab.initialize(model=GPT2LMHeadModel(gpt2_tiny(), "torch"), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.dp_world_size == 1 and not engine.parallel.model_parallel
