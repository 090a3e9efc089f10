"""Long-context suites in ``dslab bench`` (``suites/long_context``): one Llama sequence of 32k to 256k
tokens split over the processes of one host, dslab's engine with DeepSpeed-Ulysses sequence
parallelism beside PyTorch's context parallelism (ring attention), on the same model, weights and
batch.

The kind runs as the data-parallel one does (:mod:`dslab.bench.data_parallel`, whose launches and
report merging it shares): ``dslab bench suites/long_context`` starts one torchrun per process
count (:mod:`dslab.bench.launcher`), each launch names its cases ``<case>-n<N>`` and writes its
part of the run's one report, and inside a launch each arm is built (the ranks agreeing on the
outcome), timed for every trial and closed before the next. The sequence-parallel degree is the
launch's process count: every rank holds ``seq_len / N`` tokens of the case's sequence(s).

The arms (:mod:`dslab.bench.long_context_suite`):

- ``dslab-ulysses`` (:class:`DslabUlyssesArm`): :class:`dslab.models.llama.LlamaForCausalLM` on
  dslab's kernels with ``sequence_parallel_size`` N over the group of
  :func:`dslab.parallel.sequence.initialize_sequence_parallel`, in ``dslab.initialize`` with the
  suite's engine config plus the case's micro-batch, the precision and the top-level
  ``sequence_parallel_size`` N (the engine's ZeRO stage then shards over the N ranks that hold the
  one replica). Every rank is handed the whole batch and keeps its chunk; one step is
  ``engine(...)``, ``engine.backward``, ``engine.step()``.
- ``torch-cp``: :mod:`dslab.bench.long_context_peers`.

Both start from the weights the suite's seed gives dslab's Llama and train on the same synthetic
batch (:class:`~dslab.bench.workloads.Workload`); ``checkpoint_layers`` in the model options
checkpoints both arms' blocks alike.

Measurements are the training kind's (:mod:`dslab.bench.training`): the slowest rank's step times,
every rank's peak memory (``peak_memory_bytes_rank<r>``; on a CPU ``peak_rss_bytes_rank<r>``),
and tokens/s of the step's sequences (``micro_batch * seq_len`` tokens per step over all the
ranks: one sequence is split, not replicated). TFLOP/s and MFU are per GPU: the flops of one step
counted once per case from the aten ops of a forward and backward of
:class:`~dslab.bench.torch_llama.TorchLlama` over the whole sequence (:func:`count_step_flops`),
over the launch's processes (``config.flops_per_step[case]``). Attention is counted as computed:
a causal SDPA call is priced at half of torch's score-square formula, the lower triangle that the
flash kernels compute (:func:`dslab.profilers.flops_causal.causal_aware_formulas`, and the same
for the CPU's flash kernel here), so MFU does not credit the masked half. Recomputation under
activation checkpointing is not counted (model flops). The case's entry of ``config.cases`` has
the closed form beside the count (``formula_flops_per_step``, :func:`llama_step_flops`); a count
that differs from it by more than 1% is noted.

Per case and arm, ``report.profilers["long_context"]["<case> <arm>"]`` holds the arm's first-step
loss (the whole sequence's mean, read after its trials: no synchronisation in the timed steps), the
sequence-parallel degree and the tokens each rank holds; the dslab arm's engine profiler records
(the comms logger's all-to-alls of Ulysses among them, memory, wall clock, telemetry) go to
``report.profilers[section]["<case> <arm>"]``, its files to ``profiles/<case>/<arm>/rank<r>``.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch

from dslab import comm
from dslab.bench.common import OOM_PREFIX, PART_ENV, ArmSkipped, World, error_text, free_memory
from dslab.bench.data_parallel import DataParallelCase, DataParallelSuite, base_cases, process_counts
from dslab.bench.long_context_suite import (
    DSLAB_LONG_CONTEXT_ARMS, LongContextSuiteConfig, check_sequence_split, long_context_peers,
    select_long_context_arms,
)
from dslab.bench.protocol import Counts, Plan, RunContext
from dslab.bench.torch_llama import TorchLlama, rotary_tables, shifted_targets
from dslab.bench.training import _case_entry
from dslab.bench.workloads import Workload
from dslab.models.llama import LlamaConfig, LlamaForCausalLM, llama_parameter_count
from dslab.profilers.flops_causal import causal_aware_formulas, expand_kv_heads, runs_causal

RECORD_SECTION = "long_context"
FLOPS_METHOD = ("counted from the aten ops of one forward and backward of the whole sequence (FlopCounterMode on "
                "fake CPU tensors of the plain torch Llama): matmuls, and SDPA called causal at half of torch's "
                "score-square formula (the lower triangle the flash kernels compute); no recomputation")
COUNT_TOLERANCE = 0.01


def llama_step_flops(config: LlamaConfig, seq_len: int, sequences: int) -> int:
    """The closed form of what :func:`count_step_flops` counts for one step over ``sequences``
    sequences of ``seq_len`` tokens: ``6 T P`` for the ``P`` weights of the blocks' projections
    and the LM head (forward 2, backward 4 flops per weight and token, ``T`` tokens), plus causal
    attention as computed, ``7 b h s^2 d`` per layer: the forward's ``q k^T`` and ``p v``
    (``4 b h s^2 d`` over the whole square) and the backward's five products (recomputed scores,
    dv, dp, dq, dk: ``10 b h s^2 d``), each over the lower triangle, half of it."""
    tokens = sequences * seq_len
    block = config.hidden * config.qkv_rows + config.heads * config.head_dim * config.hidden \
        + 3 * config.hidden * config.intermediate
    weights = config.layers * block + config.padded_vocab_size * config.hidden
    attention = 7 * sequences * config.heads * seq_len**2 * config.head_dim
    return 6 * tokens * weights + config.layers * attention


def cpu_flash_formulas() -> dict:
    """``FlopCounterMode`` prices for the CPU's fused attention kernel
    (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), which torch's counter
    has none for: the flash kernels' formulas (grouped-query key/value heads widened to the
    query's, :func:`~dslab.profilers.flops_causal.expand_kv_heads`), halved for a causal call as
    :func:`~dslab.profilers.flops_causal.causal_aware_formulas` halves the CUDA ones."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    forward_op = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def forward(query, key, value, *args, out_val=None, **kwargs):
        q, k, v = expand_kv_heads((query, key, value))
        flops = flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
        return flops // 2 if runs_causal(forward_op, (query, key, value, *args), kwargs) else flops

    def backward(grad_out, query, key, value, *args, out_val=None, **kwargs):
        q, k, v = expand_kv_heads((query, key, value))
        flops = flop_counter.sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)
        return flops // 2 if runs_causal(backward_op, (grad_out, query, key, value, *args), kwargs) else flops

    forward._get_raw = backward._get_raw = True  # FlopCounterMode hands them the tensors and is_causal
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def count_step_flops(config: LlamaConfig, seq_len: int, sequences: int) -> int:
    """The flops of one forward and backward of :class:`~dslab.bench.torch_llama.TorchLlama` over
    ``sequences`` whole sequences of ``seq_len`` tokens, counted by ``FlopCounterMode`` with the
    causal-aware prices (:func:`cpu_flash_formulas`) on fake CPU tensors: shapes only, no memory,
    so a 256k-token step of a 1.5B model counts in seconds on any host. Activation checkpointing is
    off for the count (its recomputation is not model flops)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    counted = dataclasses.replace(config, checkpoint_layers=0)
    counter = FlopCounterMode(display=False, custom_mapping={**causal_aware_formulas(), **cpu_flash_formulas()})
    with FakeTensorMode(), torch.device("cpu"):
        model = TorchLlama(counted)
        ids = torch.randint(0, counted.vocab_size, (sequences, seq_len))
        cos, sin = rotary_tables(counted, seq_len, torch.device("cpu"))
        with counter:
            model(ids, shifted_targets(ids), cos, sin).backward()
    return int(counter.get_total_flops())


def long_context_workloads(suite: LongContextSuiteConfig, scale: str, cases: list[str] | None,
                           nprocs: list[int]) -> list[Workload]:
    """One workload per case and process count, named ``<case>-n<N>``, its model the preset with
    the suite's, then the scale's, then the case's model options; ``cases`` may name cases
    (``32k``: every count) or process-count cases (``32k-n4``)."""
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
                                model_options={**suite.model_options, **sc.model_options, **case.model_options},
                                seed=suite.seed, precision=suite.precision)
            try:
                config = workload.model_config()
            except ValueError as err:
                raise ValueError(f"suite {suite.name}, scale {scale}, case {case.name!r}: {err}") from None
            if case.seq_len > config.max_positions:
                raise ValueError(f"suite {suite.name}, scale {scale}, case {case.name!r}: seq_len {case.seq_len} > "
                                 f"the model's max_positions {config.max_positions}; raise it in model_options")
            workloads.append(workload)
    if not workloads:
        raise ValueError(f"suite {suite.name}: no case of {', '.join(sorted(wanted))} runs on "
                         f"{', '.join(map(str, nprocs))} process(es)")
    return workloads


class DslabUlyssesArm:
    """``dslab-ulysses`` (module docstring): ``step()`` is one optimizer step over the case's
    sequences; ``records()`` the engine's profiler records."""

    def __init__(self, workload: Workload, device: torch.device, precision: str, engine: dict, world: int,
                 profile_dir=None, measured_peak_tflops: float | None = None, echo_profile_text: bool = False):
        import dslab
        from dslab.parallel.sequence import initialize_sequence_parallel

        check_sequence_split(workload.case.seq_len, world, "dslab-ulysses")
        try:
            config = workload.model_config({"sequence_parallel_size": world})
        except ValueError as err:  # heads that do not split over the ranks
            raise ArmSkipped(f"dslab-ulysses cannot split the model over {world} ranks: {err}") from None
        group = initialize_sequence_parallel(world).group if world > 1 else None
        torch.manual_seed(workload.seed)
        with torch.device(device):
            model = LlamaForCausalLM(config, "dslab", sp_group=group)
        cfg = copy.deepcopy(engine)
        cfg["train_micro_batch_size_per_gpu"] = workload.case.micro_batch
        cfg["gradient_accumulation_steps"] = 1
        cfg["sequence_parallel_size"] = world
        if precision != "fp32":
            cfg[precision] = {"enabled": True}
        cfg.setdefault("steps_per_print", 10**9)
        self.engine, _, _, _ = dslab.initialize(model=model, config=cfg, dist_init_required=False)
        if profile_dir is not None:
            self.engine.set_profile_output_dir(profile_dir, echo_text=echo_profile_text)
        if measured_peak_tflops:
            self.engine.set_measured_peak(measured_peak_tflops)
        self.batch = workload.make_batch(self.engine.device)
        self.first_loss: torch.Tensor | None = None

    def step(self) -> torch.Tensor:
        loss = self.engine(**self.batch)
        self.engine.backward(loss)
        self.engine.step()
        if self.first_loss is None:
            self.first_loss = loss.detach().clone()
        return loss

    def records(self) -> dict[str, dict]:
        return self.engine.profiler_records()

    def cuda_graph_stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self.engine.destroy()
        del self.engine, self.batch


class LongContextSuite(DataParallelSuite):
    """The long-context kind (:class:`~dslab.bench.protocol.SuiteKind`): launches and process
    counts as the data-parallel kind's, each launch one sequence-parallel group."""

    def __init__(self, suite: LongContextSuiteConfig, suite_file, zero_stage: int | None = None,
                 verbose: bool = False, nprocs: list[int] | None = None):
        if zero_stage is not None:
            raise ValueError("--zero-stage: a long-context suite's dslab arm runs the suite engine's "
                             "zero_optimization.stage; set it in the suite")
        super().__init__(suite, suite_file, None, verbose, nprocs)

    def plan(self, scale: str, arms: list[str] | None, cases: list[str] | None, counts: Counts, world: World,
             device: torch.device) -> Plan:
        suite = self.suite
        if scale not in suite.scales:
            raise ValueError(f"suite {suite.name} has no scale {scale!r}; it has {', '.join(suite.scales)}")
        arm_names = select_long_context_arms(suite, arms, scale)
        nprocs = process_counts(suite, scale, self.nprocs)
        inside = bool(os.environ.get(PART_ENV)) or comm.is_initialized()
        measured_here = [world.size] if inside else nprocs
        workloads = long_context_workloads(suite, scale, cases, measured_here)
        entries = []
        for workload, (base, n) in zip(workloads, base_cases(workloads)):
            model = workload.model_config()
            case = workload.case
            entries.append({**_case_entry(workload), "base_case": base, "nprocs": n, "sequence_parallel_size": n,
                            "tokens_per_rank": case.micro_batch * case.seq_len // n,
                            "parameters": llama_parameter_count(model),
                            "formula_flops_per_step": llama_step_flops(model, case.seq_len, case.micro_batch),
                            "flops_method": FLOPS_METHOD})
        config = {
            "kind": "long_context",
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
            "model_options": {**suite.model_options, **suite.scales[scale].model_options},
            "engine": self.engine,
            "peers": long_context_peers(arm_names),
            "world_size": world.size,
            "device": str(device),
            "seed": suite.seed,
        }
        notes = ["each arm runs all its trials before the next arm is built (two sharded 1.5B trainers at 256k "
                 "tokens do not fit on the GPUs together); the trials of one arm are not interleaved with the "
                 "others'",
                 "one sequence is split over the launch's processes (sequence parallelism = the process count): "
                 "tokens/s count its tokens once; TFLOP/s and MFU are per GPU from the counted flops with causal "
                 "attention at half the score square (the lower triangle that is computed), no recomputation"]
        return Plan(arms=arm_names, cases=workloads, config=config,
                    data={"kind": "synthetic", "description": workloads[0].data_description}, notes=notes)

    def open_case(self, workload: Workload, context: RunContext) -> "LongContextCase":
        return LongContextCase(self, workload, context)


class LongContextCase(DataParallelCase):
    """One sequence length on one process count: each arm built (the ranks agreeing on the
    outcome), timed and closed in turn (:class:`~dslab.bench.protocol.CaseRun`)."""

    def step_flops(self) -> int | None:
        """The counted flops of one step (module docstring) over this launch's processes; rank 0
        only (its report is the one written), with a note when the count strays from the closed
        form or fails."""
        context = self.context
        if context.world.rank != 0:
            return None
        case = self.workload.case
        config = self.workload.model_config()
        try:
            counted = count_step_flops(config, case.seq_len, case.micro_batch)
        except Exception as err:  # counting is informative; the timings stand without it
            context.report.notes.append(f"{self.name}: flop count failed: {error_text(err).splitlines()[0]}")
            return None
        formula = llama_step_flops(config, case.seq_len, case.micro_batch)
        if abs(counted - formula) > COUNT_TOLERANCE * formula:
            context.report.notes.append(f"{self.name}: counted {counted:.4g} flops per step, the closed form gives "
                                        f"{formula:.4g}; TFLOP/s and MFU divide the count")
        return int(counted / context.world.size)

    def step_work(self, name: str, arm) -> tuple[int, int]:
        """The case's sequences and their tokens: one split sequence is counted once."""
        case = self.workload.case
        return case.micro_batch, case.micro_batch * case.seq_len

    def build_arm(self, name: str):
        context = self.context
        arm, error, skipped = None, None, None
        try:
            arm = self._build(name)
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

    def _build(self, name: str):
        context = self.context
        world = context.world.size
        if name in DSLAB_LONG_CONTEXT_ARMS:
            profile_dir = context.run_path / "profiles" / self.name / name
            if world > 1:
                profile_dir = profile_dir / f"rank{context.world.rank}"
            return DslabUlyssesArm(self.workload, context.device, self.suite.precision, self.engine, world,
                                   profile_dir=profile_dir,
                                   measured_peak_tflops=context.report.peaks.get("bf16_matmul_tflops"),
                                   echo_profile_text=self.verbose)
        from dslab.bench.long_context_peers import TorchContextParallelArm  # torch's CP loads only for its arm

        return TorchContextParallelArm(self.workload, context.device, self.suite.precision, self.engine, world)

    def finish(self, arms: dict) -> None:
        report = self.context.report
        case = self.workload.case
        world = self.context.world.size
        for name, arm in arms.items():
            if isinstance(arm, DslabUlyssesArm):
                self.record_profilers(arm, name, f"{self.name} {name}")
            first = arm.first_loss
            if report.profilers.get(RECORD_SECTION) is None:
                report.profilers[RECORD_SECTION] = {}
            report.profilers[RECORD_SECTION][f"{self.name} {name}"] = {
                "first_step_loss": None if first is None else float(first.float()),
                "sequence_parallel_size": world,
                "tokens_per_rank": case.micro_batch * case.seq_len // world,
                "attention": ("Ulysses: all-to-alls trade the sequence split for a head split around attention"
                              if name in DSLAB_LONG_CONTEXT_ARMS else
                              "ring: key/value chunks passed around the ranks inside SDPA (context_parallel)"),
            }

    def trial_line(self, name: str, metrics: dict) -> str:
        mfu = metrics.get("mfu_measured", metrics.get("mfu_datasheet"))
        tflops = f"  {metrics['model_tflops']:.3g} TFLOP/s/GPU" if "model_tflops" in metrics else ""
        return (f"{name:<14} {metrics['tokens_per_s']:>12,.0f} tokens/s  {metrics['step_time_ms']:>10.2f} ms/step"
                f"{tflops}{f'  MFU {mfu:.1%}' if mfu is not None else ''}")
