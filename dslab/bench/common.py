"""What every kind of case in ``dslab bench`` shares: the device, freeing its memory between arms,
an arm's error as the report records it, the progress lines, and the processes of the run.

An arm that runs out of GPU memory (``torch.OutOfMemoryError``) is recorded with status ``oom``
and an error whose first line says where and repeats PyTorch's first line
(:func:`error_text`); any other exception is ``failed``, with its traceback's last frames.
"""

from __future__ import annotations

import gc
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from dslab import comm
from dslab.report import RunReport, run_dir, write_report
from dslab.report.store import REPORT_FILE

OOM_STATUS = "oom"
OOM_PREFIX = "out of memory"


class RunNotStarted(ValueError):
    """The run was refused before it started: the suite (missing, unreadable, invalid), the
    scale, arms, cases or counts asked for, or the kind's own checks. Nothing was measured and no
    report was written; the message names the problem. ``dslab bench`` exits 2 on it."""


class ArmSkipped(Exception):
    """The arm cannot run here (a missing optional package, a distributed run of a
    single-process arm); recorded as skipped, not failed."""


class TrialFailed(Exception):
    """An arm's trial failed with an error already in the report's words (another rank's, say);
    the runner records the message as it is."""


def current_device() -> torch.device:
    """This process's CUDA device, or the CPU where there is none."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def free_memory(device: torch.device) -> None:
    """Collect garbage and, on CUDA, return the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(err: BaseException, where: str | None = None) -> str:
    """An arm's error for the report: out of memory, ``"out of memory (<where>): <torch's first
    line>"``; else the exception and the last frames of its traceback."""
    if isinstance(err, torch.OutOfMemoryError):
        lines = str(err).splitlines()
        return f"{OOM_PREFIX}{f' ({where})' if where else ''}: {lines[0] if lines else 'torch.OutOfMemoryError'}"
    last = traceback.format_exception(err)[-3:]
    return f"{type(err).__name__}: {err}\n{''.join(last)}"


def failure_status(error: str) -> str:
    """``oom`` for an error :func:`error_text` made of an out-of-memory error (on any rank: a
    gathered error is prefixed ``rank <r>: ``), else ``failed``."""
    first = error.split(": ", 1)[1] if error.startswith("rank ") and ": " in error else error
    return OOM_STATUS if first.startswith(OOM_PREFIX) else "failed"


def datasheet_bf16(environment: dict) -> float | None:
    """The first GPU's datasheet dense bf16 TFLOP/s from a report's environment, if known."""
    gpus = (environment.get("cuda") or {}).get("gpus") or []
    spec = gpus[0].get("spec") if gpus else None
    return spec.get("bf16_tflops") if spec else None


class Progress:
    """The run's progress lines, printed by rank 0 only."""

    def __init__(self, stream: TextIO, enabled: bool = True):
        self.stream = stream
        self.enabled = enabled

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)


# Set by the launcher (:mod:`dslab.bench.launcher`) in the processes it starts: the run id they
# share, and the part of the run's report that they write (``part-<part>.json`` beside run.json).
RUN_ID_ENV = "DSLAB_BENCH_RUN_ID"
PART_ENV = "DSLAB_BENCH_PART"


def part_file(part: str) -> str:
    """The file name of part ``part`` of a run's report."""
    return f"part-{part}.json"


@dataclass(frozen=True)
class World:
    """This process's rank, the number of processes running the suite together and, in a launch
    of the data-parallel launcher, the part of the run's report they write."""

    rank: int = 0
    size: int = 1
    part: str | None = None

    def write(self, report: RunReport, out) -> Path:
        """Write the report on rank 0 (run.json, or the part's file); every rank gets its path."""
        name = part_file(self.part) if self.part else REPORT_FILE
        if self.rank == 0:
            return write_report(report, out, name)
        return run_dir(out, report.suite, report.run_id) / name


def requested_world_size() -> int:
    """``WORLD_SIZE`` as torchrun / ``dslab launch`` set it (1 when unset)."""
    raw = os.environ.get("WORLD_SIZE", "1") or "1"
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={raw!r} is not a number of processes") from None


def join_world() -> World:
    """Join the process group torchrun / ``dslab launch`` describe when ``WORLD_SIZE`` > 1."""
    if requested_world_size() > 1:
        comm.init_distributed()
    return World(comm.get_rank(), comm.get_world_size(), os.environ.get(PART_ENV) or None)
