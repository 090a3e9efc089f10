"""Run reports: the versioned schema, atomic writing and tolerant reading, and the environment
record every report carries. Imports nothing else of dslab."""

from dslab.report.schema import (
    METRIC_DIRECTIONS,
    SCHEMA_VERSION,
    Result,
    RunReport,
    Trial,
    report_from_dict,
)
from dslab.report.store import find_run, list_runs, new_run_id, read_report, run_dir, write_report

__all__ = [
    "METRIC_DIRECTIONS",
    "SCHEMA_VERSION",
    "Result",
    "RunReport",
    "Trial",
    "find_run",
    "list_runs",
    "new_run_id",
    "read_report",
    "report_from_dict",
    "run_dir",
    "write_report",
]
