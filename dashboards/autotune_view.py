"""The autotuning view of a ``dslab autotune`` run (suite ``autotune``): every experiment the tuner
ran or pruned, in run order, with its configuration, status and metric; the metric per experiment
with the running best; each experiment's estimated memory against the budget the memory model
pruned by; and one summary line.

The tuner writes ``report.profilers["autotuning"]`` (``metric``, ``tuner_type``, ``best``,
``best_metric``, ``wall_time_s``, ``memory_budget_bytes``, ``model`` and ``experiments``: per
experiment its ``name``, ``order``, ``config`` overrides, ``status`` (``ok``, ``early_stopped``,
``pruned``, ``oom``, ``failed``), ``metric``, ``estimated_memory_bytes``, ``reason`` and
``wall_time_s``) and one result per experiment (case = the experiment's name, arm ``dslab``) whose
medians give the measured samples/s, latency, TFLOP/s and peak memory. The section is not
``{case: record}``, so no frame holds it: it is read here, a malformed part raising ValueError
naming its key, which the page turns into a warning; the results come from
:func:`dslab.report.frames.results`.

The running best counts ``ok`` experiments only: an early-stopped one was cut short because it
was already worse than the best by more than the tuner's margin, and its metric covers only the
steps it ran. Memory is in GB (10^9 bytes), the unit of the tuner's pruning reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dashboards.figure_base import empty_figure, laid_out, plotly_go
from dashboards.views import _dict, _list, _number
from dslab.report import RunReport, frames, report_from_dict

if TYPE_CHECKING:
    import plotly.graph_objects as go

SUITE = "autotune"
SECTION = "autotuning"
ARM = "dslab"
GB = 1e9
MARGIN = {"l": 70, "r": 20, "t": 60, "b": 50}


@dataclass(frozen=True)
class MetricSpec:
    """How a tuning metric is shown: its label, unit, the factor from the tuner's unit (samples/s,
    seconds per optimizer step, FLOP/s per GPU) to the shown one, and which way is better."""

    label: str
    unit: str
    scale: float
    direction: str

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` is better than ``b``."""
        return a > b if self.direction == "higher" else a < b


METRICS = {
    "throughput": MetricSpec("throughput", "samples/s", 1.0, "higher"),
    "latency": MetricSpec("latency", "ms per step", 1e3, "lower"),
    "flops": MetricSpec("flops", "TFLOP/s per GPU", 1e-12, "higher"),
}
# Statuses in the order of the summary's counts, their labels, and their marks (symbol, colour).
STATUSES = ("ok", "early_stopped", "pruned", "oom", "failed")
STATUS_LABELS = {"ok": "ok", "early_stopped": "early stopped", "pruned": "pruned", "oom": "out of memory",
                 "failed": "failed"}
STATUS_MARKS = {"ok": ("circle", "#1f77b4"), "early_stopped": ("diamond-open", "#ff7f0e"),
                "pruned": ("x", "#7f7f7f"), "oom": ("triangle-down", "#d62728"), "failed": ("square-open", "#8c564b")}
OTHER_MARK = ("circle-open", "#9ca3af")
BEST_MARK = ("star", "#e6b800")
MAIN_KEYS = (("zero_stage", "stage"), ("micro_batch_size", "micro_batch"), ("gradient_accumulation_steps", "gas"))
EXTRA_KEYS = ("offload_optimizer", "activation_checkpointing", "cuda_graphs", "kernels")
NOTE = ("Experiments in the order the tuner ran them. Metric: the tuner's, measured over its profiled optimizer "
        "steps after a device synchronize at each boundary. Running best: the best metric so far among the "
        "experiments that ran to the end (ok); early-stopped ones were stopped once even their fastest profiled "
        "step was worse than the best so far by more than 5%, so they never count. Pruned experiments did not "
        "run: the memory model estimated more than the budget. Out of memory and failed ones ran and left no "
        "metrics (the reason is the first line of their error). Estimated memory: the memory model's, per GPU; "
        "measured peak: the CUDA allocator's, the largest rank's. GB = 10^9 bytes.")


def columns(spec: MetricSpec) -> list[tuple[str, str]]:
    """The experiments table's ``(key of :func:`experiment_rows`, header)`` pairs."""
    return [("run", "#"), ("name", "experiment"), ("stage", "ZeRO stage"), ("micro_batch", "micro-batch"),
            ("gas", "grad. accum."), ("extras", "other settings"), ("status", "status"),
            ("metric", f"{spec.label} ({spec.unit})"), ("estimated_gb", "estimated GB"), ("reason", "reason"),
            ("best", "best"), ("peak_gb", "measured peak GB"), ("samples_per_s", "samples/s"),
            ("latency_ms", "latency ms"), ("tflops_per_gpu", "TFLOP/s per GPU"), ("wall_time_s", "wall s")]


def as_report(report: RunReport | dict) -> RunReport:
    """``report`` itself, or the report its parsed ``run.json`` content holds."""
    return report if isinstance(report, RunReport) else report_from_dict(report)


def section(report: RunReport | dict) -> dict | None:
    """``profilers["autotuning"]``; None when the report has none. Raises ValueError when it is not
    an object."""
    raw = as_report(report).profilers.get(SECTION)
    return None if raw is None else _dict(raw, f"profilers.{SECTION}")


def is_autotune(report: RunReport | dict) -> bool:
    """Whether the run's page draws this view: a run of the ``autotune`` suite (with the section or
    not yet), or any run with an autotuning section."""
    report = as_report(report)
    return report.suite == SUITE or report.profilers.get(SECTION) is not None


def empty_message(report: RunReport | dict) -> str:
    """Why there is nothing to draw: the report has no autotuning section."""
    report = as_report(report)
    state = f"the run is {report.status}; " if report.status in ("running", "incomplete") else ""
    return (f"no autotuning results in this run (the report has no profilers[\"{SECTION}\"] section; {state}"
            "dslab autotune writes it with the tuner's results)")


def metric_spec(data: dict) -> tuple[str, MetricSpec]:
    """The section's metric and how it is shown. Raises ValueError when it is not one of
    :data:`METRICS`."""
    name = data.get("metric")
    if name not in METRICS:
        raise ValueError(f"profilers.{SECTION}.metric should be one of {', '.join(METRICS)}, not {name!r}")
    return name, METRICS[name]


def experiments(data: dict) -> list[dict]:
    """The section's experiments in run order (by ``order``; the list's order where it ties or is
    missing). Raises ValueError naming the key of an experiment that is not an object or lacks a
    name, or a config that is not an object."""
    where = f"profilers.{SECTION}.experiments"
    found = []
    for i, raw in enumerate(_list(data.get("experiments", []), where)):
        exp = _dict(raw, f"{where}[{i}]")
        if not isinstance(exp.get("name"), str) or not exp["name"]:
            raise ValueError(f"{where}[{i}].name should be a non-empty string, not {exp.get('name')!r}")
        _dict(exp.get("config") or {}, f"{where}[{i}].config")
        order = _number(exp.get("order"))
        found.append((order if order is not None else float(i), i, exp))
    return [exp for _, _, exp in sorted(found, key=lambda item: item[:2])]


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def extras(config: dict) -> str:
    """The experiment's settings other than ZeRO stage, micro-batch and gradient accumulation, as
    ``key=value`` (``on``/``off`` for flags), the known ones first."""
    main = {key for key, _ in MAIN_KEYS}
    keys = [k for k in EXTRA_KEYS if k in config] + [k for k in config if k not in main and k not in EXTRA_KEYS]
    return ", ".join(f"{k}={_shown(config[k])}" for k in keys if config[k] is not None)


def _results_by_case(report: RunReport) -> dict[str, dict]:
    return {r["case"]: r for r in frames.records(frames.results(report)) if r["arm"] == ARM}


def _first_line(text) -> str | None:
    return str(text).splitlines()[0][:200] if text else None


def experiment_rows(report: RunReport | dict) -> list[dict]:
    """One row per experiment in run order (:func:`columns`): ``run`` (1-based position),
    ``name``, ``stage``, ``micro_batch``, ``gas``, ``extras``, ``status``, ``metric`` (in
    :class:`MetricSpec`'s unit), ``estimated_gb``, ``reason`` (the tuner's, else the first line of
    the result's error), ``wall_time_s``, ``best``, and from the experiment's result
    ``samples_per_s``, ``latency_ms``, ``tflops_per_gpu`` and ``peak_gb``. Empty without the
    section."""
    report = as_report(report)
    data = section(report)
    if data is None:
        return []
    _, spec = metric_spec(data)
    best = data.get("best")
    results = _results_by_case(report)
    rows = []
    for run, exp in enumerate(experiments(data), start=1):
        config = exp.get("config") or {}
        result = results.get(exp["name"], {})
        metric, estimate = _number(exp.get("metric")), _number(exp.get("estimated_memory_bytes"))
        peak = result.get("peak_memory_gb")
        rows.append({
            "run": run, "name": exp["name"],
            **{column: config.get(key) for key, column in MAIN_KEYS},
            "extras": extras(config), "status": str(exp.get("status", "?")),
            "metric": None if metric is None else metric * spec.scale,
            "estimated_gb": None if estimate is None else estimate / GB,
            "peak_gb": peak,
            "samples_per_s": result.get("samples_per_s"), "latency_ms": result.get("latency_ms"),
            "tflops_per_gpu": result.get("tflops_per_gpu"), "wall_time_s": _number(exp.get("wall_time_s")),
            "best": exp["name"] == best,
            "reason": _first_line(exp.get("reason")) or _first_line(result.get("error")),
        })
    return rows


def running_best(rows: list[dict], spec: MetricSpec) -> list[float | None]:
    """Per row of :func:`experiment_rows`, the best ``metric`` of the ``ok`` rows up to it (None
    before the first)."""
    best, out = None, []
    for row in rows:
        value = row["metric"]
        if row["status"] == "ok" and value is not None and (best is None or spec.better(value, best)):
            best = value
        out.append(best)
    return out


def status_counts(rows: list[dict]) -> dict[str, int]:
    """``{status: experiments}``, :data:`STATUSES` first in their order, then others by name; only
    statuses some experiment has."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    known = [s for s in STATUSES if s in counts]
    return {s: counts[s] for s in known + sorted(set(counts) - set(known))}


def summary(report: RunReport | dict, rows: list[dict] | None = None) -> dict:
    """The run's tuning in figures: ``{"tuner", "metric", "spec", "best", "best_metric"`` (shown
    unit, None without a best), ``"wall_time_s", "experiments", "counts", "budget_gb",
    "num_params"}``. Raises ValueError without the section."""
    report = as_report(report)
    data = section(report)
    if data is None:
        raise ValueError(f"the report has no profilers.{SECTION} section")
    metric, spec = metric_spec(data)
    rows = experiment_rows(report) if rows is None else rows
    best_metric = _number(data.get("best_metric"))
    budget = _number(data.get("memory_budget_bytes"))
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    return {"tuner": str(data.get("tuner_type", "?")), "metric": metric, "spec": spec,
            "best": data.get("best") if isinstance(data.get("best"), str) else None,
            "best_metric": None if best_metric is None else best_metric * spec.scale,
            "wall_time_s": _number(data.get("wall_time_s")), "experiments": len(rows),
            "counts": status_counts(rows), "budget_gb": None if budget is None else budget / GB,
            "num_params": _number(model.get("num_params"))}


def summary_line(facts: dict) -> str:
    """:func:`summary` as one sentence: tuner, metric and its direction, the best experiment and
    its metric, the wall time, and the experiments by status."""
    spec = facts["spec"]
    if facts["best"] is None:
        best = "no best experiment (none ran to the end)"
    elif facts["best_metric"] is None:
        best = f"best {facts['best']}"
    else:
        best = f"best {facts['best']} at {facts['best_metric']:.4g} {spec.unit}"
    wall = "?" if facts["wall_time_s"] is None else f"{facts['wall_time_s']:.0f} s"
    counts = ", ".join(f"{n} {STATUS_LABELS.get(s, s)}" for s, n in facts["counts"].items()) or "none"
    return (f"{facts['tuner']} tuner on {facts['metric']} ({spec.direction} is better): {best}; "
            f"{facts['experiments']} experiments in {wall}: {counts}.")


# -- figures ----------------------------------------------------------------------------------


def _mark(status: str) -> tuple[str, str]:
    return STATUS_MARKS.get(status, OTHER_MARK)


def metric_figure(rows: list[dict], spec: MetricSpec, title: str = "Metric per experiment") -> go.Figure:
    """The metric of each experiment against its place in the run, one marker trace per status
    (named by :data:`STATUS_LABELS`), the running best as a step line and the best experiment as a
    star. Experiments without a metric (pruned, out of memory, failed) are marked in a strip under
    the metric's axis, a line per status, with their reason in the hover: never at a value of the
    metric, which for latency would read as the fastest."""
    if not rows:
        return empty_figure(title, "no experiments", MARGIN)
    from plotly.subplots import make_subplots

    go = plotly_go()
    strip = [STATUS_LABELS.get(s, s) for s in status_counts([r for r in rows if r["metric"] is None])]
    fig = make_subplots(rows=2 if strip else 1, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        row_heights=[0.8, 0.2] if strip else None)
    for status in status_counts(rows):
        label = STATUS_LABELS.get(status, status)
        symbol, colour = _mark(status)
        for in_strip in (False, True):
            mine = [r for r in rows if r["status"] == status and (r["metric"] is None) == in_strip]
            if not mine:
                continue
            fig.add_trace(go.Scatter(
                x=[r["run"] for r in mine], y=[label if in_strip else r["metric"] for r in mine],
                mode="markers", name=label, legendgroup=status,
                showlegend=not in_strip or all(r["metric"] is None for r in rows if r["status"] == status),
                marker={"symbol": symbol, "color": colour, "size": 11, "line": {"width": 2, "color": colour}},
                customdata=[[r["name"], r["reason"] or "",
                             "no metric" if in_strip else f"{r['metric']:.4g} {spec.unit}"] for r in mine],
                hovertemplate="%{customdata[0]}<br>" + label + ": %{customdata[2]}<br>%{customdata[1]}<extra></extra>"),
                row=2 if in_strip else 1, col=1)
    best = running_best(rows, spec)
    kept = [(r["run"], b) for r, b in zip(rows, best) if b is not None]
    if kept:
        fig.add_trace(go.Scatter(x=[k[0] for k in kept], y=[k[1] for k in kept], mode="lines", name="running best",
                                 line={"shape": "hv", "color": "#2ca02c", "dash": "dash"},
                                 hovertemplate="best so far %{y:.4g} " + spec.unit + "<extra></extra>"), row=1, col=1)
    chosen = [r for r in rows if r["best"] and r["metric"] is not None]
    if chosen:
        symbol, colour = BEST_MARK
        fig.add_trace(go.Scatter(
            x=[r["run"] for r in chosen], y=[r["metric"] for r in chosen], mode="markers", name="best",
            marker={"symbol": symbol, "color": colour, "size": 20, "line": {"width": 1, "color": "#333"}},
            customdata=[r["name"] for r in chosen],
            hovertemplate="best: %{customdata}<br>%{y:.4g} " + spec.unit + "<extra></extra>"), row=1, col=1)
    fig.update_xaxes(tickmode="array", tickvals=[r["run"] for r in rows], ticktext=[str(r["run"]) for r in rows],
                     range=[0.5, len(rows) + 0.5])
    fig.update_xaxes(title="experiment (run order)", row=2 if strip else 1, col=1)
    fig.update_yaxes(title=f"{spec.label} ({spec.unit}, {spec.direction} is better)", rangemode="tozero", row=1, col=1)
    if strip:
        fig.update_yaxes(title="no metric", type="category", categoryorder="array", categoryarray=strip[::-1],
                         row=2, col=1)
    return laid_out(fig, title, MARGIN, height=460 if strip else 400, legend_title_text="experiment")


def memory_figure(rows: list[dict], budget_gb: float | None,
                  title: str = "Estimated memory per experiment against the budget") -> go.Figure:
    """Each experiment's estimated memory (GB per GPU) as a bar, one bar trace per status (pruned
    ones above the budget), its measured peak where it ran, and the budget as a dashed line."""
    estimated = [r for r in rows if r["estimated_gb"] is not None]
    if not estimated:
        return empty_figure(title, "the tuner recorded no memory estimates", MARGIN)
    go = plotly_go()
    fig = go.Figure()
    for status in status_counts(estimated):
        mine = [r for r in estimated if r["status"] == status]
        colour = _mark(status)[1]
        fig.add_trace(go.Bar(x=[r["run"] for r in mine], y=[r["estimated_gb"] for r in mine],
                             name=f"estimate, {STATUS_LABELS.get(status, status)}", marker_color=colour,
                             width=0.7,
                             opacity=0.55 if status == "pruned" else 0.85,
                             customdata=[[r["name"], r["reason"] or ""] for r in mine],
                             hovertemplate="%{customdata[0]}<br>estimated %{y:.1f} GB<br>%{customdata[1]}"
                                           "<extra></extra>"))
    measured = [r for r in rows if r["peak_gb"] is not None]
    if measured:
        fig.add_trace(go.Scatter(x=[r["run"] for r in measured], y=[r["peak_gb"] for r in measured],
                                 mode="markers", name="measured peak", customdata=[r["name"] for r in measured],
                                 marker={"symbol": "line-ew-open", "size": 22, "color": "#111",
                                         "line": {"width": 3, "color": "#111"}},
                                 hovertemplate="%{customdata}<br>measured peak %{y:.1f} GB<extra></extra>"))
    if budget_gb is not None:
        fig.add_hline(y=budget_gb, line_dash="dash", line_color="#d62728",
                      annotation_text=f"budget {budget_gb:.1f} GB", annotation_position="top left")
    fig.update_layout(barmode="overlay")
    fig.update_xaxes(title="experiment (run order)", tickmode="array", tickvals=[r["run"] for r in rows],
                     ticktext=[str(r["run"]) for r in rows], range=[0.4, len(rows) + 0.6])
    fig.update_yaxes(title="GB per GPU", rangemode="tozero")
    return laid_out(fig, title, MARGIN, height=380, legend_title_text="memory")
