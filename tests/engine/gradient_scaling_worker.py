"""One rank of test_gradient_scaling.py, started by torchrun: GPT-2 tiny on the gloo ranks at ZeRO
stages 0-3 with DeepSpeed's gradient scaling keys (none, ``prescale_gradients``,
``gradient_predivide_factor`` 4 and the world size); records the losses, the parameters, and per
gradient collective its op and the largest magnitude it was handed (the scale the gradients travel
at)."""

import os
import sys

import torch
import torch.distributed as dist

import dslab
from dslab.comm import collectives
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

SEEN: list = []


def _recording(original, position: int):
    """``original`` recording (op, largest magnitude) of the tensor at ``position`` it reduces
    (scalars, such as the clipping norm's, left out)."""
    def call(*args, **kwargs):
        tensor = args[position]
        if tensor.numel() > 1:
            SEEN.append((str(kwargs.get("op")).split(".")[-1], float(tensor.abs().max())))
        return original(*args, **kwargs)
    return call


def train(stage: int, scaling: dict) -> dict:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0, layers=2), kernels="torch")
    # plain SGD, no clipping: each update is the averaged gradient times the learning rate, so a
    # gradient at the wrong scale shows in the parameters (Adam would normalise it away)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000}, **scaling}
    engine, *_ = dslab.initialize(model=model, config=config)
    world = int(os.environ["WORLD_SIZE"])
    ids = torch.randint(0, 1000, (2 * world, 24), generator=torch.Generator().manual_seed(5))
    ids = ids[2 * engine.rank: 2 * engine.rank + 2]
    SEEN.clear()
    losses = []
    for _ in range(3):
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    params = {k: v.detach().float().clone() for k, v in engine.module_state_dict().items()}
    engine.destroy()
    return {"losses": losses, "params": params, "collectives": list(SEEN)}


def main(out: str) -> None:
    dist.all_reduce = _recording(dist.all_reduce, 0)
    collectives._reduce_scatter_single = _recording(collectives._reduce_scatter_single, 1)
    world = int(os.environ["WORLD_SIZE"])
    results = {"world": world}
    for stage in (0, 1, 2, 3):
        for name, scaling in (("plain", {}), ("prescale", {"prescale_gradients": True}),
                              ("f4", {"gradient_predivide_factor": 4.0}),
                              ("fworld", {"gradient_predivide_factor": float(world)})):
            results[f"{stage}-{name}"] = train(stage, scaling)
    if dist.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
