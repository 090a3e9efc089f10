"""One rank of the pipeline tests, started by torchrun (or alone, as one process): trains a small
seeded layer-list model with tied input and output layers and a tuple-carrying middle, and writes
its losses and its stage's parameters (see test_pipeline.py).

    pipe_worker.py OUT_DIR STAGES DP STEPS MICRO ACCUM [key=value ...] [+ OUT_DIR STAGES ...]

Options: zero=<stage>, clip=<norm>, ckpt=<interval>, partition=<method>, bf16=1, fp16=1, comms=1,
model=mlp|gpt2, lr=<lr>, opt=AdamW|SGD, short=1 (then a batch one micro-batch short).

Runs joined by ``+`` train one after another in the same processes (each its own model, engine
and process groups), so the tests pay for one launch, not one per run; a run's ``STAGES x DP``
must be the launch's world size. The model and its data are seeded per run, never from the
process's RNG state, so a run computes what it would alone. The comms logger's counts are the
process's, so a ``comms=1`` run comes first in its launch.
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import dslab
from dslab import comm
from dslab.pipe import LayerSpec, PipeDataParallelTopology, PipelineModule, TiedLayerSpec

VOCAB, DIM, SEQ = 37, 24, 6


class Embed(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.3)

    def forward(self, ids):
        return self.weight[ids]


def head(module, h):
    return h @ module.weight.t()


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class Split(nn.Module):
    """One stream into two that both carry gradients (a tuple crosses a stage boundary)."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, h):
        return h, torch.sigmoid(self.fc(h))


class PairBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, pair):
        h, gate = pair
        return h + gate * torch.tanh(self.fc(h)), gate


class Merge(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, pair):
        h, gate = pair
        return self.fc(h * gate) + h


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def mlp_layers():
    return [TiedLayerSpec("embed", Embed, VOCAB, DIM), LayerSpec(Block, DIM), LayerSpec(Split, DIM),
            LayerSpec(PairBlock, DIM), LayerSpec(Merge, DIM), LayerSpec(Block, DIM),
            TiedLayerSpec("embed", Embed, VOCAB, DIM, forward_fn=head)]


def batches(step: int, accum: int, micro: int, dp: int, dp_rank: int, vocab: int, seq: int):
    """The micro-batches of ``step`` for data-parallel rank ``dp_rank``: rows of one global
    micro-batch of ``dp * micro`` rows, the same on every layout."""
    for a in range(accum):
        g = torch.Generator().manual_seed(1000 * step + a)
        ids = torch.randint(0, vocab, (dp * micro, seq + 1), generator=g)
        rows = ids[dp_rank * micro:(dp_rank + 1) * micro]
        yield rows[:, :-1], rows[:, 1:]


def main(out_dir: str, stages: int, dp: int, steps: int, micro: int, accum: int, options: dict):
    comm.init_distributed(dist_backend="gloo")
    model_kind = options.get("model", "mlp")
    partition = options.get("partition", "uniform")
    if model_kind == "gpt2":
        from dslab.models.gpt2 import gpt2_tiny
        from dslab.models.gpt2_pipe import gpt2_pipeline_layers, gpt2_pipeline_loss

        config = gpt2_tiny(dropout=0.0, layers=4, vocab_size=64, n_positions=16)
        layers, loss, vocab, seq = gpt2_pipeline_layers(config, "torch"), gpt2_pipeline_loss(config, "torch"), 64, 12
    else:
        layers, loss, vocab, seq = mlp_layers(), loss_fn, VOCAB, SEQ
    topology = PipeDataParallelTopology(num_pp=stages, num_dp=dp)
    model = PipelineModule(layers, topology=topology, loss_fn=loss, seed_layers=True, base_seed=11,
                           partition_method=partition,
                           activation_checkpoint_interval=int(options.get("ckpt", 0)))
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
           "optimizer": {"type": options.get("opt", "AdamW"), "params": {"lr": float(options.get("lr", 1e-2))}},
           "zero_optimization": {"stage": int(options.get("zero", 0))},
           "gradient_clipping": float(options.get("clip", 0.0)), "steps_per_print": 1000}
    if options.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    if options.get("fp16"):  # a loss scale that overflows on the first step: the skip is shared
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 19, "loss_scale_window": 2}
    if options.get("comms"):
        cfg["comms_logger"] = {"enabled": True}
    engine, _, _, _ = dslab.initialize(model=model, config=cfg)
    losses = []
    for step in range(steps):
        it = batches(step, accum, micro, dp, engine.dp_rank, vocab, seq)
        losses.append(float(engine.train_batch(it)))
    eval_loss = float(engine.eval_batch(batches(steps, accum, micro, dp, engine.dp_rank, vocab, seq)))
    short_error = None
    if options.get("short"):  # one micro-batch too few: every stage must stop, none may hang
        try:
            engine.train_batch(iter(list(batches(steps, accum, micro, dp, engine.dp_rank, vocab, seq))[:-1]))
        except ValueError as err:
            short_error = str(err)
    records = engine.profiler_records()
    summary = {}
    if options.get("comms"):
        summary = comm.log_summary(return_dict=True)
        summary = {op: sum(row["count"] for row in sizes.values())
                   for op, sizes in summary.items() if isinstance(sizes, dict) and op in ("send", "recv")}
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.save({"rank": comm.get_rank(), "short_error": short_error, "skipped": engine.skipped_steps, "loss_scale": engine.cur_scale, "stage": engine.stage_id, "dp_rank": engine.dp_rank,
                "losses": losses, "eval_loss": eval_loss, "params": params, "parts": model.parts,
                "pipeline": records["pipeline"], "p2p_counts": summary},
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
        opts = dict(a.split("=", 1) for a in run[6:])
        main(run[0], *(int(a) for a in run[1:6]), opts)
