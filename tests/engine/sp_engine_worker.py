"""One rank of the engine's sequence-parallel tests, started by torchrun on 4 ranks (see
test_engine_sequence_parallel.py):

    sp_engine_worker.py OUT_DIR

``sequence_parallel_size`` 2 on 4 ranks (data 2 x sequence 2). Each case builds a tiny GPT-2 split
over ``initialize_sequence_parallel(2)``'s group from a seed of its own per rank (the engine must
start every rank from rank 0's weights), takes its micro-batches from the data loader
``dslab.initialize`` returns, and trains 3 optimizer steps with SGD and momentum: unlike Adam's,
and unlike a binding clip's, its step scales with the gradient, so a gradient summed where it
should be averaged, or the reverse, shows. Rank 0 then trains the unsplit model built from rank
0's seed, in its process alone, on the global batch (the data-parallel ranks' micro-batches,
gathered). Every micro-step's engine loss (averaged over the data-parallel ranks) must equal the
single-process loss, and the engine's final whole parameters the single-process ones. The cases:
ZeRO stages 0 to 3; layer checkpoints with an ``activation_checkpointing`` section at stages 1
and 3; gradient accumulation at stage 1; a binding clip by the global norm at stage 2. Then a
checkpoint round trip at stages 1 and 3 (saved after 2 steps, loaded into an engine built from
other weights, which then trains the next 2 steps to the saving engine's losses and parameters),
fp16 with a loss scale that overflows the first steps at stages 2 and 3, and the sizes and models
the engine refuses. Each rank writes ``rank<r>.json``.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import dslab
from dslab import comm
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.parallel.sequence import initialize_sequence_parallel

SP, MICRO, SEQ, STEPS, SEED = 2, 2, 16, 3, 5
TOL = dict(rtol=1e-5, atol=1e-6)
LR, MOMENTUM = 0.3, 0.5
CASES = {  # name: (zero stage, gradient accumulation, checkpoint_layers, kernels, gradient_clipping)
    "stage0": (0, 1, 0, "torch", 0.0),
    "stage1_checkpoint_accum": (1, 2, 1, "dslab", 0.0),
    "stage2_clip": (2, 1, 0, "dslab", 0.5),
    "stage3_checkpoint": (3, 1, 1, "dslab", 0.0),
}


def config(stage: int, accum: int, checkpoint: bool, clip: float = 0.0, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum,
           "sequence_parallel_size": SP, "gradient_clipping": clip,
           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
           "zero_optimization": {"stage": stage}}
    if checkpoint:
        cfg["activation_checkpointing"] = {"cpu_checkpointing": False}
    return {**cfg, **extra}


def gpt2(kernels: str, checkpoint_layers: int = 0, sp: int = SP, group=None):
    return GPT2LMHeadModel(gpt2_tiny(dropout=0.0, layers=2, checkpoint_layers=checkpoint_layers,
                                     sequence_parallel_size=sp), kernels=kernels, sp_group=group)


def train_reference(kernels: str, batches: list[torch.Tensor], accum: int, clip: float) -> tuple[list, dict]:
    """The unsplit model from rank 0's seed, trained in this process alone on ``batches`` (the
    global micro-batches): its losses and final state, after checking that clipping bound and
    that every parameter moved."""
    torch.manual_seed(SEED)
    whole = gpt2(kernels, sp=1)
    initial = {name: value.clone() for name, value in whole.state_dict().items()}
    optimizer = torch.optim.SGD(whole.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for step, ids in enumerate(batches):
        loss = whole(ids, ids)
        (loss / accum).backward()
        losses.append(loss.item())
        if (step + 1) % accum == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(whole.parameters(), clip or float("inf")).item())
            optimizer.step()
            optimizer.zero_grad()
    if clip:  # the clip bound: every step's norm was above it
        assert min(norms) > clip, norms
    state = whole.state_dict()
    for name, value in state.items():  # every parameter trained: the comparison is not of untouched weights
        assert (value - initial[name]).abs().max() > 1e-4, name
    return losses, state


def run_case(stage: int, accum: int, checkpoint_layers: int, kernels: str, clip: float) -> dict:
    groups = initialize_sequence_parallel(SP)
    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(SEED + rank)
    model = gpt2(kernels, checkpoint_layers, group=groups.group)
    data = TensorDataset(torch.randint(0, model.config.vocab_size, (64, SEQ),
                                       generator=torch.Generator().manual_seed(3)))
    engine, _, loader, _ = dslab.initialize(model=model, training_data=data,
                                            config=config(stage, accum, checkpoint_layers > 0, clip))
    assert engine.sequence_parallel_group is groups.group
    assert (engine.dp_world_size, engine.dp_rank, engine.seq_dp_world_size) == (world // SP, rank // SP, world)
    assert engine.train_batch_size() == MICRO * accum * (world // SP)
    batches = iter(loader)
    losses, global_batches = [], []
    for _ in range(STEPS * accum):
        (ids,) = next(batches)
        gathered = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(gathered, ids)
        # the ranks of a sequence-parallel group read the same samples, the data-parallel ranks others
        assert all(torch.equal(gathered[r], gathered[r - r % SP]) for r in range(world))
        assert not torch.equal(gathered[0], gathered[SP])
        global_batches.append(torch.cat(gathered[::SP]))
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=groups.data_parallel_group)
        losses.append(mean.item() / (world // SP))
    state = engine.module_state_dict()  # a collective at stage 3
    engine.destroy()
    # one process trains the reference (the others would only repeat it on the shared cores)
    reference = [None]
    if rank == 0:
        reference_losses, reference_state = train_reference(kernels, global_batches, accum, clip)
        for name, value in reference_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        reference = [reference_losses]
    dist.broadcast_object_list(reference, src=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), **TOL)
    return {"losses": losses, "reference_losses": reference[0], "engine_steps": engine.global_steps}


def checkpoint_round_trip(stage: int, out: Path) -> dict:
    """Save under sequence parallelism after 2 steps; an engine built from other weights loads
    the checkpoint and trains the next 2 micro-batches to the same losses and parameters."""
    groups = initialize_sequence_parallel(SP)
    rank = comm.get_rank()
    data = TensorDataset(torch.randint(0, 1000, (64, SEQ), generator=torch.Generator().manual_seed(4)))

    def build(seed: int):
        torch.manual_seed(seed + rank)
        model = gpt2("dslab", 1, group=groups.group)
        engine, _, loader, _ = dslab.initialize(model=model, training_data=data, config=config(stage, 1, True))
        return engine, loader

    def train(engine, batches) -> list[float]:
        losses = []
        for ids in batches:
            loss = engine(ids, ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    saving, loader = build(SEED)
    batches = [ids for (ids,), _ in zip(loader, range(4))]
    train(saving, batches[:2])
    path = saving.save_checkpoint(out / f"sp_checkpoint_stage{stage}")
    expected = train(saving, batches[2:])
    expected_state = saving.module_state_dict()
    saving.destroy()
    loading, _ = build(SEED + 100)
    before = loading.module_state_dict()
    differed = any(not torch.equal(before[k], expected_state[k]) for k in before)
    loaded, _ = loading.load_checkpoint(out / f"sp_checkpoint_stage{stage}")
    assert Path(loaded) == Path(path), (loaded, path)
    resumed = train(loading, batches[2:])
    state = loading.module_state_dict()
    loading.destroy()
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(expected), rtol=1e-6, atol=1e-7)
    for name, value in expected_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    return {"expected": expected, "resumed": resumed, "started_elsewhere": differed}


def fp16_overflows(stage: int) -> dict:
    """fp16 with a loss scale so high that the first steps overflow: every rank must skip the
    same steps (one rank's overflow is every rank's, though each holds other gradient shards)
    and end with the same scale and parameters."""
    groups = initialize_sequence_parallel(SP)
    rank = comm.get_rank()
    torch.manual_seed(SEED + rank)
    model = gpt2("torch", group=groups.group)
    fp16 = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2, "hysteresis": 1}
    engine, _, _, _ = dslab.initialize(model=model, config=config(stage, 1, False, fp16=fp16))
    ids = torch.randint(0, 1000, (MICRO, SEQ), generator=torch.Generator().manual_seed(7 + rank // SP))
    losses, scales = [], []
    for _ in range(12):
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.float()))
        scales.append(engine.loss_scale)
    state = engine.module_state_dict()
    engine.destroy()
    checksum = float(sum(v.double().sum() for v in state.values()))
    return {"skipped": engine.skipped_steps, "scales": scales, "losses": losses, "checksum": checksum}


def refusal(build) -> str:
    try:
        build()
    except ValueError as err:
        return str(err)
    return "accepted"


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    result = {"rank": rank, "world": dist.get_world_size()}
    for name, case in CASES.items():
        result[name] = run_case(*case)
    for stage in (1, 3):
        result[f"checkpoint_stage{stage}"] = checkpoint_round_trip(stage, out)
    for stage in (2, 3):
        result[f"fp16_stage{stage}"] = fp16_overflows(stage)
    groups = initialize_sequence_parallel(SP)
    split = gpt2("torch", group=groups.group)
    result["world_not_divisible"] = refusal(lambda: dslab.initialize(
        model=gpt2("torch", sp=1), config=config(1, 1, False, sequence_parallel_size=3)))
    result["model_size_differs"] = refusal(lambda: dslab.initialize(
        model=split, config=config(1, 1, False, sequence_parallel_size=1)))
    result["model_group_differs"] = refusal(lambda: dslab.initialize(
        model=gpt2("torch", group=groups.data_parallel_group), config=config(0, 1, False)))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
