"""Ulysses sequence parallelism in dslab's Llama (``LlamaConfig.sequence_parallel_size``) over 2
and 4 real gloo processes (torchrun, llama_sp_worker.py): the split model gives the unsplit model's
loss on every rank, its gradients summed over the ranks are the unsplit model's, three SGD steps
keep the losses equal (both kernel sets), and without labels each rank gets its chunk of the
logits; a group of the wrong size and a sequence that does not divide are refused by name. In one
process: the config's checks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslab.models.llama import LlamaForCausalLM, llama_tiny

HERE = Path(__file__).parent


@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.world_size(2)),
                                        pytest.param(4, marks=pytest.mark.world_size(4))])
def ranks(request, tmp_path_factory):
    nproc = request.param
    out_dir = tmp_path_factory.mktemp(f"llama_sp{nproc}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE / "llama_sp_worker.py"), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_split_model_trains_to_the_unsplit_losses_on_every_rank(ranks):
    world = len(ranks)
    for result in ranks:
        assert result["world"] == world
        for kernels in ("torch", "dslab"):
            assert len(result[kernels]["losses"]) == 3
            assert result[kernels]["losses"] == ranks[0][kernels]["losses"]  # every rank returns the same loss
        assert f"sequence_parallel_size={2 * world} but the default group (sp_group=None) has {world} ranks" \
            in result["wrong_size"]
        assert f"must divide by {world}" in result["indivisible_seq"]


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match="heads=4 does not divide by sequence_parallel_size=3"):
        llama_tiny(sequence_parallel_size=3)
    with pytest.raises(ValueError, match="sequence_parallel_size must be a positive int"):
        llama_tiny(sequence_parallel_size=0)
    with pytest.raises(ValueError, match="no process group is initialised"):
        LlamaForCausalLM(llama_tiny(sequence_parallel_size=2), kernels="torch")
