"""``dslab bench`` for inference suites (``"kind": "inference"``, :mod:`dslab.bench.inference_suite`).

For each case, transformers' GPT-2 of the case's preset is built once with random weights (the
suite's seed) in the suite's precision on the device, with a batch of random prompts; every arm
generates from that model and those prompts, greedily, exactly ``max_new_tokens`` new tokens (no
eos), so all arms do the same work:

- ``dslab`` / ``dslab-int8``: :func:`dslab.init_inference` of that model (its weights copied into
  dslab's modules; int8 for the second) with the suite's ``inference`` keys and a KV cache of
  ``prompt_len + max_new_tokens`` positions; ``engine.generate``;
- ``hf`` / ``hf-static``: the model's own ``generate`` (``cache_implementation="static"`` for the
  second).

Trials run interleaved with the arm order rotated, as the training runner does
(:mod:`dslab.bench.runner`). A trial times ``steps`` generate calls with
:class:`dslab.inference.TokenClock` (CUDA events; transformers' calls are marked by a stopping
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
import sys
from pathlib import Path
from typing import TextIO

import torch

from dslab.bench.arms import ArmSkipped
from dslab.bench.inference_suite import (
    InferenceCase, InferenceSuiteConfig, select_inference_arms, select_inference_cases,
)
from dslab.bench.measure import measure_peaks, sync
from dslab.bench.runner import Progress, _datasheet_bf16, _device, _error_text, _failure_status, _free
from dslab.inference import TokenClock, init_inference
from dslab.profilers.memory import MemoryTracer
from dslab.profilers.telemetry import TelemetrySampler
from dslab.report import Result, RunReport, Trial, new_run_id, write_report
from dslab.report.environment import collect_environment
from dslab.report.store import utc_now
from dslab.report.summary import describe, results_table

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
        if self.engine is not None:
            return self.engine.generate(self.prompts, attention_mask=self.mask, max_new_tokens=new)
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


def _run_case(report: RunReport, suite: InferenceSuiteConfig, case: InferenceCase, preset: str, arm_names: list[str],
              device: torch.device, trials: int, steps: int, warmup: int, out, progress: Progress) -> None:
    tag = f"[{suite.name} {case.name}]"
    built: dict[str, GenerateArm] = {}
    try:
        model = build_hf_gpt2(preset, {**suite.model_options, **case.model_options}, suite.seed,
                              DTYPES[suite.precision], device)
    except Exception as err:
        for name in arm_names:
            report.results.append(Result(case=case.name, arm=name, status="failed",
                                         error=_error_text(err, "building the model")))
        progress.line(f"{tag} the model could not be built: {_error_text(err).splitlines()[0]}")
        return
    if case.prompt_len + case.max_new_tokens > model.config.n_positions:
        raise ValueError(f"case {case.name!r}: prompt_len + max_new_tokens = {case.prompt_len + case.max_new_tokens} "
                         f"exceeds the model's {model.config.n_positions} positions")
    prompts = make_prompts(case.batch, case.prompt_len, model.config.vocab_size, suite.seed, device)
    for name in arm_names:
        result = Result(case=case.name, arm=name)
        report.results.append(result)
        try:
            built[name] = GenerateArm(name, model, prompts, case, suite.precision, suite.inference, device)
        except ArmSkipped as err:
            result.status, result.error = "skipped", str(err)
        except Exception as err:
            result.error = _error_text(err, "building the arm")
            result.status = _failure_status(result.error)
            progress.line(f"{tag} {name}: {result.status} while building: {result.error.splitlines()[0]}")
            _free(device)
    write_report(report, out)
    telemetry = TelemetrySampler.from_config(suite.telemetry)
    if telemetry is not None:
        telemetry.start()
    outputs, memory, warmed = {}, {}, set()
    for t in range(trials):
        live = [n for n in arm_names if n in built]
        if not live:
            break
        shift = t % len(live)
        for name in live[shift:] + live[:shift]:
            result = report.result(case.name, name)
            try:
                measured = run_generations(built[name], device, warmup if name not in warmed else SETTLE_STEPS, steps)
                warmed.add(name)
            except Exception as err:
                result.error = _error_text(err, f"trial {t + 1}")
                result.status = _failure_status(result.error)
                progress.line(f"{tag} trial {t + 1}/{trials} {name}: {result.status}: {result.error.splitlines()[0]}")
                built.pop(name).close()
                _free(device)
                continue
            metrics = trial_metrics(measured, case)
            result.trials.append(Trial(trial=t, step_times_ms=[c["total_ms"] for c in measured["calls"]],
                                       metrics=metrics))
            result.summarize()
            outputs[name] = measured["tokens"]
            memory[name] = built[name].memory()
            progress.line(f"{tag} trial {t + 1}/{trials} {name:<10} {metrics['tokens_per_s']:>10.1f} tokens/s  "
                          f"prefill {metrics['prefill_ms']:>8.2f} ms  per token "
                          f"{metrics.get('per_token_ms_p50', float('nan')):>7.3f} ms")
        write_report(report, out)
    if telemetry is not None:
        telemetry.close()
        if report.profilers.get("telemetry") is None:
            report.profilers["telemetry"] = {}
        report.profilers["telemetry"][case.name] = telemetry.records()
    report.inference[case.name] = _case_record(report, case, preset, memory, outputs, suite.compare_tokens)
    if "dslab" in built:  # the Memory tab's record of the case, as the training suites' dslab arm
        if report.profilers.get("memory") is None:
            report.profilers["memory"] = {}
        report.profilers["memory"][case.name] = built["dslab"].memory_trace()
    for name, arm in built.items():
        stats = arm.engine.cuda_graph_stats if arm.engine is not None else {}
        if stats:
            report.notes.append(f"{case.name}: {name} decode steps: "
                                f"{', '.join(f'{k} {v}' for k, v in sorted(stats.items()))}")
        arm.close()
    built.clear()
    del model
    _free(device)


def run_inference_suite(suite: InferenceSuiteConfig, suite_file: Path, scale: str | None = None,
                        arms: list[str] | None = None, cases: list[str] | None = None, trials: int | None = None,
                        steps: int | None = None, warmup_steps: int | None = None, out: str | Path = "reports",
                        stream: TextIO | None = None, zero_stage: int | None = None) -> tuple[RunReport, Path]:
    """Run an inference suite (module docstring); returns the report and the path of its run.json.
    Runs in one process: ``WORLD_SIZE`` > 1 and ``zero_stage`` are refused."""
    if zero_stage is not None:
        raise ValueError(f"--zero-stage applies to training suites; {suite.name} is an inference suite")
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        raise ValueError(f"inference suite {suite.name} runs in one process (WORLD_SIZE={os.environ['WORLD_SIZE']}); "
                         f"tensor-parallel inference is tested by tests/inference/test_tensor_parallel.py")
    device = _device()
    progress = Progress(stream or sys.stderr)
    if scale is None:
        scale = "full" if device.type == "cuda" else "tiny"
        if device.type != "cuda":
            progress.line(f"no CUDA GPU: running suite {suite.name} at the 'tiny' scale on the CPU")
    if scale not in suite.scales:
        raise ValueError(f"suite {suite.name} has no scale {scale!r}; it has {', '.join(suite.scales)}")
    sc = suite.scales[scale]
    arm_names = select_inference_arms(suite, arms, scale)
    chosen = select_inference_cases(sc, cases)
    n_trials, n_steps = trials or sc.trials, steps or sc.steps
    n_warmup = sc.warmup_steps if warmup_steps is None else warmup_steps
    for name, value in (("--trials", n_trials), ("--steps", n_steps)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    report = RunReport(run_id=new_run_id(), suite=suite.name, created=utc_now())
    report.environment = collect_environment()
    report.config = {
        "suite_file": str(suite_file), "kind": "inference", "scale": scale, "arms": arm_names, "trials": n_trials,
        "steps": n_steps, "warmup_steps": n_warmup, "precision": suite.precision, "family": suite.family,
        "cases": [{**c.model_dump(), "preset": c.preset or sc.preset} for c in chosen],
        "model_options": suite.model_options, "inference": suite.inference, "compare_tokens": suite.compare_tokens,
        "world_size": 1, "device": str(device), "seed": suite.seed,
    }
    report.data = {"kind": "synthetic", "description": "uniform random prompt token ids (the suite's seed), no "
                   "padding; greedy generation of exactly max_new_tokens new tokens (no eos); random weights"}
    path = write_report(report, out)
    progress.line(f"run {report.run_id}: {len(chosen)} case(s) x {len(arm_names)} arm(s) x {n_trials} trial(s) "
                  f"of {n_steps} generate calls on {device} -> {path.parent}")
    try:
        report.peaks = measure_peaks(device)
        datasheet = _datasheet_bf16(report.environment)
        if datasheet:
            report.peaks["datasheet_bf16_tflops"] = datasheet
        for case in chosen:
            _run_case(report, suite, case, case.preset or sc.preset, arm_names, device, n_trials, n_steps, n_warmup,
                      out, progress)
        report.compute_ratios("dslab", "samples_per_s")
        report.status = "complete"
    except KeyboardInterrupt:
        report.status = "incomplete"
        report.notes.append("interrupted (Ctrl-C) before the run finished")
        report.compute_ratios("dslab", "samples_per_s")
        raise
    except BaseException:
        report.status = "incomplete"
        report.notes.append("the runner stopped on an error before the run finished")
        raise
    finally:
        report.finished = utc_now()
        path = write_report(report, out)
        progress.line("")
        progress.line(describe(report) + "\n" + results_table(report))
        progress.line(f"report: {path}")
    return report, path
