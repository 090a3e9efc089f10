"""DeepSpeed-Ulysses sequence-parallel attention (dslab.parallel.sequence, dslab.sequence.layer).

Over 2 and 4 real gloo processes (torchrun, sequence_attention_worker.py), ``DistributedAttention``
on each rank's sequence chunk is held against attention over the whole sequence in float64: each
rank's output and q, k, v gradients equal its chunk of the reference's, in both layouts, fp32 and
fp64, causal and not, with grouped-query k/v, dslab's attention kernel, sub-groups and groups of
one rank; one forward and one backward each issue four all-to-alls through ``dslab.comm``. In one
process (no group): the identity wrapper and the refusals by name.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dslab import comm
from dslab.parallel.sequence import DistributedAttention, seq_all_to_all
from dslab.sequence.layer import DistributedAttention as DeepSpeedName

HERE = Path(__file__).parent

CHECKS = [
    "matches_whole_sequence_attention", "grouped_query_kv_heads", "dslab_attention_kernel_as_local_attention",
    "groups_of_one_rank_issue_nothing", "indivisible_heads_are_refused_by_name",
]


@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.world_size(2)),
                                        pytest.param(4, marks=pytest.mark.world_size(4))])
def ranks(request, tmp_path_factory):
    nproc = request.param
    out_dir = tmp_path_factory.mktemp(f"ulysses{nproc}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE / "sequence_attention_worker.py"), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_every_rank_passes_every_check(ranks):
    world = len(ranks)
    expected = list(CHECKS)
    if world == 4:
        expected.insert(4, "two_sub_groups_of_two")
    for result in ranks:
        assert result["world"] == world
        assert result["passed"] == expected, f"rank {result['rank']}"


def test_two_all_to_alls_each_way_are_observed_q_k_v_packed_in_one(ranks):
    world = len(ranks)
    for result in ranks:
        numel = result["numel"]
        # forward: q, k and v packed, then the output; backward: the output's gradient, then q's,
        # k's and v's packed
        for phase, sizes in (("forward_calls", [3 * numel, numel]), ("backward_calls", [numel, 3 * numel])):
            calls = result[phase]
            assert [c["op"] for c in calls] == ["all_to_all"] * 2, (phase, calls)
            assert [c["numel"] for c in calls] == sizes, (phase, calls)
            assert all(c["group_size"] == world for c in calls), (phase, calls)
            assert all(c["dtype"] == "torch.float32" for c in calls), (phase, calls)


def sdpa_seq_first(q, k, v, causal=False):
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=causal)
    return out.permute(2, 0, 1, 3)


class Recorder:
    def __init__(self):
        self.ops = []

    def before(self, call):
        self.ops.append(call.op)

    def after(self, call, work):
        pass


def test_one_process_is_the_identity_wrapper():
    assert DeepSpeedName is DistributedAttention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    recorder = Recorder()
    comm.add_observer(recorder)
    try:
        out = DistributedAttention(sdpa_seq_first, None)(q, k, v, causal=True)
        out.sum().backward()
    finally:
        comm.remove_observer(recorder)
    torch.testing.assert_close(out, sdpa_seq_first(q, k, v, causal=True), rtol=0, atol=0)
    assert recorder.ops == []
    x = torch.randn(3, 4)
    assert seq_all_to_all(x, 1, 0) is x


def test_unsupported_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match=r"scatter_idx=1"):
        DistributedAttention(sdpa_seq_first, None, scatter_idx=1, gather_idx=0)
    with pytest.raises(ValueError, match=r"gather_idx=3"):
        DistributedAttention(sdpa_seq_first, None, scatter_idx=2, gather_idx=3)
    with pytest.raises(ValueError, match=r"gather_idx=2"):
        DistributedAttention(sdpa_seq_first, None, scatter_idx=2, gather_idx=2)
    with pytest.raises(ValueError, match=r"local_attention must be callable"):
        DistributedAttention(None, None)


def test_mismatched_shapes_are_refused_by_name():
    seq_first = DistributedAttention(sdpa_seq_first, None)
    batch_first = DistributedAttention(sdpa_seq_first, None, gather_idx=1)
    q = torch.randn(7, 2, 3, 5)
    with pytest.raises(ValueError, match=r"query must be a 4-d tensor"):
        seq_first(q[0], q, q)
    with pytest.raises(ValueError, match=r"value must be a 4-d tensor"):
        seq_first(q, q, None)
    with pytest.raises(ValueError, match=r"key's sequence length 6 \(dim 0\) differs from query's 7"):
        seq_first(q, q[:6], q)
    with pytest.raises(ValueError, match=r"value's batch size 1 \(dim 1\) differs from query's 2"):
        seq_first(q, q, q[:, :1])
    with pytest.raises(ValueError, match=r"key's sequence length 1 \(dim 1\) differs from query's 2"):
        batch_first(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match=r"key has 3 heads and value 1"):
        seq_first(q, q, q[:, :, :1])
    with pytest.raises(ValueError, match=r"key has 2 heads, which do not divide the query's 3"):
        seq_first(q, q[:, :, :2], q[:, :, :2])
