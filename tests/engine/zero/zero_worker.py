"""One rank of the ZeRO tests, started by torchrun (see test_zero_multiprocess.py).

``main OUT CKPT``: 2 ranks. Every stage against stage 0 in several configs, the comms each stage
issues, and sharded checkpoints (save, resume, uninterrupted run) per stage.
``reload OUT CKPT``: 3 ranks. Loads the 2-rank checkpoints (re-partitioning), saves them again
at 3 ranks, and runs stage 2 against stage 0 with odd padding.
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import dslab
from dslab import comm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import TinyNet, base_config, make_data  # noqa: E402

DIM, HIDDEN, CLASSES = 13, 9, 3  # odd sizes: every unit needs padding


class TiedNet(nn.Module):
    """Embedding, a layer, and a head tied to the embedding (read outside the embedding's
    forward, as GPT-2's LM head is)."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, ids, y):
        h = torch.relu(self.fc(self.emb(ids))).mean(1)
        return F.cross_entropy(F.linear(h, self.emb.weight).float(), y)


class Block(nn.Module):
    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, ids):
        return torch.relu(self.fc(self.emb(ids)))


class NestedTiedNet(nn.Module):
    """A block of two modules and a head tied to the block's embedding, read by the root outside
    the block's forward. Granularities (elements / (1 + descendants)): block 108 / 3 = 36,
    proj 42, root 261 / 5 = 52, so a threshold of 40 gathers the block whole and nothing else."""

    GRANULARITY = 40

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.block = Block(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.out_bias = nn.Parameter(torch.zeros(111))

    def forward(self, ids, y):
        h = self.proj(self.block(ids)).mean(1)
        logits = F.linear(h, self.block.emb.weight) + self.out_bias[:11]
        return F.cross_entropy(logits.float(), y)


class Observed:
    def __init__(self):
        self.calls = []

    def before(self, call):
        self.calls.append((call.op, call.nbytes))

    def after(self, call, work):
        pass


def build(stage, tied=False, dropout=0.0, seed=0, **overrides):
    # stage 3 releases every unit after its forward unless a scenario sets a reuse distance
    zero = {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 200, "stage3_max_reuse_distance": 0}
    zero.update(overrides.pop("zero", {}))
    cfg = base_config(zero_optimization=zero, **overrides)
    torch.manual_seed(seed)
    if tied == "nested":
        model = NestedTiedNet()
    else:
        model = TiedNet() if tied else TinyNet(DIM, HIDDEN, CLASSES, dropout=dropout)
    engine, _, _, _ = dslab.initialize(model=model, config=cfg)
    return engine


def batches(engine, tied, steps, start=0):
    """This rank's micro-batches of global steps ``start .. start + steps``."""
    micro, accum, world = (engine.train_micro_batch_size_per_gpu(),
                           engine.gradient_accumulation_steps(), engine.world_size)
    n = micro * accum * world * (start + steps)
    if tied:
        g = torch.Generator().manual_seed(5)
        x, y = torch.randint(0, 11, (n, 5), generator=g), torch.randint(0, 11, (n,), generator=g)
    else:
        x, y = make_data(n, dim=DIM, classes=CLASSES, seed=7)
    for s in range(start, start + steps):
        base = s * micro * accum * world
        for a in range(accum):
            lo = base + (a * world + engine.rank) * micro
            yield x[lo:lo + micro].to(engine.device), y[lo:lo + micro].to(engine.device)


def train(engine, steps, tied=False, start=0):
    losses = []
    for xb, yb in batches(engine, tied, steps, start):
        loss = engine(xb, yb)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().cpu().clone())
    return losses


def state(engine):
    return {k: v.detach().cpu().clone() for k, v in engine.module_state_dict().items()}


def same_on_all_ranks(sd):
    flat = torch.cat([v.float().reshape(-1) for v in sd.values()])
    gathered = comm.all_gather_object(flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


SCENARIOS = {
    "fp32": {},
    "accum_clip": {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05},
    "offload": {"zero": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}},
    # Offload with several micro-steps (stages 2-3 accumulate every backward's shards), a clip
    # that binds and the CPU step in chunks of 40 shard elements; with fp16 the overflow check
    # and the unscaling come from the gradient norms.
    "offload_accum_clip": {"gradient_accumulation_steps": 3, "gradient_clipping": 0.05,
                           "zero": {"offload_optimizer": {"device": "cpu"}, "sub_group_size": 40}},
    # the same with the micro-steps' shards added on the CPU by a worker thread through one
    # staging buffer (every later shard waits for the addition before it)
    "offload_accum_on_cpu": {"gradient_accumulation_steps": 3, "gradient_clipping": 0.05,
                             "zero": {"offload_optimizer": {"device": "cpu", "accumulate_on": "cpu",
                                                            "staging_buffers": 1},
                                      "sub_group_size": 40}},
    # the same with the window's sum kept where the shards are and handed over once, at the last
    # micro-step
    "offload_accum_resident": {"gradient_accumulation_steps": 3, "gradient_clipping": 0.05,
                               "zero": {"offload_optimizer": {"device": "cpu", "accumulate_on": "gpu_resident"},
                                        "sub_group_size": 40}},
    # partial offload: about half of the shard elements step on the CPU, the rest where they are
    "offload_ratio": {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
                      "zero": {"offload_optimizer": {"device": "cpu", "ratio": 0.5},
                               "sub_group_size": 40}},
    "offload_fp16": {"fp16": {"enabled": True, "initial_scale_power": 18, "hysteresis": 1},
                     "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False,
                                                              "weight_decay": 0.01}},
                     "zero": {"offload_optimizer": {"device": "cpu"}}},
    # gradients all-reduced instead of reduce-scattered, and the updated parameters all-gathered
    # in pieces of at most 7 elements (units hold up to 100)
    "allreduce_pieces": {"gradient_accumulation_steps": 2,
                         "zero": {"reduce_scatter": False, "allgather_bucket_size": 7}},
    "offload_allreduce_pieces": {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
                                 "zero": {"reduce_scatter": False, "allgather_bucket_size": 7,
                                          "offload_optimizer": {"device": "cpu"}}},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 18, "hysteresis": 1},
             "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False,
                                                      "weight_decay": 0.01}}},
    "tied": {"tied": True},
    # stage 3 gathers the block (embedding and layer) as one unit; the root reads the embedding
    # outside the block's forward
    "nested_granularity": {"tied": "nested", "gradient_accumulation_steps": 2, "zero": {
        "stage3_module_granularity_threshold": NestedTiedNet.GRANULARITY}},
    # DeepSpeed's default reuse distance: stage 3 keeps units gathered from forward to backward
    "tied_reuse": {"tied": True, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
                   "zero": {"stage3_max_reuse_distance": 1_000_000_000}},
}


def run_matrix(results):
    for name, overrides in SCENARIOS.items():
        tied = overrides.get("tied", False)
        for stage in (0, 1, 2, 3):
            kwargs = {k: v for k, v in overrides.items() if k != "tied"}
            if stage == 0:
                kwargs.pop("zero", None)
            engine = build(stage, tied=tied, **kwargs)
            train(engine, 3, tied)
            sd = state(engine)
            results[f"{name}/stage{stage}"] = {
                "state": sd, "skipped": engine.skipped_steps, "ranks_agree": same_on_all_ranks(sd),
                "units": [list(u.layout.names) for u in engine.zero.units] if stage else []}
            engine.destroy()


COMMS_RUNS = {"stage2": (2, {}), "stage3": (3, {}),
              # units kept from forward to backward: gathered once per micro-step
              "stage3_reuse": (3, {"stage3_max_reuse_distance": 1_000_000_000}),
              # all-reduced gradients and all-gathers of at most 40 elements (20 per rank)
              "stage2_allreduce_pieces": (2, {"reduce_scatter": False,
                                              "allgather_bucket_size": 40})}


def run_comms(results):
    ops = ("reduce_scatter", "all_gather", "all_reduce")
    for name, (stage, zero) in COMMS_RUNS.items():
        observed = Observed()
        comm.add_observer(observed)
        engine = build(stage, gradient_accumulation_steps=2, comms_logger={"enabled": True},
                       zero=zero)
        train(engine, 2)
        summary = comm.log_summary(return_dict=True)
        comm.remove_observer(observed)
        results[f"comms/{name}"] = {
            "calls": [c for c in observed.calls if c[0] in ops],
            "logged": {op: {int(size): row["count"] for size, row in summary.get(op, {}).items()}
                       for op in ops},
            "padded_bytes": [u.padded * 4 for u in engine.zero.units],
        }
        engine.destroy()


CKPT = {"gradient_accumulation_steps": 2, "dropout": 0.2,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.02}}}


def run_checkpoints(results, ckpt_root):
    for stage in (1, 2, 3):
        straight = build(stage, **CKPT)
        expected = train(straight, 4)
        results[f"ckpt/stage{stage}/straight"] = state(straight)
        straight.destroy()

        first = build(stage, **CKPT)
        head = train(first, 2)
        save_dir = ckpt_root / f"stage{stage}"
        first.save_checkpoint(save_dir, client_state={"stage": stage})
        results[f"ckpt/stage{stage}/saved"] = state(first)
        first.destroy()

        torch.manual_seed(1234)
        resumed = build(stage, seed=99, **CKPT)
        _, client = resumed.load_checkpoint(save_dir)
        tail = train(resumed, 2, start=2)
        results[f"ckpt/stage{stage}/resumed"] = state(resumed)
        results[f"ckpt/stage{stage}/losses_equal"] = all(
            torch.equal(a, b) for a, b in zip(expected, head + tail))
        results[f"ckpt/stage{stage}/client"] = client
        resumed.destroy()


def run_start_from_rank0(results):
    """Every rank builds its model from a different seed: the engine starts all of them from rank
    0's weights (stage 3 broadcasts each unit as it shards it)."""
    for stage in (0, 1, 2, 3):
        engine = build(stage, seed=10 + comm.get_rank())
        sd = state(engine)
        results[f"init/stage{stage}"] = {"state": sd, "ranks_agree": same_on_all_ranks(sd)}
        engine.destroy()


def run_16bit(results, ckpt_root):
    """Stage 3 gathers the weights and rank 0 writes them in bf16."""
    engine = build(3, bf16={"enabled": True},
                   zero={"stage3_gather_16bit_weights_on_model_save": True})
    train(engine, 2)
    results["16bit/saved"] = engine.save_16bit_model(ckpt_root / "16bit")
    results["16bit/state"] = state(engine)
    engine.destroy()


def param_offload_runs(nvme_root: Path) -> dict:
    """Stage 3 with ``offload_param`` (and the optimizer offload it needs), by name."""
    return {
        "cpu": {"offload_param": {"device": "cpu", "pin_memory": True},
                "offload_optimizer": {"device": "cpu"}},
        "cpu_reuse_chunks": {"offload_param": {"device": "cpu"}, "sub_group_size": 40,
                             "offload_optimizer": {"device": "cpu"},
                             "stage3_max_reuse_distance": 1_000_000_000},
        "nvme": {"offload_param": {"device": "nvme", "nvme_path": str(nvme_root / "params"),
                                   "buffer_count": 2, "max_in_cpu": 0},
                 "offload_optimizer": {"device": "cpu"}},
        # the units that fit in 40 shard elements in CPU memory, the rest in files
        "nvme_cached": {"offload_param": {"device": "nvme", "nvme_path": str(nvme_root / "params"),
                                          "max_in_cpu": 40, "pin_memory": True},
                        "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_root / "states")},
                        "sub_group_size": 40},
        "cpu_ratio": {"offload_param": {"device": "cpu"},
                      "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
        "cpu_host_add_ratio": {"offload_param": {"device": "cpu"},
                               "offload_optimizer": {"device": "cpu", "ratio": 0.5, "accumulate_on": "cpu",
                                                     "staging_buffers": 2}},
        "cpu_resident_add": {"offload_param": {"device": "cpu"},
                             "offload_optimizer": {"device": "cpu", "accumulate_on": "gpu_resident"}},
        # the offloaded units' step on a worker thread while the next forward runs
        "cpu_overlap": {"offload_param": {"device": "cpu"}, "sub_group_size": 40,
                        "offload_optimizer": {"device": "cpu", "overlap_step": True}},
        "cpu_overlap_ratio": {"offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu", "ratio": 0.5, "overlap_step": True}},
        "nvme_ratio": {"offload_param": {"device": "nvme", "nvme_path": str(nvme_root / "params"),
                                         "max_in_cpu": 0},
                       "offload_optimizer": {"device": "nvme", "ratio": 0.6,
                                             "nvme_path": str(nvme_root / "states")}},
        "nvme_both": {"offload_param": {"device": "nvme", "nvme_path": str(nvme_root / "params"),
                                        "buffer_count": 3, "max_in_cpu": 0},
                      "offload_optimizer": {"device": "nvme",
                                            "nvme_path": str(nvme_root / "states")},
                      "sub_group_size": 40},
        # the same with the micro-steps' gradient shards added on the host
        "nvme_both_host_add": {"offload_param": {"device": "nvme", "nvme_path": str(nvme_root / "params"),
                                                 "buffer_count": 3, "max_in_cpu": 0},
                               "offload_optimizer": {"device": "nvme", "accumulate_on": "cpu",
                                                     "nvme_path": str(nvme_root / "states")},
                               "sub_group_size": 40},
    }


PARAM_OFFLOAD_TRAINING = {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05}
PARAM_OFFLOAD_BF16_FETCH = {"offload_param": {"device": "cpu", "fetch_dtype": "bf16"},
                            "offload_optimizer": {"device": "cpu"}}
PARAM_OFFLOAD_BF16_STAGING = {"offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu", "accumulate_on": "cpu", "staging_dtype": "bf16"}}


def run_param_offload(results, ckpt_root):
    """Stage 3 with parameter offload against stage 0 (plain and tied models), and a sharded
    checkpoint of an NVMe-offloaded run that resumes where the uninterrupted run goes."""
    for tied in (False, True):
        reference = build(0, tied=tied, **PARAM_OFFLOAD_TRAINING)
        results[f"param_offload/tied{tied}/losses/stage0"] = train(reference, 3, tied)
        results[f"param_offload/tied{tied}/stage0"] = state(reference)
        reference.destroy()
        for name, zero in param_offload_runs(ckpt_root / "nvme").items():
            engine = build(3, tied=tied, zero=zero, **PARAM_OFFLOAD_TRAINING)
            home = engine.zero.param_home
            directory = getattr(home, "directory", None)
            losses = train(engine, 3, tied)
            sd = state(engine)
            results[f"param_offload/tied{tied}/{name}"] = {
                "losses": losses, "state": sd, "ranks_agree": same_on_all_ranks(sd),
                "shard_devices": sorted({str(u.shard.device) for u in engine.zero.units}),
                "shard_sizes": sorted({u.shard.numel() for u in engine.zero.units}),
                "held": sum(home.holds(u) for u in engine.zero.units),
                "released": sum(not u.resident for u in engine.zero.units),
                "on_device": sum(engine.zero.offload.on_device),
                "files": len(list(directory.iterdir())) if directory is not None else None,
                "cached": sum(home.holds(u) and not home.on_disk(u) for u in engine.zero.units)
                if hasattr(home, "on_disk") else None,
                "stats": home.stats()}
            engine.destroy()
            if directory is not None:
                results[f"param_offload/tied{tied}/{name}"]["removed"] = not directory.exists()
        # the shards fetched from bf16 copies kept beside the fp32 masters (offload_param.fetch_dtype)
        engine = build(3, tied=tied, zero=PARAM_OFFLOAD_BF16_FETCH, **PARAM_OFFLOAD_TRAINING)
        home = engine.zero.param_home
        losses = train(engine, 3, tied)
        sd = state(engine)
        results[f"param_offload/tied{tied}/cpu_fetch_bf16"] = {
            "losses": losses, "state": sd, "ranks_agree": same_on_all_ranks(sd), "stats": home.stats(),
            "copies": len(home.copies),
            "copies_current": all(torch.equal(home.copies[u.index], u.shard.to(torch.bfloat16))
                                  for u in engine.zero.units if home.holds(u))}
        engine.destroy()
        # the same with the offloaded units' step in the background (offload_optimizer.overlap_step)
        overlap = {**PARAM_OFFLOAD_BF16_FETCH, "sub_group_size": 40,
                   "offload_optimizer": {"device": "cpu", "overlap_step": True}}
        engine = build(3, tied=tied, zero=overlap, **PARAM_OFFLOAD_TRAINING)
        home = engine.zero.param_home
        losses = train(engine, 3, tied)
        sd = state(engine)  # module_state_dict settles the background step first
        results[f"param_offload/tied{tied}/cpu_fetch_bf16_overlap"] = {
            "losses": losses, "state": sd, "stats": {**home.stats(), **engine.zero.offload.stats()},
            "copies_current": all(torch.equal(home.copies[u.index], u.shard.to(torch.bfloat16))
                                  for u in engine.zero.units if home.holds(u))}
        engine.destroy()
        # later micro-steps' gradient shards staged in bf16 for the host adds (offload_optimizer.staging_dtype)
        engine = build(3, tied=tied, zero=PARAM_OFFLOAD_BF16_STAGING, **PARAM_OFFLOAD_TRAINING)
        losses = train(engine, 3, tied)
        sd = state(engine)
        offload = engine.zero.offload
        results[f"param_offload/tied{tied}/cpu_staging_bf16"] = {
            "losses": losses, "state": sd, "ranks_agree": same_on_all_ranks(sd), "stats": offload.stats(),
            "staging_dtypes": sorted({str(b.dtype) for b in offload._staging_free})}
        engine.destroy()
    runs = param_offload_runs(ckpt_root / "nvme")
    straight = build(3, zero=runs["nvme_both"], **CKPT)
    train(straight, 4)
    results["param_offload/ckpt/straight"] = state(straight)
    straight.destroy()
    first = build(3, zero=runs["nvme_both"], **CKPT)
    train(first, 2)
    first.save_checkpoint(ckpt_root / "param-offload")
    first.destroy()
    resumed = build(3, seed=99, zero=runs["nvme_both"], **CKPT)
    resumed.load_checkpoint(ckpt_root / "param-offload")
    train(resumed, 2, start=2)
    results["param_offload/ckpt/resumed"] = state(resumed)
    resumed.destroy()


def main_mode(out, ckpt_root):
    results = {}
    run_param_offload(results, ckpt_root)
    run_16bit(results, ckpt_root)
    run_start_from_rank0(results)
    run_matrix(results)
    run_comms(results)
    run_checkpoints(results, ckpt_root)
    if comm.get_rank() == 0:
        torch.save(results, out)


def reload_mode(out, ckpt_root):
    results = {}
    for stage in (1, 2, 3):
        engine = build(stage, **CKPT)
        engine.load_checkpoint(ckpt_root / f"stage{stage}")
        results[f"reload/stage{stage}/state"] = state(engine)
        engine.save_checkpoint(ckpt_root / f"stage{stage}-3ranks")
        losses = train(engine, 1, start=2)
        results[f"reload/stage{stage}/finite"] = all(torch.isfinite(x).item() for x in losses)
        engine.destroy()
    for stage in (0, 2):
        engine = build(stage, gradient_clipping=0.05)
        train(engine, 3)
        results[f"three/stage{stage}"] = state(engine)
        engine.destroy()
    if comm.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    mode, out, ckpt_root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    {"main": main_mode, "reload": reload_mode}[mode](out, ckpt_root)
