"""The run report: what one ``dslab bench`` run measured, as versioned JSON.

A report is the contract between producers (bench, engine, profilers, I/O tuner) and consumers
(dashboard, gate, ``dslab report``). Layout of ``run.json`` (schema version 3)::

    {
      "schema": "dslab.run", "schema_version": 3,
      "run_id": "20261122T031500Z-3fa9c1", "suite": "bert_large",
      "status": "running" | "complete" | "partial" | "incomplete",
      "created": ISO-8601, "finished": ISO-8601 or null,
      "environment": {...},          # dslab.report.environment.collect_environment()
      "config": {...},               # the resolved suite config, engine config included
      "data": {"kind": "synthetic", "description": "..."},
      "peaks": {"bf16_matmul_tflops": measured, "copy_gbps": measured, "datasheet": {...}},
      "results": [                   # one per (case, arm)
        {"case": "seq128", "arm": "dslab", "status": "ok" | "failed" | "oom" | "skipped",
         "error": null, "metrics": {"samples_per_s": ..., ...},   # medians over trials
         "trials": [{"trial": 0, "step_times_ms": [...], "metrics": {...}}]}
      ],
      "ratios": {"seq128": {"dslab/torch": 1.31, ..., "dslab/best_plain": 0.97}},
      "best_plain": {"seq128": "torch-compile-ro"},
      "profilers": {"flops": null, "memory": null, "comms": null, "telemetry": null,
                    "wall_clock": null},    # each filled by its profiler, per case
      "inference": {                 # inference suites only; {} otherwise
        "124m-b1": {"batch": 1, "prompt_len": 32, "max_new_tokens": 128, "model": "gpt2_124m",
                    "arms": {"dslab": {"prefill_ms": ..., "per_token_ms_p50": ..., "per_token_ms_p90": ...,
                                       "tokens_per_s": ..., "peak_memory_bytes": ..., "weights_bytes": ...,
                                       "kv_cache_bytes": ...}, "hf": {...}},
                    "greedy": {"reference_arm": "hf", "compared_tokens": 32,
                               "arms": {"dslab": {"equal": true, "first_divergence": null,
                                                  "agreement": 1.0}}}}
      },
      "notes": []
    }

A run's ``status`` is ``running`` while it runs, then ``complete`` when every (case, arm) ran
(``ok``) or was skipped, ``partial`` when the run finished but some arm failed or ran out of memory
(:meth:`RunReport.failed_results`; their errors are in their results), and ``incomplete`` when the
run was interrupted or stopped on an error. A skipped arm (one that cannot run here: a missing
optional package, a single-process arm in a distributed run) does not make a run partial.
``partial`` is a value readers of version 3 read as the string it is, so it left the layout (and its
version) unchanged; reports written before it say ``complete`` for such runs.

``profilers`` maps a section name to ``{case: record}``; a producer may add a section, which
readers keep as it is (the dashboard shows the sections it knows). ``profilers["moe"][case]`` is
written by the bench runner for mixture-of-experts cases (``dslab.bench.moe_report``): the dslab
arm's routing after its last step (per MoE layer, ``exp_counts`` per expert and the dropped
assignments), the expert flops per step of each arm and, with expert parallelism, the
``all_to_all`` rows of the comms logger; those results also carry ``expert_tflops``. Being an
optional section and an optional metric, they left the layout (and its version) unchanged.

``profilers["comms"][case]`` is the comms logger's record (``dslab.profilers.comms``: ``ops``,
``per_rank`` calls, ``stragglers``, ``straggler``, ``clock_offsets_ns``, ``definitions``, ...).
A per-rank call the engine issued for a gradient bucket carries ``bucket`` (the bucket's or ZeRO
unit's index). ``overlap``, present once a step reduced such buckets, is the last micro-step that
ran the optimizer, per rank: ``{"per_rank": {rank: {"step", "clock": "cuda_events" | "host",
"phases_ms": {"forward_begin", "backward_begin", "backward_end", "optimizer_begin", "step_end"},
"host_phases_ms": {...}, "buckets": [{"bucket", "op", "bytes", "group", "seq", "issue_ms",
"start_ms", "end_ms", "comm_ms", "overlapped_ms", "exposed_ms"}], "totals": {"buckets", "bytes",
"comm_ms", "overlapped_ms", "exposed_ms", "backward_ms"}}}, "definitions": str}``, times in ms
since the step's forward began on that rank's clock (``dslab.profilers.comms_overlap`` defines
each figure). Optional keys of a record, they left the layout (and its version) unchanged.

``profilers["kernel_choices"]`` holds the run's kernel choices, written by the bench runner after
the last trial (``dslab.bench.kernel_pins``); its one record is not a case's but the run's, under
the key ``"_run"`` (a launched part of a multi-process run writes ``"_run <part>"``, which the
launching process merges into ``"_run"``): the Triton autotune configs each autotuner chose, the
cuDNN/cuBLAS flags, the device/torch/Triton/CUDA/cuDNN fingerprint they hold for
(``dslab.kernels.pinning``), and ``replay``, None unless the run replayed choices from a file
(``dslab bench --pin-kernels``), then what it pinned and the keys it autotuned itself. Baselines
keep it; an optional section, it left the layout (and its version) unchanged.

A profiler's record may name the text report it wrote as ``text_file``: a path relative to the
run's directory (``profiles/<case>/flops_profile.txt`` for the flops profile,
``profiles/<case>/comms_calls.txt`` for the comms logger's verbose lines; ``profiles/<case>/rank<r>/``
in a distributed run), or as the config gave it when the file lies outside the run's directory
(``flops_profiler.output_file``); None when the text went to standard output only. An optional key
of a record, it left the layout unchanged too.

``ratios[case]["dslab/<arm>"]`` is the dslab arm's samples/s over that arm's. The best plain arm
of a case is the fastest arm other than dslab (every other arm runs plain PyTorch: ``torch``,
``torch-compile``, ``torch-compile-ro``, transformers' model in ``hf`` and with Liger-Kernel's ops in
``liger``, ``sdpa``, and the parallel suites' peers) among those whose
result is ``ok``; ``best_plain[case]`` names it and ``ratios[case]["dslab/best_plain"]`` is
dslab's samples/s over its. Version 2 added those two; version 1 had the rest. Arms named
``dslab-<variant>`` (the inference suites' ``dslab-int8``) are dslab's too, never a best plain arm.

``inference[case]`` (version 3) is what an inference suite measured of each arm, medians over its
trials: the prompt's forward and first token (``prefill_ms``), the gaps between later tokens
(``per_token_ms_p50`` / ``_p90``, over every token of every timed generation), new tokens per
second, peak memory, and for dslab's arms the bytes of the weights and of the KV cache; and the
greedy tokens of each arm against a reference arm's (transformers' ``generate``): equal or not, the
first new-token index where they differ, and the fraction of agreeing positions. Its results carry
the same figures as metrics. Reports of versions 1 and 2 read with an empty ``inference``.

Readers are tolerant: a report of an older version, or one cut short (Ctrl-C, a crash), loads
with defaults for what is missing, and :attr:`RunReport.missing` lists those keys. A version-1
report gets its best plain arms derived on reading, from its results by the same rule.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "dslab.run"
SCHEMA_VERSION = 3
# The arm the ratios are taken against, the metric they compare, and the key of the best plain arm.
RATIO_ARM = "dslab"
RATIO_METRIC = "samples_per_s"
BEST_PLAIN = "best_plain"

STATUS_COMPLETE = "complete"
STATUS_PARTIAL = "partial"
STATUS_INCOMPLETE = "incomplete"
STATUSES = (STATUS_COMPLETE, STATUS_PARTIAL, STATUS_INCOMPLETE, "running", "failed")
# A result's status: ``ok`` and ``skipped`` are not failures; anything else (``failed``, ``oom``) is.
RESULT_OK = "ok"
RESULT_SKIPPED = "skipped"

# Metrics a result may carry, with the direction in which they are better. The gate and the
# dashboard read this table; producers may add others (they are kept, with no direction).
METRIC_DIRECTIONS = {
    "samples_per_s": "higher",
    "tokens_per_s": "higher",
    "step_time_ms": "lower",
    "host_step_ms": "lower",
    "model_tflops": "higher",
    "mfu_measured": "higher",
    "mfu_datasheet": "higher",
    "peak_memory_bytes": "lower",
    "graph_pool_bytes": "lower",
    "expert_tflops": "higher",
    "prefill_ms": "lower",
    "per_token_ms_p50": "lower",
    "per_token_ms_p90": "lower",
}

PROFILER_SECTIONS = ("flops", "memory", "comms", "telemetry", "wall_clock")


@dataclass
class Trial:
    trial: int
    step_times_ms: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Result:
    """One arm on one case: its trials and the median of each metric over them."""

    case: str
    arm: str
    status: str = "ok"
    error: str | None = None
    trials: list[Trial] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def summarize(self) -> None:
        """Set ``metrics`` to the median over trials of every metric the trials share."""
        if not self.trials:
            self.metrics = {}
            return
        names = set.intersection(*(set(t.metrics) for t in self.trials))
        self.metrics = {n: statistics.median(t.metrics[n] for t in self.trials) for n in sorted(names)}

    def trial_values(self, metric: str) -> list[float]:
        return [t.metrics[metric] for t in self.trials if metric in t.metrics]


@dataclass
class RunReport:
    run_id: str
    suite: str
    status: str = "running"
    created: str | None = None
    finished: str | None = None
    environment: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    peaks: dict = field(default_factory=dict)
    results: list[Result] = field(default_factory=list)
    ratios: dict = field(default_factory=dict)
    best_plain: dict = field(default_factory=dict)
    profilers: dict = field(default_factory=lambda: {name: None for name in PROFILER_SECTIONS})
    inference: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    # Filled by the reader, never written: keys the file lacked, and other warnings.
    missing: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def result(self, case: str, arm: str) -> Result | None:
        for r in self.results:
            if r.case == case and r.arm == arm:
                return r
        return None

    def cases(self) -> list[str]:
        return list(dict.fromkeys(r.case for r in self.results))

    def arms(self) -> list[str]:
        return list(dict.fromkeys(r.arm for r in self.results))

    def failed_results(self) -> list[Result]:
        """The results whose arm failed or ran out of memory: every status but ``ok`` and
        ``skipped``. A finished run with any is ``partial``."""
        return [r for r in self.results if r.status not in (RESULT_OK, RESULT_SKIPPED)]

    def finished_status(self) -> str:
        """The status of a run that finished: ``partial`` when an arm failed, else ``complete``."""
        return STATUS_PARTIAL if self.failed_results() else STATUS_COMPLETE

    def compute_ratios(self, numerator_arm: str = RATIO_ARM, metric: str = RATIO_METRIC) -> None:
        """``ratios[case]["<numerator>/<arm>"]`` = numerator's metric over each other arm's, and
        over the best of them (``"<numerator>/best_plain"``, that arm in ``best_plain[case]``;
        see :meth:`fastest_other`)."""
        self.ratios = {}
        self.best_plain = {}
        for case in self.cases():
            mine = self.result(case, numerator_arm)
            if mine is None or metric not in mine.metrics:
                continue
            for other in self.results:
                if other.case != case or other.arm == numerator_arm or metric not in other.metrics:
                    continue
                if other.metrics[metric] > 0:
                    key = f"{numerator_arm}/{other.arm}"
                    self.ratios.setdefault(case, {})[key] = mine.metrics[metric] / other.metrics[metric]
            self._set_best_plain(case, numerator_arm, metric)

    def fastest_other(self, case: str, numerator_arm: str = RATIO_ARM, metric: str = RATIO_METRIC) -> Result | None:
        """The result of ``case`` with the highest ``metric`` among the arms other than
        ``numerator_arm`` and its variants (``<numerator_arm>-...``) whose status is ``ok`` (a failed
        arm's partial trials do not count)."""
        best = None
        for other in self.results:
            if other.case != case or other.status != "ok" or is_variant_of(other.arm, numerator_arm):
                continue
            value = other.metrics.get(metric)
            if value is not None and value > 0 and (best is None or value > best.metrics[metric]):
                best = other
        return best

    def _set_best_plain(self, case: str, numerator_arm: str, metric: str) -> None:
        mine = self.result(case, numerator_arm)
        best = self.fastest_other(case, numerator_arm, metric)
        if mine is None or metric not in mine.metrics or best is None:
            return
        self.ratios.setdefault(case, {})[f"{numerator_arm}/{BEST_PLAIN}"] = mine.metrics[metric] / best.metrics[metric]
        self.best_plain[case] = best.arm

    def best_plain_ratio(self, case: str, numerator_arm: str = RATIO_ARM) -> tuple[str, float] | None:
        """``(best plain arm, numerator's metric over its)`` of ``case``, or None when the report
        has none for it (no ok plain arm, or a report cut short before the ratios)."""
        arm = self.best_plain.get(case) if isinstance(self.best_plain, dict) else None
        ratios = self.ratios.get(case) if isinstance(self.ratios, dict) else None
        value = ratios.get(f"{numerator_arm}/{BEST_PLAIN}") if isinstance(ratios, dict) else None
        if not isinstance(arm, str) or not _is_number(value):
            return None
        return arm, float(value)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("missing")
        data.pop("warnings")
        return {"schema": SCHEMA, **data}


def is_variant_of(arm: str, numerator_arm: str) -> bool:
    """``arm`` is ``numerator_arm`` itself or one of its variants (``dslab-int8`` of ``dslab``)."""
    return arm == numerator_arm or arm.startswith(numerator_arm + "-")


def _as_trial(raw: Any, where: str, warnings: list[str]) -> Trial | None:
    if not isinstance(raw, dict):
        warnings.append(f"{where}: not an object; skipped")
        return None
    try:
        return Trial(
            trial=int(raw.get("trial", 0)),
            step_times_ms=[float(x) for x in raw.get("step_times_ms", [])],
            metrics={str(k): float(v) for k, v in (raw.get("metrics") or {}).items() if _is_number(v)},
        )
    except (TypeError, ValueError) as err:
        warnings.append(f"{where}: {err}; skipped")
        return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_result(raw: Any, where: str, warnings: list[str]) -> Result | None:
    if not isinstance(raw, dict) or "case" not in raw or "arm" not in raw:
        warnings.append(f"{where}: a result needs 'case' and 'arm'; skipped")
        return None
    trials = []
    for i, t in enumerate(raw.get("trials") or []):
        trial = _as_trial(t, f"{where}.trials[{i}]", warnings)
        if trial is not None:
            trials.append(trial)
    result = Result(
        case=str(raw["case"]),
        arm=str(raw["arm"]),
        status=str(raw.get("status", "ok")),
        error=raw.get("error"),
        trials=trials,
        metrics={str(k): float(v) for k, v in (raw.get("metrics") or {}).items() if _is_number(v)},
    )
    if not result.metrics and trials:
        result.summarize()
    return result


def report_from_dict(data: dict) -> RunReport:
    """Build a RunReport from parsed JSON, tolerating older versions and partial files."""
    if not isinstance(data, dict):
        raise ValueError(f"a run report must be a JSON object, not {type(data).__name__}")
    if data.get("schema", SCHEMA) != SCHEMA:
        raise ValueError(f"not a dslab run report (schema {data.get('schema')!r})")
    missing = []
    warnings = []
    version = data.get("schema_version")
    if version is None:
        missing.append("schema_version")
        version = SCHEMA_VERSION
    elif not isinstance(version, int) or version > SCHEMA_VERSION:
        warnings.append(f"schema_version {version!r} is newer than this reader ({SCHEMA_VERSION}); reading what it can")
    layout = version if isinstance(version, int) and not isinstance(version, bool) else SCHEMA_VERSION

    def take(key, default, kind):
        if key not in data:
            missing.append(key)
            return default
        value = data[key]
        if not isinstance(value, kind):
            warnings.append(f"'{key}' should be {kind.__name__ if isinstance(kind, type) else kind}; ignored")
            return default
        return value

    results = []
    for i, raw in enumerate(take("results", [], list)):
        r = _as_result(raw, f"results[{i}]", warnings)
        if r is not None:
            results.append(r)
    profilers = {name: None for name in PROFILER_SECTIONS}
    profilers.update(take("profilers", {}, dict))
    report = RunReport(
        run_id=str(take("run_id", "unknown", str)),
        suite=str(take("suite", "unknown", str)),
        status=str(take("status", STATUS_INCOMPLETE, str)),
        created=take("created", None, (str, type(None))),
        finished=data.get("finished"),
        environment=take("environment", {}, dict),
        config=take("config", {}, dict),
        data=take("data", {}, dict),
        peaks=take("peaks", {}, dict),
        results=results,
        ratios=take("ratios", {}, dict),
        best_plain=take(BEST_PLAIN, {}, dict) if layout >= 2 else {},
        profilers=profilers,
        inference=take("inference", {}, dict) if layout >= 3 else {},
        notes=[str(n) for n in take("notes", [], list)],
        schema_version=int(version) if isinstance(version, int) else SCHEMA_VERSION,
        missing=missing,
        warnings=warnings,
    )
    if layout < 2:
        # Version 1 stored the per-arm ratios only (always dslab's samples/s over each arm's, at
        # the end of the run): derive the best plain arm of each case that has ratios.
        for case, case_ratios in list(report.ratios.items()):
            if isinstance(case_ratios, dict):
                report._set_best_plain(case, RATIO_ARM, RATIO_METRIC)
    return report
