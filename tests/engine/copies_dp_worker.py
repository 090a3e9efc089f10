"""One rank of the bf16-weight-copies data-parallel test (test_weight_copies_data_parallel.py),
started by torchrun, or alone for the one-process reference: GPT-2 tiny at ZeRO stage 0, each rank
training on its slice of one global batch, step after step."""

import os
import sys

import torch

import dslab
from dslab import comm
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

STEPS = 4
GLOBAL_BATCH = 4


def main(out_path: str, weight_copies: str) -> None:
    config = {
        "train_micro_batch_size_per_gpu": 1,  # set below from the world size
        "bf16": {"enabled": True, "weight_copies": weight_copies == "true"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 20_000},
    }
    if torch.cuda.is_available():  # on GPUs (nccl), with the layer stack in CUDA graphs as well
        config["cuda_graphs"] = {"enabled": True}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = GLOBAL_BATCH // world
    config["train_micro_batch_size_per_gpu"] = micro
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="dslab")
    engine, *_ = dslab.initialize(model=model, config=config)
    rank = engine.rank
    ids = torch.randint(0, 1000, (GLOBAL_BATCH, 32), generator=torch.Generator().manual_seed(3))
    losses = []
    for step in range(STEPS):
        batch = ids[rank * micro:(rank + 1) * micro].to(engine.device)  # one global batch, every step
        loss = engine(batch, labels=batch)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        if world > 1:
            comm.all_reduce(mean)
            mean /= world
        losses.append(float(mean))
    reducer = engine.grad_reducer
    buckets = [] if reducer is None else [(str(b.params[0].dtype), [p.numel() for p in b.params])
                                           for b in reducer.buckets]
    copies = engine.weight_copies is not None
    params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    if rank == 0:
        torch.save({"losses": losses, "params": params, "buckets": buckets, "copies": copies,
                    "world": world}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
