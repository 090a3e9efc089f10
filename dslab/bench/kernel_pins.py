"""Kernel choices in a ``dslab bench`` run: replayed from a file before any arm is built, recorded
after the last trial.

``dslab bench SUITE --pin-kernels FILE`` replays the choices in FILE (a kernel-choices JSON, a
baseline, or a run's run.json; :func:`dslab.kernels.pinning.load_kernel_choices`) in every process
of the run before anything is measured, so that the candidate runs the kernels its baseline ran:
Triton's autotuner takes the recorded configs instead of benchmarking, and the cuDNN/cuBLAS flags
are the recorded ones (``cudnn.benchmark`` off). A file recorded on another device or torch,
Triton, CUDA or cuDNN version is refused before the run starts (exit 2), naming the field.

Every run, pinned or not, records its choices after the trials in
``report.profilers["kernel_choices"]["_run"]`` (:mod:`dslab.report.schema`): the record of
:func:`dslab.kernels.pinning.record_kernel_choices` plus ``replay``, None for a run that pinned
nothing, else the replay's summary with ``misses``, the autotune keys this run chose itself. A
launched part of a data- or model-parallel run records under ``"_run <part>"`` and the launching
process merges the parts into ``"_run"`` (:func:`dslab.kernels.pinning.merge_kernel_choices`).
"""

from __future__ import annotations

from pathlib import Path

from dslab.bench.common import World
from dslab.kernels.pinning import (
    REPORT_SECTION, RUN_RECORD, load_kernel_choices, merge_kernel_choices, pinning_misses, record_kernel_choices,
    replay_kernel_choices,
)
from dslab.report import RunReport


def replay_pins(path: str | Path) -> dict:
    """Replay the kernel choices of ``path`` here; the replay's summary. FileNotFoundError or
    ValueError (naming the file and the field) when they cannot be used."""
    return replay_kernel_choices(load_kernel_choices(path), strict=True, source=str(path))


def pins_note(summary: dict) -> str:
    """The report's note on a replay: where from, what it pinned and what it skipped."""
    stale = f"; skipped {len(summary['stale'])} stale: {'; '.join(summary['stale'])}" if summary["stale"] else ""
    return (f"kernel choices pinned from {summary['source']}: {summary['pinned']} Triton autotune choice(s) of "
            f"{summary['kernels']} kernel(s), cuDNN/cuBLAS flags as recorded, cudnn.benchmark off{stale}")


def _section(report: RunReport) -> dict:
    section = report.profilers.get(REPORT_SECTION)
    if not isinstance(section, dict):
        section = report.profilers[REPORT_SECTION] = {}
    return section


def record_pins(report: RunReport, world: World, replay: dict | None) -> None:
    """Add this process's kernel choices to ``report`` (module docstring), with the replay's
    summary and misses when the run pinned its kernels."""
    record = record_kernel_choices()
    record["replay"] = None if replay is None else {**replay, "misses": pinning_misses()}
    _section(report)[RUN_RECORD if not world.part else f"{RUN_RECORD} {world.part}"] = record


def merge_part_pins(report: RunReport) -> None:
    """In the launching process of a multi-process run: the parts' records merged into ``_run``."""
    section = _section(report)
    parts = [record for key, record in sorted(section.items())
             if key.startswith(f"{RUN_RECORD} ") and isinstance(record, dict)]
    if parts:
        section[RUN_RECORD] = merge_kernel_choices(parts)
