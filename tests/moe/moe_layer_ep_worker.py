"""One rank of the expert-parallel MoE test, started by torchrun (see test_moe_layer_ep.py).

Every rank feeds its own tokens to an ep_size-p layer (8 experts) and to an ep_size-1 layer holding
all 8 experts with the same weights, and compares: output, l_aux, exp_counts, the gradients of the
input and the gate (this rank's tokens only), and each local expert's weight gradient, which under
expert parallelism sums over the tokens of every rank of the expert-parallel group. It then checks
the engine's rule (sum over the expert-data-parallel group, divide by the world size) against the
world-mean gradient of ep_size 1. Each rank pickles its results to ``argv[1]/rank{r}.pkl``.

``MOE_EP_BACKEND=nccl`` runs it on one GPU per rank (the layers, tokens and exchanges on CUDA, the
Triton kernels in the hot path); the default is gloo on CPU.
"""

import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dslab import comm
from dslab.moe import MoE

H, FFN, EXPERTS, TOKENS = 6, 10, 8, 13


class _Recorder:
    def __init__(self):
        self.calls = []

    def before(self, call):
        if call.op == "all_to_all":
            self.calls.append({"numel": call.numel, "dtype": str(call.dtype), "group_size": call.group_size,
                               **call.extra})

    def after(self, call, work):
        pass


class _LoopExpert(nn.Module):
    """Not stackable: the per-expert loop path."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def _tokens(rank, shape):
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _run(moe, x, dy, seed):
    """Forward and backward of ``sum(out * dy) + 0.1 * l_aux`` with the RNG at ``seed``."""
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out, l_aux, counts = moe(x)
    ((out * dy).sum() + 0.1 * l_aux).backward()
    grads = {n: p.grad.detach().clone() for n, p in moe.named_parameters()}
    return {"out": out.detach(), "l_aux": l_aux.detach(), "counts": counts, "dx": x.grad, "grads": grads}


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def compare(case: dict, recorder: _Recorder, device: torch.device) -> dict:
    rank, world = comm.get_rank(), comm.get_world_size()
    ep_size = case["ep_size"]
    kwargs = dict(num_experts=EXPERTS, k=case["k"], capacity_factor=0.75, min_capacity=1,
                  drop_tokens=case["drop_tokens"], noisy_gate_policy=case.get("noisy"), use_rts=case.get("rts", False),
                  top2_2nd_expert_sampling=case.get("sampling", False))
    torch.manual_seed(0)
    expert = _LoopExpert() if case.get("loop") else nn.Sequential(nn.Linear(H, FFN), nn.GELU(), nn.Linear(FFN, H))
    full = MoE(H, expert, ep_size=1, **kwargs)
    with torch.no_grad():
        for p in full.deepspeed_moe.experts.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    sharded = MoE(H, expert, ep_size=ep_size, **kwargs)
    local = sharded.num_local_experts
    ep_rank = sharded.expert_groups.ep_rank
    first = ep_rank * local
    with torch.no_grad():
        sharded.deepspeed_moe.gate.wg.weight.copy_(full.deepspeed_moe.gate.wg.weight)
        _copy_experts(full, sharded, first, local)
    full, sharded = full.to(device), sharded.to(device)

    def tokens(r):
        return [t.to(device) for t in _tokens(r, (TOKENS, H) if r % 2 else (1, TOKENS, H))]

    x, dy = tokens(rank)
    recorder.calls.clear()
    got = _run(sharded, x, dy, seed=300 + rank)
    calls = list(recorder.calls)
    # ep_size 1 on each rank's tokens (every rank can make every rank's tokens)
    refs = [_run(full, *tokens(r), seed=300 + r) for r in range(world)]
    mine = refs[rank]
    errors = {"out": _max_err(got["out"], mine["out"]), "l_aux": _max_err(got["l_aux"], mine["l_aux"]),
              "dx": _max_err(got["dx"], mine["dx"]),
              "gate": _max_err(got["grads"]["deepspeed_moe.gate.wg.weight"],
                               mine["grads"]["deepspeed_moe.gate.wg.weight"])}
    counts_equal = torch.equal(got["counts"], mine["counts"])
    group_ranks = range(rank - ep_rank, rank - ep_rank + ep_size)
    for name, grad in got["grads"].items():
        if name.startswith("deepspeed_moe.experts."):
            summed = sum(_expert_slice(refs[r]["grads"], name, first, local) for r in group_ranks)
            errors[f"{name} (sum over ep group)"] = _max_err(grad, summed)
            # the engine's rule: sum over the expert-data-parallel group, divide by the world
            reduced = grad.clone()
            comm.all_reduce(reduced, group=sharded.expert_groups.expert_data_parallel)
            world_mean = sum(_expert_slice(refs[r]["grads"], name, first, local) for r in range(world)) / world
            errors[f"{name} (engine rule)"] = _max_err(reduced / world, world_mean)
    scale = max(mine["out"].abs().max().item(), 1.0)
    return {"case": case, "errors": errors, "scale": scale, "counts_equal": counts_equal, "calls": calls,
            "kept_rows": int(got["counts"].sum()), "on_device": got["counts"].device.type}


def _copy_experts(full, sharded, first, local):
    src, dst = full.deepspeed_moe.experts, sharded.deepspeed_moe.experts
    if dst.stacked:
        for name in ("w1", "b1", "w2", "b2"):
            getattr(dst, name).copy_(getattr(src, name)[first:first + local])
    else:
        for j in range(local):
            dst.deepspeed_experts[j].load_state_dict(src.deepspeed_experts[first + j].state_dict())


def _expert_slice(grads, name, first, local):
    """ep_size 1's gradient of the experts [first, first + local) under the ep layer's name."""
    if name.startswith("deepspeed_moe.experts.deepspeed_experts."):
        _, _, _, j, rest = name.split(".", 4)
        return grads[f"deepspeed_moe.experts.deepspeed_experts.{first + int(j)}.{rest}"]
    return grads[name][first:first + local]


CASES = {
    2: [dict(ep_size=2, k=1, drop_tokens=True, noisy="Jitter", rts=True),
        dict(ep_size=2, k=2, drop_tokens=True, sampling=True),
        dict(ep_size=2, k=1, drop_tokens=False),
        dict(ep_size=2, k=2, drop_tokens=False, noisy="Jitter", sampling=True),
        dict(ep_size=2, k=2, drop_tokens=False, loop=True)],
    4: [dict(ep_size=4, k=1, drop_tokens=True, rts=True),
        dict(ep_size=4, k=2, drop_tokens=False, sampling=True),
        dict(ep_size=2, k=2, drop_tokens=True, noisy="Jitter"),
        dict(ep_size=2, k=1, drop_tokens=False, noisy="RSample")],
}


def main(out_dir: str) -> None:
    backend = os.environ.get("MOE_EP_BACKEND", "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    comm.init_distributed(dist_backend=backend)
    recorder = _Recorder()
    comm.add_observer(recorder)
    results = [compare(case, recorder, device) for case in CASES[comm.get_world_size()]]
    comm.remove_observer(recorder)
    with open(Path(out_dir) / f"rank{comm.get_rank()}.pkl", "wb") as f:
        pickle.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
