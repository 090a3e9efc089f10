"""A stand-in training script for the autotuning tests: it follows the experiment protocol of
``dslab.engine.autotuning.experiment`` without torch, so an experiment costs a Python start-up.

It reads its config (``--deepspeed_config``) and ``exp.json`` from ``$DSLAB_AUTOTUNING_EXPERIMENT``
and writes ``metrics.json`` whose numbers are known functions of the config, given by the JSON
file ``--surface`` names::

    {"num_params": int, "activation_bytes_per_sample": int,
     "device_bytes": int,                       # above this peak the run "runs out of memory"
     "a": {"<stage>": float}, "b": float,       # throughput = a[stage] * mbs / (b + mbs) * gas_gain
     "gas_gain": float,                         # factor per doubling of gradient accumulation
     "kernels_gain": {"torch": float},          # factor of a kernels choice
     "checkpoint_factor": float,                # activations times this with checkpointing on
     "first_sample_bytes": int,                 # optional: the activations of a micro-batch of 1
     "fail_stages": [int],                      # these stages crash with a ValueError
     "calls": "path"}                           # optional: one line appended per run

Peak memory is dslab's estimate of the model states (fp32 parameters and gradients, Adam's two
fp32 states: 16 bytes per parameter, partitioned as ZeRO does over a world of 1, i.e. not at all)
plus the activations of the micro-batch. ``--batch`` (optional) must equal the micro-batch size
when given: it checks ``autotuning.arg_mappings``. Without ``$DSLAB_AUTOTUNING_EXPERIMENT`` it is a
plain training run: it prints the config's micro-batch size and stage and exits 0.
"""

import argparse
import json
import os
import sys
from pathlib import Path


def throughput(surface: dict, config: dict) -> float:
    stage = config["zero_optimization"]["stage"]
    mbs = config["train_micro_batch_size_per_gpu"]
    gas = config["gradient_accumulation_steps"]
    value = surface["a"][str(stage)] * mbs / (surface["b"] + mbs)
    value *= surface.get("gas_gain", 1.0) ** (gas.bit_length() - 1)
    value *= surface.get("kernels_gain", {}).get(config.get("kernels", "auto"), 1.0)
    return value


def peak_bytes(surface: dict, config: dict) -> int:
    per_sample = surface["activation_bytes_per_sample"]
    if config["train_micro_batch_size_per_gpu"] == 1 and "first_sample_bytes" in surface:
        per_sample = surface["first_sample_bytes"]  # a one-sample peak off the slope
    if (config.get("activation_checkpointing") or {}).get("checkpoint_layers"):
        per_sample = int(per_sample * surface.get("checkpoint_factor", 1.0))
    return 16 * surface["num_params"] + per_sample * config["train_micro_batch_size_per_gpu"]


def _write(exp_dir: Path, metrics: dict) -> None:
    tmp = exp_dir / "metrics.json.tmp"
    tmp.write_text(json.dumps(metrics))
    os.replace(tmp, exp_dir / "metrics.json")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--surface", required=True)
    parser.add_argument("--batch", type=int, default=None)
    args = parser.parse_args()
    config = json.loads(Path(args.deepspeed_config).read_text())
    surface = json.loads(Path(args.surface).read_text())
    if not os.environ.get("DSLAB_AUTOTUNING_EXPERIMENT"):  # a plain training run
        print(f"trained with {args.deepspeed_config}: micro-batch {config['train_micro_batch_size_per_gpu']}, "
              f"stage {config['zero_optimization']['stage']}", flush=True)
        return 0
    exp_dir = Path(os.environ["DSLAB_AUTOTUNING_EXPERIMENT"])
    exp = json.loads((exp_dir / "exp.json").read_text())
    if surface.get("calls"):
        with open(surface["calls"], "a") as calls:
            calls.write(exp["name"] + "\n")
    if "autotuning" in config or any(isinstance(v, list) for v in config.values()):
        raise ValueError("the experiment's config still has the autotuning section or a list")
    if exp["model_info_only"]:
        _write(exp_dir, {"num_params": surface["num_params"], "trainable_params": surface["num_params"],
                         "world_size": 1, "model_info_only": True})
        return 0
    mbs, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    if args.batch is not None and args.batch != mbs:
        raise ValueError(f"--batch {args.batch} is not the config's micro-batch {mbs}")
    if config["zero_optimization"]["stage"] in surface.get("fail_stages", []):
        raise ValueError(f"stage {config['zero_optimization']['stage']} is broken in this fake")
    peak = peak_bytes(surface, config)
    if peak > surface["device_bytes"]:
        print(f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {peak} bytes", file=sys.stderr)
        return 1
    value = throughput(surface, config)
    samples = mbs * gas
    latency = samples / value
    steps = exp["end_profile_step"] - exp["start_profile_step"] + 1
    early = bool(exp["early_stop"] and exp["best_metric"] is not None and value < 0.95 * exp["best_metric"])
    _write(exp_dir, {"throughput": value, "latency": latency, "flops": None,
                     "step_times_s": [latency] * (2 if early else steps), "profiled_steps": 2 if early else steps,
                     "early_stopped": early, "peak_memory_bytes": peak, "num_params": surface["num_params"],
                     "micro_batch_size": mbs, "gradient_accumulation_steps": gas, "world_size": 1,
                     "samples_per_step": samples, "tflops_source": None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
