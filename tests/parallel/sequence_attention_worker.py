"""One rank of the sequence-parallel attention tests, started by torchrun (see
test_sequence_attention.py):

    sequence_attention_worker.py OUT_DIR

Every rank draws the same whole q, k, v and output gradient from shared seeds, computes attention
over the whole sequence in float64 (the reference), and runs ``DistributedAttention`` on its own
sequence chunk: its output and the gradients of its q, k, v chunks must equal its chunk of the
reference's. Both layouts, fp32 and fp64, causal and not, grouped-query k/v, dslab's attention
kernel as the local attention, sub-groups of the world, groups of one rank, and the refusals of
indivisible head counts. A failed check raises, and the process exits non-zero. Each rank writes
``rank<r>.json``: the checks it passed and the collectives one forward and one backward issued
through ``dslab.comm``.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from dslab import comm
from dslab.kernels.attention.attention import attention
from dslab.parallel.sequence import DistributedAttention, seq_all_to_all

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}
S_LOCAL, BATCH, HEAD_DIM = 3, 2, 5

passed: list[str] = []


def check(fn):
    """Run ``fn`` now, as one named check."""
    fn()
    passed.append(fn.__name__)
    return fn


def sdpa(seq_dim):
    """SDPA on ``[s, b, h, d]`` (``seq_dim`` 0) or ``[b, s, h, d]`` (1) tensors, kv heads a divisor."""
    def to_bhsd(t):
        return t.permute(1, 2, 0, 3) if seq_dim == 0 else t.transpose(1, 2)

    def local(q, k, v, causal=False):
        out = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), is_causal=causal,
                                             enable_gqa=k.shape[2] != q.shape[2])
        return out.permute(2, 0, 1, 3) if seq_dim == 0 else out.transpose(1, 2)
    return local


def draw(seed, seq, heads, kv_heads, seq_dim, head_dim=HEAD_DIM):
    """Whole float64 q, k, v and output gradient in the layout whose sequence dim is ``seq_dim``."""
    g = torch.Generator().manual_seed(seed)

    def one(h):
        shape = [BATCH, h, head_dim]
        shape.insert(seq_dim, seq)
        return torch.randn(shape, generator=g, dtype=torch.float64)
    return one(heads), one(kv_heads), one(kv_heads), one(heads)


def compare(local, seed, seq_dim, dtype, causal, group=None, heads=None, kv_heads=None, head_dim=HEAD_DIM):
    """DistributedAttention(local) over ``group`` against ``local`` on the whole sequence in float64:
    output and q, k, v gradients, this rank's sequence chunk of each."""
    size, rank = comm.get_world_size(group), comm.get_rank(group)
    heads = heads or 3 * size
    kv_heads = kv_heads or heads
    q, k, v, grad = draw(seed, S_LOCAL * size, heads, kv_heads, seq_dim, head_dim)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = local(*whole, causal=causal)
    ref.backward(grad)

    def mine(t):
        return t.chunk(size, seq_dim)[rank]

    parts = [mine(t).to(dtype).requires_grad_() for t in (q, k, v)]
    layer = DistributedAttention(local, group, scatter_idx=2, gather_idx=seq_dim)
    out = layer(*parts, causal=causal)
    out.backward(mine(grad).to(dtype))
    what = f"seq_dim={seq_dim} {dtype} causal={causal} group size {size}"
    torch.testing.assert_close(out, mine(ref).to(dtype), **TOL[dtype], msg=lambda m: f"{what} output: {m}")
    for name, part, ref_t in zip("qkv", parts, whole):
        torch.testing.assert_close(part.grad, mine(ref_t.grad).to(dtype), **TOL[dtype],
                                   msg=lambda m: f"{what} d{name}: {m}")


def refused(fn, *words):
    """``fn()`` raises a ValueError whose message holds every one of ``words``."""
    try:
        fn()
    except ValueError as e:
        missing = [w for w in words if w not in str(e)]
        assert not missing, f"{e!r} does not name {missing}"
    else:
        raise AssertionError(f"accepted; expected a ValueError naming {words}")


class Recorder:
    def __init__(self):
        self.calls = []

    def before(self, call):
        self.calls.append({"op": call.op, "numel": call.numel, "group_size": call.group_size,
                           "dtype": str(call.dtype)})

    def after(self, call, work):
        pass


def main(out_dir: Path) -> None:
    comm.init_distributed(dist_backend="gloo")
    rank, world = comm.get_rank(), comm.get_world_size()
    results = {"rank": rank, "world": world}

    @check
    def matches_whole_sequence_attention():
        seed = 100
        for seq_dim in (0, 1):
            for dtype in (torch.float32, torch.float64):
                for causal in (False, True):
                    seed += 1
                    compare(sdpa(seq_dim), seed, seq_dim, dtype, causal)

    @check
    def grouped_query_kv_heads():
        # one kv head (fewer than the ranks: repeated) and one per rank (split as they are)
        compare(sdpa(0), 200, 0, torch.float64, True, heads=2 * world, kv_heads=1)
        compare(sdpa(1), 201, 1, torch.float64, False, heads=2 * world, kv_heads=world)

    @check
    def dslab_attention_kernel_as_local_attention():
        def local(q, k, v, causal=False):
            out = attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), causal=causal)
            return out.permute(2, 0, 1, 3)
        compare(local, 300, 0, torch.float32, True, heads=world, head_dim=32)

    @check
    def groups_of_one_rank_issue_nothing():
        singles = [comm.new_group([r]) for r in range(world)]
        recorder = Recorder()
        comm.add_observer(recorder)
        try:
            compare(sdpa(0), 400 + rank, 0, torch.float64, True, group=singles[rank])
        finally:
            comm.remove_observer(recorder)
        assert recorder.calls == [], recorder.calls

    if world == 4:
        @check
        def two_sub_groups_of_two():
            pairs = [comm.new_group([0, 1]), comm.new_group([2, 3])]
            compare(sdpa(1), 500 + rank // 2, 1, torch.float32, True, group=pairs[rank // 2])

    @check
    def indivisible_heads_are_refused_by_name():
        layer = DistributedAttention(sdpa(0))
        x = torch.randn(S_LOCAL, BATCH, 2 * world - 1, HEAD_DIM)
        refused(lambda: layer(x, x, x), f"{2 * world - 1} heads", f"group size {world}")
        q = torch.randn(S_LOCAL, BATCH, 3 * world, HEAD_DIM)
        kv = torch.randn(S_LOCAL, BATCH, 3, HEAD_DIM)
        refused(lambda: layer(q, kv, kv), "key has 3 heads", f"group size {world}")
        refused(lambda: seq_all_to_all(torch.randn(3, 2 * world - 1), 1, 0), "scatter_idx", str(2 * world - 1))

    recorder = Recorder()
    q, k, v, grad = (t.float().chunk(world, 0)[rank] for t in draw(600, S_LOCAL * world, 3 * world, 3 * world, 0))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    layer = DistributedAttention(sdpa(0), None)
    comm.add_observer(recorder)
    out = layer(q, k, v, causal=True)
    results["forward_calls"] = list(recorder.calls)
    recorder.calls.clear()
    out.backward(grad)
    comm.remove_observer(recorder)
    results["backward_calls"] = recorder.calls
    results["numel"] = q.numel()
    results["passed"] = passed
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
