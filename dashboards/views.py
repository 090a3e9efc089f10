"""A run report as the plain tables and series the dashboard and the PNG figures draw.

Pure functions over the DataFrames of :mod:`dslab.report.frames` (a run's ``results``, its
``trials``, one case's ``flops_modules``, ``comms_calls``, ...): no Dash, no plotly, no
matplotlib, and no walking of the report's layout, which the frames own. The pages build those
frames with ``strict=True``, so a section whose data has the wrong shape raises ValueError naming
the key, and the page shows a warning for that section and draws the rest. What no frame holds (a
profile's headline figures: MFU, the device-time step, the roofline's peaks, the memory estimate)
is read from the case's record, ``report.profilers[section][case]`` (:func:`section`). The
Flops tab's tables are in :mod:`dashboards.flops_view`, the Comms tab's in
:mod:`dashboards.comms_view`, the Memory tab's in :mod:`dashboards.memory_view`, the Expert load
tab's in :mod:`dashboards.experts_view`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pandas as pd

from dslab.report import RunReport, frames

TELEMETRY_FIELDS = (
    ("util_gpu", "GPU utilisation (%)"),
    ("power_w", "power (W)"),
    ("sm_clock_mhz", "SM clock (MHz)"),
    ("mem_used_bytes", "memory used (GiB)"),
    ("temp_c", "temperature (C)"),
)


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _dict(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} should be an object, not {type(value).__name__}")
    return value


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where} should be a list, not {type(value).__name__}")
    return value


def section(report: RunReport, name: str, case: str | None = None) -> tuple[list[str], str | None, Any]:
    """``(cases with data, chosen case, its data)`` of profiler section ``name``.

    The chosen case is ``case`` when it has data, else the first; ``(.., None, None)`` when the
    section is absent. Raises ValueError when the section is not ``{case: object}``."""
    raw = report.profilers.get(name)
    if raw is None:
        return [], None, None
    raw = _dict(raw, f"profilers.{name}")
    cases = [c for c, v in raw.items() if v is not None]
    for c in cases:
        _dict(raw[c], f"profilers.{name}.{c}")
    if not cases:
        return [], None, None
    chosen = case if case in cases else cases[0]
    return cases, chosen, raw[chosen]


# -- run --------------------------------------------------------------------------------------


def _rows_by_arm(frame: pd.DataFrame) -> dict[tuple[str, str], list[dict]]:
    """The rows (plain values) of a ``results`` or ``trials`` frame by ``(case, arm)``, in the
    frame's order."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in frames.records(frame):
        groups[(row["case"], row["arm"])].append(row)
    return dict(groups)


def trial_spread(trials: pd.DataFrame, metric: str = "samples_per_s") -> dict[str, dict[str, list[float]]]:
    """``{case: {arm: [metric of each trial]}}`` of a run's ``trials`` frame, for the arms whose
    trials have it."""
    out: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for (case, arm), rows in _rows_by_arm(trials).items():
        values = [r[metric] for r in rows if r.get(metric) is not None]
        if values:
            out[case][arm] = values
    return dict(out)


def best_plain_of(results: pd.DataFrame, case: str) -> tuple[str, float] | None:
    """``(best plain arm, dslab over it)`` of ``case`` in a run's ``results`` frame, or None when
    the report names none (see :meth:`dslab.report.RunReport.best_plain_ratio`)."""
    for r in frames.records(results[(results["case"] == case).fillna(False)]):
        if r["best_plain"] and r["dslab_over_arm"] is not None:
            return r["arm"], r["dslab_over_arm"]
    return None


def arm_rows(results: pd.DataFrame, trials: pd.DataFrame) -> list[dict]:
    """One row per (case, arm) of a run's ``results`` frame: medians over trials, the spread of
    step time over ``trials`` (half the range, % of the median), ``dslab/arm`` from the report's
    ratios, and ``best_plain`` (True on the case's best plain-PyTorch arm, see
    :func:`best_plain_rows`); ``expert_tflops`` is None outside MoE runs."""
    steps = trial_spread(trials, "step_time_ms")
    rows = []
    for m in frames.records(results):
        values = steps.get(m["case"], {}).get(m["arm"], [])
        spread = None
        if len(values) > 1 and m.get("step_time_ms"):
            spread = (max(values) - min(values)) / 2 / m["step_time_ms"] * 100
        mfu = m.get("mfu_measured")
        mfu = m.get("mfu_datasheet") if mfu is None else mfu
        rows.append({
            "case": m["case"], "arm": m["arm"], "status": m["status"], "trials": m["trial_count"],
            "samples_per_s": m.get("samples_per_s"), "tokens_per_s": m.get("tokens_per_s"),
            "step_time_ms": m.get("step_time_ms"), "spread_pct": spread,
            "model_tflops": m.get("model_tflops"), "expert_tflops": m.get("expert_tflops"),
            "mfu_pct": 100 * mfu if mfu is not None else None,
            "peak_gib": m["peak_memory_bytes"] / 2**30 if m.get("peak_memory_bytes") is not None else None,
            "dslab_over_arm": m["dslab_over_arm"], "best_plain": bool(m["best_plain"]),
            "error": m["error"].splitlines()[0][:200] if m["error"] else None,
        })
    return rows


def best_plain_rows(results: pd.DataFrame) -> list[dict]:
    """Per case of a run's ``results`` frame, dslab against the case's best plain-PyTorch arm (the
    fastest ok arm other than dslab, as the report stores it; a schema-1 report gets it derived on
    reading): ``{"case", "best_plain_arm", "dslab_samples_per_s", "best_plain_samples_per_s",
    "dslab_over_best_plain"}``. Cases without one (no dslab result, no ok plain arm, a run cut
    short before its ratios) are left out."""
    by_arm = {key: rows[0] for key, rows in _rows_by_arm(results).items()}
    rows = []
    for case in dict.fromkeys(results["case"]):
        best = best_plain_of(results, case)
        if best is None:
            continue
        arm, ratio = best
        dslab, plain = by_arm.get((case, "dslab")), by_arm.get((case, arm))
        rows.append({"case": case, "best_plain_arm": arm,
                     "dslab_samples_per_s": dslab.get("samples_per_s") if dslab else None,
                     "best_plain_samples_per_s": plain.get("samples_per_s") if plain else None,
                     "dslab_over_best_plain": ratio})
    return rows


def best_plain_compare_rows(a: pd.DataFrame, b: pd.DataFrame) -> list[dict]:
    """Per case of either run (their ``results`` frames), dslab over its best plain arm in run A
    and in run B: ``{"case", "A_arm", "A", "B_arm", "B", "B_over_A"}`` (None where a run has no
    such ratio)."""
    rows = []
    for case in dict.fromkeys(list(a["case"]) + list(b["case"])):
        best_a, best_b = best_plain_of(a, case), best_plain_of(b, case)
        if best_a is None and best_b is None:
            continue
        rows.append({"case": case,
                     "A_arm": best_a[0] if best_a else None, "A": best_a[1] if best_a else None,
                     "B_arm": best_b[0] if best_b else None, "B": best_b[1] if best_b else None,
                     "B_over_A": best_b[1] / best_a[1] if best_a and best_b and best_a[1] else None})
    return rows


COMPARED_METRICS = ("samples_per_s", "tokens_per_s", "step_time_ms", "model_tflops")


def compare_rows(a: pd.DataFrame, b: pd.DataFrame, metrics: tuple[str, ...] = COMPARED_METRICS) -> list[dict]:
    """Each (case, arm) of run A's ``results`` frame that run B has too, one row per metric of
    ``metrics`` both measured: ``{"case", "arm", "metric", "A", "B", "B_over_A"}``."""
    theirs = {key: rows[0] for key, rows in _rows_by_arm(b).items()}
    rows = []
    for mine in frames.records(a):
        other = theirs.get((mine["case"], mine["arm"]))
        if other is None:
            continue
        for m in metrics:
            if mine.get(m) is not None and other.get(m) is not None:
                rows.append({"case": mine["case"], "arm": mine["arm"], "metric": m, "A": mine[m], "B": other[m],
                             "B_over_A": other[m] / mine[m] if mine[m] else None})
    return rows


def flatten(prefix: str, value) -> list[tuple[str, str]]:
    """Nested objects (and lists of objects) as ``(dotted key, value)`` rows."""
    rows: list[tuple[str, str]] = []
    if isinstance(value, dict) and value:
        for k, v in value.items():
            rows += flatten(f"{prefix}.{k}" if prefix else str(k), v)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            rows += flatten(f"{prefix}[{i}]", v)
    else:
        rows.append((prefix, "-" if value is None else str(value)))
    return rows


def environment_rows(report: RunReport) -> list[tuple[str, str]]:
    """The environment, config and measured peaks flattened to ``(dotted key, value)`` rows."""
    return (flatten("environment", report.environment) + flatten("config", report.config)
            + flatten("peaks", report.peaks))


# -- telemetry --------------------------------------------------------------------------------


def telemetry_series(samples: pd.DataFrame) -> list[dict]:
    """Per GPU of one case's ``telemetry_timeline`` frame: ``{"gpu": label, "uuid", "t": [s],
    field: [value]}`` for each of :data:`TELEMETRY_FIELDS`."""
    out: dict[str, dict] = {}
    for s in frames.records(samples):
        series = out.get(s["gpu_uuid"])
        if series is None:
            index = "?" if s["gpu_index"] is None else s["gpu_index"]
            series = out[s["gpu_uuid"]] = {"gpu": f"GPU {index} {s['gpu_name'] or ''}".strip(), "uuid": s["gpu_uuid"],
                                           "t": [], **{name: [] for name, _ in TELEMETRY_FIELDS}}
        series["t"].append(s["t"])
        for name, _ in TELEMETRY_FIELDS:
            series[name].append(s[name])
    return list(out.values())
