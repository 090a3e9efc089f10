"""One rank of the deferred-gather test (test_param_gather.py), started by torchrun: GPT-2 tiny
at ZeRO stage 1 or 2 with its layer stack in 2 segments, trained with the post-step parameter
gathers waited at the end of the step and waited where the next forward reads them."""

import sys

import torch

import dslab
from dslab.engine.zero import param_gather
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

param_gather.HOST_DEFERRAL = True  # gloo: waited at the step otherwise (param_gather.defers_on)

STEPS = 4


def train(stage: int, overlap: bool) -> dict:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0, layers=4), kernels="torch")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "cuda_graphs": {"enabled": True, "segments": 2},  # on a CPU the segments run eagerly
        "comms_logger": {"enabled": True},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 60_000, "overlap_param_gather": overlap},
    }
    engine, *_ = dslab.initialize(model=model, config=config)
    rank = engine.rank
    ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(11))[2 * rank: 2 * rank + 2]
    losses, pending_after_step = [], []
    for _ in range(STEPS):  # one batch, step after step
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        deferred = engine.zero.deferred
        pending_after_step.append(deferred.pending if deferred is not None else 0)
        losses.append(float(loss.detach()))
    deferred = engine.zero.deferred
    params = {k: v.detach().clone() for k, v in engine.module_state_dict().items()}  # settles the last step's
    result = {
        "losses": losses,
        "pending_after_step": pending_after_step,
        "stats": dict(deferred.stats) if deferred is not None else {},
        "segments": sorted(set(deferred.segment_of.values())) if deferred is not None else [],
        "units": len(engine.zero.units),
        "params": params,
    }
    engine.destroy()
    return result


def main(out: str) -> None:
    results = {f"{stage}-{overlap}": train(stage, overlap) for stage in (1, 2) for overlap in (False, True)}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
