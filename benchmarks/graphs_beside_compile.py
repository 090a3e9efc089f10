"""One process holding a dslab engine with ``cuda_graphs`` on and a model under
``torch.compile(mode="reduce-overhead")``: steps each several times and checks the dslab losses
against a run without the compiled model.

Each scenario runs in its own process (a device fault poisons the CUDA context of the process it
happens in) and prints one line; the table at the end says which scenarios crashed:

    python3 benchmarks/graphs_beside_compile.py                  # every scenario, a table
    python3 benchmarks/graphs_beside_compile.py --scenario both  # one, in this process

Scenarios: ``alone`` (dslab only), ``both`` (dslab, then the compiled model, then dslab again),
``both_blocking`` (``both`` with ``CUDA_LAUNCH_BLOCKING=1``, so a fault names its launch),
``*_ws0`` (with ``CUBLAS_WORKSPACE_CONFIG=:0:0``: cuBLAS runs without a workspace), ``eager_*``
(the dslab arm with ``cuda_graphs`` off), ``recapture_*`` (the dslab arm's graphs released and
captured again before the compiled model runs, as the benchmark's parking does). ``--unfixed``
leaves out dslab's clearing of cuBLAS workspaces around its captures (:mod:`dslab.models.graphs`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

SCENARIOS = ("alone", "both", "both_blocking", "alone_ws0", "both_ws0", "eager_alone", "eager_both",
             "recapture_alone", "recapture_both")


def _arms(suite_dir: str, case: str, layers: int | None, profilers: bool):
    import torch

    from dslab.bench.arms import build_arm
    from dslab.bench.suite import load_suite
    from dslab.bench.training import engine_config
    from dslab.bench.workloads import workloads_for

    suite, _ = load_suite(suite_dir)
    workload = workloads_for(suite, "full", [case])[0]
    if layers is not None:
        workload.model_options["layers"] = layers
    engine = engine_config(suite.engine, None)
    if not profilers:
        for section in ("flops_profiler", "memory_tracer", "comms_logger", "telemetry"):
            engine.pop(section, None)
    device = torch.device("cuda", torch.cuda.current_device())
    return workload, engine, device, suite.precision, build_arm


def run_scenario(name: str, suite_dir: str, case: str, layers: int | None, steps: int, warm: int,
                 profilers: bool, rounds: int = 1) -> list[float]:
    import torch

    workload, engine, device, precision, build_arm = _arms(suite_dir, case, layers, profilers)
    if name.startswith("eager_"):
        engine["cuda_graphs"] = {"enabled": False}
    dslab_arm = build_arm("dslab", workload, device, precision, engine)
    for _ in range(warm):
        dslab_arm.step()
    if name.startswith("recapture_"):
        dslab_arm.engine.module.release_cuda_graphs()
        torch.cuda.empty_cache()
        for _ in range(warm):
            dslab_arm.step()
    torch.cuda.synchronize()
    compiled_step = None
    if "both" in name:
        plain = build_arm("torch", workload, device, precision, engine)
        plain.forward = torch.compile(plain.model, mode="reduce-overhead")
        inner_step = plain.step

        def compiled_step():
            torch.compiler.cudagraph_mark_step_begin()
            return inner_step().detach().clone()

    losses = []
    for _ in range(rounds):
        if compiled_step is not None:
            for _ in range(warm):
                compiled_step()
            torch.cuda.synchronize()
        torch.manual_seed(7)
        for _ in range(steps):
            losses.append(float(dslab_arm.step().detach()))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="suites/bert_large")
    parser.add_argument("--case", default="seq128")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warm", type=int, default=3, help="steps of each arm before the checked ones")
    parser.add_argument("--rounds", type=int, default=1, help="alternations of compiled steps and dslab steps")
    parser.add_argument("--unfixed", action="store_true", help="dslab captures without clearing cuBLAS workspaces")
    parser.add_argument("--profilers", action="store_true", help="keep the suite's profiler sections")
    parser.add_argument("--scenario", choices=SCENARIOS, default=None, help="run one scenario here")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, for the table")
    args = parser.parse_args()
    common = ["--suite", args.suite, "--case", args.case, "--steps", str(args.steps), "--warm", str(args.warm),
              "--rounds", str(args.rounds)]
    if args.profilers:
        common.append("--profilers")
    if args.layers is not None:
        common += ["--layers", str(args.layers)]
    if args.unfixed:
        common.append("--unfixed")
    if args.scenario is not None:
        if args.unfixed:
            from dslab.models import graphs
            graphs._clear_cublas_workspaces = lambda: None
        losses = run_scenario(args.scenario, args.suite, args.case, args.layers, args.steps, args.warm,
                              args.profilers, args.rounds)
        print("LOSSES " + " ".join(f"{x:.6f}" for x in losses), flush=True)
        return 0
    rows = []
    references: dict[str, list[float]] = {}  # the first run of each family's dslab-only scenario
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
        env = dict(os.environ)
        if name == "both_blocking":
            env["CUDA_LAUNCH_BLOCKING"] = "1"
        if name.endswith("_ws0"):
            env["CUBLAS_WORKSPACE_CONFIG"] = ":0:0"
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--scenario", name, *common], env=env,
                                  capture_output=True, text=True, timeout=args.timeout)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            rc, out = "timeout", (err.stdout or b"").decode() + (err.stderr or b"").decode()
        seconds = time.perf_counter() - start
        loss_line = next((line for line in out.splitlines() if line.startswith("LOSSES ")), None)
        losses = [float(x) for x in loss_line.split()[1:]] if loss_line else None
        family = name.replace("both", "alone").replace("_blocking", "")
        reference = references.setdefault(family, losses) if losses is not None else references.get(family)
        if rc != 0:
            tail = [line for line in out.splitlines() if line.strip()][-12:]
            print(f"--- {name}: rc {rc}\n" + "\n".join(tail), flush=True)
        same = "-" if losses is None or reference is None else (
            "same" if losses == reference else f"{max(abs(a - b) for a, b in zip(losses, reference)):.1e}")
        rows.append((name, rc, f"{seconds:.0f}s", same, loss_line or "(no losses)"))
    print(f"\n{'scenario':<18} {'rc':>8} {'time':>6} {'vs ref':>8}  losses")
    for name, rc, seconds, same, losses in rows:
        print(f"{name:<18} {str(rc):>8} {seconds:>6} {same:>8}  {losses}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
