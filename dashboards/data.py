"""Finding and reading run reports for the dashboard, safely and fast.

Run references come from URLs, so every lookup goes through :func:`resolve_run`: the suite and
run id must be plain names (``dslab.report.store.NAME_PATTERN``: no ``/``, no leading ``.``), and
the resolved directory must lie inside the reports root (a symlink out of it is refused). Nothing
outside the reports directory is ever read.

:class:`RunStore` keeps one :class:`RunSummary` per run directory, re-read only when its
``run.json`` changes (size or mtime), a few whole reports, and the components of the run pages
last drawn (:meth:`RunStore.page`), so a page drawn once answers at once until its report or its
trace changes. Summaries are made from the
``runs`` and ``results`` frames (:mod:`dslab.report.frames`) of every report read at once. The
gate's files are read here as plain JSON (the gate's verdicts on two runs come from ``dslab.gate``): baselines under
``<root>/baselines/<suite>/*.json`` and change points in ``<root>/<suite>/change_points.json``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dslab.report import RunReport, frames, list_runs, read_report
from dslab.report.store import NAME_PATTERN, REPORT_FILE
from dslab.report.timeline import TRACE_FILE

logger = logging.getLogger(__name__)

BASELINES_DIR = "baselines"
CHANGE_POINTS_FILE = "change_points.json"
REPORT_CACHE_SIZE = 16
PAGE_CACHE_SIZE = 64


def check_name(value: str, what: str) -> str:
    """``value`` if it is a plain name (letters, digits, ``_ . -``, not starting with ``.``)."""
    if not isinstance(value, str) or not NAME_PATTERN.match(value) or value in (".", ".."):
        raise ValueError(f"{what} {value!r} is not a valid name (letters, digits, '_', '-', '.')")
    return value


def resolve_run(root: str | Path, suite: str, run_id: str) -> Path:
    """The directory of run ``suite/run_id`` under ``root``, checked to lie inside ``root``.

    Raises ValueError for a bad name or a path that leaves ``root``, FileNotFoundError when there
    is no such run."""
    check_name(suite, "suite")
    check_name(run_id, "run id")
    if suite == BASELINES_DIR:
        raise ValueError("'baselines' holds gate baselines, not runs")
    base = Path(root).resolve()
    path = (base / suite / run_id).resolve()
    if not path.is_relative_to(base) or path == base:
        raise ValueError(f"run {suite}/{run_id} is outside the reports directory")
    if not (path / REPORT_FILE).is_file():
        raise FileNotFoundError(f"no run {suite}/{run_id} under {root}")
    return path


def parse_ref(ref: str) -> tuple[str, str]:
    """``"suite/run_id"`` -> ``(suite, run_id)``, both checked with :func:`check_name`."""
    parts = (ref or "").split("/")
    if len(parts) != 2:
        raise ValueError(f"a run reference is 'suite/run_id', not {ref!r}")
    return check_name(parts[0], "suite"), check_name(parts[1], "run id")


@dataclass
class RunSummary:
    """What the Runs page shows of one run; ``error`` is set when the report could not be read."""

    suite: str
    run_id: str
    status: str = "unreadable"
    created: str | None = None
    gpu: str = "?"
    commit: str = "?"
    source: str = "?"
    arms: list[str] = field(default_factory=list)
    cases: list[str] = field(default_factory=list)
    # {(case, arm): {metric: median over trials}}
    metrics: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.suite}/{self.run_id}"


def gpu_label(run: dict) -> str:
    """The GPUs of a ``runs`` frame row (``"NVIDIA H100 80GB HBM3"``, ``"2x NVIDIA H100 80GB
    HBM3"``), ``"CPU"`` without one, ``"?"`` when the report does not say."""
    return run["hardware"] or "?"


def commit_label(run: dict) -> str:
    """The short git commit of a ``runs`` frame row (``+dirty`` when the tree had changes)."""
    if not run["git_commit"]:
        return "?"
    return run["git_commit"][:10] + ("+dirty" if run["git_dirty"] else "")


def source_label(run: dict) -> str:
    """The source digest of a ``runs`` frame row (the package's code wherever it ran, even where the
    commit beside it names a stale checkout), ``"?"`` for reports from before it was recorded."""
    return run.get("source_digest") or "?"


def summarize_all(items: list[tuple[RunReport, str, str]]) -> list[RunSummary]:
    """The summaries of ``(report, suite folder, run folder)`` items, from the ``runs`` and
    ``results`` frames of all the reports at once (one frame of many reports costs what one of
    one report does)."""
    reports = [report for report, _, _ in items]
    results = frames.results(reports)
    metrics = frames.metric_names(results, "results")
    rows = frames.records(results)
    out, start = [], 0
    for (report, suite, run_id), run in zip(items, frames.records(frames.runs(reports))):
        mine = rows[start:start + len(report.results)]  # one row per result, in the reports' order
        start += len(report.results)
        summary = RunSummary(suite=suite, run_id=run_id, status=report.status, created=report.created,
                             gpu=gpu_label(run), commit=commit_label(run), source=source_label(run),
                             arms=list(dict.fromkeys(r["arm"] for r in mine)),
                             cases=list(dict.fromkeys(r["case"] for r in mine)))
        for r in mine:
            summary.metrics[(r["case"], r["arm"])] = {m: r[m] for m in metrics if r[m] is not None}
        if report.run_id != run_id or report.suite != suite:
            summary.warnings.append(f"the report says {report.suite}/{report.run_id}, its folder {suite}/{run_id}")
        summary.warnings.extend(f"lacks '{key}'" for key in report.missing)
        summary.warnings.extend(report.warnings)
        out.append(summary)
    return out


def summarize(report: RunReport, suite: str, run_id: str) -> RunSummary:
    """The summary of one report (see :func:`summarize_all`)."""
    return summarize_all([(report, suite, run_id)])[0]


def _stamp(path: Path, name: str = REPORT_FILE) -> tuple[int, int] | None:
    try:
        st = (path / name).stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class RunStore:
    """The runs under one reports root, with summaries and reports cached by file stamp."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._summaries: dict[Path, tuple[tuple[int, int], RunSummary]] = {}
        self._reports: OrderedDict[Path, tuple[tuple[int, int], RunReport]] = OrderedDict()
        self._pages: OrderedDict[tuple, list] = OrderedDict()
        self._lock = threading.Lock()

    def summaries(self) -> list[RunSummary]:
        """One summary per run directory, oldest first; unreadable runs carry ``error``."""
        try:
            paths = list_runs(self.root)
        except (OSError, ValueError) as err:
            logger.warning("cannot list runs under %s: %s", self.root, err)
            return []
        with self._lock:
            stamps = {path: _stamp(path) for path in paths}
            fresh: dict[Path, RunSummary] = {}
            readable: list[tuple[Path, RunReport]] = []
            for path in paths:
                cached = self._summaries.get(path)
                if cached is not None and cached[0] == stamps[path]:
                    continue
                try:
                    readable.append((path, read_report(path)))
                except (OSError, ValueError) as err:
                    fresh[path] = RunSummary(suite=path.parent.name, run_id=path.name, error=str(err))
            made = summarize_all([(report, path.parent.name, path.name) for path, report in readable])
            fresh.update((path, summary) for (path, _), summary in zip(readable, made))
            for path, summary in fresh.items():
                self._summaries[path] = (stamps[path], summary)
            for gone in set(self._summaries) - set(paths):
                del self._summaries[gone]
            return [self._summaries[path][1] for path in paths]

    def run_path(self, suite: str, run_id: str) -> Path:
        return resolve_run(self.root, suite, run_id)

    def report(self, suite: str, run_id: str) -> RunReport:
        """The report of ``suite/run_id`` (validated, see :func:`resolve_run`); raises ValueError or
        FileNotFoundError with a message fit to show."""
        path = self.run_path(suite, run_id)
        stamp = _stamp(path)
        with self._lock:
            cached = self._reports.get(path)
            if cached is not None and cached[0] == stamp:
                self._reports.move_to_end(path)
                return cached[1]
        report = read_report(path)
        with self._lock:
            self._reports[path] = (stamp, report)
            while len(self._reports) > REPORT_CACHE_SIZE:
                self._reports.popitem(last=False)
        return report

    def page(self, suite: str, run_id: str, key: tuple, build: Callable[[RunReport], list]) -> list:
        """``build(report)`` for run ``suite/run_id``, cached under ``key`` (the tab and case) until
        the run's ``run.json`` or trace changes (size or mtime); the last :data:`PAGE_CACHE_SIZE`
        pages are kept. A page that raises is not kept."""
        path = self.run_path(suite, run_id)
        full_key = (path, _stamp(path), _stamp(path, TRACE_FILE), *key)
        with self._lock:
            cached = self._pages.get(full_key)
            if cached is not None:
                self._pages.move_to_end(full_key)
                return cached
        page = build(self.report(suite, run_id))
        with self._lock:
            self._pages[full_key] = page
            while len(self._pages) > PAGE_CACHE_SIZE:
                self._pages.popitem(last=False)
        return page

    def drop_pages(self) -> None:
        """Forget the pages drawn so far, so that each is drawn afresh on its next request; the
        reports read stay kept (the page-speed test times first draws this way)."""
        with self._lock:
            self._pages.clear()

    def trace_file(self, suite: str, run_id: str) -> Path | None:
        """The run's Perfetto trace (``dslab bench`` writes it with the run, ``dslab trace`` for an older
        one), None when the run's directory has none."""
        path = self.run_path(suite, run_id) / TRACE_FILE
        return path if path.is_file() else None

    def baselines(self, suite: str) -> list[dict]:
        """The suite's baseline files (the gate's ``dslab.baseline`` JSON), each with ``_file``;
        unreadable files are logged and left out."""
        check_name(suite, "suite")
        folder = self.root / BASELINES_DIR / suite
        out = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            data = _read_json(path)
            if isinstance(data, dict) and isinstance(data.get("results"), list):
                out.append({**data, "_file": path.name})
        return out

    def change_points(self, suite: str) -> list[dict]:
        """The gate's change points of ``suite`` (``[]`` when the gate has not written any)."""
        check_name(suite, "suite")
        data = _read_json(self.root / suite / CHANGE_POINTS_FILE)
        points = data.get("change_points") if isinstance(data, dict) else None
        return [p for p in points if isinstance(p, dict)] if isinstance(points, list) else []


def _read_json(path: Path):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        logger.warning("cannot read %s: %s", path, err)
        return None
