"""What continuous profiling costs in production training: GPT-2 with every profiler on, the flops
profiler re-taking its per-module device-time profile every N steps, vs every profiler off.

Two dslab engine arms of suites/gpt2's 124M case (``--size full``: dslab's GPT-2 124M, seq 1024,
micro-batch 16, bf16, CUDA graphs, AdamW, clipping 1.0) or its tiny case (``--size tiny``: for a
CPU, checks the pipeline, not speed), in one process:

* ``profilers off``: the suite's engine config without its profiler sections;
* ``profilers on``: ``flops_profiler`` (``profile_step`` 2, ``module_depth`` 2, ``top_modules`` 3,
  ``every_n_steps`` N, ``continuous_timer`` from ``--timer``), ``comms_logger``, ``memory_tracer``
  (``profile_step`` 5) and ``telemetry`` (NVML every 500 ms).

Each arm first runs ``--warmup`` steps (the flops count, the first device-timed step, the memory
trace and the CUDA-graph captures happen there). Trials then alternate between the arms (off, on;
on, off; ...), each ``--steps`` consecutive steps timed with a CUDA event around every step (host
clock on a CPU) and no synchronisation inside the trial. ``--steps`` is a multiple of N, so every
trial of the ``on`` arm holds the same number of profiled steps (one per N): its steps/s is the
amortised cost. The table gives each arm's median over the trials of steps/s, the overhead
(``1 - on / off``; target <= 1% at N = 100), and the profiled steps' median time over the plain
step's (target < 2x). ``--out`` writes the figures, the hardware and versions, both configs, the
on arm's CUDA-graph counts (replays on the unprofiled steps, eager calls on the profiled ones) and
its profile series as JSON. The last line of the table compares the later profiles' module times
with the first profile's (kernel durations under ``torch.profiler``, the exact figure): with
``--timer events`` it says how far the stream marks are from the kernels, and in how many profiles
the host had queued the whole step before the device began it.

    python benchmarks/continuous_profiling.py [--size full] [--every 100] [--timer events] [--trials 5] [--out f.json]
    python benchmarks/continuous_profiling.py --size tiny --every 2 --steps 2 --trials 2 --warmup 6
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from dslab.bench.arms import EngineArm
from dslab.bench.measure import run_trial
from dslab.bench.suite import load_suite
from dslab.bench.workloads import workloads_for

SUITE = Path(__file__).resolve().parent.parent / "suites" / "gpt2"
PROFILER_KEYS = ("flops_profiler", "memory_tracer", "comms_logger", "telemetry", "wall_clock_breakdown")
PROFILE_STEP = 2
LARGE_MODULE_MS = 0.25
MEMORY_STEP = 5


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("full", "tiny"), default=None,
                        help="full: GPT-2 124M (the default on CUDA); tiny: the suite's tiny case (the default on a CPU)")
    parser.add_argument("--every", type=int, default=100, help="flops_profiler.every_n_steps")
    parser.add_argument("--timer", choices=("events", "kernels"), default="events",
                        help="flops_profiler.continuous_timer: how the profiles after the first time the modules")
    parser.add_argument("--steps", type=int, default=None, help="steps per trial, a multiple of --every (default: --every)")
    parser.add_argument("--trials", type=int, default=5, help="trials per arm")
    parser.add_argument("--warmup", type=int, default=15, help="steps per arm before the trials")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.steps = args.steps or args.every
    if args.every < 1 or args.steps % args.every:
        parser.error(f"--steps ({args.steps}) must be a multiple of --every ({args.every}) >= 1")
    if args.warmup < PROFILE_STEP + 2 or args.trials < 1:
        parser.error(f"--warmup must be >= {PROFILE_STEP + 2} (the counted and the first timed step) "
                     "and --trials >= 1")
    return args


def engine_configs(suite_engine: dict, every: int, timer: str = "events") -> dict[str, dict]:
    """The two arms' engine configs from the suite's."""
    off = {k: v for k, v in suite_engine.items() if k not in PROFILER_KEYS}
    on = dict(off,
              flops_profiler={"enabled": True, "profile_step": PROFILE_STEP, "module_depth": 2, "top_modules": 3,
                              "detailed": False, "every_n_steps": every, "continuous_timer": timer},
              comms_logger={"enabled": True}, memory_tracer={"enabled": True, "profile_step": MEMORY_STEP},
              telemetry={"enabled": True, "interval_ms": 500})
    return {"profilers off": off, "profilers on": on}


def against_first(profiles: list[dict]) -> dict | None:
    """How the later profiles' module times compare with the first profile's (kernel durations
    under ``torch.profiler``, exact): per later profile, each module both kept (the model first)
    as later / first, forward and backward; with the medians over the profiles of the model's
    ratio and of the worst deviation among the modules of at least :data:`LARGE_MODULE_MS` (forward
    + backward) in the first profile (a mark costs the stream a few microseconds, which a module
    of tens of microseconds feels), and how many profiles say the host led the device
    (``host_lead``)."""
    timed = [p for p in profiles if "modules" in p]
    if len(timed) < 2:
        return None
    first = {m["name"]: m for m in timed[0]["modules"] if m["forward_ms"] + m["backward_ms"] >= LARGE_MODULE_MS}
    rows = []
    for p in timed[1:]:
        ratios = {}
        for m in p["modules"]:
            base = first.get(m["name"])
            if base is None:
                continue
            ratios[m["name"]] = {key: m[key] / base[key] if base[key] > 0 else None
                                 for key in ("forward_ms", "backward_ms")}
        rows.append({"step": p["step"], "timer": p.get("timer"), "host_lead": p.get("host_lead"), "ratios": ratios})

    def spread(row):
        values = [v for r in row["ratios"].values() for v in r.values() if v is not None]
        return max(abs(v - 1.0) for v in values) if values else None

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else float("nan")

    model = [r["ratios"].get("", {}) for r in rows]
    return {"profiles": rows,
            "model_forward": median(m.get("forward_ms") for m in model),
            "model_backward": median(m.get("backward_ms") for m in model),
            "worst_module_deviation": median(map(spread, rows)),
            "host_led": sum(1 for r in rows if r["host_lead"]), "later_profiles": len(rows)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="continuous_profiling_") as files:
        return run(args, Path(files))


def run(args, files: Path) -> dict:
    """The benchmark (module docstring); the profilers' text and snapshot files go to ``files``."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    size = args.size or ("full" if device.type == "cuda" else "tiny")
    suite, _ = load_suite(SUITE)
    workload = workloads_for(suite, size, ["124m"])[0]
    precision = suite.precision if device.type == "cuda" else "fp32"
    configs = engine_configs(suite.engine, args.every, args.timer)
    arms = {name: EngineArm(workload, device, precision, cfg) for name, cfg in configs.items()}
    on = arms["profilers on"]
    on.engine.set_profile_output_dir(files)

    for arm in arms.values():
        run_trial(arm.step, device, args.warmup, 0)
    trials: dict[str, list[dict]] = {name: [] for name in arms}
    for t in range(args.trials):
        for name in (list(arms) if t % 2 == 0 else list(reversed(arms))):
            first_step = arms[name].engine.global_steps
            trial = run_trial(arms[name].step, device, 0, args.steps)
            trial["first_step"] = first_step
            trials[name].append(trial)

    records = on.records()
    series = records["flops"].get("continuous") or {}
    profiled_steps = {p["step"] for p in series.get("profiles", [])}
    profiled_ms = [ms for trial in trials["profilers on"]
                   for i, ms in enumerate(trial["step_times_ms"]) if trial["first_step"] + i in profiled_steps]
    result = {"device": device.type, "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
              "torch": torch.__version__, "python": platform.python_version(), "size": size,
              "preset": workload.preset, "seq_len": workload.case.seq_len, "micro_batch": workload.case.micro_batch,
              "precision": precision, "every_n_steps": args.every, "steps_per_trial": args.steps,
              "trials": args.trials, "warmup": args.warmup, "arms": {}}
    for name, ts in trials.items():
        rates = [len(t["step_times_ms"]) / (sum(t["step_times_ms"]) / 1e3) for t in ts]
        result["arms"][name] = {"steps_per_s": statistics.median(rates), "trial_steps_per_s": rates,
                                "median_step_ms": statistics.median(ms for t in ts for ms in t["step_times_ms"]),
                                "config": configs[name]}
    off_rate, on_rate = result["arms"]["profilers off"]["steps_per_s"], result["arms"]["profilers on"]["steps_per_s"]
    plain_ms = result["arms"]["profilers off"]["median_step_ms"]
    result["overhead_pct"] = 100.0 * (1.0 - on_rate / off_rate)
    result["profiled_steps_timed"] = len(profiled_ms)
    result["profiled_step_ms"] = statistics.median(profiled_ms) if profiled_ms else None
    result["profiled_over_plain"] = result["profiled_step_ms"] / plain_ms if profiled_ms else None
    result["cuda_graph_stats"] = on.cuda_graph_stats()
    result["profilers_on"] = sorted(records)
    result["continuous"] = series
    result["timer"] = args.timer
    result["against_first"] = against_first(series.get("profiles", []))
    for arm in arms.values():
        arm.close()

    print(f"\nGPT-2 {workload.case.name} ({workload.preset}, seq {workload.case.seq_len}, micro-batch "
          f"{workload.case.micro_batch}, {precision}) on {result['gpu'] or 'CPU'}, torch {torch.__version__}")
    print(f"profilers on: {', '.join(result['profilers_on'])}; flops_profiler.every_n_steps = {args.every}; "
          f"{args.trials} trials x {args.steps} steps per arm, interleaved")
    print(f"{'arm':<15}{'steps/s':>10}{'median step ms':>16}   trial steps/s")
    for name, arm in result["arms"].items():
        spread = f"{min(arm['trial_steps_per_s']):.3f}..{max(arm['trial_steps_per_s']):.3f}"
        print(f"{name:<15}{arm['steps_per_s']:>10.3f}{arm['median_step_ms']:>16.2f}   {spread}")
    print(f"overhead: {result['overhead_pct']:.2f}% (1 - on/off steps/s; target <= 1% at every_n_steps 100)")
    if profiled_ms:
        print(f"profiled step: {result['profiled_step_ms']:.2f} ms = {result['profiled_over_plain']:.2f}x the plain "
              f"step (median of {len(profiled_ms)}; target < 2x)")
    agree = result["against_first"]
    if agree:
        print(f"later profiles ({args.timer}) against the first (kernel durations): model forward "
              f"{agree['model_forward']:.3f}x, backward {agree['model_backward']:.3f}x, the worst kept module "
              f"off by {100 * agree['worst_module_deviation']:.1f}% (medians over {agree['later_profiles']}); "
              + (f"host led the device in {agree['host_led']} of {agree['later_profiles']}" if device.type == "cuda"
                 else "on a CPU the marks are the host clock, Python included"))
    if result["cuda_graph_stats"]:
        print(f"CUDA graphs (profilers on): {dict(sorted(result['cuda_graph_stats'].items()))}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
