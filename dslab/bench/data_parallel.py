"""Data-parallel suites in ``dslab bench`` (``suites/zero``): dslab's ZeRO stages beside DDP, FSDP2
and DeepSpeed on the same model, on every process count of the run (the data-parallel kind of
:mod:`dslab.bench.protocol`).

``dslab bench suites/zero`` started by hand does not train: it starts one torchrun per process
count (:mod:`dslab.bench.launcher`), each running this kind on that many processes, and merges
what they write into the run's one report. Inside a launch, every case of the suite becomes
``<case>-n<N>`` for the launch's ``N`` processes, each stepping the case's micro-batch on its
own GPU (on a CPU, gloo processes). Started under torchrun by hand, the run measures the world
it was started in.

Each arm is built, warmed up, timed for every trial and closed before the next one is built
(:attr:`DataParallelCase.one_arm_at_a_time`): a dozen sharded engines of a 1.5B model do not fit
on a GPU together, and an arm that is parked in host memory between trials would have its
sharded state moved under its process group's feet. So the trials of one arm are interleaved
with nothing; the run's notes say so.

Measurements are the training kind's (:mod:`dslab.bench.training`): the slowest rank's step times,
global throughput, every rank's peak memory. Each dslab arm's profiler records (flops, memory with
every rank's model states, comms with every rank's collectives, telemetry, wall clock) go to
``report.profilers[section]["<case> <arm>"]``, its files to ``profiles/<case>/<arm>/rank<r>``.
"""

from __future__ import annotations

import copy
import os

import torch

from dslab import comm
from dslab.bench.arms import EngineArm
from dslab.bench.common import PART_ENV, World, join_world
from dslab.bench.data_parallel_suite import (
    DSLAB_ARMS, DataParallelSuiteConfig, default_nprocs, select_data_parallel_arms,
)
from dslab.bench.protocol import Counts, Plan, RunContext
from dslab.bench.training import TrainingCase, TrainingSuite, _case_entry
from dslab.bench.workloads import Workload

def arm_engine_config(engine: dict, arm: str) -> dict:
    """The engine config of dslab arm ``arm``: the suite's, at the arm's ZeRO stage, with the
    optimizer offloaded to the CPU for ``dslab-zero3-offload``."""
    if arm not in DSLAB_ARMS:
        raise ValueError(f"{arm!r} is not a dslab arm; choose from {', '.join(DSLAB_ARMS)}")
    stage = int(arm.removeprefix("dslab-zero")[0])
    config = copy.deepcopy(engine)
    zero = {**(config.get("zero_optimization") or {}), "stage": stage}
    if arm.endswith("-offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config["zero_optimization"] = zero
    return config


def process_counts(suite: DataParallelSuiteConfig, scale: str, requested: list[int] | None) -> list[int]:
    """The run's process counts: ``requested`` (``--nprocs``), else the scale's, else 1, 2, 4, ...
    up to this machine's GPUs and their count (1 and 2 gloo processes without a GPU). A
    model-parallel suite's config is read alike."""
    if requested:
        return sorted(set(requested))
    configured = suite.scales[scale].nprocs
    if configured:
        return sorted(set(configured))
    return default_nprocs(torch.cuda.device_count() if torch.cuda.is_available() else 0)


class DataParallelSuite(TrainingSuite):
    """The data-parallel kind (:class:`~dslab.bench.protocol.SuiteKind`). ``nprocs`` are the run's
    process counts (the launcher's choice); inside a launch only the current world's runs."""

    launches_processes = True

    def __init__(self, suite: DataParallelSuiteConfig, suite_file, zero_stage: int | None = None,
                 verbose: bool = False, nprocs: list[int] | None = None):
        if zero_stage is not None:
            raise ValueError("--zero-stage: a data-parallel suite runs each ZeRO stage as an arm of its own "
                             "(dslab-zero0 ... dslab-zero3); pick them with --arms")
        super().__init__(suite, suite_file, None, verbose)
        self.nprocs = nprocs

    def join_world(self) -> World:
        """Every process of a launch joins the process group, one process included (the peers'
        DDP and FSDP2 need one)."""
        if os.environ.get("WORLD_SIZE") and not comm.is_initialized():
            comm.init_distributed()
        return join_world()

    def plan(self, scale: str, arms: list[str] | None, cases: list[str] | None, counts: Counts, world: World,
             device: torch.device) -> Plan:
        suite = self.suite
        if scale not in suite.scales:
            raise ValueError(f"suite {suite.name} has no scale {scale!r}; it has {', '.join(suite.scales)}")
        arm_names = select_data_parallel_arms(suite, arms, scale)
        nprocs = process_counts(suite, scale, self.nprocs)
        inside = bool(os.environ.get(PART_ENV)) or comm.is_initialized()
        measured_here = [world.size] if inside else nprocs
        workloads = data_parallel_workloads(suite, scale, cases, measured_here)
        config = {
            "kind": "data_parallel",
            "suite_file": str(self.suite_file),
            "scale": scale,
            "arms": arm_names,
            "nprocs": measured_here,
            "trials": counts.trials,
            "steps": counts.steps,
            "warmup_steps": counts.warmup_steps,
            "precision": suite.precision,
            "family": suite.family,
            "cases": [{**_case_entry(w), "base_case": base, "nprocs": n}
                      for w, (base, n) in zip(workloads, base_cases(workloads))],
            "model_options": suite.model_options,
            "engine": self.engine,
            "arm_engines": {a: arm_engine_config(self.engine, a) for a in arm_names if a in DSLAB_ARMS},
            "world_size": world.size,
            "device": str(device),
            "seed": suite.seed,
        }
        notes = ["each arm runs all its trials before the next arm is built (a data-parallel suite's engines "
                 "do not fit on the GPUs together); the trials of one arm are not interleaved with the others'"]
        return Plan(arms=arm_names, cases=workloads, config=config,
                    data={"kind": "synthetic", "description": workloads[0].data_description}, notes=notes)

    def open_case(self, workload: Workload, context: RunContext) -> "DataParallelCase":
        return DataParallelCase(self, workload, context)


def base_cases(workloads: list[Workload]) -> list[tuple[str, int]]:
    """``(model case, process count)`` of each workload, from its name ``<case>-n<N>``."""
    out = []
    for w in workloads:
        base, _, n = w.case.name.rpartition("-n")
        out.append((base, int(n)))
    return out


def data_parallel_workloads(suite: DataParallelSuiteConfig, scale: str, cases: list[str] | None,
                            nprocs: list[int]) -> list[Workload]:
    """One workload per model case and process count, named ``<case>-n<N>``; ``cases`` may name
    model cases (``355m``: every count) or process-count cases (``355m-n4``). A model-parallel
    suite's config (:mod:`dslab.bench.model_parallel_suite`) has the same fields and is read alike."""
    sc = suite.scales[scale]
    names = {c.name for c in sc.cases}
    wanted = set(cases or [])
    unknown = [c for c in wanted if c not in names and c.rpartition("-n")[0] not in names]
    if unknown:
        choices = sorted(names | {f"{c}-n{n}" for c in names for n in nprocs})
        raise ValueError(f"unknown case(s) {', '.join(sorted(unknown))}; this scale has {', '.join(choices)}")
    workloads = []
    for n in nprocs:
        for case in sc.cases:
            name = f"{case.name}-n{n}"
            if wanted and case.name not in wanted and name not in wanted:
                continue
            workload = Workload(family=suite.family, preset=case.preset or sc.preset,
                                case=case.model_copy(update={"name": name}),
                                model_options={**suite.model_options, **case.model_options},
                                seed=suite.seed, precision=suite.precision)
            try:
                workload.model_config()
            except ValueError as err:
                raise ValueError(f"suite {suite.name}, scale {scale}, case {case.name!r}: {err}") from None
            workloads.append(workload)
    if not workloads:
        raise ValueError(f"suite {suite.name}: no case of {', '.join(sorted(wanted))} runs on "
                         f"{', '.join(map(str, nprocs))} process(es)")
    return workloads


class DataParallelCase(TrainingCase):
    """One model case on one process count: each arm built, timed and closed in turn
    (:class:`~dslab.bench.protocol.CaseRun`)."""

    one_arm_at_a_time = True
    parks_idle_arms = False

    def build_arm(self, name: str):
        context = self.context
        if name in DSLAB_ARMS:
            profile_dir = context.run_path / "profiles" / self.name / name
            if context.world.size > 1:
                profile_dir = profile_dir / f"rank{context.world.rank}"
            return EngineArm(self.workload, context.device, self.suite.precision,
                             arm_engine_config(self.engine, name), profile_dir=profile_dir,
                             measured_peak_tflops=context.report.peaks.get("bf16_matmul_tflops"),
                             echo_profile_text=self.verbose)
        from dslab.bench.peers import build_peer_arm  # FSDP2, DDP and DeepSpeed load only for their arms

        return build_peer_arm(name, self.workload, context.device, self.suite.precision, self.engine)

    def finish(self, arms: dict) -> None:
        for name, arm in arms.items():
            if name in DSLAB_ARMS:
                self.record_profilers(arm, name, f"{self.name} {name}")

    def trial_line(self, name: str, metrics: dict) -> str:
        host = f"  host {metrics['host_step_ms']:.2f} ms" if "host_step_ms" in metrics else ""
        return (f"{name:<19} {metrics.get('tokens_per_s', metrics['samples_per_s']):>12,.0f} tokens/s  "
                f"{metrics['step_time_ms']:>9.2f} ms/step{host}")
