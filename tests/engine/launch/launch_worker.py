"""One rank of the two-"node" launch test, started by ``dslab launch`` (see test_launch_run.py).

Trains TinyNet a few steps with dslab.initialize on gloo, each rank on its own data from its own
initial weights, checks that the ranks end with equal parameters, and writes
``<out_dir>/rank<R>.json`` (written to a temporary name, then renamed)."""

import json
import os
import sys
from pathlib import Path

import torch

import dslab
from dslab import comm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import TinyNet, base_config, make_data  # noqa: E402


def main(out_dir: str, steps: int) -> None:
    torch.manual_seed(int(os.environ["RANK"]))  # rank 1 starts elsewhere: the engine broadcasts rank 0's
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=base_config(train_micro_batch_size_per_gpu=4))
    assert engine.world_size == 2, engine.world_size
    start = torch.cat([p.detach().flatten() for p in engine.module.parameters()]).clone()
    x, y = make_data(4 * steps, seed=10 + engine.rank)
    for step in range(steps):
        loss = engine(x[step * 4:(step + 1) * 4], y[step * 4:(step + 1) * 4])
        engine.backward(loss)
        engine.step()
    flat = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    gathered = torch.empty(2 * flat.numel())
    comm.all_gather_into_tensor(gathered, flat)
    ranks_equal = torch.equal(gathered[:flat.numel()], gathered[flat.numel():])
    assert ranks_equal, "parameters differ across ranks"
    assert not torch.equal(flat, start), "the optimizer did not move the parameters"
    marker = {
        "rank": engine.rank, "world_size": engine.world_size, "node_rank": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]), "global_steps": engine.global_steps,
        "ranks_equal": ranks_equal, "env_file_value": os.environ.get("DSLAB_LAUNCH_TEST"),
    }
    engine.destroy()
    path = Path(out_dir) / f"rank{engine.rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(marker))
    tmp.replace(path)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
