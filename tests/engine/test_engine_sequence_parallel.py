"""The engine's ``sequence_parallel_size`` (DeepSpeed-Ulysses) on 4 real gloo processes (torchrun,
sp_engine_worker.py): data 2 x sequence 2 trains a split GPT-2 to the losses and the parameters of
one process on the same global batch, at ZeRO stages 0 to 3, with layer checkpoints, gradient
accumulation and a binding clip; the data loader gives the ranks of a sequence group the same
samples; a checkpoint saved at stages 1 and 3 resumes the run in an engine built from other weights;
fp16 overflows skip the same steps on every rank at stages 2 and 3. A world the size does not divide, and a model built with another size or group, are
refused naming the key. In one process: the key's validation and its refusals."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dslab
from dslab.engine.config import load_config
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

HERE = Path(__file__).parent
CASES = ("stage0", "stage1_checkpoint_accum", "stage2_clip", "stage3_checkpoint")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("engine_sp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(HERE / "sp_engine_worker.py"), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", CASES)
def test_data2_x_sequence2_trains_like_one_process(ranks, case):
    """The worker asserts each micro-step's loss (rtol 1e-5) and the final parameters against the
    single-process run; here every rank must report the same run."""
    for result in ranks:
        run = result[case]
        assert run["engine_steps"] == 3
        assert run["losses"] == ranks[0][case]["losses"]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(run["reference_losses"]),
                                   rtol=1e-5, atol=1e-6)
        assert len(run["losses"]) == (6 if "accum" in case else 3)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_resumes_the_sequence_parallel_run(ranks, stage):
    """The worker asserts the resumed losses and parameters against the run that saved; here
    that the loading engine started from other weights, and every rank resumed the same run."""
    for result in ranks:
        run = result[f"checkpoint_stage{stage}"]
        assert run["started_elsewhere"]
        assert run["resumed"] == run["expected"] and len(run["resumed"]) == 2
        # the two ranks of a sequence-parallel group report the whole sequence's loss
        partner = ranks[result["rank"] ^ 1][f"checkpoint_stage{stage}"]
        assert run["expected"] == partner["expected"]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_overflows_skip_the_same_steps_on_every_rank(ranks, stage):
    """A loss scale of 2**20 overflows fp16 gradients in the first steps: every rank, whatever
    shard of the gradients it holds, skips the same steps, halves the scale alike, and ends with
    the same parameters, which trained once the scale came down."""
    runs = [result[f"fp16_stage{stage}"] for result in ranks]
    first = runs[0]
    assert 0 < first["skipped"] < len(first["losses"])
    assert first["scales"][0] < 2.0**20 and first["losses"][-1] < first["losses"][0] - 1.0
    for r, run in enumerate(runs):
        assert (run["skipped"], run["scales"], run["checksum"]) == (first["skipped"], first["scales"],
                                                                   first["checksum"]), r
        assert run["losses"] == runs[r ^ 1]["losses"]  # the sequence-parallel partner's whole-sequence loss


@pytest.mark.world_size(4)
def test_bad_sizes_and_models_are_refused_by_name(ranks):
    for result in ranks:
        r = result["rank"]
        assert result["world_not_divisible"] == ("config key 'sequence_parallel_size': sequence_parallel_size=3 does "
                                                 "not divide the world size 4: the world is data-parallel x "
                                                 "sequence-parallel ranks")
        assert result["model_size_differs"].startswith(
            "config key 'sequence_parallel_size' is 1 but the model (GPT2LMHeadModel) is built with "
            "config.sequence_parallel_size=2")
        pair, strided = [r - r % 2, r - r % 2 + 1], [r % 2, r % 2 + 2]
        assert (f"this rank's sequence-parallel group is ranks {pair}, but the model's sp_group holds ranks "
                f"{strided}") in result["model_group_differs"]


def test_key_is_validated_by_name():
    assert load_config({"train_batch_size": 2}).sequence_parallel_size == 1
    assert load_config({"train_batch_size": 2, "sequence_parallel_size": 4}).sequence_parallel_size == 4
    with pytest.raises(ValueError, match="config key 'sequence_parallel_size'"):
        load_config({"train_batch_size": 2, "sequence_parallel_size": 0})
    with pytest.raises(ValueError, match="did you mean 'sequence_parallel_size'"):
        load_config({"train_batch_size": 2, "sequence_parallel_sise": 2})


def test_one_process_refuses_a_split_and_a_split_model():
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="torch")
    with pytest.raises(ValueError, match="config key 'sequence_parallel_size': sequence_parallel_size=2 needs a "
                                         "process group"):
        dslab.initialize(model=model, config={**config, "sequence_parallel_size": 2})
    engine, *_ = dslab.initialize(model=model, config=config)
    assert (engine.sequence_parallel_group, engine.dp_world_size, engine.seq_dp_world_size) == (None, 1, 1)
    with pytest.raises(ValueError, match="heads=4 does not divide by sequence_parallel_size=3"):
        gpt2_tiny(sequence_parallel_size=3)
