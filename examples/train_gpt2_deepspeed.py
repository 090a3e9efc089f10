"""examples/train_gpt2.py on DeepSpeed's engine: the same dslab GPT-2 (dslab's kernels) and random
tokens, trained by ``deepspeed.initialize``; what DeepSpeed's own autotuner tunes beside `dslab
autotune` (benchmarks/autotune_vs_deepspeed.sh).

    deepspeed --autotuning tune --num_gpus 1 examples/train_gpt2_deepspeed.py --model gpt2_355m \\
        --steps 8 --deepspeed_config ds_config.json
    python3 examples/train_gpt2_deepspeed.py --model gpt2_tiny --steps 5 --deepspeed_config cfg.json

The config comes whole from ``--deepspeed_config`` (a path, or the base64 text DeepSpeed's
autotuner passes its experiments); an ``autotuning`` section of a tuned config
(``ds_config_optimal.json``) is dropped when ``--timed_from`` asks for a timed run, so that the
engine trains instead of profiling. ``--timed_from K`` times optimizer steps K+1..``--steps`` on the
device clock (synchronised at both ends) and prints ``timed: <tokens/s> tokens/s``, as
examples/train_gpt2.py does.
"""

import argparse
import base64
import json
import os
import time
from pathlib import Path

import torch

from dslab.bench.measure import TimedWindow
from dslab.models import gpt2 as gpt2_models

PRESETS = ("gpt2_tiny", "gpt2_124m", "gpt2_355m", "gpt2_774m", "gpt2_1558m")


def read_config(text: str) -> dict:
    """A DeepSpeed config from a JSON file's path or from base64 JSON (DeepSpeed's autotuner)."""
    try:
        is_file = Path(text).is_file()
    except OSError:  # base64 text longer than a file name may be
        is_file = False
    if is_file:
        return json.loads(Path(text).read_text())
    try:
        return json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise SystemExit(f"--deepspeed_config {text[:60]!r}: neither a file nor base64 JSON") from None


def main():
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=PRESETS, default="gpt2_124m")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timed_from", type=int, default=None,
                        help="time the optimizer steps after this one and print tokens/s")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None:
        parser.error("--deepspeed_config is required (a DeepSpeed JSON config)")
    if args.timed_from is not None and not 0 <= args.timed_from < args.steps:
        parser.error(f"--timed_from must be in [0, --steps) = [0, {args.steps}), got {args.timed_from}")
    config = read_config(args.deepspeed_config)
    if args.timed_from is not None:
        config.pop("autotuning", None)
    model_config = gpt2_models.__dict__[args.model](vocab_pad_multiple=64, dropout=0.0)
    if args.seq > model_config.n_positions:
        parser.error(f"--seq {args.seq} exceeds the model's n_positions {model_config.n_positions}")
    deepspeed.init_distributed()
    device = torch.device("cuda", args.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    kernels = "dslab" if device.type == "cuda" else "torch"
    model = gpt2_models.GPT2LMHeadModel(model_config, kernels=kernels).to(device)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           config=config)
    g = torch.Generator().manual_seed(1000 + engine.global_rank)
    micro = engine.train_micro_batch_size_per_gpu()
    window = TimedWindow(device, args.timed_from)
    t0 = time.perf_counter()
    while engine.global_steps < args.steps:
        window.mark(engine.global_steps)
        tokens = torch.randint(0, model_config.vocab_size, (micro, args.seq), generator=g).to(device)
        loss = engine(tokens, labels=tokens)
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0 and engine.global_steps % 5 == 0 and engine.is_gradient_accumulation_boundary():
            print(f"step {engine.global_steps:4d}  loss {loss.item():.4f}", flush=True)
    timed = window.line(engine.global_steps, micro * engine.gradient_accumulation_steps() * engine.world_size * args.seq)
    if engine.global_rank == 0:
        print(f"{engine.global_steps} steps in {time.perf_counter() - t0:.1f}s on {device} x{engine.world_size}")
        if timed is not None:
            print(timed, flush=True)


if __name__ == "__main__":
    main()
