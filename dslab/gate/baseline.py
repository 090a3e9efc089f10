"""Baselines: the trials a candidate is judged against, where they are kept, and how a run
history is searched for change points.

A :class:`TrialSet` is the per-trial values of every metric of every (case, arm) of one or more
runs that share a fingerprint, with the status of each (case, arm). Candidates and baselines are
both trial sets. A baseline file, ``reports/baselines/<suite>/<fingerprint key>.json``, written
atomically::

    {
      "schema": "dslab.baseline", "schema_version": 1,
      "suite": "bert_large", "created": ISO-8601, "label": "run 20261122T031500Z-3fa9c1",
      "source_runs": ["20261122T031500Z-3fa9c1"],
      "fingerprint": {"key": "...", "hardware": {...}, "config": {...}, "cases": {...}},
      "results": [{"case": "seq128", "arm": "dslab", "status": "ok", "error": null,
                   "trials": {"samples_per_s": [612.1, 608.3, ...], "step_time_ms": [...]}}],
      "kernel_choices": {"fingerprint": {...}, "backends": {...}, "triton": {...}, ...}
    }

``kernel_choices`` (optional; baselines written before it lack it and read as before) is the
kernel choices of the newest source run that recorded them, as that run's report holds them
(``profilers["kernel_choices"]["_run"]``, :mod:`dslab.report.schema`): the Triton autotune
configs and cuDNN/cuBLAS flags the baseline's numbers were measured with. ``dslab bench SUITE
--pin-kernels <baseline file>`` replays them, so that a candidate runs the baseline's kernels
rather than picking its own (:mod:`dslab.kernels.pinning`, which this layer does not import: here
they are plain data, kept as read). Pooled runs may have chosen differently; the newest's are kept.

A run that finished is used whether it is ``complete`` or ``partial`` (some arm failed or ran out
of memory): its arms that ran are pooled, and a failed arm keeps its status and error, so the
verdict on it is cannot-judge and names the error while the other arms are judged. A run that did
not finish (``incomplete``, ``running``) is refused. Rolling baselines pool the trials of the last N
finished runs of a suite with the candidate's fingerprint key. Change points (:func:`detect_change_points`) are found by binary segmentation
over a history of runs; :func:`write_change_points` saves them to
``<reports>/<suite>/change_points.json`` for the dashboard's Runs page.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from dslab.gate.fingerprint import Fingerprint, explain_difference, fingerprint_of, stable_hash
from dslab.gate.stats import rank_z
from dslab.gate.trial_set import BASELINE_SCHEMA, BASELINE_VERSION, TrialSet
from dslab.gate.verdict import DEFAULT_METRICS, GateSettings, compare_samples
from dslab.report.schema import METRIC_DIRECTIONS, STATUS_COMPLETE, STATUS_PARTIAL
from dslab.report.store import atomic_write_text, list_runs, read_report, utc_now

# The run statuses whose reports the gate pools: the runs that finished (see the module docstring).
FINISHED_STATUSES = (STATUS_COMPLETE, STATUS_PARTIAL)
CHANGE_POINTS_SCHEMA = "dslab.change_points"
CHANGE_POINTS_FILE = "change_points.json"
BASELINES_DIR = "baselines"
# Where a run report keeps the run's kernel choices: profilers[KERNEL_CHOICES_SECTION][RUN_RECORD].
KERNEL_CHOICES_SECTION = "kernel_choices"
RUN_RECORD = "_run"


def _result_trials(result) -> dict[str, list[float]]:
    """Every metric of a report Result as its trial values; the median alone when no trial has it."""
    out: dict[str, list[float]] = {}
    for trial in result.trials:
        for name, value in trial.metrics.items():
            out.setdefault(name, []).append(float(value))
    for name, value in result.metrics.items():
        out.setdefault(name, [float(value)])
    return out


def kernel_choices_of(report) -> dict | None:
    """The kernel choices a run recorded (``profilers["kernel_choices"]["_run"]``), or None."""
    section = report.profilers.get(KERNEL_CHOICES_SECTION) if isinstance(report.profilers, dict) else None
    choices = section.get(RUN_RECORD) if isinstance(section, dict) else None
    return choices if isinstance(choices, dict) else None


def trial_set_from_reports(reports: list, label: str | None = None) -> TrialSet:
    """Pool ``reports`` (RunReports of one suite and one fingerprint key, oldest first).

    A case whose settings differ from those of the newest report holding it is taken only from
    the reports that agree with the newest. The set keeps the kernel choices of the newest report
    that recorded them (:func:`kernel_choices_of`). Raises ValueError when the reports are of different
    suites or fingerprint keys (naming the differing fields) or when one did not finish (a
    ``partial`` run is used: its failed arms keep their status and error).
    """
    if not reports:
        raise ValueError("no runs to build a trial set from")
    suites = sorted({r.suite for r in reports})
    if len(suites) > 1:
        raise ValueError(f"runs of different suites cannot be pooled: {', '.join(suites)}")
    for r in reports:
        if r.status not in FINISHED_STATUSES:
            raise ValueError(f"run {r.run_id} is {r.status}, not complete or partial; it cannot be used")
    prints = [fingerprint_of(r) for r in reports]
    newest = prints[-1]
    for r, fp in zip(reports, prints):
        if fp.key != newest.key:
            fields = "; ".join(explain_difference(fp, newest, r.run_id, reports[-1].run_id))
            raise ValueError(f"runs {r.run_id} and {reports[-1].run_id} have different fingerprints: {fields}")
    cases = {}
    for fp in reversed(prints):
        for name, settings in fp.cases.items():
            cases.setdefault(name, settings)
    merged = TrialSet(
        suite=suites[0],
        fingerprint=Fingerprint(newest.hardware, newest.config, cases),
        source_runs=[r.run_id for r in reports],
        label=label or (f"run {reports[0].run_id}" if len(reports) == 1 else
                        f"{len(reports)} runs {reports[0].run_id} .. {reports[-1].run_id}"),
        created=utc_now(),
        kernel_choices=next((c for c in map(kernel_choices_of, reversed(reports)) if c is not None), None),
    )
    for r, fp in zip(reports, prints):
        for result in r.results:
            if result.case in cases and fp.cases.get(result.case) != cases[result.case]:
                continue
            key = (result.case, result.arm)
            if result.status != "ok":
                if key not in merged.trials:
                    first_line = result.error.splitlines()[0] if result.error else result.status
                    merged.status[key] = {"status": result.status, "error": f"run {r.run_id}: {first_line}"}
                continue
            merged.status[key] = {"status": "ok", "error": None}
            pooled = merged.trials.setdefault(key, {})
            for name, values in _result_trials(result).items():
                pooled.setdefault(name, []).extend(values)
    return merged


def trial_set_from_dict(data: dict, where: str = "baseline") -> TrialSet:
    """A TrialSet from a baseline file's JSON; ValueError naming ``where`` and the key when malformed."""
    if not isinstance(data, dict) or data.get("schema") != BASELINE_SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise ValueError(f"{where}: not a dslab baseline (schema {schema!r})")
    if not isinstance(data.get("schema_version"), int) or data["schema_version"] > BASELINE_VERSION:
        raise ValueError(f"{where}: 'schema_version' {data.get('schema_version')!r} is not one this reader knows")
    try:
        fingerprint = Fingerprint.from_dict(data.get("fingerprint") or {})
    except ValueError as err:
        raise ValueError(f"{where}: 'fingerprint': {err}") from None
    out = TrialSet(
        suite=str(data.get("suite", "unknown")),
        fingerprint=fingerprint,
        source_runs=[str(x) for x in data.get("source_runs") or []],
        label=str(data.get("label") or where),
        created=data.get("created"),
    )
    choices = data.get("kernel_choices")
    if choices is not None and not isinstance(choices, dict):
        raise ValueError(f"{where}: 'kernel_choices' must be an object (the source run's kernel choices)")
    out.kernel_choices = choices
    for i, entry in enumerate(data.get("results") or []):
        if not isinstance(entry, dict) or "case" not in entry or "arm" not in entry:
            raise ValueError(f"{where}: 'results[{i}]' needs 'case' and 'arm'")
        key = (str(entry["case"]), str(entry["arm"]))
        out.status[key] = {"status": str(entry.get("status", "ok")), "error": entry.get("error")}
        trials = entry.get("trials") or {}
        if not isinstance(trials, dict):
            raise ValueError(f"{where}: 'results[{i}].trials' must map metric names to lists")
        try:
            out.trials[key] = {str(k): [float(v) for v in vs] for k, vs in trials.items()}
        except (TypeError, ValueError):
            raise ValueError(f"{where}: 'results[{i}].trials' holds a value that is not a number") from None
    return out


def baseline_path(root: str | Path, suite: str, key: str) -> Path:
    """``<root>/baselines/<suite>/<key>.json``."""
    return Path(root) / BASELINES_DIR / suite / f"{key}.json"


def write_baseline(trial_set: TrialSet, root: str | Path) -> Path:
    """Write ``trial_set`` as the baseline of its suite and fingerprint, atomically; returns the path."""
    path = baseline_path(root, trial_set.suite, trial_set.fingerprint.key)
    atomic_write_text(path, json.dumps(trial_set.to_dict(), indent=1) + "\n")
    return path


def read_baseline(path: str | Path) -> TrialSet:
    """Read a baseline file; FileNotFoundError or ValueError naming the file when it cannot be used."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no baseline file at {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    trial_set = trial_set_from_dict(data, str(path))
    trial_set.label = f"baseline {path}"
    return trial_set


def list_baselines(root: str | Path, suite: str) -> list[Path]:
    directory = Path(root) / BASELINES_DIR / suite
    return sorted(directory.glob("*.json")) if directory.is_dir() else []


def injected_sleep_ms(report) -> float | None:
    """The ``DSLAB_INJECT_STEP_SLEEP_MS`` a run was slowed by on purpose (its config's
    ``inject_step_sleep_ms``), or None when it was not."""
    value = report.config.get("inject_step_sleep_ms") if isinstance(report.config, dict) else None
    return value or None


def _readable_runs(root: str | Path, suite: str) -> list:
    """Finished (complete or partial) run reports of ``suite`` under ``root``, oldest first.
    Unreadable runs, and runs slowed on purpose by ``DSLAB_INJECT_STEP_SLEEP_MS``, are skipped:
    neither is history."""
    reports = []
    for path in list_runs(root, suite):
        try:
            report = read_report(path)
        except (OSError, ValueError):
            continue
        if report.status in FINISHED_STATUSES and report.environment and not injected_sleep_ms(report):
            reports.append(report)
    return reports


def rolling_baseline(
    root: str | Path, suite: str, key: str, last: int, exclude: tuple[str, ...] = (), before: str | None = None
) -> TrialSet:
    """Pool the ``last`` newest finished runs of ``suite`` whose fingerprint key is ``key`` (runs
    slowed by ``DSLAB_INJECT_STEP_SLEEP_MS`` are never used).

    Runs in ``exclude`` (the candidates) and runs with an id sorting after ``before`` (the newest
    candidate's id; run ids sort by time) are not used. Raises ValueError when none qualifies.
    """
    if last < 1:
        raise ValueError(f"a rolling baseline needs N >= 1 runs, got {last}")
    chosen = []
    for report in _readable_runs(root, suite):
        if report.run_id in exclude or (before is not None and report.run_id > before):
            continue
        if fingerprint_of(report).key == key:
            chosen.append(report)
    chosen = chosen[-last:]
    if not chosen:
        raise ValueError(f"no earlier finished run of suite {suite!r} under {root} has fingerprint {key}")
    return trial_set_from_reports(chosen, label=f"rolling baseline: {len(chosen)} run(s) "
                                                f"{chosen[0].run_id} .. {chosen[-1].run_id}")


def detect_change_points(
    history: list[tuple[str, list[float]]],
    direction: str,
    settings: GateSettings | None = None,
    min_segment: int = 1,
) -> list[dict]:
    """Change points in one metric over a run history, by binary segmentation.

    ``history`` is ``[(run_id, trial values)]`` oldest first. For a segment of R runs, every split
    leaving at least ``min_segment`` runs on each side is scored by the standardised rank statistic
    (:func:`dslab.gate.stats.rank_z`, trials pooled on each side); the split with the largest
    ``|z|`` is judged by the gate's rule
    (:func:`dslab.gate.verdict.compare_samples`: CI of the median ratio clear of 1, reaching the
    threshold) with the rank test's alpha divided by the number of splits tried (Bonferroni; the
    interval keeps the uncorrected level, so the correction does not widen it toward the
    threshold). A found change
    splits the segment and both halves are searched again.

    Returns ``[{"run_id": first run after the change, "index", "change": median ratio after/before,
    "ci": [low, high], "p_value", "direction": "up" | "down", "kind": "regression" | "improvement"}]``
    ordered by run.
    """
    settings = settings or GateSettings()
    if min_segment < 1:
        raise ValueError(f"min_segment must be >= 1, got {min_segment}")
    arrays = [np.asarray(values, dtype=np.float64) for _, values in history]
    found: list[dict] = []

    def search(start: int, stop: int) -> None:
        splits = range(start + min_segment, stop - min_segment + 1)
        if len(splits) == 0:
            return
        best_z, best_split = -1.0, None
        for split in splits:
            before, after = np.concatenate(arrays[start:split]), np.concatenate(arrays[split:stop])
            if before.size == 0 or after.size == 0:
                continue
            z = abs(rank_z(after, before))
            if z > best_z:
                best_z, best_split = z, split
        if best_split is None:
            return
        corrected = dataclasses.replace(settings, alpha=settings.alpha / len(splits), confidence=settings.level)
        before, after = np.concatenate(arrays[start:best_split]), np.concatenate(arrays[best_split:stop])
        comparison = compare_samples(before, after, direction, corrected)
        if comparison.verdict not in ("regression", "improvement"):
            return
        found.append({
            "run_id": history[best_split][0],
            "index": best_split,
            "change": comparison.ratio,
            "ci": [comparison.ci_low, comparison.ci_high],
            "p_value": comparison.p_value,
            "direction": "up" if comparison.ratio > 1 else "down",
            "kind": comparison.verdict,
        })
        search(start, best_split)
        search(best_split, stop)

    search(0, len(history))
    return sorted(found, key=lambda point: point["index"])


def history_change_points(
    root: str | Path,
    suite: str,
    metrics: tuple[str, ...] | None = None,
    arms: tuple[str, ...] | None = None,
    settings: GateSettings | None = None,
    min_segment: int = 1,
) -> list[dict]:
    """Change points over every finished run of ``suite`` under ``root``.

    Runs are grouped by fingerprint key and, per case, by the case's settings; each (case, arm,
    metric) series is searched with :func:`detect_change_points`. ``metrics`` default: samples_per_s
    where a result has it, else tokens_per_s; ``arms`` default: all. Each point gets ``suite``,
    ``fingerprint``, ``case``, ``arm`` and ``metric`` added.
    """
    series: dict[tuple, list[tuple[str, list[float]]]] = {}
    for report in _readable_runs(root, suite):
        fp = fingerprint_of(report)
        for result in report.results:
            if result.status != "ok" or (arms and result.arm not in arms):
                continue
            trials = _result_trials(result)
            chosen = metrics or next(([m] for m in DEFAULT_METRICS if m in trials), [])
            case_hash = stable_hash(fp.cases.get(result.case))
            for metric in chosen:
                if metric in trials and metric in METRIC_DIRECTIONS:
                    key = (fp.key, case_hash, result.case, result.arm, metric)
                    series.setdefault(key, []).append((report.run_id, trials[metric]))
    points = []
    for (key, _, case, arm, metric), history in series.items():
        for point in detect_change_points(history, METRIC_DIRECTIONS[metric], settings, min_segment):
            points.append({"suite": suite, "fingerprint": key, "case": case, "arm": arm, "metric": metric, **point})
    return sorted(points, key=lambda p: (p["run_id"], p["case"], p["arm"], p["metric"]))


def write_change_points(
    root: str | Path, suite: str, points: list[dict], settings: GateSettings | None = None
) -> Path:
    """Save ``points`` to ``<root>/<suite>/change_points.json`` atomically; returns the path.

    Layout: ``{"schema": "dslab.change_points", "schema_version": 1, "suite", "generated",
    "settings": {"threshold", "alpha", "level"}, "change_points": [...]}``.
    """
    settings = settings or GateSettings()
    path = Path(root) / suite / CHANGE_POINTS_FILE
    payload = {
        "schema": CHANGE_POINTS_SCHEMA,
        "schema_version": 1,
        "suite": suite,
        "generated": utc_now(),
        "settings": {"threshold": settings.threshold, "alpha": settings.alpha, "level": settings.level},
        "change_points": points,
    }
    atomic_write_text(path, json.dumps(payload, indent=1) + "\n")
    return path
