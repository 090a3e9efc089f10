"""One expensive launch that several tests read, run once per test session.

The tests of one module can land on both of pytest-xdist's workers (bin/test runs two), and each
worker is a process with fixtures of its own: a module-scoped fixture that starts gloo processes
would start them once per worker. :func:`shared_directory` runs its ``produce`` once for the
session instead. The first worker to ask takes a file lock in the session's temporary root (the
directory every worker's own temporary directory sits in), runs ``produce`` into a fresh
directory and marks it done; a worker that asks later waits on the lock and gets the same
directory. When ``produce`` fails, its traceback is kept beside the directory, so the tests that
ask later (on any worker) fail with that error instead of starting the launch again.
"""

from __future__ import annotations

import os
import shutil
import traceback
from pathlib import Path
from typing import Callable

from filelock import FileLock

DONE, FAILED = ".done", ".failed"


def session_root(tmp_path_factory) -> Path:
    """The temporary directory all of this session's workers see: under xdist the parent of the
    worker's base directory (``.../pytest-N/popen-gw0`` -> ``.../pytest-N``), else the base
    directory itself (its parent is shared with other pytest sessions)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_directory(tmp_path_factory, name: str, produce: Callable[[Path], None]) -> Path:
    """The directory ``produce`` filled, running it only if no worker of this session has."""
    root = session_root(tmp_path_factory)
    out = root / f"shared-{name}"
    with FileLock(str(root / f"shared-{name}.lock")):
        failed = root / f"shared-{name}{FAILED}"
        if failed.exists():
            raise RuntimeError(f"the shared launch {name!r} failed earlier in this session:\n{failed.read_text()}")
        if not (out / DONE).exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            try:
                produce(out)
            except BaseException:
                failed.write_text(traceback.format_exc()[-8000:])
                raise
            (out / DONE).touch()
    return out
