"""3D parallelism through ``dslab.initialize``: GPT-2 split over tensor-parallel ranks (with and
without sequence parallelism), times data-parallel replicas with ZeRO-1, and tensor-parallel
pipeline stages, each trains as the unsplit model does (grid_worker.py on gloo processes: the
unsplit references in one process, the split runs in one launch per world size)."""

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

from shared_launch import shared_directory

HERE = Path(__file__).parent

# Every run, by name: (tp, pp, dp, options, micro, accum), 3 steps each. The unsplit references
# train in one process, the split runs in one launch per world size (grid_worker.py runs a
# launch's runs one after another); each launch runs once per session (shared_launch.py) and the
# tests read its runs' results.
REFERENCES = {
    "dense": (1, 1, 1, ("clip=0.3",), 4, 2),
    "unclipped": (1, 1, 1, (), 4, 2),
    "one_stage": (1, 1, 1, ("clip=0.3", "pipeline=1"), 4, 2),
}
ON_TWO = {
    "tp2": (2, 1, 1, ("clip=0.3",), 4, 2),
    "tp2_sp": (2, 1, 1, ("clip=0.3", "sp=1"), 4, 2),
}
ON_FOUR = {
    "tp2_dp2": (2, 1, 2, ("clip=0.3", "zero=1"), 2, 2),
    "tp2_pp2": (2, 2, 1, ("clip=0.3",), 4, 2),
}
STEPS = 3


def launch(out: Path, runs: dict[str, tuple], world: int) -> None:
    """Train ``runs`` in one launch of ``world`` processes (one plain process when 1), each into
    ``out/<name>``."""
    args = []
    for name, (tp, pp, dp, options, micro, accum) in runs.items():
        assert tp * pp * dp == world, name
        (out / name).mkdir()
        if args:
            args.append("+")
        args += [str(out / name), str(tp), str(pp), str(dp), str(STEPS), str(micro), str(accum), *options]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if world == 1:
        cmd = [sys.executable, str(HERE / "grid_worker.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               str(HERE / "grid_worker.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]


def results(tmp_path_factory, label: str, runs: dict[str, tuple], world: int) -> dict[str, list[dict]]:
    """Each run's rank results (one dict per rank), from the session's launch of ``runs``."""
    out = shared_directory(tmp_path_factory, f"grid-{label}", lambda out: launch(out, runs, world))
    return {name: [torch.load(out / name / f"rank{r}.pt", weights_only=True) for r in range(world)]
            for name in runs}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict]:
    return {name: ranks[0] for name, ranks in results(tmp_path_factory, "one", REFERENCES, 1).items()}


@pytest.fixture(scope="module")
def on_two(tmp_path_factory) -> dict[str, list[dict]]:
    return results(tmp_path_factory, "two", ON_TWO, 2)


@pytest.fixture(scope="module")
def on_four(tmp_path_factory) -> dict[str, list[dict]]:
    return results(tmp_path_factory, "four", ON_FOUR, 4)


def assert_trains_as(reference: dict, ranks: list[dict], rtol=2e-5, atol=2e-6):
    seen = set()
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=atol)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=rtol, atol=atol, msg=name)
            seen.add(name)
    assert seen == set(reference["params"])


@pytest.mark.world_size(2)
def test_tensor_parallel_engine_trains_as_the_dense_model(references, on_two):
    dense, unclipped = references["dense"], references["unclipped"]
    assert unclipped["losses"][1:] != dense["losses"][1:]  # the clipping is in play
    assert_trains_as(dense, on_two["tp2"])
    assert_trains_as(dense, on_two["tp2_sp"])


@pytest.mark.world_size(4)
def test_tensor_times_data_parallel_with_zero1_trains_as_the_dense_model(references, on_four):
    ranks = on_four["tp2_dp2"]
    assert sorted(r["coord"] for r in ranks) == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert_trains_as(references["dense"], ranks)


@pytest.mark.world_size(4)
def test_tensor_parallel_pipeline_stages_train_as_one_stage(references, on_four):
    assert_trains_as(references["one_stage"], on_four["tp2_pp2"])


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
