"""One rank of the 2-GPU check of CUDA-graphed layer stacks with collectives inside (see
test_parallel_graphs_gpu.py), started by torchrun on 2 nccl processes:

    parallel_graphs_worker.py OUT_DIR

GPT-2 tiny (dslab kernels, bf16, dropout 0, AdamW, clipping 1.0) trained by the engine for 4
steps with ``cuda_graphs`` on and off, from the same weights on one batch: split over the 2
ranks by tensor parallelism (``tp_size`` 2, an mpu), then by sequence parallelism
(``sequence_parallel_size`` 2). Each rank writes ``rank<r>.json`` with both runs' losses, the
largest difference of their final parameters, the graphed run's stack counters, and the
collectives each run issued per step as the comm layer's observers saw them (a graphed step's are
announced at its replays). Without GPUs it runs on 2 gloo processes, where the stack runs eagerly
either way (a check of the worker, not of the graphs).
"""

import json
import sys
from collections import Counter
from pathlib import Path

import torch

import dslab
from dslab import comm
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.parallel.sequence import initialize_sequence_parallel
from dslab.parallel.topology import PipelineParallelGrid, PipeModelDataParallelTopology

STEPS, MICRO, SEQ = 4, 2, 64


class Counting:
    """Counts the collectives the observers see, by op."""

    def __init__(self):
        self.ops = Counter()

    def before(self, call):
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self.ops[call.op] += 1

    def after(self, call, work):
        pass

    def replayed(self, call):
        self.ops[call.op] += 1


def train(layout: str, graphs: bool) -> dict:
    rank = comm.get_rank()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "gradient_clipping": 1.0, "steps_per_print": 10**9, "cuda_graphs": {"enabled": graphs},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    torch.manual_seed(0)
    if layout == "tp":
        grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
        model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0, tp_size=2), "dslab", tp_group=grid.get_model_parallel_group())
        engine, _, _, _ = dslab.initialize(model=model, config=config, mpu=grid)
    else:
        groups = initialize_sequence_parallel(2)
        model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0, sequence_parallel_size=2), "dslab", sp_group=groups.group)
        engine, _, _, _ = dslab.initialize(model=model, config={**config, "sequence_parallel_size": 2})
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (MICRO, SEQ), generator=torch.Generator().manual_seed(1)).to(engine.device)
    if layout == "sp":  # this rank's chunk of each sequence
        ids = ids.chunk(2, dim=1)[rank].contiguous()
    counting = Counting()
    comm.add_observer(counting)
    losses, per_step = [], []
    try:
        for step in range(STEPS):
            before = Counter(counting.ops)
            loss = engine(ids, ids)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
            per_step.append(dict(counting.ops - before))
    finally:
        comm.remove_observer(counting)
    state = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
    stats = dict(engine.module.cuda_graph_stats) if graphs else {}
    engine.destroy()
    return {"losses": losses, "state": state, "stats": stats, "per_step": per_step}


def main(out: Path) -> None:
    comm.init_distributed()
    result = {"rank": comm.get_rank()}
    for layout in ("tp", "sp"):
        eager, graphed = train(layout, False), train(layout, True)
        diff = max((eager["state"][k] - graphed["state"][k]).abs().max().item() for k in eager["state"])
        result[layout] = {"eager_losses": eager["losses"], "graphed_losses": graphed["losses"],
                          "max_param_diff": diff, "stats": graphed["stats"],
                          "eager_per_step": eager["per_step"], "graphed_per_step": graphed["per_step"]}
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
