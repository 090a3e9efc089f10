"""Finding and reading run reports for the dashboard, safely and fast.

Run references come from URLs, so every lookup goes through :func:`resolve_run`: the suite and
run id must be plain names (``dslab.report.store.NAME_PATTERN``: no ``/``, no leading ``.``), and
the resolved directory must lie inside the reports root (a symlink out of it is refused). Nothing
outside the reports directory is ever read.

:class:`RunStore` keeps one :class:`RunSummary` per run directory, re-read only when its
``run.json`` changes (size or mtime), and a few whole reports. The gate's files are read here as
plain JSON (the dashboard imports ``dslab.report`` only): baselines under
``<root>/baselines/<suite>/*.json`` and change points in ``<root>/<suite>/change_points.json``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from dslab.report import RunReport, list_runs, read_report
from dslab.report.store import NAME_PATTERN, REPORT_FILE

logger = logging.getLogger(__name__)

BASELINES_DIR = "baselines"
CHANGE_POINTS_FILE = "change_points.json"
TRACE_FILE = "trace.pftrace"
REPORT_CACHE_SIZE = 16


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
    arms: list[str] = field(default_factory=list)
    cases: list[str] = field(default_factory=list)
    # {(case, arm): {metric: median over trials}}
    metrics: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    trials: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.suite}/{self.run_id}"


def gpu_name(report: RunReport) -> str:
    """The first GPU's name from the environment, ``"CPU"`` without one, ``"?"`` when the
    report does not say."""
    cuda = report.environment.get("cuda") if isinstance(report.environment, dict) else None
    if cuda is None:
        return "?"
    gpus = cuda.get("gpus") if isinstance(cuda, dict) else None
    if isinstance(gpus, list) and gpus and isinstance(gpus[0], dict):
        name = str(gpus[0].get("name", "?"))
        return f"{len(gpus)}x {name}" if len(gpus) > 1 else name
    return "CPU"


def commit_of(report: RunReport) -> str:
    """The short git commit the run was made at (``+dirty`` when the tree had changes)."""
    dslab = report.environment.get("dslab") if isinstance(report.environment, dict) else None
    if not isinstance(dslab, dict) or not dslab.get("git_commit"):
        return "?"
    return str(dslab["git_commit"])[:10] + ("+dirty" if dslab.get("git_dirty") else "")


def summarize(report: RunReport, suite: str, run_id: str) -> RunSummary:
    summary = RunSummary(suite=suite, run_id=run_id, status=report.status, created=report.created,
                         gpu=gpu_name(report), commit=commit_of(report), arms=report.arms(),
                         cases=report.cases())
    for r in report.results:
        summary.metrics[(r.case, r.arm)] = dict(r.metrics)
        summary.trials[(r.case, r.arm)] = r.trial_values("samples_per_s")
    if report.run_id != run_id or report.suite != suite:
        summary.warnings.append(f"the report says {report.suite}/{report.run_id}, its folder {suite}/{run_id}")
    summary.warnings.extend(f"lacks '{key}'" for key in report.missing)
    summary.warnings.extend(report.warnings)
    return summary


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = (path / REPORT_FILE).stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class RunStore:
    """The runs under one reports root, with summaries and reports cached by file stamp."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._summaries: dict[Path, tuple[tuple[int, int], RunSummary]] = {}
        self._reports: OrderedDict[Path, tuple[tuple[int, int], RunReport]] = OrderedDict()
        self._lock = threading.Lock()

    def summaries(self) -> list[RunSummary]:
        """One summary per run directory, oldest first; unreadable runs carry ``error``."""
        out = []
        try:
            paths = list_runs(self.root)
        except (OSError, ValueError) as err:
            logger.warning("cannot list runs under %s: %s", self.root, err)
            return []
        with self._lock:
            seen = set()
            for path in paths:
                seen.add(path)
                stamp = _stamp(path)
                cached = self._summaries.get(path)
                if cached is not None and cached[0] == stamp:
                    out.append(cached[1])
                    continue
                try:
                    summary = summarize(read_report(path), path.parent.name, path.name)
                except (OSError, ValueError) as err:
                    summary = RunSummary(suite=path.parent.name, run_id=path.name, error=str(err))
                self._summaries[path] = (stamp, summary)
                out.append(summary)
            for gone in set(self._summaries) - seen:
                del self._summaries[gone]
        return out

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

    def trace_file(self, suite: str, run_id: str) -> Path | None:
        """The run's Perfetto trace if ``dslab trace`` has written it."""
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
