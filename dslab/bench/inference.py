"""``dslab bench`` for inference suites (``"kind": "inference"``, :mod:`dslab.bench.inference_suite`).

For each case, transformers' model of the case's preset (GPT-2, or Llama for a ``llama`` suite) is built once with random weights (the
suite's seed) in the suite's precision on the device, with a batch of random prompts; every arm
generates from that model and those prompts, greedily, exactly ``max_new_tokens`` new tokens (no
eos), so all arms do the same work:

- ``dslab`` / ``dslab-int8``: :func:`dslab.init_inference` of that model (its weights copied into
  dslab's modules; int8 for the second) with the suite's ``inference`` keys and a KV cache of
  ``prompt_len + max_new_tokens`` positions; ``engine.generate``;
- ``hf`` / ``hf-static``: the model's own ``generate`` (``cache_implementation="static"`` for the
  second).

The inference kind of :mod:`dslab.bench.protocol`: the runner (:mod:`dslab.bench.runner`) runs
the trials interleaved with the arm order rotated, as for training; later trials settle with one
call. It runs in one process (``WORLD_SIZE`` > 1 and ``zero_stage`` are refused). A trial times
``steps`` generate calls with :class:`dslab.inference.TokenClock` (CUDA events; transformers' calls are marked by a stopping
criterion that runs after every token): per call its prefill (start to the first new token), the
gaps between later tokens, and its total. The trial's metrics: ``step_time_ms`` (median total),
``prefill_ms`` (median), ``per_token_ms_p50`` / ``_p90`` (over every gap of the trial's calls),
``tokens_per_s`` (new tokens, ``batch * max_new_tokens / step_time``), ``samples_per_s`` (sequences),
``peak_memory_bytes`` (the allocator's peak during the trial, every arm's weights included: all
arms of a case stay resident). The run's ratios are dslab's samples/s over each arm's (equal to the
ratio of new tokens per second).

Each arm's generate calls are steps of a :class:`~dslab.profilers.memory.MemoryTracer` attached
to the module that generates; the ``dslab`` arm's records (per-call peaks on CUDA, the weights as
model states, and ``"inference"``: the engine's weight and KV-cache bytes) go to
``profilers["memory"][case]``, as the training suites' dslab arm's do. With the suite's
``telemetry`` section on, NVML is sampled while a case's trials run (``profilers["telemetry"][case]``).

``report.inference[case]`` (run-report schema 3) gets each arm's medians, the weights and KV-cache
bytes of the dslab arms (``engine.memory_records()``) and, with the measured copy bandwidth, the
floor of a batch-1 token (reading every weight once); and the greedy comparison of the first
``compare_tokens`` new tokens of each arm's last generation against the ``hf`` arm's.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from dslab.bench.common import ArmSkipped, World, error_text, free_memory
from dslab.bench.inference_suite import (
    InferenceCase, InferenceSuiteConfig, select_inference_arms, select_inference_cases,
)
from dslab.bench.measure import sync
from dslab.bench.protocol import Counts, Plan, RunContext
from dslab.inference import TokenClock, init_inference
from dslab.profilers.memory import MemoryTracer
from dslab.profilers.telemetry import TelemetrySampler
from dslab.report import Result, RunReport

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SETTLE_STEPS = 1
REFERENCE_ARM = "hf"


def build_hf_gpt2(preset: str, options: dict, seed: int, dtype: torch.dtype, device: torch.device):
    """transformers' ``GPT2LMHeadModel`` of dslab's preset ``gpt2_*`` (no dropout, eval mode),
    random weights from ``seed``, in ``dtype`` on ``device``."""
    import transformers

    from dslab.models import gpt2 as presets

    factory = getattr(presets, preset, None) if preset.startswith("gpt2_") else None
    if not callable(factory):
        raise ValueError(f"preset {preset!r} is not one of dslab.models.gpt2's gpt2_* presets")
    c = factory(**options)
    config = transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.hidden, n_layer=c.layers, n_head=c.heads,
        layer_norm_epsilon=c.layer_norm_epsilon, initializer_range=c.initializer_range, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.GPT2LMHeadModel(config)
    return model.to(dtype).eval()


def build_hf_llama(preset: str, options: dict, seed: int, dtype: torch.dtype, device: torch.device):
    """transformers' ``LlamaForCausalLM`` of dslab's preset (:mod:`dslab.models.llama`'s ``llama*``;
    SDPA attention, eval mode), random weights from ``seed``, in ``dtype`` on ``device``."""
    import transformers

    from dslab.models import llama as presets

    factory = getattr(presets, preset, None) if preset.startswith("llama") else None
    if not callable(factory) or preset == "llama_parameter_count":
        raise ValueError(f"preset {preset!r} is not one of dslab.models.llama's presets (llama3_1b, llama3_3b, "
                         f"llama3_8b, llama_tiny)")
    c = factory(**options)
    config = transformers.LlamaConfig(**c.hf_kwargs(), bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                      attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


# The transformers model of each family's presets, and how many positions it takes.
HF_BUILDERS = {"gpt2": build_hf_gpt2, "llama": build_hf_llama}


def model_positions(model) -> int:
    """The positions a transformers model of a suite's family takes."""
    config = model.config
    return getattr(config, "n_positions", None) or config.max_position_embeddings


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=generator).to(device)


def _clock_criterion(clock: TokenClock):
    """A transformers stopping criterion that never stops and marks each new token on ``clock``
    (``generate`` calls its criteria once per new token)."""
    from transformers import StoppingCriteria

    class TokenClockCriterion(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            clock.tick()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return TokenClockCriterion()


class GenerateArm:
    """One way of generating: ``run()`` -> ``(tokens [batch, P + N], clock result)``.

    Each call is a step of the arm's :class:`~dslab.profilers.memory.MemoryTracer` (attached to the
    module that generates: the injected model, or transformers'): the allocator's peak per call on
    CUDA (``last_peak``), and the module's weights counted by storage."""

    def __init__(self, name: str, model, prompts: torch.Tensor, case: InferenceCase, precision: str,
                 inference_keys: dict, device: torch.device):
        self.name, self.case, self.prompts = name, case, prompts
        self.mask = torch.ones_like(prompts)
        self.clock = TokenClock(device)
        self.engine = None
        self.model = model
        self.tracer = MemoryTracer(profile_step=0)
        self.calls = 0
        self.last_peak = None
        if name.startswith("dslab"):
            dtype = torch.int8 if name == "dslab-int8" else DTYPES[precision]
            keys = dict(inference_keys)
            if name == "dslab-int8":
                keys["quant"] = {**keys.get("quant", {}), "compute_dtype": precision}
            self.engine = init_inference(model, config=keys, dtype=dtype,
                                         max_out_tokens=case.prompt_len + case.max_new_tokens)
            self.engine.token_clock = self.clock
            self.tracer.attach(self.engine.module)
        else:
            self.tracer.attach(model)
            try:
                import transformers  # noqa: F401
            except ImportError:
                raise ArmSkipped("transformers is not installed") from None

    def run(self) -> tuple[torch.Tensor, dict]:
        self.tracer.on_step_begin(self.calls)
        tokens = self._generate()
        self.tracer.on_step_end(self.calls)
        self.calls += 1
        if self.tracer.cuda:  # reset when the step began: this call's peak
            self.last_peak = torch.cuda.max_memory_allocated(self.tracer.device)
        return tokens, self.clock.result()

    def _generate(self) -> torch.Tensor:
        new = self.case.max_new_tokens
        if self.engine is not None:  # the same loop as transformers' arms below: every row makes all `new` tokens
            return self.engine.generate(self.prompts, attention_mask=self.mask, max_new_tokens=new,
                                        min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        from transformers import StoppingCriteriaList

        static = {"cache_implementation": "static"} if self.name == "hf-static" else {}
        self.clock.start()
        with torch.no_grad():
            return self.model.generate(self.prompts, attention_mask=self.mask, max_new_tokens=new,
                                       min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                                       stopping_criteria=StoppingCriteriaList([_clock_criterion(self.clock)]), **static)

    def memory(self) -> dict:
        if self.engine is not None:
            records = self.engine.memory_records()
            return {"weights_bytes": records["weights_bytes"], "kv_cache_bytes": records["kv_cache_bytes"]}
        tensors = {t.data_ptr(): t.numel() * t.element_size() for t in self.model.parameters()}
        return {"weights_bytes": sum(tensors.values())}

    def memory_trace(self) -> dict:
        """The memory tracer's records, with the engine's weight and KV-cache bytes
        (``"inference"``) for a dslab arm."""
        records = self.tracer.records()
        if self.engine is not None:
            records["inference"] = self.engine.memory_records()
        return records

    def close(self) -> None:
        self.tracer.close()
        if self.engine is not None:
            self.engine.release_cuda_graphs()
        self.engine = self.model = None


def run_generations(arm: GenerateArm, device: torch.device, warmup: int, steps: int) -> dict:
    """``warmup`` untimed calls, then ``steps`` timed ones: their clock results, the last tokens
    and the allocator's peak (CUDA) over the timed calls (the largest of their peaks)."""
    for _ in range(warmup):
        arm.run()
    sync(device)
    calls, peaks, tokens = [], [], None
    for _ in range(steps):
        tokens, timing = arm.run()
        calls.append(timing)
        peaks.append(arm.last_peak)
    sync(device)
    return {"calls": calls, "tokens": tokens, "peak_memory_bytes": max(peaks) if None not in peaks else None}


def trial_metrics(measured: dict, case: InferenceCase) -> dict:
    totals = [c["total_ms"] for c in measured["calls"]]
    gaps = [g for c in measured["calls"] for g in c["per_token_ms"]]
    step_ms = statistics.median(totals)
    metrics = {"step_time_ms": step_ms, "step_time_min_ms": min(totals), "step_time_max_ms": max(totals),
               "prefill_ms": statistics.median(c["prefill_ms"] for c in measured["calls"]),
               "samples_per_s": case.batch / (step_ms / 1e3),
               "tokens_per_s": case.batch * case.max_new_tokens / (step_ms / 1e3)}
    if gaps:
        metrics["per_token_ms_p50"] = statistics.median(gaps)
        metrics["per_token_ms_p90"] = statistics.quantiles(gaps, n=10)[-1] if len(gaps) >= 2 else gaps[0]
    if measured["peak_memory_bytes"] is not None:
        metrics["peak_memory_bytes"] = float(measured["peak_memory_bytes"])
    return metrics


def compare_greedy(outputs: dict[str, torch.Tensor], prompt_len: int, compared: int) -> dict | None:
    """Each arm's first ``compared`` new tokens against the reference arm's (None without it)."""
    reference = outputs.get(REFERENCE_ARM)
    if reference is None:
        return None
    ref = reference[:, prompt_len:prompt_len + compared].cpu()
    arms = {}
    for name, tokens in outputs.items():
        if name == REFERENCE_ARM:
            continue
        ours = tokens[:, prompt_len:prompt_len + compared].cpu()
        differs = (ours != ref).any(dim=0).nonzero()
        arms[name] = {"equal": bool(torch.equal(ours, ref)),
                      "first_divergence": int(differs[0]) if len(differs) else None,
                      "agreement": float((ours == ref).float().mean())}
    return {"reference_arm": REFERENCE_ARM, "compared_tokens": int(ref.shape[1]), "arms": arms}


def _case_record(report: RunReport, case: InferenceCase, preset: str, memory: dict, outputs: dict,
                 compare_tokens: int) -> dict:
    arms = {}
    copy_gbps = report.peaks.get("copy_gbps")
    for name, bytes_ in memory.items():
        result = report.result(case.name, name)
        keep = ("prefill_ms", "per_token_ms_p50", "per_token_ms_p90", "tokens_per_s", "peak_memory_bytes")
        entry = {k: result.metrics[k] for k in keep if result is not None and k in result.metrics}
        entry.update(bytes_)
        if copy_gbps:  # half the copy bandwidth's bytes are reads: reading the weights once per token
            entry["weights_read_floor_ms"] = bytes_["weights_bytes"] / (copy_gbps / 2 * 1e9) * 1e3
        arms[name] = entry
    return {"batch": case.batch, "prompt_len": case.prompt_len, "max_new_tokens": case.max_new_tokens,
            "model": preset, "arms": arms, "greedy": compare_greedy(outputs, case.prompt_len, compare_tokens)}


class InferenceSuite:
    """The inference kind (:class:`~dslab.bench.protocol.SuiteKind`): one process, no ZeRO."""

    def __init__(self, suite: InferenceSuiteConfig, suite_file: Path, zero_stage: int | None = None,
                 verbose: bool = False):
        if zero_stage is not None:
            raise ValueError(f"--zero-stage applies to training suites; {suite.name} is an inference suite")
        self.suite, self.suite_file = suite, suite_file

    def join_world(self) -> World:
        if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
            raise ValueError(f"inference suite {self.suite.name} runs in one process "
                             f"(WORLD_SIZE={os.environ['WORLD_SIZE']}); tensor-parallel inference is tested by "
                             f"tests/inference/test_tensor_parallel.py")
        return World()

    def plan(self, scale: str, arms: list[str] | None, cases: list[str] | None, counts: Counts, world: World,
             device: torch.device) -> Plan:
        suite = self.suite
        sc = suite.scales[scale]
        arm_names = select_inference_arms(suite, arms, scale)
        chosen = select_inference_cases(sc, cases)
        config = {
            "suite_file": str(self.suite_file), "kind": "inference", "scale": scale, "arms": arm_names,
            "trials": counts.trials, "steps": counts.steps, "warmup_steps": counts.warmup_steps,
            "precision": suite.precision, "family": suite.family,
            "cases": [{**c.model_dump(), "preset": c.preset or sc.preset} for c in chosen],
            "model_options": suite.model_options, "inference": suite.inference, "compare_tokens": suite.compare_tokens,
            "world_size": 1, "device": str(device), "seed": suite.seed,
        }
        data = {"kind": "synthetic", "description": "uniform random prompt token ids (the suite's seed), no padding; "
                "greedy generation of exactly max_new_tokens new tokens (no eos); random weights"}
        return Plan(arms=arm_names, cases=[(c, c.preset or sc.preset) for c in chosen], config=config, data=data,
                    step_noun="generate calls")

    def open_case(self, planned: tuple[InferenceCase, str], context: RunContext) -> "GenerationCase | None":
        case, preset = planned
        suite = self.suite
        try:
            model = HF_BUILDERS[suite.family](preset, {**suite.model_options, **case.model_options}, suite.seed,
                                              DTYPES[suite.precision], context.device)
        except Exception as err:
            for name in context.arms:
                context.report.results.append(Result(case=case.name, arm=name, status="failed",
                                                     error=error_text(err, "building the model")))
            context.progress.line(f"[{suite.name} {case.name}] the model could not be built: "
                                  f"{error_text(err).splitlines()[0]}")
            return None
        if case.prompt_len + case.max_new_tokens > model_positions(model):
            raise ValueError(f"case {case.name!r}: prompt_len + max_new_tokens = "
                             f"{case.prompt_len + case.max_new_tokens} exceeds the model's "
                             f"{model_positions(model)} positions")
        return GenerationCase(suite, case, preset, model, context)


class GenerationCase:
    """One case's arms generating from one model and one batch of prompts
    (:class:`~dslab.bench.protocol.CaseRun`)."""

    settle_steps = SETTLE_STEPS

    def __init__(self, suite: InferenceSuiteConfig, case: InferenceCase, preset: str, model, context: RunContext):
        self.suite, self.case, self.preset, self.model, self.context = suite, case, preset, model, context
        self.name = case.name
        self.prompts = make_prompts(case.batch, case.prompt_len, model.config.vocab_size, suite.seed, context.device)
        self.telemetry = None
        self.outputs: dict[str, torch.Tensor] = {}
        self.memory: dict[str, dict] = {}

    def build_arm(self, name: str) -> GenerateArm:
        return GenerateArm(name, self.model, self.prompts, self.case, self.suite.precision, self.suite.inference,
                           self.context.device)

    def before_trials(self) -> None:
        self.telemetry = TelemetrySampler.from_config(self.suite.telemetry)
        if self.telemetry is not None:
            self.telemetry.start()

    def run_trial(self, name: str, arm: GenerateArm, warmup: int, steps: int, trial: int) -> tuple[list[float], dict]:
        measured = run_generations(arm, self.context.device, warmup, steps)
        self.outputs[name] = measured["tokens"]
        self.memory[name] = arm.memory()
        return [c["total_ms"] for c in measured["calls"]], trial_metrics(measured, self.case)

    def trial_line(self, name: str, metrics: dict) -> str:
        return (f"{name:<10} {metrics['tokens_per_s']:>10.1f} tokens/s  prefill {metrics['prefill_ms']:>8.2f} ms  "
                f"per token {metrics.get('per_token_ms_p50', float('nan')):>7.3f} ms")

    def finish(self, arms: dict[str, GenerateArm]) -> None:
        report = self.context.report
        if self.telemetry is not None:
            self.telemetry.close()
            if report.profilers.get("telemetry") is None:
                report.profilers["telemetry"] = {}
            report.profilers["telemetry"][self.name] = self.telemetry.records()
        report.inference[self.name] = _case_record(report, self.case, self.preset, self.memory, self.outputs,
                                                   self.suite.compare_tokens)
        if "dslab" in arms:  # the Memory tab's record of the case, as the training suites' dslab arm
            if report.profilers.get("memory") is None:
                report.profilers["memory"] = {}
            report.profilers["memory"][self.name] = arms["dslab"].memory_trace()
        for name, arm in arms.items():
            stats = arm.engine.cuda_graph_stats if arm.engine is not None else {}
            if stats:
                report.notes.append(f"{self.name}: {name} decode steps: "
                                    f"{', '.join(f'{k} {v}' for k, v in sorted(stats.items()))}")

    def close(self) -> None:
        self.model = self.prompts = None
        self.outputs.clear()
        free_memory(self.context.device)
