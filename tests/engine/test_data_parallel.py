"""A real 2-process gloo run (torchrun) ends where one process on the full batch ends."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def run_worker(tmp_path, nproc, steps, micro, accum):
    out = tmp_path / f"result-{nproc}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, str(HERE / "dp_worker.py")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(nproc), str(HERE / "dp_worker.py")]
    proc = subprocess.run(cmd + [str(out), str(steps), str(micro), str(accum)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.world_size(2)
def test_two_gloo_ranks_match_one_process_on_full_batch(tmp_path):
    single = run_worker(tmp_path, 1, steps=4, micro=16, accum=1)
    double = run_worker(tmp_path, 2, steps=4, micro=4, accum=2)
    assert single["world"] == 1 and double["world"] == 2
    for key, value in single["params"].items():
        torch.testing.assert_close(double["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    # buckets of <= 100 elements split TinyNet's four tensors into four all-reduces per optimizer
    # step, and nothing is reduced off the accumulation boundary
    assert len(double["all_reduces"]) == 4 * 4
    total = sum(p.numel() for p in single["params"].values())
    assert sum(double["all_reduces"]) == 4 * total
    # the engine's comms logger (comms_logger.enabled) saw every gradient bucket, by size in bytes
    sizes = sorted(4 * n for n in set(double["all_reduces"]))
    assert sorted(int(s) for s in double["logged_all_reduces"]) == sizes
    assert sum(double["logged_all_reduces"].values()) == 16


def test_pack_gradients_concatenates_and_zero_fills():
    from dslab.engine.data_parallel import pack_gradients

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4)),
              torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p)
    flat = torch.full((17,), float("nan"))
    pack_gradients(params, flat)
    expected = torch.cat([p.grad.reshape(-1) for p in params] + [torch.zeros(2)])
    assert torch.equal(flat, expected)
    params[1].grad = None  # a parameter without a gradient contributes zeros
    flat.fill_(float("nan"))
    pack_gradients(params, flat, release=True)
    assert torch.equal(flat[6:10], torch.zeros(4)) and torch.equal(flat[:6], expected[:6])
    assert torch.equal(flat[10:15], expected[10:15]) and torch.equal(flat[15:], torch.zeros(2))
    assert all(p.grad is None for p in params)


def test_averaging_op_is_none_without_a_group_and_on_gloo(tmp_path):
    import torch.distributed as dist

    from dslab import comm

    assert comm.averaging_op() is None
    comm.init_distributed(dist_backend="gloo", init_method=f"file://{tmp_path / 'store'}",
                          rank=0, world_size=1)
    try:
        assert comm.averaging_op() is None  # gloo has no AVG: callers divide first
    finally:
        dist.destroy_process_group()


def test_pack_gradients_leaves_a_gradient_that_already_is_its_slot():
    from dslab.engine.data_parallel import pack_gradients

    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    flat = torch.full((8,), float("nan"))
    flat[:3] = torch.tensor([1.0, 2.0, 3.0])
    params[0].grad = flat[:3]  # the view a finished reduction left as .grad, accumulated into in place
    params[1].grad = torch.randn(2, 2)
    pack_gradients(params, flat)
    assert params[0].grad.data_ptr() == flat.data_ptr()
    assert torch.equal(flat, torch.cat([torch.tensor([1.0, 2.0, 3.0]), params[1].grad.reshape(-1), torch.zeros(1)]))
