"""A host tensor bound for a collective over a backend without a CPU path (nccl) is staged on the
current GPU (the pipeline module broadcasts its tied weights before the engine moves it to the
device); gloo, mixed backends and device tensors need no staging. Checked on a one-rank gloo group
with the backend name replaced: the decision is the comm layer's, not the backend's."""

import pytest
import torch
import torch.distributed as dist

from dslab import comm
from dslab.comm import collectives


@pytest.fixture
def one_rank_group(tmp_path):
    comm.init_distributed(dist_backend="gloo", init_method=f"file://{tmp_path / 'store'}",
                          rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_gloo_takes_host_tensors_as_they_are(one_rank_group):
    assert comm.staging_device(torch.zeros(3)) is None


@pytest.mark.parametrize("backend, staged", [("nccl", True), ("cpu:gloo,cuda:nccl", False), ("gloo", False)])
def test_a_backend_without_a_host_path_stages_on_the_current_gpu(one_rank_group, monkeypatch, backend, staged):
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    expected = torch.device("cuda", 1) if staged else None
    assert comm.staging_device(torch.zeros(3)) == expected


def test_a_device_tensor_or_no_process_group_needs_no_staging(monkeypatch):
    assert comm.staging_device(torch.zeros(3)) is None  # no process group
    meta = torch.empty(3, device="meta")
    monkeypatch.setattr(collectives, "is_initialized", lambda: True)
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    assert comm.staging_device(meta) is None
