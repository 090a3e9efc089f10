"""bf16 weight copies at ZeRO stage 0 on several data-parallel ranks (dslab/engine/weight_copies.py,
dslab/engine/data_parallel.py): the copies' bf16 gradients are what the ranks average, and two
gloo ranks train as one process on the whole batch does, within bf16's rounding of the average."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def _run(tmp_path, nproc: int, weight_copies: bool):
    out = tmp_path / f"copies-{nproc}-{weight_copies}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(HERE / "copies_dp_worker.py")]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(nproc), str(HERE / "copies_dp_worker.py")]
    proc = subprocess.run(cmd + [str(out), "true" if weight_copies else "false"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.world_size(2)
def test_two_ranks_average_the_copies_bf16_gradients_and_train_as_one_process(tmp_path):
    single = _run(tmp_path, 1, True)
    double = _run(tmp_path, 2, True)
    fp32_double = _run(tmp_path, 2, False)
    assert single["copies"] and double["copies"] and not fp32_double["copies"]
    assert single["world"] == 1 and double["world"] == 2

    # The reducer is handed the copies: their gradients are bf16, bucketed apart from the fp32
    # parameters the model does not read through a copy (embeddings, norms), and a bucket closes
    # only when the next tensor of its dtype would overflow it (20,000 elements), not at each
    # change of dtype along the layers.
    dtypes = {dtype for dtype, _ in double["buckets"]}
    assert dtypes == {"torch.bfloat16", "torch.float32"}
    assert {dtype for dtype, _ in fp32_double["buckets"]} == {"torch.float32"}
    for dtype in dtypes:
        buckets = [numels for d, numels in double["buckets"] if d == dtype]
        for bucket, following in zip(buckets, buckets[1:]):
            assert sum(bucket) + following[0] > 20_000, (dtype, bucket, following)
    total = sum(sum(numels) for _, numels in fp32_double["buckets"])
    assert sum(sum(numels) for _, numels in double["buckets"]) == total

    # Same global batch: the first loss is the same forward; later ones differ by the bf16
    # rounding of the averaged gradients (and the order of the sums) only.
    assert double["losses"][0] == pytest.approx(single["losses"][0], rel=1e-5)
    torch.testing.assert_close(torch.tensor(double["losses"]), torch.tensor(single["losses"]), rtol=3e-3, atol=0)
    torch.testing.assert_close(torch.tensor(fp32_double["losses"]), torch.tensor(single["losses"]), rtol=3e-3, atol=0)
    assert double["losses"][-1] < double["losses"][0]  # it trains
    # Adam turns any difference in a near-zero gradient into up to lr per step, so the parameters
    # are compared in aggregate: the bf16 average lands as close to the one-process run as the
    # fp32 average of the same ranks does.
    def distance(run):
        return sum(float((run["params"][k].float() - v.float()).pow(2).sum()) for k, v in single["params"].items()) ** 0.5

    scale = sum(float(v.float().pow(2).sum()) for v in single["params"].values()) ** 0.5
    assert distance(fp32_double) < 1e-3 * scale
    assert distance(double) <= 1.25 * distance(fp32_double), (distance(double), distance(fp32_double))
