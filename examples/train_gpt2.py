"""A DeepSpeed-style GPT-2 training script on random tokens: what `dslab autotune` tunes on a GPU.

    bin/dslab autotune examples/train_gpt2.py --model gpt2_355m --steps 12 --deepspeed_config cfg.json
    python3 examples/train_gpt2.py --model gpt2_tiny --steps 5 --deepspeed_config cfg.json

Everything the autotuner varies comes from the config (ZeRO stage, micro-batch, gradient
accumulation, offload, ``activation_checkpointing.checkpoint_layers``, ``cuda_graphs``,
``kernels``); the script only builds the model and loops. ``--steps`` counts optimizer steps.
``--timed_from K`` times steps K+1..``--steps`` on the device clock (synchronised at both ends)
and prints ``timed: <tokens/s> tokens/s`` (examples/train_gpt2_deepspeed.py does the same on
DeepSpeed's engine).
"""

import argparse
import time

import torch

import dslab
from dslab.bench.measure import TimedWindow
from dslab.models import gpt2 as gpt2_models

PRESETS = ("gpt2_tiny", "gpt2_124m", "gpt2_355m", "gpt2_774m", "gpt2_1558m")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=PRESETS, default="gpt2_124m")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timed_from", type=int, default=None,
                        help="time the optimizer steps after this one and print tokens/s")
    dslab.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None:
        parser.error("--deepspeed_config is required (a DeepSpeed JSON config)")
    if args.timed_from is not None and not 0 <= args.timed_from < args.steps:
        parser.error(f"--timed_from must be in [0, --steps) = [0, {args.steps}), got {args.timed_from}")
    config = gpt2_models.__dict__[args.model](vocab_pad_multiple=64, dropout=0.0)
    if args.seq > config.n_positions:
        parser.error(f"--seq {args.seq} exceeds the model's n_positions {config.n_positions}")
    torch.manual_seed(0)
    engine, _, _, _ = dslab.initialize(model=gpt2_models.GPT2LMHeadModel(config), config=args.deepspeed_config)
    g = torch.Generator().manual_seed(1000 + engine.rank)
    micro = engine.train_micro_batch_size_per_gpu()
    window = TimedWindow(engine.device, args.timed_from)
    t0 = time.perf_counter()
    while engine.global_steps < args.steps:
        window.mark(engine.global_steps)
        tokens = torch.randint(0, config.vocab_size, (micro, args.seq), generator=g).to(engine.device)
        loss = engine(tokens, labels=tokens)
        engine.backward(loss)
        engine.step()
        if engine.rank == 0 and engine.was_step_applied() and engine.global_steps % 5 == 0:
            print(f"step {engine.global_steps:4d}  loss {loss.item():.4f}", flush=True)
    timed = window.line(engine.global_steps, micro * engine.gradient_accumulation_steps() * engine.world_size * args.seq)
    if engine.rank == 0:
        print(f"{engine.global_steps} steps in {time.perf_counter() - t0:.1f}s on {engine.device} x{engine.world_size}")
        if timed is not None:
            print(timed, flush=True)


if __name__ == "__main__":
    main()
