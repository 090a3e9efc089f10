"""One rank of the ZeRO memory-tracer test, started by torchrun (see test_zero_memory.py).

``memory_worker.py OUT``: 2 ranks. For fp32 and bf16 autocast and ZeRO stages 0-3, trains a
12-layer MLP for 3 steps (2 micro-steps each) with the memory tracer on and saves rank 0's and
rank 1's measured model states, ``estimate_zero_memory``'s rows for dslab's layout and
DeepSpeed's, and an independent count of the rank's distinct storages at one instant; then the
same under bf16 with the optimizer offloaded to the CPU at stages 1-3.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import dslab
from dslab import comm
from dslab.profilers.memory import model_state_bytes

LAYERS, WIDTH, CLASSES = 12, 40, 5


class DeepNet(nn.Module):
    """``LAYERS`` equal Linear layers (so stage 3's one-layer gather buffer is small)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return F.cross_entropy(self.head(x).float(), y)


def distinct_storage_bytes(engine) -> int:
    """Every tensor the rank's model states can live in, each storage once (by data_ptr)."""
    tensors = list(engine.module.parameters()) + [p.grad for p in engine.module.parameters()]
    if engine.zero is not None:
        for unit in engine.zero.units:
            tensors += [unit.full, unit.shard, unit.grad_shard]
        tensors += list(engine.zero.masters)
        if engine.zero.offload is not None:
            tensors += engine.zero.offload.buffers()
    for state in engine.optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    storages = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def run(precision, stage, offload=False, offload_param="none", ratio=1.0):
    torch.manual_seed(0)
    model = DeepNet()
    layout = {"precision": "bf16" if precision == "bf16" else "fp32",
              "offload_optimizer": "cpu" if offload else "none",
              "offload_param": offload_param, "offload_ratio": ratio}
    rows = {
        "dslab": dslab.estimate_zero_memory(model, 2, stage, param_bytes=4, master_bytes=0, **layout)[0],
        "deepspeed": dslab.estimate_zero_memory(model, 2, stage, **layout)[0],
    }
    config = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                              "stage3_param_persistence_threshold": 0},
        "memory_tracer": {"enabled": True, "profile_step": 1},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": ratio}
    if offload_param != "none":
        config["zero_optimization"]["offload_param"] = {"device": offload_param}
    engine, _, _, _ = dslab.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(comm.get_rank())
    instant = None
    for step in range(3):
        for micro in range(2):
            loss = engine(torch.randn(4, WIDTH, generator=g), torch.randint(0, CLASSES, (4,), generator=g))
            engine.backward(loss)
            if step == 2 and micro == 0:  # an instant with gradients held: count it both ways
                instant = {"traced": model_state_bytes(engine.module, engine.optimizer, 2,
                                                       runtime=engine.zero, stage=stage),
                           "distinct": distinct_storage_bytes(engine)}
            engine.step()
    states = engine.profiler_records()["memory"]["model_states"]
    engine.destroy()
    return {"states": states, "instant": instant,
            "estimate": {k: r.to_dict() for k, r in rows.items()}}


def main(out):
    results = {}
    for precision in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            results[f"{precision}/stage{stage}"] = run(precision, stage)
    for stage in (1, 2, 3):
        results[f"offload/stage{stage}"] = run("bf16", stage, offload=True)
    results["param_offload/stage3"] = run("bf16", 3, offload=True, offload_param="cpu")
    results["ratio/stage2"] = run("bf16", 2, offload=True, ratio=0.5)
    results["ratio/stage3"] = run("bf16", 3, offload=True, offload_param="cpu", ratio=0.5)
    gathered = comm.all_gather_object(results)
    if comm.get_rank() == 0:
        torch.save(gathered, out)


if __name__ == "__main__":
    main(sys.argv[1])
