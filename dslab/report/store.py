"""Where run reports live and how they are written and found.

``<root>/<suite>/<run_id>/run.json``, written atomically (a temp file in the same directory, fsync,
then rename), so a reader never sees half a report. Other files of a run (traces, plots, profiler
dumps) sit beside ``run.json`` in the run's directory.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import tempfile
from pathlib import Path

from dslab.report.schema import RunReport, report_from_dict

REPORT_FILE = "run.json"
RUN_ID_PATTERN = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}$")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def new_run_id(now: datetime.datetime | None = None) -> str:
    """``<UTC timestamp>-<6 hex digits>``: the first three digits are the fraction of the second
    (in 4096ths), the last three random, so ids sort by time within a second too (runs started
    back to back) and two hosts starting a run in the same quarter millisecond still differ."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    fraction = now.microsecond * 4096 // 1_000_000
    return f"{now.strftime('%Y%m%dT%H%M%SZ')}-{fraction:03x}{secrets.token_hex(2)[:3]}"


def _check_name(value: str, what: str) -> str:
    if not NAME_PATTERN.match(value or ""):
        raise ValueError(f"{what} {value!r} may hold only letters, digits, '_', '-' and '.'")
    return value


def run_dir(root: str | Path, suite: str, run_id: str) -> Path:
    return Path(root) / _check_name(suite, "suite name") / _check_name(run_id, "run id")


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename, so a
    reader sees the old file or the whole new one, never part of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_report(report: RunReport, root: str | Path, file_name: str = REPORT_FILE) -> Path:
    """Write ``report`` to ``<root>/<suite>/<run_id>/run.json`` (or ``file_name`` there, a part
    of a run that several launches write) atomically; returns the path."""
    path = run_dir(root, report.suite, report.run_id) / _check_name(file_name, "report file name")
    atomic_write_text(path, json.dumps(report.to_dict(), indent=1, sort_keys=False, default=_jsonable) + "\n")
    return path


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def read_report(path: str | Path) -> RunReport:
    """Read a report from a run directory or its ``run.json``.

    Raises FileNotFoundError or ValueError naming the file when it cannot be read at all; a
    partial or older report loads, with ``missing`` and ``warnings`` saying what was off.
    """
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no run report at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); the run may have been cut short") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file") from None
    try:
        return report_from_dict(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def list_runs(root: str | Path, suite: str | None = None) -> list[Path]:
    """Run directories under ``root`` (optionally one suite), oldest first by run id."""
    root = Path(root)
    if not root.is_dir():
        return []
    suites = [root / _check_name(suite, "suite name")] if suite else [p for p in root.iterdir() if p.is_dir()]
    runs = []
    for s in suites:
        if not s.is_dir() or s.name == "baselines":
            continue
        runs.extend(p for p in s.iterdir() if (p / REPORT_FILE).is_file())
    return sorted(runs, key=lambda p: (p.name, p.parent.name))


def find_run(root: str | Path, ref: str) -> Path:
    """The run directory for ``ref``: a run id (searched in every suite), ``suite/run_id``, or a
    path to a run directory. A ref naming something outside ``root`` that is not an existing
    run directory is refused."""
    root = Path(root)
    candidate = Path(ref)
    if candidate.is_dir() and (candidate / REPORT_FILE).is_file():
        return candidate
    if candidate.name == REPORT_FILE and candidate.is_file():
        return candidate.parent
    parts = ref.strip("/").split("/")
    if len(parts) == 2:
        path = run_dir(root, parts[0], parts[1])
        if (path / REPORT_FILE).is_file():
            return path
        raise FileNotFoundError(f"no run {ref} under {root}")
    _check_name(ref, "run id")
    matches = [p for p in list_runs(root) if p.name == ref or p.name.startswith(ref)]
    if not matches:
        raise FileNotFoundError(f"no run {ref!r} under {root}")
    if len(matches) > 1:
        raise ValueError(f"run id {ref!r} is ambiguous: {', '.join(p.parent.name + '/' + p.name for p in matches[:5])}")
    return matches[0]
