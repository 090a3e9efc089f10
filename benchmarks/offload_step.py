"""The offloaded optimizer step with the clip factor folded into torch's fused AdamW
(:func:`dslab.engine.zero.offload.folded_factor`) against the same step with a separate scaling
pass over the host's gradients. The model runs where the engine puts it (a GPU when there is one,
whose step then also copies the new parameters back); the optimizer steps on this machine's CPU.

    python benchmarks/offload_step.py [--layers 24] [--dim 2048] [--trials 3] [--steps 12]
                                      [--param-offload] [--json F]

A stack of ``--layers`` Linear(dim, dim) layers (tanh between) trains at ZeRO stage 2 with
``offload_optimizer: cpu`` and gradient clipping 1.0 (so every step has a factor to apply);
``--param-offload`` makes it stage 3 with ``offload_param: cpu`` and bf16 fetch copies (the
2.7B size ladder's job: each step also refreshes the bf16 copies). Each
trial runs both arms, alternating which goes first, each in its own process; a trial's figure is
the median ``engine.step()`` time over its steps after the first two. Prints the per-arm median
over trials, their ratio and the last losses of both arms (equal up to the rounding of a division
against a multiplication), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(arm: str, layers: int, dim: int, steps: int, param_offload: bool) -> dict:
    import torch
    import torch.nn as nn

    import dslab
    from dslab.engine.zero import offload

    if arm == "scale-pass":
        offload.steps_with_grad_scale = lambda optimizer: False

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.square().mean()

    torch.manual_seed(0)
    config = {"train_batch_size": 4, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    if param_offload:
        config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0,
                                       "offload_optimizer": {"device": "cpu"},
                                       "offload_param": {"device": "cpu", "fetch_dtype": "bf16"}}
    engine, _, _, _ = dslab.initialize(model=Stack(), config=config)
    x = torch.randn(4, dim, device=engine.device)
    times, losses = [], []
    for _ in range(steps):
        loss = engine(x)
        engine.backward(loss)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()  # the new parameters' copies back to the GPU
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    params = layers * (dim * dim + dim)  # counted from the model's shape: stage 3 leaves placeholders
    return {"arm": arm, "step_s": statistics.median(times[2:]), "losses": losses, "params": params,
            "device": str(engine.device), "torch_threads": torch.get_num_threads(),
            "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--param-offload", action="store_true",
                        help="stage 3 with offload_param: cpu and bf16 fetch copies (default: stage 2)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=("folded", "scale-pass"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first two are not timed)")
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.dim, args.steps, args.param_offload)))
        return 0
    results: dict[str, list[dict]] = {"folded": [], "scale-pass": []}
    for trial in range(args.trials):
        for arm in (("folded", "scale-pass") if trial % 2 == 0 else ("scale-pass", "folded")):
            cmd = [sys.executable, __file__, "--child", arm, "--layers", str(args.layers), "--dim", str(args.dim),
                   "--steps", str(args.steps)] + (["--param-offload"] if args.param_offload else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
            if proc.returncode != 0:
                print(f"offload_step: the {arm} arm failed in trial {trial}:\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            results[arm].append(row)
            print(f"trial {trial} {arm}: {row['step_s'] * 1e3:.1f} ms a step", flush=True)
    median = {arm: statistics.median(r["step_s"] for r in rows) for arm, rows in results.items()}
    first = results["folded"][0]
    summary = {"params": first["params"], "cpu_count": os.cpu_count(), "cpus_allowed": first["cpus_allowed"],
               "torch_threads": first["torch_threads"], "device": first["device"],
               "stage": 3 if args.param_offload else 2,
               "step_ms": {arm: m * 1e3 for arm, m in median.items()},
               "speedup": median["scale-pass"] / median["folded"],
               "last_losses": {arm: rows[-1]["losses"][-1] for arm, rows in results.items()},
               "trials": results}
    if args.json:
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(args.json)
    print(f"stage {summary['stage']}{' with parameter offload' if args.param_offload else ''}, "
          f"{summary['device']}; torch threads {summary['torch_threads']}, CPUs allowed {summary['cpus_allowed']} "
          f"of {summary['cpu_count']}")
    print("| params | folded ms/step | scale pass ms/step | speedup | last loss folded / scale pass |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| {summary['params'] / 1e6:.0f}M | {summary['step_ms']['folded']:.1f} | "
          f"{summary['step_ms']['scale-pass']:.1f} | {summary['speedup']:.3f}x | "
          f"{summary['last_losses']['folded']:.6f} / {summary['last_losses']['scale-pass']:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
