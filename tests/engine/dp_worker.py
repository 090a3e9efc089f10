"""One rank of the data-parallel test, started by torchrun (see test_data_parallel.py)."""

import sys

import torch

import dslab
from dslab import comm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from helpers import TinyNet, base_config, make_data  # noqa: E402


class CountCollectives:
    def __init__(self):
        self.calls = []

    def before(self, call):
        self.calls.append((call.op, call.numel))

    def after(self, call, work):
        pass


def main(out_path: str, steps: int, micro: int, accum: int):
    torch.manual_seed(0)
    counter = CountCollectives()
    comm.add_observer(counter)
    cfg = base_config(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum,
                      zero_optimization={"stage": 0, "reduce_bucket_size": 100},
                      comms_logger={"enabled": True})
    # Each rank builds the model from a different seed: the engine must broadcast rank 0's weights.
    torch.manual_seed(comm.get_rank() if comm.is_initialized() else 0)
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=cfg)
    rank, world = engine.rank, engine.world_size
    global_batch = micro * accum * world
    x, y = make_data(global_batch * steps, seed=7)
    for s in range(steps):
        step_x = x[s * global_batch:(s + 1) * global_batch]
        step_y = y[s * global_batch:(s + 1) * global_batch]
        for a in range(accum):
            lo = (a * world + rank) * micro
            loss = engine(step_x[lo:lo + micro], step_y[lo:lo + micro])
            engine.backward(loss)
            engine.step()
    all_reduces = [n for op, n in counter.calls if op == "all_reduce"]
    summary = comm.log_summary(return_dict=True) if world > 1 else {}
    logged = {size: row["count"] for size, row in summary.get("all_reduce", {}).items()}
    engine.destroy()
    if rank == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
                    "all_reduces": all_reduces, "world": world, "logged_all_reduces": logged}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
