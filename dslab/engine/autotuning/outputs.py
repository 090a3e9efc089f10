"""What a search leaves behind: the records of its experiments and, under ``results_dir``,
``ds_config_optimal.json``, ``cmd_optimal.txt`` and ``summary.txt``; and the run report (suite
``autotune``) under ``<reports>/autotune/<run_id>/run.json``.

Every file is written atomically (:func:`dslab.report.store.atomic_write_text`), so an interrupted
search never leaves half a file. In the report each experiment is one result (case = its name, arm
``dslab``): ``ok`` (early-stopped ones too, with the metric ``early_stopped`` = 1), ``failed``,
``oom``, or ``skipped`` for those the memory model or an out-of-memory neighbour pruned (the
reason in ``error``); ``profilers["autotuning"]`` holds the search itself (the experiments in the
order the tuner decided on them, their estimates, the best). The model-info run is not an
experiment of the space and appears in the notes only.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

from dslab.engine.autotuning.memory_model import GB
from dslab.engine.autotuning.space import Experiment
from dslab.report.store import atomic_write_text

OPTIMAL_CONFIG_FILE = "ds_config_optimal.json"
OPTIMAL_COMMAND_FILE = "cmd_optimal.txt"
SUMMARY_FILE = "summary.txt"
SUITE = "autotune"
ARM = "dslab"
_REPORT_STATUS = {"ok": "ok", "early_stopped": "ok", "failed": "failed", "oom": "oom", "pruned": "skipped"}
METRIC_UNITS = {"throughput": ("samples/s", 1.0), "latency": ("ms/step", 1e3), "flops": ("TFLOP/s/GPU", 1e-12)}


@dataclasses.dataclass
class ExperimentRecord:
    """One experiment as the search decided on it: ran (``ok``, ``early_stopped``, ``failed``,
    ``oom``) or ``pruned``. ``metrics`` is its ``metrics.json`` (empty when it wrote none);
    ``order`` is 1-based, in the order of the decisions."""

    experiment: Experiment
    status: str
    order: int
    config: dict
    metric: float | None = None
    metrics: dict = dataclasses.field(default_factory=dict)
    reason: str | None = None
    estimated_memory_bytes: int | None = None
    wall_time_s: float = 0.0

    @property
    def name(self) -> str:
        return self.experiment.name


@dataclasses.dataclass
class AutotuneResult:
    """A finished search: its inputs, its records and the best experiment (None when none ran to
    the end). ``optimal_command`` is the command line that trains with the best config."""

    metric: str
    tuner_type: str
    user_config: dict
    settings: dict
    script: str
    script_args: list[str]
    processes: int
    records: list[ExperimentRecord]
    best: ExperimentRecord | None
    memory_budget_bytes: int | None
    num_params: int | None
    wall_time_s: float
    stop_reason: str | None
    notes: list[str]
    results_dir: Path
    exps_dir: Path
    optimal_command: list[str] | None = None
    written: dict[str, Path] = dataclasses.field(default_factory=dict)


def format_metric(metric: str, value: float | None) -> str:
    """``value`` of ``metric`` in its display unit (``"1234.5 samples/s"``), ``"-"`` when None."""
    if value is None:
        return "-"
    unit, scale = METRIC_UNITS[metric]
    return f"{value * scale:.4g} {unit}"


def _extras_text(experiment: Experiment) -> str:
    shown = []
    for key, value in experiment.extras:
        shown.append(f"{key}={('on' if value else 'off') if isinstance(value, bool) else value}")
    return ", ".join(shown) or "-"


def summary_text(result: AutotuneResult) -> str:
    """The table of every experiment (summary.txt), with the search's facts above it and its
    notes below."""
    best = result.best
    budget = "none" if result.memory_budget_bytes is None else f"{result.memory_budget_bytes / GB:.1f} GB"
    lines = [
        f"dslab autotune: {result.script} ({result.processes} process(es)), metric {result.metric}, "
        f"tuner {result.tuner_type}",
        f"model parameters: {result.num_params if result.num_params is not None else 'unknown'}; "
        f"memory budget per GPU: {budget}; wall time {result.wall_time_s:.1f} s",
        f"best: {best.name} ({format_metric(result.metric, best.metric)})" if best is not None
        else "best: none (no experiment ran to the end)",
        "",
    ]
    header = ("#", "experiment", "stage", "mbs", "gas", "extras", result.metric, "status", "note")
    rows = [header]
    for r in sorted(result.records, key=lambda r: r.order):
        e = r.experiment
        mark = " *" if best is not None and r.name == best.name else ""
        rows.append((str(r.order), r.name + mark, str(e.stage), str(e.micro_batch_size),
                     str(e.gradient_accumulation_steps), _extras_text(e), format_metric(result.metric, r.metric),
                     r.status, (r.reason or "").splitlines()[0][:120] if r.reason else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    lines.append("")
    if result.stop_reason:
        lines.append(f"search ended: {result.stop_reason}")
    lines.extend(f"note: {note}" for note in result.notes)
    if result.optimal_command:
        lines.append(f"train with the best config: {shlex.join(result.optimal_command)}")
    return "\n".join(lines) + "\n"


def _trial_metrics(record: ExperimentRecord) -> dict[str, float]:
    m = record.metrics
    out: dict[str, float] = {}
    if isinstance(m.get("throughput"), (int, float)):
        out["samples_per_s"] = float(m["throughput"])
    if isinstance(m.get("latency"), (int, float)):
        out["latency_ms"] = float(m["latency"]) * 1e3
    if isinstance(m.get("flops"), (int, float)):
        out["tflops_per_gpu"] = float(m["flops"]) * 1e-12
    if isinstance(m.get("peak_memory_bytes"), (int, float)):
        out["peak_memory_gb"] = float(m["peak_memory_bytes"]) / GB
    if record.status == "early_stopped":
        out["early_stopped"] = 1.0
    return out


def build_report(result: AutotuneResult):
    """The run report of ``result`` (suite ``autotune``; module docstring)."""
    from dslab.report import Result, RunReport, Trial, new_run_id
    from dslab.report.environment import collect_environment
    from dslab.report.store import utc_now

    report = RunReport(run_id=new_run_id(), suite=SUITE, created=utc_now())
    report.environment = collect_environment()
    report.config = {"script": result.script, "script_args": list(result.script_args),
                     "processes": result.processes, "config": result.user_config, "autotuning": result.settings}
    report.data = {"kind": "user script", "description": f"the training script {result.script}, run once "
                                                         "per experiment with the experiment's config"}
    experiments = []
    for r in sorted(result.records, key=lambda r: r.order):
        steps = r.metrics.get("step_times_s") if isinstance(r.metrics.get("step_times_s"), list) else []
        trials = [] if r.status == "pruned" else [
            Trial(trial=0, step_times_ms=[float(t) * 1e3 for t in steps], metrics=_trial_metrics(r))]
        result_row = Result(case=r.name, arm=ARM, status=_REPORT_STATUS[r.status],
                            error=r.reason if r.status in ("failed", "oom", "pruned") else None, trials=trials)
        result_row.summarize()
        report.results.append(result_row)
        experiments.append({"name": r.name, "order": r.order, "config": r.experiment.overrides(),
                            "status": r.status, "metric": r.metric,
                            "estimated_memory_bytes": r.estimated_memory_bytes, "reason": r.reason,
                            "wall_time_s": round(r.wall_time_s, 3)})
    report.profilers["autotuning"] = {
        "metric": result.metric, "tuner_type": result.tuner_type,
        "best": result.best.name if result.best is not None else None,
        "best_metric": result.best.metric if result.best is not None else None,
        "wall_time_s": round(result.wall_time_s, 3), "experiments": experiments,
        "memory_budget_bytes": result.memory_budget_bytes, "model": {"num_params": result.num_params},
        "stop_reason": result.stop_reason,
    }
    report.notes = list(result.notes) + ([f"search ended: {result.stop_reason}"] if result.stop_reason else [])
    report.finished = utc_now()
    report.status = report.finished_status()
    return report


def write_outputs(result: AutotuneResult, reports: str | Path | None = "reports") -> dict[str, Path]:
    """Write ``results_dir``'s files and (unless ``reports`` is None) the run report; returns
    ``{"ds_config_optimal", "cmd_optimal", "summary", "report"}`` -> path for what was written.
    Without a best experiment the optimal config and command are not written (and an older
    search's are removed, so that they are never mistaken for this one's)."""
    from dslab.report import write_report

    written: dict[str, Path] = {}
    results_dir = Path(result.results_dir)
    optimal, command = results_dir / OPTIMAL_CONFIG_FILE, results_dir / OPTIMAL_COMMAND_FILE
    if result.best is not None:
        atomic_write_text(optimal, json.dumps(result.best.config, indent=2) + "\n")
        written["ds_config_optimal"] = optimal
        if result.optimal_command:
            atomic_write_text(command, shlex.join(result.optimal_command) + "\n")
            written["cmd_optimal"] = command
    else:
        for stale in (optimal, command):
            stale.unlink(missing_ok=True)
    summary = results_dir / SUMMARY_FILE
    atomic_write_text(summary, summary_text(result))
    written["summary"] = summary
    if reports is not None:
        written["report"] = write_report(build_report(result), reports)
    result.written = written
    return written
