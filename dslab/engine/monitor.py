"""Training metrics to CSV files and TensorBoard, configured by DeepSpeed's ``csv_monitor`` and
``tensorboard`` sections.

The engine hands :meth:`Monitor.write_events` a list of ``(name, value, step)`` events, with
DeepSpeed's names (``Train/Samples/train_loss``, ``Train/Samples/lr``,
``Train/Samples/loss_scale``, ...). Only rank 0 writes; on every other rank the monitor has no
sinks and is ``enabled == False``, so the engine can skip building events (and the device
synchronisation a ``loss.item()`` costs) there.

CSV layout: ``<output_path or ./csv_monitor>/<job_name>/<name with '/' -> '_'>.csv``, one file
per metric, header ``step,<name>``, one row per event, flushed after every call so a crash keeps
what was written. TensorBoard: a SummaryWriter at ``<output_path or ./runs>/<job_name>``.
"""

from __future__ import annotations

import csv
import numbers
import pathlib
import warnings
from typing import Any, Sequence

from pydantic import field_validator

from dslab.config_base import ConfigSection

CSV_DEFAULT_DIR = "csv_monitor"
TENSORBOARD_DEFAULT_DIR = "runs"


class _MonitorSection(ConfigSection):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "dslab_job"

    @field_validator("job_name")
    @classmethod
    def _job_name_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value


class CSVMonitorConfig(_MonitorSection):
    """DeepSpeed's ``csv_monitor`` section: ``enabled``, ``output_path`` (default
    ``./csv_monitor``), ``job_name``."""


class TensorBoardConfig(_MonitorSection):
    """DeepSpeed's ``tensorboard`` section: ``enabled``, ``output_path`` (default ``./runs``),
    ``job_name``."""


def metric_file_name(name: str) -> str:
    """The CSV file of metric ``name``: path separators become '_', plus ``.csv``."""
    stem = name.replace("/", "_").replace("\\", "_")
    return f"{stem}.csv"


class _CSVSink:
    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Any] = {}
        self._writers: dict[str, Any] = {}

    def _writer(self, name: str):
        writer = self._writers.get(name)
        if writer is None:
            path = self.directory / metric_file_name(name)
            has_rows = path.is_file() and path.stat().st_size > 0
            f = open(path, "a", newline="", encoding="utf-8")
            writer = csv.writer(f)
            if not has_rows:
                writer.writerow(["step", name])
            self._files[name] = f
            self._writers[name] = writer
        return writer

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        touched = set()
        for name, value, step in events:
            self._writer(name).writerow([step, repr(value)])
            touched.add(name)
        for name in touched:
            self._files[name].flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._writers.clear()


class _TensorBoardSink:
    def __init__(self, writer_cls, log_dir: pathlib.Path):
        self.log_dir = log_dir
        self.writer = writer_cls(log_dir=str(log_dir))

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _summary_writer_class():
    """torch's SummaryWriter, or None (with one warning) when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        warnings.warn(
            "the 'tensorboard' config section is enabled but the 'tensorboard' package is not "
            f"installed ({err}); continuing without TensorBoard logging "
            "(pip install tensorboard to get it)", RuntimeWarning, stacklevel=3)
        return None
    return SummaryWriter


def _check_events(events: Any) -> list[tuple[str, float, int]]:
    if not isinstance(events, (list, tuple)):
        raise ValueError(
            f"events must be a list of (name, value, step), got {type(events).__name__}")
    checked = []
    for i, event in enumerate(events):
        if not isinstance(event, (list, tuple)) or len(event) != 3:
            raise ValueError(f"events[{i}] must be a (name, value, step) tuple, got {event!r}")
        name, value, step = event
        if not isinstance(name, str) or not name:
            raise ValueError(f"events[{i}]: the name must be a non-empty string, got {name!r}")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ValueError(f"events[{i}] ({name}): the step must be an int, got {step!r}")
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"events[{i}] ({name}): the value must be a number, got {value!r}") from None
        checked.append((name, value, int(step)))
    return checked


class Monitor:
    """Writes ``(name, value, step)`` events to the enabled sinks, on rank 0 only.

    Args:
        csv: the ``csv_monitor`` section.
        tensorboard: the ``tensorboard`` section.
        rank: this process's global rank; every rank but 0 gets a monitor with no sinks.
    """

    def __init__(self, csv: CSVMonitorConfig, tensorboard: TensorBoardConfig, rank: int):
        if not isinstance(csv, CSVMonitorConfig):
            raise ValueError(f"csv must be a CSVMonitorConfig, got {type(csv).__name__}")
        if not isinstance(tensorboard, TensorBoardConfig):
            raise ValueError(
                f"tensorboard must be a TensorBoardConfig, got {type(tensorboard).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        self.rank = rank
        self._csv: _CSVSink | None = None
        self._tensorboard: _TensorBoardSink | None = None
        if rank != 0:
            return
        if csv.enabled:
            root = pathlib.Path(csv.output_path or CSV_DEFAULT_DIR)
            self._csv = _CSVSink(root / csv.job_name)
        if tensorboard.enabled:
            writer_cls = _summary_writer_class()
            if writer_cls is not None:
                root = pathlib.Path(tensorboard.output_path or TENSORBOARD_DEFAULT_DIR)
                self._tensorboard = _TensorBoardSink(writer_cls, root / tensorboard.job_name)

    @property
    def enabled(self) -> bool:
        """True when at least one sink writes on this rank."""
        return self._csv is not None or self._tensorboard is not None

    @property
    def csv_dir(self) -> pathlib.Path | None:
        """The directory the CSV files go to, or None when CSV is off on this rank."""
        return self._csv.directory if self._csv is not None else None

    @property
    def tensorboard_dir(self) -> pathlib.Path | None:
        """The TensorBoard log directory, or None when TensorBoard is off on this rank."""
        return self._tensorboard.log_dir if self._tensorboard is not None else None

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Write each ``(name, value, step)``; values are converted with ``float()``. A no-op
        when no sink is enabled on this rank. Raises ValueError naming the malformed event."""
        if not self.enabled:
            return
        checked = _check_events(events)
        if self._csv is not None:
            self._csv.write(checked)
        if self._tensorboard is not None:
            self._tensorboard.write(checked)

    def close(self) -> None:
        """Flush and close every sink; the monitor writes nothing afterwards. Idempotent."""
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
