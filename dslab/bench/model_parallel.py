"""Model-parallel suites in ``dslab bench`` (``suites/parallel``): GPT-2 split over the processes of
one host in several layouts (data, tensor and pipeline parallel and their products), dslab's
engines beside PyTorch's own tensor and pipeline parallelism and DeepSpeed's pipeline engine, on
the same model and the same global batch.

The kind runs as the data-parallel one does (:mod:`dslab.bench.data_parallel`, whose launches
and report merging it shares): ``dslab bench suites/parallel`` starts one torchrun per process
count (:mod:`dslab.bench.launcher`), each launch names its cases ``<case>-n<N>`` and writes its
part of the run's one report, and inside a launch each arm is built, timed for every trial and
closed before the next. An arm is a layout (:mod:`dslab.bench.model_parallel_suite`); a layout
that needs another number of processes than the launch has is skipped with the reason, as is
one that cannot split the case's model or whose data-parallel replicas cannot share the case's
global batch out (:func:`plan_layout`).

One step of an arm is one optimizer step over the case's ``global_batch`` sequences: each of its
``dp`` data-parallel replicas runs ``global_batch / (micro_batch * dp)`` micro-batches of
``micro_batch`` x ``seq_len`` tokens (a pipeline's micro-batches, or gradient accumulation), every
micro-batch the same synthetic batch (:class:`~dslab.bench.workloads.Workload`). The dslab arms
(:class:`DslabLayoutArm`):

- no ``pp`` factor (``dp``, ``tpK``, ``tpKdpM``): dslab's GPT-2 on dslab's kernels with
  ``tp_size`` K and its tensor-parallel group from a
  :class:`~dslab.parallel.topology.PipelineParallelGrid`, in ``dslab.initialize(..., mpu=grid)``;
  a step is ``gradient_accumulation_steps`` rounds of ``engine(...)``, ``engine.backward``,
  ``engine.step()``;
- a ``pp`` factor: :func:`~dslab.models.gpt2_pipe.gpt2_pipeline_module` over the grid (its
  stages tensor parallel with a ``tp`` factor, the case's ``activation_checkpoint_interval``) in
  the pipeline engine; a step is one ``engine.train_batch`` (1F1B over the micro-batches).

Both take the suite's engine config with the case's micro-batch and accumulation, the precision,
and ZeRO stage 1 over the data-parallel group where the layout has one (``dp`` > 1), else 0.
The peers are :mod:`dslab.bench.model_parallel_peers`'s.

Measurements are the training kind's (:mod:`dslab.bench.training`): the slowest rank's step
times, every rank's peak memory (``peak_memory_bytes_rank<r>``), tokens/s of the global batch
(``global_batch * seq_len`` per step). TFLOP/s and MFU are per GPU from the model flops of
Megatron-LM's count (:func:`megatron_flops`, as ``benchmarks/parallel_layouts.py`` counts), the
same for every arm of a case: recomputation under activation checkpointing is not model flops.
``config.flops_per_step[case]`` is that count over the launch's processes, what TFLOP/s divides;
the case's entry of ``config.cases`` has the whole step's (``model_flops_per_step``) and each
arm's layout (``layouts``: ``tp``, ``pp``, ``dp``, micro-batches per step, or why it is skipped).
Each dslab arm's profiler records go to ``report.profilers[section]["<case> <arm>"]`` as in the
data-parallel suites, a pipeline arm's ``pipeline`` section among them (every stage's busy and
idle time per batch and the 1F1B bubble ``(p-1)/(m+p-1)`` it is compared with); its files to
``profiles/<case>/<arm>/rank<r>``.

A build that fails on some ranks fails on all: the ranks agree on each arm's outcome before its
trials start (:meth:`ModelParallelCase.build_arm`), so that a stage that runs out of memory does
not leave the others waiting in their first send.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch

from dslab import comm
from dslab.bench.common import OOM_PREFIX, PART_ENV, ArmSkipped, World, error_text, free_memory
from dslab.bench.data_parallel import (
    DataParallelCase, DataParallelSuite, base_cases, data_parallel_workloads, process_counts,
)
from dslab.bench.model_parallel_suite import (
    Layout, ModelParallelSuiteConfig, layout_peers, micro_batches_per_step, parse_arm, select_model_parallel_arms,
)
from dslab.bench.protocol import Counts, Plan, RunContext
from dslab.bench.training import _case_entry
from dslab.bench.workloads import Workload
from dslab.models.gpt2 import GPT2LMHeadModel
from dslab.models.gpt2_pipe import gpt2_pipeline_module
from dslab.parallel.topology import PipelineParallelGrid, PipeModelDataParallelTopology

FLOPS_METHOD = ("Megatron-LM's model flops per step, 72 B s L h^2 (1 + s/6h + V/12Lh) (Narayanan et al. 2021): "
                "forward and backward, no recomputation")


def megatron_flops(layers: int, hidden: int, vocab: int, seq_len: int, sequences: int) -> float:
    """Model flops of one training step over ``sequences`` sequences of ``seq_len`` tokens of a
    GPT with ``layers`` blocks of width ``hidden`` and a ``vocab``-word LM head:
    ``72 B s L h^2 (1 + s/(6h) + V/(12 L h))`` (Narayanan et al. 2021, whose eq. 3, 96 and
    ``V/(16 L h)``, adds the forward that activation recomputation runs again): the blocks'
    matmuls and attention scores and the head's matmul, forward (x1) and backward (x2)."""
    return 72 * sequences * seq_len * layers * hidden**2 * (1 + seq_len / (6 * hidden) + vocab / (12 * layers * hidden))


@dataclass(frozen=True)
class LayoutRun:
    """Arm ``arm`` on one case and world: its implementation, layout and sizes, and the
    micro-batches each data-parallel replica runs per step."""

    arm: str
    impl: str
    layout: Layout
    tp: int
    pp: int
    dp: int
    micro_batches: int
    checkpoint_interval: int

    @property
    def zero_stage(self) -> int:
        """ZeRO stage 1 over the data-parallel group where there is one, else 0."""
        return 1 if self.dp > 1 else 0


def plan_layout(arm: str, workload: Workload, world: int) -> LayoutRun:
    """How arm ``arm`` runs ``workload``'s case on ``world`` processes; :class:`ArmSkipped` when
    its layout needs another number of processes, cannot split the case's model (heads, MLP width
    or padded vocabulary over ``tp``; blocks over ``pp``) or cannot share its global batch out."""
    impl, layout = parse_arm(arm)
    tp, pp, dp = layout.sizes(world)
    try:
        config = workload.model_config({"tp_size": tp})
    except ValueError as err:
        raise ArmSkipped(f"layout {layout.name} cannot split the model: {err}") from None
    if pp > config.layers:
        raise ArmSkipped(f"layout {layout.name} cannot split the model: its {config.layers} blocks cannot fill "
                         f"{pp} pipeline stages")
    case = workload.case
    micro = micro_batches_per_step(case.global_batch, case.micro_batch, dp, layout.name)
    interval = case.activation_checkpoint_interval if layout.pipeline else 0
    return LayoutRun(arm, impl, layout, tp, pp, dp, micro, interval)


def layout_engine_config(engine: dict, run: LayoutRun, micro_batch: int, precision: str) -> dict:
    """The engine config of a dslab arm: the suite's, with the case's micro-batch, the arm's
    micro-batches per step as ``gradient_accumulation_steps``, the precision and its ZeRO stage."""
    config = copy.deepcopy(engine)
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["gradient_accumulation_steps"] = run.micro_batches
    if precision != "fp32":
        config[precision] = {"enabled": True}
    config["zero_optimization"] = {**(config.get("zero_optimization") or {}), "stage": run.zero_stage}
    config.setdefault("steps_per_print", 10**9)
    return config


class DslabLayoutArm:
    """A ``dslab-<layout>`` arm (module docstring): ``step()`` is one optimizer step over the
    global batch; ``records()`` the engine's profiler records (a collective over the pipeline)."""

    def __init__(self, run: LayoutRun, workload: Workload, device: torch.device, precision: str, engine: dict,
                 profile_dir=None, measured_peak_tflops: float | None = None, echo_profile_text: bool = False):
        import dslab

        self.run = run
        grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=run.pp, num_mp=run.tp, num_dp=run.dp))
        overrides = {"tp_size": run.tp, **({"chain_layer_norms": False} if run.layout.pipeline else {})}
        config = workload.model_config(overrides)
        torch.manual_seed(workload.seed)
        with torch.device(device):
            if run.layout.pipeline:
                model = gpt2_pipeline_module(config, "dslab", grid=grid, base_seed=workload.seed,
                                             activation_checkpoint_interval=run.checkpoint_interval)
            else:
                model = GPT2LMHeadModel(config, "dslab", tp_group=grid.get_model_parallel_group())
        cfg = layout_engine_config(engine, run, workload.case.micro_batch, precision)
        self.engine, _, _, _ = dslab.initialize(model=model, config=cfg, mpu=None if run.layout.pipeline else grid,
                                                dist_init_required=False)
        if profile_dir is not None:
            self.engine.set_profile_output_dir(profile_dir, echo_text=echo_profile_text)
        if measured_peak_tflops:
            self.engine.set_measured_peak(measured_peak_tflops)
        self.batch = workload.make_batch(self.engine.device)
        self.micro_batches = [(self.batch["input_ids"], self.batch["labels"])] * run.micro_batches

    def step(self) -> torch.Tensor:
        if self.run.layout.pipeline:
            return self.engine.train_batch(iter(self.micro_batches))
        for _ in range(self.run.micro_batches):
            loss = self.engine(**self.batch)
            self.engine.backward(loss)
            self.engine.step()
        return loss

    def records(self) -> dict[str, dict]:
        return self.engine.profiler_records()

    def cuda_graph_stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self.engine.destroy()
        del self.engine, self.batch, self.micro_batches


class ModelParallelSuite(DataParallelSuite):
    """The model-parallel kind (:class:`~dslab.bench.protocol.SuiteKind`): launches and process
    counts as the data-parallel kind's, arms that are layouts."""

    def __init__(self, suite: ModelParallelSuiteConfig, suite_file, zero_stage: int | None = None,
                 verbose: bool = False, nprocs: list[int] | None = None):
        if zero_stage is not None:
            raise ValueError("--zero-stage: a model-parallel suite's dslab arms run ZeRO stage 1 where their layout "
                             "has data parallelism and 0 where it has none")
        super().__init__(suite, suite_file, None, verbose, nprocs)

    def plan(self, scale: str, arms: list[str] | None, cases: list[str] | None, counts: Counts, world: World,
             device: torch.device) -> Plan:
        suite = self.suite
        if scale not in suite.scales:
            raise ValueError(f"suite {suite.name} has no scale {scale!r}; it has {', '.join(suite.scales)}")
        arm_names = select_model_parallel_arms(suite, arms, scale)
        nprocs = process_counts(suite, scale, self.nprocs)
        inside = bool(os.environ.get(PART_ENV)) or comm.is_initialized()
        measured_here = [world.size] if inside else nprocs
        workloads = data_parallel_workloads(suite, scale, cases, measured_here)
        entries = []
        for workload, (base, n) in zip(workloads, base_cases(workloads)):
            entries.append({**_case_entry(workload), "base_case": base, "nprocs": n,
                            "model_flops_per_step": step_model_flops(workload), "flops_method": FLOPS_METHOD,
                            "layouts": {arm: _layout_entry(arm, workload, n) for arm in arm_names}})
        config = {
            "kind": "model_parallel",
            "suite_file": str(self.suite_file),
            "scale": scale,
            "arms": arm_names,
            "nprocs": measured_here,
            "trials": counts.trials,
            "steps": counts.steps,
            "warmup_steps": counts.warmup_steps,
            "precision": suite.precision,
            "family": suite.family,
            "cases": entries,
            "model_options": suite.model_options,
            "engine": self.engine,
            "peers": layout_peers(arm_names),
            "world_size": world.size,
            "device": str(device),
            "seed": suite.seed,
        }
        notes = ["each arm runs all its trials before the next arm is built (the layouts' engines do not fit on the "
                 "GPUs together); the trials of one arm are not interleaved with the others'",
                 "every arm of a case steps the case's global batch: tokens/s compare at equal work per step; TFLOP/s "
                 "and MFU are per GPU, from Megatron-LM's model flops (no recomputation)"]
        return Plan(arms=arm_names, cases=workloads, config=config,
                    data={"kind": "synthetic", "description": workloads[0].data_description}, notes=notes)

    def open_case(self, workload: Workload, context: RunContext) -> "ModelParallelCase":
        return ModelParallelCase(self, workload, context)


def step_model_flops(workload: Workload) -> float:
    """:func:`megatron_flops` of one step of ``workload``'s case (its global batch)."""
    config = workload.model_config()
    case = workload.case
    return megatron_flops(config.layers, config.hidden, config.vocab_size, case.seq_len, case.global_batch)


def _layout_entry(arm: str, workload: Workload, nprocs: int) -> dict:
    try:
        run = plan_layout(arm, workload, nprocs)
    except ArmSkipped as err:
        return {"skipped": str(err)}
    entry = {"tp": run.tp, "pp": run.pp, "dp": run.dp, "micro_batches": run.micro_batches,
             "activation_checkpoint_interval": run.checkpoint_interval}
    if run.impl != "torch":  # DeepSpeed's pipeline runs its bf16 optimizer under stage 1 on any layout
        entry["zero_stage"] = run.zero_stage if run.impl == "dslab" else 1
    return entry


class ModelParallelCase(DataParallelCase):
    """One model case on one process count: each layout built (the ranks agreeing on the outcome),
    timed and closed in turn (:class:`~dslab.bench.protocol.CaseRun`)."""

    def step_flops(self) -> int:
        """Megatron's model flops of one step over this launch's processes (module docstring)."""
        return int(step_model_flops(self.workload) / self.context.world.size)

    def step_work(self, name: str, arm) -> tuple[int, int]:
        """The global batch: every arm steps the same sequences."""
        case = self.workload.case
        return case.global_batch, case.global_batch * case.seq_len

    def build_arm(self, name: str):
        context = self.context
        run = plan_layout(name, self.workload, context.world.size)  # skipped alike on every rank
        arm, error, skipped = None, None, None
        try:
            arm = self._build(run)
        except ArmSkipped as err:
            skipped = err
        except Exception as err:
            error = err
        if context.world.size == 1:
            outcomes = [(None if skipped is None else str(skipped), None)]
        else:
            outcomes = comm.all_gather_object((None if skipped is None else str(skipped),
                                               None if error is None else error_text(error, "building the arm")))
        if error is not None:
            raise error
        reason = next((why for why, _ in outcomes if why is not None), None)
        failed = next(((rank, text) for rank, (_, text) in enumerate(outcomes) if text is not None), None)
        if reason is not None or failed is not None:
            if arm is not None:
                arm.close()
            free_memory(context.device)
            if reason is not None:
                raise ArmSkipped(reason)
            rank, text = failed
            kind = torch.OutOfMemoryError if text.startswith(OOM_PREFIX) else RuntimeError
            raise kind(f"rank {rank}: {text.splitlines()[0]}")
        return arm

    def _build(self, run: LayoutRun):
        context = self.context
        if run.impl == "dslab":
            profile_dir = context.run_path / "profiles" / self.name / run.arm
            if context.world.size > 1:
                profile_dir = profile_dir / f"rank{context.world.rank}"
            return DslabLayoutArm(run, self.workload, context.device, self.suite.precision, self.engine,
                                  profile_dir=profile_dir,
                                  measured_peak_tflops=context.report.peaks.get("bf16_matmul_tflops"),
                                  echo_profile_text=self.verbose)
        from dslab.bench.model_parallel_peers import build_layout_peer  # torch's and DeepSpeed's, for their arms

        return build_layout_peer(run, self.workload, context.device, self.suite.precision, self.engine)

    def finish(self, arms: dict) -> None:
        for name, arm in arms.items():
            if isinstance(arm, DslabLayoutArm):
                self.record_profilers(arm, name, f"{self.name} {name}")
