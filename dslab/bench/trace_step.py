"""The Perfetto trace of a finished ``dslab bench`` run, written beside its report.

Once the runner has written a run's final report, :func:`write_run_trace` writes
``trace.pftrace`` from it (:func:`dslab.profilers.trace.write_trace`: every case, every rank on a
track of its own), so a run's directory holds its trace without a second command. Rank 0 writes
it, once per run: a launch that writes one part of a multi-process run leaves it to the launcher,
whose merged report has every rank.

A trace that cannot be written (the ``perfetto`` package missing, a full disk) does not fail the
run: the progress lines say so, and the report gets a note
(:data:`dslab.report.timeline.TRACE_NOT_WRITTEN` and the reason) that the dashboard shows in the
trace link's place.
"""

from __future__ import annotations

import time
from pathlib import Path

from dslab.bench.protocol import RunContext
from dslab.profilers.trace import write_trace
from dslab.report.timeline import TRACE_NOT_WRITTEN


def write_run_trace(context: RunContext, report_path: Path) -> Path | None:
    """Write the trace of the run whose final report is ``report_path``; its path, or None when
    this process does not write it or it could not be written (then noted in the report, which
    is rewritten)."""
    if context.world.rank != 0 or context.world.part:
        return None
    started = time.perf_counter()
    try:
        path = write_trace(report_path, force=True)
    except Exception as err:  # the run's measurements stand whatever happens to its trace
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        context.report.notes.append(TRACE_NOT_WRITTEN + reason)
        context.write()
        context.progress.line(f"warning: {TRACE_NOT_WRITTEN}{reason}")
        return None
    context.progress.line(f"trace: {path} ({time.perf_counter() - started:.1f} s; open it at ui.perfetto.dev)")
    return path
