"""One rank of the peer-arm tests, started by torchrun (see test_peers.py).

``OUT ARM:PRECISION ...``: for each pair, the arm is built for the tiny GPT-2 workload of a suite
(seq 16, micro-batch 2, dropout on), steps 3 times with the torch seed set before each step, and
records its losses and its final full parameters (``full_tensor()`` for FSDP2's DTensors). A
single-process loop over the same weights and batch (plain ``torch.optim.AdamW``, the suite's
settings, clipping; no process group touched) gives the reference for each precision. Rank 0
saves everything to ``OUT``; every rank records whether the ranks' losses agree.

Inductor's random ops follow eager's here (``fallback_random``), so the compiled arm draws the
dropout masks the reference draws.
"""

import sys
import time

import torch
import torch._inductor.config
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dslab.bench.arms import PRECISION_DTYPES
from dslab.bench.peers import build_peer_arm
from dslab.bench.suite import SuiteConfig
from dslab.bench.workloads import workloads_for

STEPS = 3
ENGINE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
          "gradient_clipping": 1.0}


def workload(precision):
    suite = SuiteConfig.model_validate({
        "name": "peers_test", "family": "gpt2", "precision": precision, "engine": ENGINE, "arms": ["dslab"],
        "scales": {"tiny": {"preset": "gpt2_tiny", "cases": [{"name": "a", "seq_len": 16, "micro_batch": 2}]}},
    })
    return workloads_for(suite, "tiny")[0]


def _state(model):
    module = getattr(model, "module", model)  # DDP wraps it
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for name, p in module.named_parameters()}


def reference(precision):
    """The plain single-process loop (the ``torch`` arm's) on the same weights and batch."""
    w = workload(precision)
    model = w.build_model(kernels="torch").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, foreach=True)
    batch, loss_fn, dtype = w.make_batch(torch.device("cpu")), w.loss_fn(), PRECISION_DTYPES[precision]
    losses = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return {"losses": losses, "state": _state(model)}


def run_arm(name, precision):
    start = time.perf_counter()
    arm = build_peer_arm(name, workload(precision), torch.device("cpu"), precision, ENGINE)
    losses = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        losses.append(float(arm.step()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    result = {"name": arm.name, "losses": losses, "state": _state(arm.model), "ranks_agree": all(
        g == losses for g in gathered), "seconds": time.perf_counter() - start}
    arm.close()
    result["closed"] = not hasattr(arm, "model") and not hasattr(arm, "optimizer")
    return result


def main(out, pairs):
    torch._inductor.config.fallback_random = True
    dist.init_process_group("gloo")
    results = {"world_size": dist.get_world_size()}
    for pair in pairs:
        name, precision = pair.split(":")
        results[pair] = run_arm(name, precision)
    for precision in sorted({pair.split(":")[1] for pair in pairs}):
        results[f"reference:{precision}"] = reference(precision)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
