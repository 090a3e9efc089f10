"""What leaving dslab's profilers on costs: the engine with every profiler on vs off.

Two dslab engine arms of the same workload (a suite case), one with the suite's engine config
stripped of its profiler sections and one with every profiler on (flops profiler, memory tracer,
comms logger, telemetry, wall-clock breakdown). The profilers' one-step work (flops counting,
the saved-tensor trace) happens in the warm-up; trials then alternate between the arms. Prints
the median step time of each and the ratio (target: within 2%).

    python benchmarks/profiler_overhead.py [--suite suites/gpt2] [--case 124m] [--trials 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dslab.bench.arms import EngineArm
from dslab.bench.measure import run_trial
from dslab.bench.suite import load_suite
from dslab.bench.workloads import workloads_for

PROFILER_KEYS = ("flops_profiler", "memory_tracer", "comms_logger", "telemetry", "wall_clock_breakdown")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", default="suites/gpt2")
    parser.add_argument("--case", default=None)
    parser.add_argument("--scale", default=None)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    suite, _ = load_suite(args.suite)
    scale = args.scale or ("full" if device.type == "cuda" else "tiny")
    workload = workloads_for(suite, scale, [args.case] if args.case else None)[0]
    off = {k: v for k, v in suite.engine.items() if k not in PROFILER_KEYS}
    on = dict(off, wall_clock_breakdown=True,
              flops_profiler={"enabled": True, "profile_step": 2, "detailed": False, "module_depth": 1},
              memory_tracer={"enabled": True, "profile_step": 4},
              comms_logger={"enabled": True}, telemetry={"enabled": True, "interval_ms": 100})
    arms = {"profilers off": EngineArm(workload, device, suite.precision, off),
            "profilers on": EngineArm(workload, device, suite.precision, on)}
    times = {name: [] for name in arms}
    for name, arm in arms.items():
        run_trial(arm.step, device, args.warmup, 1)
    for t in range(args.trials):
        order = list(arms) if t % 2 == 0 else list(reversed(arms))
        for name in order:
            trial = run_trial(arms[name].step, device, 2, args.steps)
            times[name].append(statistics.median(trial["step_times_ms"]))
    records = arms["profilers on"].records()
    print(f"\n{suite.name} {workload.case.name} ({workload.preset}), {device}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'} | profilers on: "
          f"{', '.join(sorted(records))}")
    for name, ts in times.items():
        print(f"{name:<14} median step {statistics.median(ts):8.2f} ms  (trial medians {min(ts):.2f}..{max(ts):.2f})")
    ratio = statistics.median(times["profilers on"]) / statistics.median(times["profilers off"])
    print(f"on / off step time: {ratio:.4f} (target <= 1.02)")


if __name__ == "__main__":
    main()
