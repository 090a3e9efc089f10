"""fio's best-practice sequential job on a given file, for the tuner's side-by-side comparison.

The job (:data:`FIO_JOB`) is the usual way to state what a drive does for large sequential
transfers: ``ioengine=libaio``, ``direct=1`` (``O_DIRECT``), ``bs=1M``, ``iodepth=32``, one job,
the whole file, read and write as separate runs. fio is Debian's ``fio`` package; without it
:func:`find_fio` returns None and the tuner says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess

FIO_JOB = {"ioengine": "libaio", "direct": 1, "bs": "1M", "iodepth": 32, "numjobs": 1}


def find_fio() -> str | None:
    """The path of the ``fio`` executable, or None."""
    return shutil.which("fio")


def fio_command(fio: str, path: str, size: int, op: str, **job) -> list[str]:
    """The command line of one run of :data:`FIO_JOB` (``op``: "read" or "write") over the
    first ``size`` bytes of ``path``; ``job`` overrides its keys (e.g. ``bs``, ``iodepth``,
    ``ioengine``). With ``numjobs`` > 1 the jobs split the range into equal parts (whole pages)
    and fio reports them as one (``group_reporting``)."""
    if op not in ("read", "write"):
        raise ValueError(f"op must be 'read' or 'write', got {op!r}")
    unknown = sorted(set(job) - set(FIO_JOB))
    if unknown:
        raise ValueError(f"unknown fio job key {unknown[0]!r} (keys: {', '.join(FIO_JOB)})")
    spec = {**FIO_JOB, **job}
    jobs = int(spec["numjobs"])
    if jobs < 1:
        raise ValueError(f"numjobs must be >= 1, got {jobs}")
    # Several jobs split the range: job k covers [k * share, (k + 1) * share), reported as one.
    share = size if jobs == 1 else size // jobs // 4096 * 4096
    if share <= 0:
        raise ValueError(f"size {size} is too small for {jobs} jobs")
    args = [fio, f"--name=dslab-nvme-tune-{op}", f"--filename={path}", f"--size={share}",
            f"--rw={op}", "--output-format=json", "--invalidate=1"]
    if jobs > 1:
        args += [f"--offset_increment={share}", "--group_reporting"]
    args += [f"--{key}={value}" for key, value in spec.items()]
    return args


def parse_fio_json(text: str, op: str) -> float:
    """The bandwidth in GB/s (1e9 bytes per second) of ``op`` in fio's JSON output. Raises
    ValueError naming what is missing."""
    start = text.find("{")  # fio may print notes before the JSON object
    if start < 0:
        raise ValueError(f"fio printed no JSON: {text[:200]!r}")
    try:
        data = json.loads(text[start:])
        job = data["jobs"][0]
        bandwidth = float(job[op]["bw_bytes"])
    except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as err:
        raise ValueError(f"fio's JSON output has no jobs[0].{op}.bw_bytes ({err})") from None
    if job.get("error"):
        raise ValueError(f"fio reported error {job['error']} for the {op} job")
    return bandwidth / 1e9


def run_fio(fio: str, path: str, size: int, op: str, timeout: float = 300.0, **job) -> float:
    """Run :data:`FIO_JOB` (with ``job``'s overrides) once and return its GB/s. Raises
    RuntimeError with fio's stderr when it fails."""
    proc = subprocess.run(fio_command(fio, path, size, op, **job), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"fio {op} on {path} failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return parse_fio_json(proc.stdout, op)
