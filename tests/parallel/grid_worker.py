"""One rank of the 3D-parallel engine tests, started by torchrun (or alone): GPT-2 (tiny, fp32,
dropout 0, torch kernels) on a (pipe, data, model) grid through ``dslab.initialize`` - the
engine's loop with ``mpu=grid`` when there is one stage, the pipeline engine's ``train_batch``
otherwise. Writes its losses and its parameters gathered to their dense form (see
test_grid_engine.py).

    grid_worker.py OUT_DIR TP PP DP STEPS MICRO ACCUM [key=value ...] [+ OUT_DIR TP ...]

Options: zero=<stage>, clip=<norm>, sp=1 (sequence parallel), opt=AdamW|SGD, lr=<lr>,
pipeline=1 (the pipeline engine even with one stage).

Runs joined by ``+`` train one after another in the same processes (each its own grid, model and
engine), so the tests pay for one launch, not one per run; a run's ``TP x PP x DP`` must be the
launch's world size. Each run seeds the model from ``torch.manual_seed(0)`` and draws its data
from generators of its own, so it computes what it would alone.
"""

import sys
from pathlib import Path

import torch

import dslab
from dslab import comm
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.gpt2_pipe import gpt2_pipeline_module
from dslab.parallel.tensor_parallel import gather_tensor_parallel_state_dict
from dslab.parallel.topology import PipelineParallelGrid, PipeModelDataParallelTopology

VOCAB, SEQ = 64, 16


def micro_batches(step, accum, micro, dp, dp_rank):
    for a in range(accum):
        g = torch.Generator().manual_seed(1000 * step + a)
        ids = torch.randint(0, VOCAB, (dp * micro, SEQ), generator=g)
        rows = ids[dp_rank * micro:(dp_rank + 1) * micro]
        yield rows, rows


def main(out_dir, tp, pp, dp, steps, micro, accum, options):
    comm.init_distributed(dist_backend="gloo")
    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp))
    config = gpt2_tiny(dropout=0.0, layers=4, vocab_size=VOCAB, n_positions=SEQ, tp_size=tp,
                       sequence_parallel=bool(options.get("sp")))
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
           "optimizer": {"type": options.get("opt", "SGD"), "params": {"lr": float(options.get("lr", 0.5))}},
           "zero_optimization": {"stage": int(options.get("zero", 0))},
           "gradient_clipping": float(options.get("clip", 0.0)), "steps_per_print": 1000}
    torch.manual_seed(0)
    pipeline = pp > 1 or bool(options.get("pipeline"))
    if pipeline:
        model = gpt2_pipeline_module(config, "torch", grid=grid, seed_layers=True, base_seed=3)
        engine, _, _, _ = dslab.initialize(model=model, config=cfg)
    else:
        model = GPT2LMHeadModel(config, "torch", tp_group=grid.get_model_parallel_group())
        engine, _, _, _ = dslab.initialize(model=model, config=cfg, mpu=grid)
    dp_rank = grid.get_data_parallel_rank()
    losses = []
    for step in range(steps):
        batches = micro_batches(step, accum, micro, dp, dp_rank)
        if pipeline:
            losses.append(float(engine.train_batch(batches)))
            continue
        total = 0.0
        for ids, labels in batches:
            loss = engine(ids, labels=labels)
            engine.backward(loss)
            engine.step()
            total += float(loss)
        mean = torch.tensor(total / accum)
        if dp > 1:  # the batch's loss: the mean over the data-parallel replicas too
            comm.all_reduce(mean, group=grid.get_data_parallel_group())
            mean /= dp
        losses.append(float(mean))
    if tp > 1:
        params = gather_tensor_parallel_state_dict(engine.module, grid.get_model_parallel_group())
    else:
        params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    torch.save({"rank": comm.get_rank(), "losses": losses, "params": params,
                "coord": tuple(grid.topology().get_coord(comm.get_rank()))},
               Path(out_dir) / f"rank{comm.get_rank()}.pt")
    engine.destroy()


def split_runs(args: list[str]) -> list[list[str]]:
    """The command line's runs: the argument lists between ``+``."""
    runs = [[]]
    for arg in args:
        if arg == "+":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


if __name__ == "__main__":
    for run in split_runs(sys.argv[1:]):
        opts = dict(a.split("=", 1) for a in run[7:])
        main(run[0], *(int(a) for a in run[1:7]), opts)
