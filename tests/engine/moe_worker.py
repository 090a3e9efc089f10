"""One rank of the engine's MoE tests, started by torchrun (see test_moe_engine.py).

``four OUT CKPT``: 4 ranks. ZeRO stages 0-3 with ep_size 1, 2 and 4 (plain and clipped with
accumulation), DeepSpeed-style param groups, optimizer offload, an fp16 overflow in one rank's
expert gradients, and checkpoints (resume, the files, loads at other layouts).
``two OUT CKPT``: 2 ranks. ep_size 2 against ep_size 1 at stages 0-2, and loading the 4-rank
checkpoint (another world size); dslab.moe.MoE at ep_size 2 against ep_size 1.
"""

import sys
from pathlib import Path

import torch

import dslab
from dslab import comm
from dslab.engine.checkpoint_io import CheckpointError
from dslab.engine.expert_checkpoint import expert_keys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import TinyNet, base_config, make_data  # noqa: E402
from moe_model import CLASSES, DIM, MoENet, RealMoENet, dense_and_expert_groups  # noqa: E402


def build(stage, ep_size, seed=0, expert_seed=1, deepspeed_groups=False, **overrides):
    zero = {"stage": stage, "reduce_bucket_size": 50}
    zero.update(overrides.pop("zero", {}))
    cfg = base_config(train_micro_batch_size_per_gpu=4, zero_optimization=zero, **overrides)
    torch.manual_seed(seed)
    model = MoENet(ep_size, expert_seed=expert_seed)
    params = dense_and_expert_groups(model, f"ep_size_{ep_size}") if deepspeed_groups else None
    engine, _, _, _ = dslab.initialize(model=model, config=cfg, model_parameters=params)
    return engine


def batches(engine, steps, start=0):
    """This rank's micro-batches of global steps ``start .. start + steps``."""
    micro, accum, world = (engine.train_micro_batch_size_per_gpu(),
                           engine.gradient_accumulation_steps(), engine.world_size)
    x, y = make_data(micro * accum * world * (start + steps), dim=DIM, classes=CLASSES, seed=7)
    for s in range(start, start + steps):
        for a in range(accum):
            lo = s * micro * accum * world + (a * world + engine.rank) * micro
            yield x[lo:lo + micro], y[lo:lo + micro]


def train(engine, steps, start=0):
    losses = []
    for xb, yb in batches(engine, steps, start):
        loss = engine(xb, yb)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return losses


def gathered(engine):
    """The model's whole state (every ep rank's experts concatenated in expert order) and whether
    the ranks hold what they should: the same non-expert values everywhere, the same experts on
    the ranks of one expert-data-parallel group. A collective."""
    ep_size = max(engine.expert_layout["expert_groups"].values())
    world = engine.world_size
    out, consistent = {}, True
    experts = expert_keys(engine.module)
    for key, value in engine.module_state_dict().items():
        value = value.detach().cpu().clone()
        every = comm.all_gather_object(value)
        if key in experts:
            out[key] = torch.cat(every[:ep_size])
            consistent &= all(torch.equal(every[r], every[r % ep_size]) for r in range(world))
        else:
            out[key] = value
            consistent &= all(torch.equal(v, value) for v in every)
    return out, consistent


def loss_table(losses):
    """Every rank's losses, ``[rank][step]``."""
    return comm.all_gather_object(torch.stack(losses))


def run(results, key, stage, ep_size, steps=3, **overrides):
    engine = build(stage, ep_size, **overrides)
    if stage == 0 and ep_size == 1 and "initial" not in results:
        results["initial"] = gathered(engine)[0]
    losses = train(engine, steps)
    state, consistent = gathered(engine)
    results[key] = {"losses": loss_table(losses), "state": state, "consistent": consistent,
                    "groups": [(g.get("name"), bool(g.get("moe", False)), len(g["params"]))
                               for g in engine.optimizer.param_groups]}
    engine.destroy()


# SGD: the clipping coefficient scales the update itself (Adam would undo a uniform scale)
SGD = {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}}
SCENARIOS = {
    "fp32": {},
    "accum_clip": {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05, "optimizer": SGD},
}


def run_matrix(results, ep_sizes):
    for name, overrides in SCENARIOS.items():
        for stage in (0, 1, 2, 3):
            for ep_size in ep_sizes:
                run(results, f"{name}/stage{stage}/ep{ep_size}", stage, ep_size, **overrides)


def run_variants(results):
    # DeepSpeed's form: param groups from split_params_into_different_moe_groups_for_optimizer
    for stage in (0, 2):
        run(results, f"deepspeed_groups/stage{stage}/ep2", stage, 2, deepspeed_groups=True,
            **SCENARIOS["accum_clip"])
    run(results, "offload/stage2/ep2", 2, 2, zero={"offload_optimizer": {"device": "cpu"}},
        **SCENARIOS["accum_clip"])
    unclipped = dict(SCENARIOS["accum_clip"], gradient_clipping=0.0)
    run(results, "accum_noclip/stage0/ep1", 0, 1, **unclipped)


def run_overflow(results):
    """fp16: rank 1's expert gradient overflows on the second step; only ranks 1 and 3 (its
    expert-data-parallel group at ep_size 2) see it, and every rank must skip that step."""
    for stage in (0, 1, 2):
        engine = build(stage, 2, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
        backwards = [0]

        def poison(grad):
            backwards[0] += 1
            return torch.full_like(grad, float("inf")) if backwards[0] == 2 else grad

        if engine.rank == 1:
            engine.module.experts.weight.register_hook(poison)
        train(engine, 3)
        _, consistent = gathered(engine)
        results[f"overflow/stage{stage}"] = {
            "skipped": comm.all_gather_object(engine.skipped_steps), "consistent": consistent}
        engine.destroy()


CKPT = {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.02}}}


def _error(fn) -> str | None:
    try:
        fn()
    except CheckpointError as err:
        return str(err)
    return None


def run_checkpoints(results, ckpt_root):
    for stage in (0, 1, 2):
        straight = build(stage, 2, **CKPT)
        expected = train(straight, 4)
        results[f"ckpt/stage{stage}/straight"] = gathered(straight)[0]
        straight.destroy()

        first = build(stage, 2, **CKPT)
        head = train(first, 2)
        first.save_checkpoint(ckpt_root / f"stage{stage}", client_state={"stage": stage})
        results[f"ckpt/stage{stage}/saved"] = gathered(first)[0]
        first.destroy()

        resumed = build(stage, 2, seed=99, expert_seed=5, **CKPT)
        _, client = resumed.load_checkpoint(ckpt_root / f"stage{stage}")
        tail = train(resumed, 2, start=2)
        results[f"ckpt/stage{stage}/resumed"] = gathered(resumed)[0]
        results[f"ckpt/stage{stage}/losses_equal"] = all(comm.all_gather_object(
            all(torch.equal(a, b) for a, b in zip(expected, head + tail))))
        results[f"ckpt/stage{stage}/client"] = client
        resumed.destroy()

    # the weights alone, into another stage (other units): stage 0 from stage 2, stage 1 from 0
    for stage, source in ((0, 2), (1, 0)):
        engine = build(stage, 2, seed=99, expert_seed=5, **CKPT)
        engine.load_checkpoint(ckpt_root / f"stage{source}", load_optimizer_states=False)
        results[f"ckpt/weights/stage{stage}_from_stage{source}"] = gathered(engine)[0]
        results[f"ckpt/weights/stage{stage}_from_stage{source}/optimizer_error"] = _error(
            lambda: engine.load_checkpoint(ckpt_root / f"stage{source}"))
        engine.destroy()

    engine = build(0, 4, **CKPT)
    results["ckpt/error/ep4"] = _error(lambda: engine.load_checkpoint(ckpt_root / "stage0"))
    engine.destroy()
    dense, _, _, _ = dslab.initialize(model=TinyNet(DIM, 8, CLASSES), config=base_config())
    results["ckpt/error/dense"] = _error(lambda: dense.load_checkpoint(ckpt_root / "stage2"))
    dense.destroy()
    engine = build(1, 2)
    try:
        engine.save_16bit_model(ckpt_root / "16bit")
        results["16bit/error"] = None
    except ValueError as err:
        results["16bit/error"] = str(err)
    engine.destroy()


def run_real_moe(results):
    """dslab.moe.MoE (top-1, no random token selection) at ep_size 2 and 1, stages 0, 2 and 3."""
    for stage in (0, 2, 3):
        for ep_size in (1, 2):
            cfg = base_config(train_micro_batch_size_per_gpu=4, gradient_clipping=0.05,
                              gradient_accumulation_steps=2, optimizer=SGD,
                              zero_optimization={"stage": stage, "reduce_bucket_size": 50})
            torch.manual_seed(0)
            engine, _, _, _ = dslab.initialize(model=RealMoENet(ep_size), config=cfg)
            if stage == 0 and ep_size == 1:
                results["real_moe/initial"] = gathered(engine)[0]
            losses = train(engine, 3)
            state, consistent = gathered(engine)
            results[f"real_moe/stage{stage}/ep{ep_size}"] = {
                "losses": loss_table(losses), "state": state, "consistent": consistent}
            engine.destroy()


def four_mode(out, ckpt_root):
    results = {}
    run_matrix(results, (1, 2, 4))
    run_variants(results)
    run_overflow(results)
    run_checkpoints(results, ckpt_root)
    if comm.get_rank() == 0:
        torch.save(results, out)


def two_mode(out, ckpt_root):
    results = {}
    for stage in (0, 1, 2):
        for ep_size in (1, 2):
            run(results, f"accum_clip/stage{stage}/ep{ep_size}", stage, ep_size,
                **SCENARIOS["accum_clip"])
    engine = build(2, 2, **CKPT)
    results["ckpt/error/world"] = _error(lambda: engine.load_checkpoint(ckpt_root / "stage2"))
    engine.destroy()
    run_real_moe(results)
    if comm.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    mode, out, ckpt_root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    comm.init_distributed(dist_backend="gloo")  # the expert groups are made with the model
    {"four": four_mode, "two": two_mode}[mode](out, ckpt_root)
