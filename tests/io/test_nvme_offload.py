"""ZeRO's NVMe optimizer offload: on 2 gloo ranks it trains to exactly the parameters of CPU
offload at stages 1-3 and resumes bit for bit from a checkpoint written through the aio handle;
in one process, the sub-groups and swaps of the GPU test's run (on the CPU), the overlap switches
and the config's errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dslab
from dslab.engine.config import load_config

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "engine"))
from helpers import base_config  # noqa: E402
from nvme_worker import (ONE_PROCESS_CHUNKS, ONE_PROCESS_UNIT_NUMELS, build, chunk_units,  # noqa: E402
                         state, train, train_one_process)

from dslab.engine.zero.offload import plan_chunks  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvme")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "nvme_worker.py"), str(root / "out.pt"), str(root / "swap"), str(root / "ckpt")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(root / "out.pt", weights_only=False), root


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_trains_to_the_parameters_of_cpu_offload(two_ranks, stage):
    results, _ = two_ranks
    _assert_equal(results[f"stage{stage}/nvme"], results[f"stage{stage}/cpu"])
    chunks = results[f"stage{stage}/chunks"]
    # a sub-group per unit: the prefetch and the write-behind ran
    assert chunks == results[f"stage{stage}/units"] >= 2
    assert results[f"stage{stage}/files"] == [f"chunk{k:05d}.states" for k in range(chunks)]
    assert results[f"stage{stage}/placeholders"]  # between steps the states are on disk only
    assert results[f"stage{stage}/removed"]  # destroy() removed the swap directory
    ops = {op["kind"]: op for op in results[f"stage{stage}/io"]["operations"]}
    # AdamW: exp_avg and exp_avg_sq, 4 bytes each per shard element, 64-byte aligned per
    # tensor and padded to 4096 per sub-group; written every step, read from the second on
    elements = results[f"stage{stage}/shard_elements"]
    assert ops["swap_out"]["count"] == 3 * chunks and ops["swap_in"]["count"] == 2 * chunks
    assert ops["swap_out"]["bytes"] >= 3 * 8 * elements
    assert ops["swap_in"]["bytes"] * 3 == ops["swap_out"]["bytes"] * 2
    assert ops["swap_in"]["GBps"] > 0 and ops["swap_out"]["GBps"] > 0


@pytest.mark.world_size(2)
def test_a_checkpoint_written_through_the_handle_resumes_bit_for_bit(two_ranks):
    results, root = two_ranks
    _assert_equal(results["ckpt/resumed"], results["ckpt/uninterrupted"])
    written = [e for e in results["ckpt/io"]["events"] if e["kind"] == "checkpoint_write"]
    # rank 0's records: its shard, then the files only rank 0 writes
    assert sorted(Path(e["path"]).name for e in written) == [
        "client_state.pt", "engine.pt", "model.pt", "zero_shard_rank00000.pt"]
    tag = root / "ckpt" / "nvme"
    assert sorted(p.name for p in tag.iterdir()) == sorted(
        ["client_state.pt", "engine.pt", "manifest.json", "model.pt", "zero_shard_rank00000.pt",
         "zero_shard_rank00001.pt"])
    assert all(e["nbytes"] == (tag / Path(e["path"]).name).stat().st_size for e in written)


def _nvme(tmp_path, **extra):
    return {"device": "nvme", "nvme_path": str(tmp_path / "swap"), "buffer_count": 2, **extra}


def test_in_one_process_sub_groups_count_whole_shards_and_match_cpu_offload(tmp_path):
    # test_io_gpu.py's run on the CPU: world size 1, each unit's shard is the whole unit
    cpu = train_one_process({"device": "cpu"}, "cpu")
    cpu_chunks, expected = chunk_units(cpu), state(cpu)
    cpu.destroy()
    engine = train_one_process({"device": "nvme", "nvme_path": str(tmp_path / "swap")}, "cpu")
    units = engine.zero.units
    assert engine.world_size == 1
    assert [u.shard_numel for u in units] == [u.layout.numel for u in units] == ONE_PROCESS_UNIT_NUMELS
    assert chunk_units(engine) == cpu_chunks == ONE_PROCESS_CHUNKS
    # runs of whole units of at least sub_group_size shard elements: 200 takes 4 + 128 + 32 and
    # then all of fc1.weight, one sub-group
    assert [[u.index for u in c] for c in plan_chunks(units, 200)] == [[0, 1, 2, 3]]
    offload = engine.zero.offload
    assert sorted(p.name for p in offload.directory.iterdir()) == ["chunk00000.states",
                                                                  "chunk00001.states"]
    offload.flush()
    ops = {op["kind"]: op for op in engine.profiler_records()["io"]["operations"]}
    got = state(engine)
    engine.destroy()
    assert ops["swap_out"]["count"] == 3 * 2 and ops["swap_in"]["count"] == 2 * 2
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_without_pipelining_the_steps_are_the_same(tmp_path):
    expected = None
    for pipeline in (True, False):
        engine = build(2, _nvme(tmp_path, pipeline_read=pipeline, pipeline_write=pipeline))
        train(engine, 2)
        got = state(engine)
        engine.destroy()
        if expected is None:
            expected = got
        else:
            for key in expected:
                assert torch.equal(got[key], expected[key]), key


@pytest.mark.serial  # a timing: the step's wait against the read's own duration, on a quiet machine
def test_a_prefetched_read_is_waited_for_only_briefly(tmp_path):
    engine = build(1, _nvme(tmp_path, buffer_count=3))
    train(engine, 3)
    events = [e for e in engine.profiler_records()["io"]["events"] if e["kind"] == "swap_in"]
    engine.destroy()
    assert events and all(e["wait_s"] is not None and e["wait_s"] <= e["seconds"] + 1e-3
                          for e in events)
    assert {e["step"] for e in events} == {1, 2}


def test_nvme_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="'zero_optimization.offload_optimizer.nvme_path' is required"):
        load_config(base_config(zero_optimization={"stage": 1, "offload_optimizer": {"device": "nvme"}}))
    with pytest.raises(ValueError, match="offload_optimizer.device.*needs 'zero_optimization.stage' >= 1"):
        load_config(base_config(zero_optimization={"stage": 0, "offload_optimizer": _nvme(tmp_path)}))
    with pytest.raises(ValueError, match="buffer_count"):
        load_config(base_config(zero_optimization={"stage": 2, "offload_optimizer": _nvme(
            tmp_path, buffer_count=1)}))
    with pytest.raises(ValueError, match="unknown config key 'aio.queue_dept'; did you mean 'aio.queue_depth'"):
        load_config(base_config(aio={"queue_dept": 8}))
    with pytest.raises(ValueError, match="aio.block_size.*multiple of 4096"):
        load_config(base_config(aio={"block_size": 5000}))
    with pytest.raises(ValueError, match="GPUDirect Storage is not supported"):
        load_config(base_config(aio={"use_gds": True}))
    with pytest.raises(ValueError, match="disagrees"):
        load_config(base_config(aio={"thread_count": 2, "intra_op_parallelism": 4}))
    config = load_config(base_config(aio={"thread_count": 4, "single_submit": True}))
    assert config.aio.intra_op_parallelism == 4 and config.aio.single_submit
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ValueError, match="'zero_optimization.offload_optimizer.nvme_path' = .*file"):
        dslab.initialize(model=torch.nn.Linear(3, 3), config=base_config(
            zero_optimization={"stage": 1, "offload_optimizer": {"device": "nvme",
                                                                 "nvme_path": str(blocked)}}))

