"""Ulysses sequence parallelism in dslab's GPT-2 (``GPT2Config.sequence_parallel_size``) over 2
and 4 real gloo processes (torchrun, gpt2_sp_worker.py): the split model gives the unsplit model's
loss on every rank, its gradients summed over the group are the unsplit model's (positions
included), three SGD steps keep the losses equal (both kernel sets, with and without layer
checkpoints, over the world and over the size-2 groups of a 2 x 2 grid), and without labels each
rank gets its chunk of the logits; a group of the wrong size, a sequence or a world that does not
divide are refused by name. In one process: the config's checks, :func:`split_sequence` and the
groups of size 1."""

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.parallel.sequence import initialize_sequence_parallel, sequence_mean_loss, split_sequence
from dslab.sequence import split_sequence as reexported_split

HERE = Path(__file__).parent


@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.world_size(2)),
                                        pytest.param(4, marks=pytest.mark.world_size(4))])
def ranks(request, tmp_path_factory):
    nproc = request.param
    out_dir = tmp_path_factory.mktemp(f"gpt2_sp{nproc}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE / "gpt2_sp_worker.py"), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_split_model_trains_to_the_unsplit_losses_on_every_rank(ranks):
    world = len(ranks)
    for result in ranks:
        assert result["world"] == world
        for run in ("torch_world", "dslab_world"):
            assert len(result[run]["losses"]) == 3
            assert result[run]["losses"] == ranks[0][run]["losses"]  # every rank returns the same loss
        assert f"sequence_parallel_size={2 * world} but the default group (sp_group=None) has {world} ranks" \
            in result["wrong_size"]
        assert f"must divide by {world}" in result["indivisible_seq"]
        assert f"sequence_parallel_size=3 does not divide the world size {world}" in result["indivisible_world"]


def test_two_by_two_grid_groups_neighbours(ranks):
    """On 4 ranks, sequence_parallel_size 2: ranks {0, 1} and {2, 3} split sequences (DeepSpeed's
    layout), {0, 2} and {1, 3} are the data-parallel groups, and each pair trains as one model."""
    if len(ranks) != 4:
        pytest.skip("the 2 x 2 grid needs 4 ranks")
    for result in ranks:
        r = result["rank"]
        assert result["groups"] == {"rank": r % 2, "ranks": [r - r % 2, r - r % 2 + 1], "dp_rank": r // 2,
                                    "dp_size": 2, "dp_ranks": [r % 2, r % 2 + 2]}
        assert len(result["torch_pairs"]["losses"]) == 3


def test_config_checks_name_the_key():
    with pytest.raises(ValueError, match="heads=4 does not divide by sequence_parallel_size=3"):
        gpt2_tiny(sequence_parallel_size=3)
    with pytest.raises(ValueError, match="sequence_parallel_size must be a positive int"):
        gpt2_tiny(sequence_parallel_size=0)
    with pytest.raises(ValueError, match="sequence_parallel_size=2 with tp_size=2"):
        gpt2_tiny(sequence_parallel_size=2, tp_size=2)
    with pytest.raises(ValueError, match="no process group is initialised"):
        GPT2LMHeadModel(gpt2_tiny(sequence_parallel_size=2), kernels="torch")
    with pytest.raises(ValueError, match="sequence_parallel_size=2 needs a process group"):
        initialize_sequence_parallel(2)
    with pytest.raises(ValueError, match="sequence_parallel_size must be a positive int"):
        initialize_sequence_parallel(0)
    one = initialize_sequence_parallel(1)
    assert (one.size, one.rank, one.group, one.data_parallel_size, one.ranks()) == (1, 0, None, 1, [0])


def test_split_sequence_takes_each_ranks_chunk_of_a_nested_batch():
    Pair = namedtuple("Pair", "ids mask")
    ids = torch.arange(24).view(2, 12)
    batch = {"input_ids": ids, "extra": [Pair(ids + 100, ids > 5)], "name": "kept"}
    chunks = [split_sequence(batch, r, 3) for r in range(3)]
    for r, chunk in enumerate(chunks):
        assert torch.equal(chunk["input_ids"], ids[:, 4 * r:4 * r + 4])
        assert isinstance(chunk["extra"][0], Pair)
        assert torch.equal(chunk["extra"][0].ids, ids[:, 4 * r:4 * r + 4] + 100)
        assert torch.equal(chunk["extra"][0].mask, ids[:, 4 * r:4 * r + 4] > 5)
        assert chunk["name"] == "kept"
    assert torch.equal(torch.cat([c["input_ids"] for c in chunks], dim=1), ids)
    assert torch.equal(split_sequence(ids.T, 1, 2, dim=0), ids.T[6:])
    assert reexported_split is split_sequence
    with pytest.raises(ValueError, match=r"batch\['extra'\]\[0\]\[0\] has sequence length 12 \(dim 1\), which does "
                                         "not divide by the sequence-parallel size 5"):
        split_sequence({"extra": [(ids,)]}, 0, 5)
    with pytest.raises(ValueError, match="no dim 1"):
        split_sequence({"lengths": torch.tensor([3, 4])}, 0, 2)
    with pytest.raises(ValueError, match="sp_rank=2 is not a rank"):
        split_sequence(ids, 2, 2)


def test_sequence_mean_loss_alone_is_the_chunk_mean():
    """In one process (a group of one) the whole sequence is the chunk: the mean comes back."""
    loss = torch.tensor(2.5, requires_grad=True)
    targets = torch.tensor([[1, -100, 3]])
    out = sequence_mean_loss(loss, targets)
    torch.testing.assert_close(out, loss)
    out.backward()
    torch.testing.assert_close(loss.grad, torch.tensor(1.0))
