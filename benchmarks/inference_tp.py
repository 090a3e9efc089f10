"""Decode with tensor parallelism: ``dslab.init_inference`` at tp_size 1 and at tp_size =
WORLD_SIZE on the same random model, per-token time and whether the greedy tokens agree.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 benchmarks/inference_tp.py \\
        [--preset gpt2_774m | llama3_8b] [--batches 1,32] [--prompt 32] [--new 128] [--trials 3]

Every rank builds transformers' ``GPT2LMHeadModel`` (a ``gpt2*`` preset of
:mod:`dslab.models.gpt2`) or ``LlamaForCausalLM`` (a ``llama*`` preset of :mod:`dslab.models.llama`:
``llama3_8b`` is Llama-3-8B's shape, 16 GB in bf16, grouped-query attention whose 8 KV heads
tp_size 2, 4 and 8 divide) of the preset from one seed (bf16) and injects
it twice: alone (tp_size 1) and sliced over all ranks (each rank holds its share of the heads and
MLP columns; two all_reduces per layer through ``dslab.comm``); both run the per-token step from
CUDA graphs (the sliced step's graph holds its NCCL all_reduces), and ``--eager`` adds the sliced
step without graphs for comparison. Each generation is timed by
:class:`dslab.inference.TokenClock` (CUDA events per token); the table on rank 0 gives the median
per-token gap of ``--trials`` generations after one warm-up, and the first new token where the two
greedy sequences differ (bf16: the sliced sums round differently, so a near-tie of a random model
can flip). The tp_size-1 engine on each rank is the same computation; rank 0's is reported.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from dslab import comm
from dslab.bench.inference import HF_BUILDERS, make_prompts
from dslab.inference import TokenClock, init_inference


def per_token_ms(engine, prompts, new_tokens: int, trials: int) -> tuple[float, torch.Tensor]:
    clock = TokenClock(prompts.device)
    engine.token_clock = clock
    mask = torch.ones_like(prompts)
    engine.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens)  # warm-up, graph capture
    gaps, tokens = [], None
    for _ in range(trials):
        tokens = engine.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens)
        gaps.append(statistics.median(clock.result()["per_token_ms"]))
    return statistics.median(gaps), tokens


def first_difference(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> int | None:
    """The first new-token position where any row of ``a`` and ``b`` differ, else None."""
    differ = (a[:, prompt_len:] != b[:, prompt_len:]).any(dim=0).nonzero()
    return int(differ[0]) if differ.numel() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2_774m",
                        help="a dslab.models.gpt2 or dslab.models.llama preset whose heads the world size divides "
                             "(GPT-2 1.5B has 25 heads: tp_size 5 only; llama3_8b: 32 heads, 8 KV heads)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eager", action="store_true", help="also time the sliced step without CUDA graphs")
    args = parser.parse_args()
    comm.init_distributed()
    world, rank = comm.get_world_size(), comm.get_rank()
    cuda = torch.cuda.is_available()
    # on a CPU (gloo ranks, fp32) it checks the pipeline, not speed
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    family = "llama" if args.preset.startswith("llama") else "gpt2"
    model = HF_BUILDERS[family](args.preset, {}, args.seed, dtype, device)
    max_out = args.prompt + args.new
    alone = init_inference(model, dtype=dtype, max_out_tokens=max_out)
    sliced = init_inference(model, dtype=dtype, max_out_tokens=max_out, tensor_parallel={"tp_size": world})
    eager = init_inference(model, dtype=dtype, max_out_tokens=max_out, tensor_parallel={"tp_size": world},
                           enable_cuda_graph=False) if args.eager else None
    del model
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = make_prompts(batch, args.prompt, alone.module.vocab_size, args.seed, device)
        t1, tokens1 = per_token_ms(alone, prompts, args.new, args.trials)
        comm.barrier()
        tn, tokens_n = per_token_ms(sliced, prompts, args.new, args.trials)
        if rank == 0:
            print(f"batch {batch}: tp1 {t1:.3f} ms/token, tp{world} {tn:.3f}", flush=True)
        te = per_token_ms(eager, prompts, args.new, args.trials)[0] if eager is not None else float("nan")
        rows.append((batch, t1, tn, te, first_difference(tokens1, tokens_n, args.prompt)))
    if rank == 0:
        where = torch.cuda.get_device_name(device) if cuda else "CPU (gloo; checks the pipeline, not speed)"
        print(f"\n{args.preset} on {world} x {where}, {str(dtype).replace('torch.', '')}, prompt {args.prompt} "
              f"+ {args.new} new tokens, median of {args.trials} generations")
        print(f"graphs: tp1 {alone.cuda_graph_stats}, tp{world} {sliced.cuda_graph_stats}; notes {sliced.notes}")
        print(f"{'batch':>5} {'tp1 ms/token':>13} {f'tp{world} ms/token':>13} {'tp1/tp' + str(world):>9} "
              f"{f'tp{world} eager':>11} {'first differing token':>22}")
        for batch, t1, tn, te, diff in rows:
            print(f"{batch:>5} {t1:>13.3f} {tn:>13.3f} {t1 / tn:>9.2f} {te:>11.3f} "
                  f"{('none' if diff is None else diff):>22}")
    for engine in (alone, sliced, eager):  # graphs holding NCCL work go before the communicator does
        if engine is not None:
            engine.release_cuda_graphs()
    if cuda:
        torch.cuda.synchronize()
    # the engines hold the process group: dropped here, it is destroyed below while the interpreter
    # is whole, not in its teardown (where a gloo group's threads can abort the process)
    del alone, sliced, eager, engine
    gc.collect()
    comm.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
