"""One rank of the gradient-overlap test, started by torchrun (see test_comms_overlap_gloo.py).

Trains a small MLP for a few steps with ZeRO stage 0 and then stage 2, each with the comms logger
on and a bucket size that cuts the gradients into several buckets, and pickles for every stage the
logger's ``records()`` (rank 0) and what the engine says the buckets are: their count and the bytes
each bucket's collective moves (stage 0: the parameters' gradients; stage 2: each unit's padded
flat buffer, the reduce-scatter's input).
"""

import pickle
import sys

import torch
import torch.nn as nn

import dslab
from dslab import comm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from helpers import base_config, make_data  # noqa: E402

DIM, HIDDEN, CLASSES, BUCKET = 24, 48, 4, 600
STEPS = 3


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return nn.functional.cross_entropy(self.fc3(h), y)


def run_stage(stage: int) -> dict:
    torch.manual_seed(0)
    cfg = base_config(zero_optimization={"stage": stage, "reduce_bucket_size": BUCKET},
                      comms_logger={"enabled": True})
    engine, _, _, _ = dslab.initialize(model=Mlp(), config=cfg)
    x, y = make_data(8 * STEPS, dim=DIM, classes=CLASSES, seed=comm.get_rank())
    for s in range(STEPS):
        loss = engine(x[8 * s: 8 * s + 8], y[8 * s: 8 * s + 8])
        engine.backward(loss)
        engine.step()
    if stage == 0:
        buckets = [sum(p.numel() * p.element_size() for p in b.params) for b in engine.grad_reducer.buckets]
    else:
        buckets = [u.padded * u.params[0].element_size() for u in engine.zero.units]
    records = engine.profiler_records()["comms"]
    engine.destroy()
    return {"records": records, "bucket_bytes": buckets,
            "param_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters())}


def main(out_path: str) -> None:
    comm.init_distributed(dist_backend="gloo")
    result = {stage: run_stage(stage) for stage in (0, 2)}
    if comm.get_rank() == 0:
        with open(out_path, "wb") as f:
            pickle.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
