"""How often ``dslab gate --ab`` catches a deliberate slowdown, and how often it cries wolf, on this GPU.

    python3 benchmarks/gate_detection.py --suite suites/gpt2 --case 124m --steps 10 \\
        --sessions 2 --repeats 5 --slowdown 0.02 --threshold 0.02 --json out.json

Each session starts three workers of :mod:`dslab.bench.ab_worker` from this tree (the processes
``dslab gate --ab`` starts, each building, compiling and warming up the case on its own): the
baseline, an unchanged candidate, and a candidate whose dslab arm sleeps ``slowdown`` times the
baseline's median step time in every step (``DSLAB_INJECT_STEP_SLEEP_MS``, calibrated from two
baseline trials; by default as a device-side spin, ``DSLAB_INJECT_STEP_SLEEP_MODE=device``, which
adds that much device time without a host synchronisation; the real slowdown is reported as
measured, the median of the pairs' ratios). Then ``repeats`` times, alternately: an A/A gate run (baseline against
the unchanged candidate) and an injected gate run (baseline against the slowed one), each the
sequential test of :func:`dslab.gate.sequential.judge_pairs` over fresh ABBA-ordered pairs until
its verdict or ``max_pairs``, exactly as :mod:`dslab.gate.ab` runs it. Gate runs within a
session share their processes (what differs per process, e.g. a kernel choice, is shared by its
runs); sessions have fresh processes. As ``dslab gate --ab`` does by default, the two candidate
workers replay the kernel choices the baseline's worker made (``--no-pin-kernels``: they choose
their own).

Printed last: per condition, gate runs, the share ending in regression, mean pairs run, and the
median of the pairs' candidate/baseline ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from dslab.gate.ab import ABRequest, Worker
from dslab.gate.sequential import SequentialSettings, judge_pairs

INJECT = "DSLAB_INJECT_STEP_SLEEP_MS"


def trial(worker: Worker, timeout_s: float = 600.0) -> dict:
    worker.send("trial")
    return worker.read(timeout_s)


def gate_run(base: Worker, cand: Worker, metric: str, settings: SequentialSettings) -> dict:
    """One sequential gate run over fresh pairs (ABBA order)."""
    values = {"baseline": [], "candidate": []}
    verdict = None
    for k in range(settings.max_pairs):
        order = (("baseline", base), ("candidate", cand)) if k % 2 == 0 else (("candidate", cand), ("baseline", base))
        for side, worker in order:
            values[side].append(float(trial(worker)["metrics"][metric]))
        verdict = judge_pairs(values["baseline"], values["candidate"], "higher", settings)
        if verdict.finished:
            break
    ratios = [c / b for b, c in zip(values["baseline"], values["candidate"])]
    return {"verdict": verdict.verdict, "inconclusive": verdict.inconclusive, "pairs": len(ratios),
            "median_ratio": statistics.median(ratios), "baseline": values["baseline"],
            "candidate": values["candidate"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="suites/gpt2")
    parser.add_argument("--case", default="124m")
    parser.add_argument("--scale", default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per trial (default: the scale's)")
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="A/A and injected gate runs per session, each")
    parser.add_argument("--slowdown", type=float, default=0.02)
    parser.add_argument("--threshold", type=float, default=0.02)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--max-pairs", type=int, default=15)
    parser.add_argument("--metric", default="samples_per_s")
    parser.add_argument("--no-pin-kernels", action="store_true")
    parser.add_argument("--inject-mode", choices=("host", "device"), default="device",
                        help="DSLAB_INJECT_STEP_SLEEP_MODE of the slowed worker (default device: a GPU spin that "
                             "adds device time without a host synchronisation)")
    parser.add_argument("--logs", default="gate_detection_logs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tree = Path(__file__).resolve().parents[1]
    settings = SequentialSettings(threshold=args.threshold, alpha=args.alpha, max_pairs=args.max_pairs)
    env: dict[str, str] = {}
    base_request = dict(suite=(tree / args.suite).resolve(), case=args.case, baseline_tree=tree, candidate_tree=tree,
                        scale=args.scale, steps=args.steps, warmup_steps=args.warmup_steps, settings=settings)
    result = {"settings": vars(args), "sessions": []}
    logs = Path(args.logs)
    for s in range(args.sessions):
        started = time.perf_counter()
        base = Worker("candidate", tree, ABRequest(**base_request, candidate_env=env), logs / f"s{s}_baseline.log")
        ready = base.read(3600)
        pins = None
        if not args.no_pin_kernels:
            pins = logs / f"s{s}_baseline_kernels.json"
            pins.write_text(json.dumps(ready["kernel_choices"]))
        calib = [trial(base) for _ in range(2)]
        step_ms = statistics.median(t for c in calib for t in c["step_times_ms"])
        sleep_ms = args.slowdown * step_ms
        clean = Worker("candidate", tree, ABRequest(**base_request, candidate_env=env), logs / f"s{s}_clean.log", pins)
        clean.read(3600)
        slow_env = {**env, INJECT: f"{sleep_ms:.4f}", "DSLAB_INJECT_STEP_SLEEP_MODE": args.inject_mode}
        slow = Worker("candidate", tree, ABRequest(**base_request, candidate_env=slow_env),
                      logs / f"s{s}_slow.log", pins)
        slow_ready = slow.read(3600)
        session = {"pinned": str(pins) if pins else None,
                   "triton_choices": sum(len(v) for v in ready["kernel_choices"]["triton"].values()), "step_ms": step_ms, "sleep_ms": sleep_ms, "device": ready.get("device"),
                   "injection_applies": slow_ready.get("injection_applies"), "aa": [], "injected": [],
                   "startup_s": time.perf_counter() - started}
        print(f"session {s}: step {step_ms:.2f} ms, injected sleep {sleep_ms:.3f} ms/step, "
              f"{session['triton_choices']} Triton choices {'pinned' if pins else 'not pinned'}, "
              f"workers ready in {session['startup_s']:.0f} s", flush=True)
        for r in range(args.repeats):
            for condition, cand in (("aa", clean), ("injected", slow)):
                run = gate_run(base, cand, args.metric, settings)
                session[condition].append(run)
                print(f"  {condition:<8} run {r}: {run['verdict']}{' (inconclusive)' if run['inconclusive'] else ''} "
                      f"after {run['pairs']} pairs, median ratio {run['median_ratio']:.4f}", flush=True)
        for worker in (base, clean, slow):
            worker.close()
        result["sessions"].append(session)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\n{args.case}: threshold {args.threshold:.1%}, alpha {args.alpha:.0%}, <= {args.max_pairs} pairs, "
          f"injected sleep {args.slowdown:.1%} of the step, {args.sessions} sessions x {args.repeats} runs")
    print(f"{'condition':<10} {'runs':>5} {'regression':>11} {'mean pairs':>11} {'median ratio':>13}")
    for condition in ("aa", "injected"):
        runs = [run for session in result["sessions"] for run in session[condition]]
        flagged = sum(run["verdict"] == "regression" for run in runs)
        print(f"{condition:<10} {len(runs):>5} {flagged / len(runs):>10.0%} "
              f"{statistics.mean(run['pairs'] for run in runs):>11.1f} "
              f"{statistics.median(run['median_ratio'] for run in runs):>13.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
