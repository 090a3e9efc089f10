"""One rank of the tensor-parallel CUDA-graph test, started by torchrun over NCCL (see
test_tp_graph_gpu.py).

Every rank builds the same dslab GPT-2 from one seed and injects it at tp_size = world size twice,
fp32: with the per-token step in CUDA graphs (its all_reduces captured) and eagerly. Each engine
generates greedily from the same left-padded prompt, the graphed one twice (the first generation
captures, the second only replays), each generation under its own comms logger. Recorded: the
tokens, the graph counters each generation added, the engine's notes and, per generation, the
logged all_reduces (seq, bytes, whether announced by a replay, whether timed). Results go to
``argv[1]/rank{r}.json``.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import dslab  # noqa: E402
from dslab import comm  # noqa: E402
from dslab.inference.decode import WARMUP_RUNS  # noqa: E402
from dslab.profilers.comms import CommsLogger, CommsLoggerConfig  # noqa: E402
from tiny_models import dslab_gpt2, prompts  # noqa: E402

NEW_TOKENS = 8


def logged_generate(engine, ids, mask) -> dict:
    """One greedy generation under a fresh comms logger: its tokens, the graph counters it added
    and the collectives the logger counted."""
    before = engine.cuda_graph_stats
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    try:
        tokens = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
        records = logger.local_records()
    finally:
        logger.close()
    after = engine.cuda_graph_stats
    return {
        "tokens": tokens.tolist(),
        "added": {key: after[key] - before.get(key, 0) for key in after},
        "calls": [{"op": r["op"], "seq": r["seq"], "bytes": r["bytes"], "graph_replay": r.get("graph_replay", False),
                   "timed": r["latency_ms"] is not None} for r in records],
    }


def main(out_dir: Path) -> None:
    comm.init_distributed(dist_backend="nccl")
    world, rank = comm.get_world_size(), comm.get_rank()
    model = dslab_gpt2()
    ids, mask = prompts(2, 12, vocab=model.config.vocab_size, pads=[0, 4])
    ids, mask = ids.cuda(), mask.cuda()
    options = {"dtype": torch.float32, "tensor_parallel": {"tp_size": world}, "max_out_tokens": 64}
    graphed = dslab.init_inference(model, enable_cuda_graph=True, **options)
    eager = dslab.init_inference(model, enable_cuda_graph=False, **options)
    result = {
        "rank": rank,
        "tp_size": graphed.tp_size,
        "layers": len(graphed.module.layers),
        "warmup_runs": WARMUP_RUNS,
        "notes": graphed.notes,
        "eager": logged_generate(eager, ids, mask),
        "first": logged_generate(graphed, ids, mask),
        "second": logged_generate(graphed, ids, mask),
        "stats": graphed.cuda_graph_stats,
        "eager_stats": eager.cuda_graph_stats,
    }
    torch.cuda.synchronize()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
