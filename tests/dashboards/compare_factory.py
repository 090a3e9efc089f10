"""Run reports for the Runs and Compare page tests: runs of one suite with many trials, made so that
the gate's verdict on any two of them is known.

:func:`make_trial_report` builds a ``run.json`` whose trial values are a fixed pattern around each
case's throughput (a spread of +-1%, the same pattern in every run), so two runs with equal
throughputs have identical trials and a ``slowdown`` of 0.9 moves every trial of that case 10%
down: the gate (alpha 0.01, 5% threshold) flags the first and not the second.
"""

from __future__ import annotations

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
TRIALS = 15
# samples/s of each case's dslab arm; the torch arm runs at TORCH_FACTOR of it
THROUGHPUT = {"124m": 900.0, "1.5b": 60.0}
TORCH_FACTOR = 0.8
SPREAD = 0.01


def trial_pattern(count: int = TRIALS) -> list[float]:
    """``count`` distinct factors spread evenly over ``1 +- SPREAD``, in a scrambled order."""
    steps = [1.0 - SPREAD + 2 * SPREAD * i / (count - 1) for i in range(count)]
    return [steps[(7 * i) % count] for i in range(count)]


def make_trial_report(run_id: str, suite: str = "gpt2", *, created: str, gpu: str = H100, gpus: int = 1,
                      throughput: dict[str, float] | None = None, slowdown: dict[str, float] | None = None,
                      commit: str = "feedc0de01", trials: int = TRIALS, status: str = "complete") -> dict:
    """One run of ``suite`` on ``gpus`` GPUs named ``gpu``: every case of ``throughput`` (default
    :data:`THROUGHPUT`) with a dslab and a torch arm, ``trials`` trials each; ``slowdown[case]``
    multiplies every trial of that case's dslab arm."""
    throughput = throughput or THROUGHPUT
    slowdown = slowdown or {}
    results = []
    for case, speed in throughput.items():
        for arm, factor in (("dslab", slowdown.get(case, 1.0)), ("torch", TORCH_FACTOR)):
            values = [speed * factor * f for f in trial_pattern(trials)]
            median = sorted(values)[len(values) // 2]
            results.append({"case": case, "arm": arm, "status": "ok", "error": None,
                            "trials": [{"trial": t, "step_times_ms": [8e3 / v], "metrics": {
                                "samples_per_s": v, "tokens_per_s": 1024 * v, "step_time_ms": 8e3 / v}}
                                       for t, v in enumerate(values)],
                            "metrics": {"samples_per_s": median, "tokens_per_s": 1024 * median,
                                        "step_time_ms": 8e3 / median}})
    return {
        "schema": "dslab.run", "schema_version": 3, "run_id": run_id, "suite": suite, "status": status,
        "created": created, "finished": created,
        "environment": {
            "torch": {"version": "2.11.0+cu128", "cuda": "12.8"},
            "dslab": {"version": "0.1.0", "git_commit": commit, "git_dirty": False},
            "cuda": {"available": True, "device_count": gpus,
                     "gpus": [{"index": i, "name": gpu, "total_memory_bytes": 80 << 30} for i in range(gpus)]},
        },
        "config": {"scale": "full", "precision": "bf16", "trials": trials, "steps": 10, "warmup_steps": 2,
                   "cases": [{"name": case, "seq_len": 1024, "micro_batch": 8} for case in throughput]},
        "data": {"kind": "synthetic", "description": "synthetic tokens"}, "peaks": {},
        "results": results, "ratios": {}, "best_plain": {}, "profilers": {}, "inference": {}, "notes": [],
    }
