"""How often ``dslab gate --ab`` catches a deliberate slowdown, and how often it cries wolf, on this GPU.

    python3 benchmarks/gate_detection.py --suite suites/gpt2 --case 124m --steps 10 \\
        --sessions 2 --repeats 5 --slowdown 0.02 --threshold 0.02 --json out.json

Each session starts three workers of :mod:`dslab.bench.ab_worker` from this tree (the processes
``dslab gate --ab`` starts, each building, compiling and warming up the case on its own): the
baseline, an unchanged candidate, and a candidate whose dslab arm sleeps ``slowdown`` times the
baseline's median step time in every step (``DSLAB_INJECT_STEP_SLEEP_MS``, calibrated from two
baseline trials; by default as a device-side spin, ``DSLAB_INJECT_STEP_SLEEP_MODE=device``, which
adds that much device time without a host synchronisation). Part of a device spin can vanish into
time the device would have idled, so the sleep is then calibrated where it is applied
(:func:`calibrate_sleep`; ``--calibrate-pairs 0`` switches it off): the slowed worker runs
``--calibrate-pairs`` ABBA pairs against the baseline, and while the measured slowdown (one minus
the median of the pairs' ratios) is more than 10% off ``slowdown``, it is restarted with a
corrected sleep (a secant step over the sleeps tried; up to 4 tries). The real slowdown of every
gate run is reported as measured, the median of the pairs' ratios. Then ``repeats`` times,
alternately: an A/A gate run (baseline against
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


def next_sleep(tried: list[tuple[float, float]], target: float) -> float:
    """The sleep (ms) to try next for a measured slowdown of ``target``, from ``tried``
    (``(sleep_ms, measured slowdown)`` in order): a secant step through the last two points when
    the slowdown rose with the sleep, else a proportional step from the last one (doubling when it
    measured nothing); never below a quarter or above four times the last sleep."""
    sleep, measured = tried[-1]
    guess = None
    if len(tried) >= 2:
        (s0, m0), (s1, m1) = tried[-2], tried[-1]
        if s1 != s0 and (m1 - m0) / (s1 - s0) > 0:
            guess = s1 + (target - m1) * (s1 - s0) / (m1 - m0)
    if guess is None:
        guess = 2 * sleep if measured <= 0 else sleep * target / measured
    return min(max(guess, sleep / 4), sleep * 4)


def calibrate_sleep(measure, target: float, first_ms: float, tolerance: float = 0.1, attempts: int = 4):
    """Search the injected sleep whose measured slowdown is within ``tolerance`` (relative) of
    ``target``. ``measure(sleep_ms)`` returns ``(measured slowdown, handle)``; the handle of the
    accepted sleep is returned with it: ``(sleep_ms, handle, tried)``, where ``tried`` lists every
    ``(sleep_ms, measured)``. After ``attempts`` tries the sleep whose slowdown came closest is
    kept (its handle; ``release(handle)`` is the caller's for the others, which ``measure`` may
    already have done)."""
    tried: list[tuple[float, float]] = []
    best = None
    sleep = first_ms
    for _ in range(attempts):
        measured, handle = measure(sleep)
        tried.append((sleep, measured))
        if best is None or abs(measured - target) < abs(best[1] - target):
            best = (sleep, measured, handle)
        if abs(measured - target) <= tolerance * target:
            return sleep, handle, tried
        sleep = next_sleep(tried, target)
    return best[0], best[2], tried


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
    parser.add_argument("--calibrate-pairs", type=int, default=4,
                        help="ABBA pairs that measure the injected slowdown before the gate runs (0: no calibration)")
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
        started_slow: list = []

        def start_slow(ms: float):
            slow_env = {**env, INJECT: f"{ms:.4f}", "DSLAB_INJECT_STEP_SLEEP_MODE": args.inject_mode}
            worker = Worker("candidate", tree, ABRequest(**base_request, candidate_env=slow_env),
                            logs / f"s{s}_slow_{len(started_slow)}.log", pins)
            started_slow.append(worker)
            return worker, worker.read(3600)

        def measure(ms: float):
            worker, ready = start_slow(ms)
            ratios = []
            for k in range(args.calibrate_pairs):
                order = (base, worker) if k % 2 == 0 else (worker, base)
                values = {id(w): float(trial(w)["metrics"][args.metric]) for w in order}
                ratios.append(values[id(worker)] / values[id(base)])
            return 1.0 - statistics.median(ratios), (worker, ready)

        if args.calibrate_pairs > 0:
            sleep_ms, (slow, slow_ready), tried = calibrate_sleep(measure, args.slowdown, sleep_ms)
        else:
            slow, slow_ready = start_slow(sleep_ms)
            tried = []
        for worker in started_slow:
            if worker is not slow:
                worker.close()
        calibration = [{"sleep_ms": ms, "measured_slowdown": m} for ms, m in tried]
        for row in calibration:
            print(f"  calibration: sleep {row['sleep_ms']:.3f} ms/step -> measured slowdown "
                  f"{row['measured_slowdown']:.2%}", flush=True)
        session = {"pinned": str(pins) if pins else None,
                   "triton_choices": sum(len(v) for v in ready["kernel_choices"]["triton"].values()), "step_ms": step_ms, "sleep_ms": sleep_ms, "device": ready.get("device"),
                   "injection_applies": slow_ready.get("injection_applies"), "calibration": calibration,
                   "aa": [], "injected": [],
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
          f"injected: a step sleep aimed at a {args.slowdown:.1%} slowdown, {args.sessions} sessions x "
          f"{args.repeats} runs")
    print(f"{'condition':<13} {'runs':>5} {'regression':>11} {'mean pairs':>11} {'median ratio':>13} "
          f"{'calibrated':>11}")
    rows = [("aa", "aa", result["sessions"]), ("injected", "injected", result["sessions"])]
    if len(result["sessions"]) > 1:  # each session's own spin: what its gate runs read
        rows += [(f"injected s{i}", "injected", [session]) for i, session in enumerate(result["sessions"])]
    for label, condition, sessions in rows:
        runs = [run for session in sessions for run in session[condition]]
        if not runs:
            continue
        flagged = sum(run["verdict"] == "regression" for run in runs)
        calibrated = [row["measured_slowdown"] for session in sessions for row in session["calibration"]
                      if row["sleep_ms"] == session["sleep_ms"]] if condition == "injected" else []
        print(f"{label:<13} {len(runs):>5} {flagged / len(runs):>10.0%} "
              f"{statistics.mean(run['pairs'] for run in runs):>11.1f} "
              f"{statistics.median(run['median_ratio'] for run in runs):>13.4f} "
              f"{(f'{statistics.median(calibrated):.2%}' if calibrated else '-'):>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
