"""Training suites in ``dslab bench``: each arm trains the case's model, one optimizer step a step
(the training kind of :mod:`dslab.bench.protocol`).

Each case is a :class:`~dslab.bench.workloads.Workload`; its arms are :mod:`dslab.bench.arms`'s,
all built from the same seed and stepping the same synthetic batch. Each arm's first trial
starts with the suite's warm-up steps; later trials settle for two steps before they are timed.
For a mixture-of-experts case the dslab arm's routing after its last step goes into
``profilers["moe"][case]`` and every arm gets ``expert_tflops`` (:mod:`dslab.bench.moe_report`).

The flops a step performs (``config.flops_per_step``, what TFLOP/s and MFU divide) are counted
once per case from the aten ops of a forward and backward of the ``torch`` kernel set's model
(:func:`dslab.bench.measure.count_step_flops`); when that runs out of GPU memory they are counted
again on fake tensors (shapes, no memory). A family with a flops formula of its own
(the Evoformer) has its forward's figure in its case's entry of ``config.cases`` as
``formula_forward_flops``, beside the count.

When every arm's resident state would not fit on the GPU at once, idle arms wait in host memory
between their trials (parked, :mod:`dslab.bench.parking`).

Started on several processes (torchrun or ``dslab launch``, ``WORLD_SIZE`` > 1), the run
joins the process group and every rank builds the ``dslab`` arm and steps it in lockstep: the
engine runs data parallelism or ZeRO as the suite's engine config says
(``zero_optimization.stage``, which ``zero_stage`` overrides). The plain arms are single-process
loops and are recorded as skipped. After each trial the ranks' measurements are gathered
(:func:`dslab.comm.all_gather_object`): the trial's step time is the slowest rank's median (its
step times are the ones kept), throughput is global (``samples_per_s`` = micro-batch x world
size / step time, likewise ``tokens_per_s``), ``model_tflops`` and MFU stay per GPU (one rank's
flops over the step time), and each rank's peak memory is kept as ``peak_memory_bytes_rank<r>``
(the CUDA allocator's peak over the trial plus what the arm's CUDA-graph pools hold beyond it,
see :func:`dslab.bench.measure.run_trial`; ``peak_memory_bytes`` is the largest) or, on a CPU,
``peak_rss_bytes_rank<r>`` (the process's largest resident set so far, from ``getrusage``). The
memory tracer's model states of every rank go into its records as ``model_states_per_rank``.
Each rank's profiler files go to ``profiles/<case>/rank<r>``. Every rank trains on the same
synthetic batch.

The text reports the dslab arm's profilers would print in a training script (the flops profile,
the comms logger's verbose lines) go to files of the run's directory instead,
``profiles/<case>/`` (per rank as above): ``flops_profile.txt`` and ``comms_calls.txt``. The
profiler's record names its file as ``text_file``, relative to the run's directory, and one
progress line per file says where it is. With ``verbose`` the text is printed as well (to
standard output, as the engine prints it).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
from pathlib import Path

import torch

from dslab import comm
from dslab.bench.arms import PRECISION_DTYPES, build_arm, describe_injected_sleep, inject_sleep_ms
from dslab.bench.common import ArmSkipped, Progress, TrialFailed, World, error_text, free_memory, join_world
from dslab.bench.measure import count_step_flops, run_trial, trial_metrics
from dslab.bench.moe_report import expert_tflops, moe_record, stats_to_host
from dslab.bench.protocol import Counts, Plan, RunContext
from dslab.bench.suite import SuiteConfig, select_arms
from dslab.bench.workloads import Workload, workloads_for
from dslab.profilers.flops_step import steady_state
from dslab.report import RunReport

SETTLE_STEPS = 2
# The progress line's name of each profiler section's text report.
TEXT_REPORTS = {"flops": "flops profile", "comms": "comms log"}


class TrainingSuite:
    """The training kind (:class:`~dslab.bench.protocol.SuiteKind`): ``zero_stage`` overrides the
    suite engine's ``zero_optimization.stage``; ``verbose`` prints the profilers' text reports as
    well as writing them."""

    def __init__(self, suite: SuiteConfig, suite_file: Path, zero_stage: int | None = None, verbose: bool = False):
        self.suite, self.suite_file, self.verbose = suite, suite_file, verbose
        self.engine = engine_config(suite.engine, zero_stage)

    def join_world(self) -> World:
        return join_world()

    def plan(self, scale: str, arms: list[str] | None, cases: list[str] | None, counts: Counts, world: World,
             device: torch.device) -> Plan:
        suite = self.suite
        workloads = workloads_for(suite, scale, cases)
        arm_names = select_arms(suite, arms, scale)
        sleep_ms = inject_sleep_ms()
        slowdown = describe_injected_sleep(world.size)  # None unless DSLAB_INJECT_STEP_SLEEP_MS is set
        config = {
            "suite_file": str(self.suite_file),
            "scale": scale,
            "arms": arm_names,
            "trials": counts.trials,
            "steps": counts.steps,
            "warmup_steps": counts.warmup_steps,
            "precision": suite.precision,
            "family": suite.family,
            "cases": [_case_entry(w) for w in workloads],
            "model_options": suite.model_options,
            "engine": self.engine,
            "zero_stage": int((self.engine.get("zero_optimization") or {}).get("stage", 0)),
            "world_size": world.size,
            "device": str(device),
            "seed": suite.seed,
            "inject_step_sleep_ms": sleep_ms,
        }
        return Plan(arms=arm_names, cases=workloads, config=config,
                    data={"kind": "synthetic", "description": workloads[0].data_description},
                    notes=[slowdown] if slowdown else [])

    def open_case(self, workload: Workload, context: RunContext) -> "TrainingCase":
        return TrainingCase(self, workload, context)


class TrainingCase:
    """One workload's arms, trained side by side (:class:`~dslab.bench.protocol.CaseRun`)."""

    settle_steps = SETTLE_STEPS
    # idle arms wait in host memory between their trials when they do not all fit on the GPU
    parks_idle_arms = True

    def __init__(self, kind: TrainingSuite, workload: Workload, context: RunContext):
        self.suite, self.engine, self.verbose = kind.suite, kind.engine, kind.verbose
        self.workload, self.context = workload, context
        self.name = workload.case.name
        self.tag = f"[{self.suite.name} {self.name}]"
        report, world, device = context.report, context.world, context.device
        samples, tokens = workload.samples_and_tokens()
        self.samples, self.tokens = samples * world.size, tokens * world.size  # every rank steps a micro-batch
        self.flops = self.step_flops()
        if self.flops:
            report.config.setdefault("flops_per_step", {})[self.name] = self.flops
        self.parking = self.parks_idle_arms and _needs_parking(workload, len(context.arms) if world.size == 1 else 1,
                                                               device)
        # host memory the parked arms' states take, and what the host has for them (None: unknown)
        self.host_available = host_available_bytes() if self.parking else None
        self.host_parked = 0
        self.resident: tuple[str, object] | None = None  # the one arm left on the GPU (parking only)
        if self.parking:
            report.notes.append(f"{self.name}: the arms do not all fit on the GPU at once; each waits in host "
                                f"memory between its trials (moved back and settled before it is timed)")
            context.progress.line(f"{self.tag} arms are parked in host memory between trials")
        self.graph_pools: dict[str, set] = {}  # per arm, see measure.run_trial
        self.text_files: list[tuple[str, Path]] = []

    def step_flops(self) -> int | None:
        """The flops of one step, what TFLOP/s and MFU divide: counted on rank 0 from the aten ops of
        the ``torch`` kernel set's model (module docstring); None on the other ranks, or with a
        note in the report when counting failed."""
        context = self.context
        if context.world.rank != 0:  # only rank 0's report is written
            return None
        flops = None
        try:
            flops, note = _count_flops(self.workload, self.suite, context.device)
            if note:
                context.report.notes.append(f"{self.name}: {note}")
        except Exception as err:  # counting is informative; the timings still stand without it
            context.report.notes.append(f"{self.name}: flop count failed: {error_text(err).splitlines()[0]}")
        free_memory(context.device)  # again outside the except block, whose traceback held the count's tensors
        return flops

    def step_work(self, name: str, arm) -> tuple[int, int]:
        """The samples and tokens one step of arm ``name`` trains, over every rank: each rank's
        micro-batch."""
        return self.samples, self.tokens

    def build_arm(self, name: str):
        context = self.context
        if name == "dslab":
            profile_dir = context.run_path / "profiles" / self.name
            if context.world.size > 1:
                profile_dir = profile_dir / f"rank{context.world.rank}"
            options = {"profile_dir": profile_dir, "echo_profile_text": self.verbose,
                       "measured_peak_tflops": context.report.peaks.get("bf16_matmul_tflops")}
        else:
            options = {"world_size": context.world.size}
        if self.parking:
            self._reserve_host_memory(name)
            self._make_room()
        arm = build_arm(name, self.workload, context.device, self.suite.precision, self.engine, **options)
        if self.parking:
            self.resident = (name, arm)
        return arm

    def _make_room(self) -> None:
        """Park the arm left on the GPU, if any: arms are parked only when another needs the GPU, so
        at most all but one wait in host memory at a time."""
        if self.resident is not None:
            _, arm = self.resident
            self.resident = None
            arm.park()

    def _reserve_host_memory(self, name: str) -> None:
        """Count the arms built before ``name`` against the host memory that was available when the
        case began: they wait there, parked, while ``name`` is built and timed (and while any one of
        them runs, the others and ``name`` do: as many arms, since every arm's state is the same
        size). :class:`ArmSkipped` when they would not fit (the kernel would kill the whole run
        part-way through instead)."""
        need = resident_state_bytes(self.workload)
        if self.host_available is not None and self.host_parked > HOST_PARKING_SHARE * self.host_available:
            gib = 2**30
            raise ArmSkipped(
                f"the {self.host_parked / gib:.1f} GiB of host memory the arms before it take parked "
                f"({need / gib:.1f} GiB each) while it runs are more than {HOST_PARKING_SHARE:.0%} of the "
                f"{self.host_available / gib:.1f} GiB this host had available; run fewer arms (--arms)")
        self.host_parked += need

    def before_trials(self) -> None:
        pass

    def run_trial(self, name: str, arm, warmup: int, steps: int, trial: int) -> tuple[list[float], dict]:
        context = self.context
        measured, error = None, None
        try:  # every rank gathers below, whatever happened here
            if self.parking and (self.resident is None or self.resident[0] != name):
                self._make_room()
                arm.unpark()
                self.resident = (name, arm)
            measured = run_trial(arm.step, context.device, warmup, steps, pools=self.graph_pools.setdefault(name, set()))
        except Exception as err:
            error = error_text(err, f"trial {trial + 1}")
        measured, error = gather_trial(measured, error, context.world)
        if error is not None:
            if self.resident is not None and self.resident[0] == name:
                self.resident = None  # the runner closes a failed arm; none is left to park
            raise TrialFailed(error)
        peaks = context.report.peaks
        samples, tokens = self.step_work(name, arm)
        metrics = trial_metrics(measured, samples, tokens, self.flops, peaks, peaks.get("datasheet_bf16_tflops"))
        metrics.update(measured.get("per_rank_memory") or {})
        return measured["step_times_ms"], metrics

    def trial_line(self, name: str, metrics: dict) -> str:
        return f"{name:<13} {metrics['samples_per_s']:>10.1f} samples/s  {metrics['step_time_ms']:>9.2f} ms/step"

    def finish(self, arms: dict) -> None:
        dslab_arm = arms.get("dslab")
        if dslab_arm is not None:
            self.record_profilers(dslab_arm, "dslab", self.name)
        if self.workload.is_moe:
            _record_moe(self.context.report, self.workload, dslab_arm, self.context.arms, self.context.progress,
                        self.suite.name)

    def record_profilers(self, engine_arm, arm: str, key: str) -> None:
        """The profiler records of ``engine_arm`` (an engine arm named ``arm``) into
        ``report.profilers[section][key]``, with every rank's model states in a distributed run
        and the flops profile's steady state at the arm's timed steps; its CUDA-graph counts go
        into the notes. A collective when several processes run: call it on every rank."""
        report, world = self.context.report, self.context.world
        label = key if arm == "dslab" else f"{key} {arm}"
        try:
            records = engine_arm.records()
            self.text_files += _text_files_in_run(records, self.context.run_path)
            if world.size > 1 and records.get("memory") is not None:
                per_rank = comm.all_gather_object(records["memory"].get("model_states"))
                records["memory"] = {**records["memory"], "model_states_per_rank": per_rank}
            for section, data in records.items():
                if report.profilers.get(section) is None:
                    report.profilers[section] = {}
                report.profilers[section][key] = data
            _steady_state_from_trials(report, key, self.name, arm)
        except Exception as err:  # a profiler's failure must not lose the measured trials
            report.notes.append(f"{label}: profiler records failed: {error_text(err).splitlines()[0]}")
        graph_stats = engine_arm.cuda_graph_stats()
        if graph_stats:
            counts = ", ".join(f"{k} {v}" for k, v in sorted(graph_stats.items()))
            report.notes.append(f"{self.name}: {arm} arm CUDA graphs of the layer stack: {counts}")

    def close(self) -> None:
        # after the arms closed: the flops profile is written at the latest then
        for section, file in self.text_files:
            self.context.progress.line(f"{self.tag} {TEXT_REPORTS.get(section, section)} text: {file}")


def engine_config(engine: dict, zero_stage: int | None) -> dict:
    """The suite's engine config, with ``zero_optimization.stage`` set to ``zero_stage`` if given."""
    config = copy.deepcopy(engine)
    if zero_stage is not None:
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        config["zero_optimization"] = {**(config.get("zero_optimization") or {}), "stage": zero_stage}
    return config


def _peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def gather_trial(measured: dict | None, error: str | None, world: World) -> tuple[dict | None, str | None]:
    """Every rank's trial as one: the slowest rank's step times, the largest peak, each rank's
    peak memory (``per_rank_memory``), or the first rank's error."""
    if world.size == 1:
        if measured is not None and measured.get("peak_memory_bytes") is None and world.part:
            # a launch of one process in a data-parallel run: its CPU memory, as the other launches report it
            rss = _peak_rss_bytes()
            measured = {**measured, "per_rank_memory": {} if rss is None else {"peak_rss_bytes_rank0": float(rss)}}
        return measured, error
    mine = {"measured": measured, "error": error, "rss": _peak_rss_bytes()}
    outcomes = comm.all_gather_object(mine)
    for rank, outcome in enumerate(outcomes):
        if outcome["error"] is not None:
            return None, f"rank {rank}: {outcome['error']}"
    medians = [statistics.median(o["measured"]["step_times_ms"]) for o in outcomes]
    slowest = outcomes[medians.index(max(medians))]["measured"]
    peaks = [o["measured"]["peak_memory_bytes"] for o in outcomes]
    if all(p is not None for p in peaks):
        per_rank = {f"peak_memory_bytes_rank{r}": float(p) for r, p in enumerate(peaks)}
        peak = max(peaks)
    else:
        per_rank = {f"peak_rss_bytes_rank{r}": float(o["rss"]) for r, o in enumerate(outcomes)
                    if o["rss"] is not None}
        peak = None
    combined = {**slowest, "peak_memory_bytes": peak, "final_loss": outcomes[0]["measured"]["final_loss"],
                "per_rank_memory": per_rank}
    return combined, None


def _count_flops(workload: Workload, suite: SuiteConfig, device: torch.device) -> tuple[int, str | None]:
    """The flops of one step counted on ``device`` or, when that runs out of memory, again on fake
    tensors of ``device`` (shapes and dtypes only, no memory: the same ops, so the same count), with a
    note saying so in the second case."""
    try:
        return _count_flops_on(workload, suite, device), None
    except torch.OutOfMemoryError as err:
        reason = error_text(err).splitlines()[0]
    free_memory(device)
    note = f"flops counted on fake tensors (shapes only): counting on {device} ran {reason}"
    return _count_flops_on(workload, suite, device, fake=True), note


def _count_flops_on(workload: Workload, suite: SuiteConfig, device: torch.device, fake: bool = False) -> int:
    # FakeTensorMode is what torch.compile traces with: tensors that carry a device, shape and
    # dtype but no storage, so autocast and every op's flop formula see what a real run sees.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = workload.build_model(kernels="torch", device=device)
        try:
            return count_step_flops(model, workload.loss_fn(), workload.make_batch(device),
                                    PRECISION_DTYPES[suite.precision], device)
        finally:
            del model
            free_memory(device)


def _case_entry(workload: Workload) -> dict:
    """A case's entry in ``config.cases``: its settings, preset and family, and the model's own
    forward flops figure where the family has one."""
    entry = {**workload.case.model_dump(), "preset": workload.preset, "family": workload.family}
    formula = workload.formula_forward_flops()
    if formula is not None:
        entry["formula_forward_flops"] = formula
    return entry


def _text_files_in_run(records: dict[str, dict], run_path: Path) -> list[tuple[str, Path]]:
    """The text report files the profilers' ``records`` name (``text_file``), as ``(section, path)``;
    each record's ``text_file`` becomes relative to the run's directory (a file outside it, such as
    a ``flops_profiler.output_file`` the suite names, stays as given)."""
    files = []
    for section, record in records.items():
        named = record.get("text_file") if isinstance(record, dict) else None
        if not named:
            continue
        files.append((section, Path(named)))
        try:
            record["text_file"] = Path(named).resolve().relative_to(run_path.resolve()).as_posix()
        except ValueError:
            pass
    return files


def _steady_state_from_trials(report: RunReport, key: str, case: str, arm: str = "dslab") -> None:
    """The flops profile's whole-model figure (``profilers["flops"][key]``) at ``arm``'s timed
    steps of ``case`` (every trial's), in place of the engine's own few steps: the run's steady
    state is what the benchmark timed."""
    record = (report.profilers.get("flops") or {}).get(key)
    result = report.result(case, arm)
    if not isinstance(record, dict) or not record.get("profiled") or result is None or not result.trials:
        return
    times = [t for trial in result.trials for t in trial.step_times_ms]
    record["steady_state"] = steady_state(
        record, times, f"the benchmark: median of the {arm} arm's {len(times)} timed steps over "
                       f"{len(result.trials)} trial(s)")


def _record_moe(report: RunReport, workload: Workload, dslab_arm, arm_names: list[str], progress: Progress,
                suite_name: str) -> None:
    """``profilers["moe"][case]`` from the dslab arm's routing after its last step (read to the
    host once), and every arm's ``expert_tflops`` (:mod:`dslab.bench.moe_report`)."""
    case = workload.case.name
    plain = [a for a in arm_names if a != "dslab"]
    record = None
    if dslab_arm is not None:
        try:
            stats = dslab_arm.moe_stats()
            if stats:
                comms = (report.profilers.get("comms") or {}).get(case)
                record = moe_record(workload, stats_to_host(stats), plain, comms)
        except Exception as err:  # the routing is informative; the timings stand without it
            report.notes.append(f"{case}: MoE routing could not be read: {error_text(err).splitlines()[0]}")
    if record is not None:
        if report.profilers.get("moe") is None:
            report.profilers["moe"] = {}
        report.profilers["moe"][case] = record
        flops = record["expert_flops_per_step"]
        loads = ", ".join(f"layer {layer['layer']} max/mean {layer['max_over_mean']:.2f}" for layer in record["layers"]
                          if layer["max_over_mean"] is not None)
        progress.line(f"[{suite_name} {case}] dslab routing after its last step: {loads}; "
                      f"dropped {record['dropped_fraction']:.1%} of {record['assignments']} assignments")
    else:
        flops = {arm: workload.expert_flops_per_step(hf=arm == "hf") for arm in arm_names}
    for arm in arm_names:
        result = report.result(case, arm)
        if result is None or not result.trials:
            continue
        for trial in result.trials:
            value = expert_tflops(flops.get(arm), trial.metrics.get("step_time_ms"))
            if value is not None:
                trial.metrics["expert_tflops"] = value
        result.summarize()


# The share of the host's available memory the parked arms may take (the rest: the process itself,
# the data and the report).
HOST_PARKING_SHARE = 0.85


def host_available_bytes() -> int | None:
    """The host memory available to new allocations (``MemAvailable`` of ``/proc/meminfo``), or
    None where that file does not exist."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resident_state_bytes(workload: Workload) -> int:
    """An arm's training state between steps: fp32 weights and AdamW's two moments, 12 bytes per
    parameter of the case's model (counted on the meta device)."""
    with torch.device("meta"):
        params = sum(p.numel() for p in workload.build_model(kernels="torch").parameters())
    return params * 12


def _needs_parking(workload: Workload, n_arms: int, device: torch.device) -> bool:
    """True when every arm's resident state (fp32 weights and AdamW moments, 12 bytes per
    parameter; gradients are freed between steps) would take more than half of the GPU, leaving
    too little for the running arm's activations beside the ``torch-compile-ro`` arm's graph pool
    (which holds a whole step's activations between its trials): then idle arms wait in host
    memory between their trials. Llama-3.2-1B's six arms (89 GB of states at seq 2048) ran out
    of memory on an H200's 140 GB while all stayed resident."""
    if device.type != "cuda" or n_arms < 2:
        return False
    total = torch.cuda.get_device_properties(device).total_memory
    return resident_state_bytes(workload) * n_arms > 0.5 * total
