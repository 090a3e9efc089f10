"""One rank of the NVMe offload test (test_nvme_offload.py), started by torchrun with 2 ranks.

``OUT NVME CKPT``: for ZeRO stages 1-3, the same model trained with CPU optimizer offload and with
NVMe optimizer offload (states swapped under NVME through small AIO blocks, one sub-group per unit,
two buffers, accumulation and clipping); then a stage 2 NVMe run checkpointed through the aio
handle into CKPT, resumed by a fresh engine and trained on, beside the uninterrupted run. Rank 0
saves every result to OUT.

Also the single-process run shared by test_nvme_offload.py (on the CPU) and test_io_gpu.py (on a
GPU): :func:`train_one_process`.
"""

import sys
from pathlib import Path

import torch

import dslab
from dslab import comm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from helpers import TinyNet, base_config, make_data  # noqa: E402

DIM, HIDDEN, CLASSES = 13, 29, 3
AIO = {"block_size": 8192, "queue_depth": 4, "intra_op_parallelism": 2, "overlap_events": True}


def build(stage: int, offload: dict, aio: dict | None = AIO, seed: int = 0):
    zero = {"stage": stage, "reduce_bucket_size": 150, "stage3_param_persistence_threshold": 0,
            "sub_group_size": 1, "offload_optimizer": offload}
    cfg = base_config(zero_optimization=zero, gradient_accumulation_steps=2, gradient_clipping=0.05)
    if aio is not None:
        cfg["aio"] = aio
    torch.manual_seed(seed)
    engine, _, _, _ = dslab.initialize(model=TinyNet(DIM, HIDDEN, CLASSES, dropout=0.0), config=cfg)
    return engine


# One process, stage 2, bf16: TinyNet's units at reduce_bucket_size 100 are fc2.bias | fc2.weight |
# fc1.bias | fc1.weight (4, 128, 32 and 512 elements, each unit's whole shard at world size 1).
# Sub-groups are runs of whole units of at least sub_group_size shard elements (DeepSpeed's rule:
# this rank's elements), so 100 makes two sub-groups of two units each.
ONE_PROCESS_ZERO = {"stage": 2, "sub_group_size": 100, "reduce_bucket_size": 100}
ONE_PROCESS_UNIT_NUMELS = [4, 128, 32, 512]
ONE_PROCESS_CHUNKS = [[0, 1], [2, 3]]


def train_one_process(offload: dict, device: str, steps: int = 3):
    """TinyNet trained for ``steps`` steps in this process with ``offload`` as
    ``zero_optimization.offload_optimizer`` (:data:`ONE_PROCESS_ZERO`, bf16, clipping), its data
    on ``device``; returns the engine."""
    cfg = base_config(zero_optimization={**ONE_PROCESS_ZERO, "offload_optimizer": offload},
                      gradient_clipping=0.05, bf16={"enabled": True})
    torch.manual_seed(0)
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=cfg)
    x, y = make_data(8 * steps, seed=2)
    for s in range(steps):
        loss = engine(x[s * 8:(s + 1) * 8].to(device), y[s * 8:(s + 1) * 8].to(device))
        engine.backward(loss)
        engine.step()
    return engine


def chunk_units(engine) -> list[list[int]]:
    """The unit indices of each optimizer sub-group of ``engine``'s offload."""
    return [[unit.index for unit in chunk] for chunk in engine.zero.offload.chunks]


def train(engine, steps: int, start: int = 0) -> None:
    micro, accum, world = 8, 2, engine.world_size
    x, y = make_data(micro * accum * world * (start + steps), dim=DIM, classes=CLASSES, seed=7)
    for s in range(start, start + steps):
        for a in range(accum):
            lo = ((s * accum + a) * world + engine.rank) * micro
            loss = engine(x[lo:lo + micro], y[lo:lo + micro])
            engine.backward(loss)
            engine.step()


def state(engine) -> dict:
    return {k: v.detach().cpu().clone() for k, v in engine.module_state_dict().items()}


def main(out: str, nvme: Path, ckpt: Path) -> None:
    results = {}
    nvme_offload = {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 2}
    for stage in (1, 2, 3):
        cpu = build(stage, {"device": "cpu"}, aio=None)
        train(cpu, 3)
        results[f"stage{stage}/cpu"] = state(cpu)
        cpu.destroy()
        engine = build(stage, nvme_offload)
        train(engine, 3)
        results[f"stage{stage}/nvme"] = state(engine)
        offload = engine.zero.offload
        results[f"stage{stage}/chunks"] = len(offload.chunks)
        results[f"stage{stage}/units"] = len(engine.zero.units)
        results[f"stage{stage}/files"] = sorted(p.name for p in offload.directory.iterdir())
        results[f"stage{stage}/placeholders"] = all(
            v.numel() == 0 for s in engine.optimizer.state.values() for k, v in s.items()
            if k != "step")
        offload.flush()  # the last step's write-behind: its swap_out events are recorded
        results[f"stage{stage}/io"] = engine.profiler_records()["io"]
        results[f"stage{stage}/shard_elements"] = sum(u.shard_numel for u in engine.zero.units)
        directory = offload.directory
        engine.destroy()
        results[f"stage{stage}/removed"] = not directory.exists()

    engine = build(2, nvme_offload)
    train(engine, 2)
    engine.save_checkpoint(ckpt, tag="nvme")
    results["ckpt/io"] = engine.profiler_records()["io"]
    train(engine, 2, start=2)
    results["ckpt/uninterrupted"] = state(engine)
    engine.destroy()
    resumed = build(2, nvme_offload, seed=1)
    resumed.load_checkpoint(ckpt, tag="nvme")
    train(resumed, 2, start=2)
    results["ckpt/resumed"] = state(resumed)
    resumed.destroy()
    if comm.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
