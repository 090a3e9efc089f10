"""The processes of a data-parallel run: one torchrun per process count, one report for all.

``dslab bench suites/zero`` started by hand (no ``WORLD_SIZE`` in its environment) measures
nothing itself. For each process count ``N`` of the run it starts::

    python -m torch.distributed.run --standalone --nproc_per_node N -m dslab.cli bench SUITE
        --scale S --arms ... --cases ... --trials T --steps K --warmup W --out OUT

with ``DSLAB_BENCH_RUN_ID`` (the run's id) and ``DSLAB_BENCH_PART=n<N>`` in its environment, and
NVLink multicast off (``NCCL_NVLS_ENABLE=0`` and its two siblings; the lent machines do not
support it reliably). On a machine without a GPU the processes are gloo processes with one
thread each. Rank 0 of the launch writes its cases' results, profiler records and notes to
``part-n<N>.json`` in the run's directory (its profiler files go to the run's ``profiles/``), and
prints its progress lines, which pass through to this terminal.

After each launch its part is merged into the run's ``run.json`` (written atomically), so a
launch that fails or is interrupted loses none of the launches before it: its arms without a
result, and those it left with fewer trials than asked (an arm's result is written as it starts),
are recorded as ``failed`` with the launch's exit status and the last line it printed, and the
next process count runs. Ctrl-C stops the launch in flight (its processes get the same
interrupt), merges what it wrote, and leaves the report marked incomplete.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque
from pathlib import Path

from dslab.bench.common import PART_ENV, RUN_ID_ENV, Progress, part_file
from dslab.report import Result, RunReport, read_report
from dslab.report.schema import RESULT_OK

# NVLink multicast (NVLS) stays off in every launch: see the module docstring.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
KEEP_LINES = 40


def part_name(nprocs: int) -> str:
    return f"n{nprocs}"


def launch_command(suite_file: Path, nprocs: int, options: list[str]) -> list[str]:
    """The torchrun command of one launch of ``nprocs`` processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs),
            "-m", "dslab.cli", "bench", str(suite_file), *options]


def launch_environment(run_id: str, nprocs: int, gpus: int) -> dict[str, str]:
    env = dict(os.environ, **NO_MULTICAST)
    env[RUN_ID_ENV] = run_id
    env[PART_ENV] = part_name(nprocs)
    env.pop("WORLD_SIZE", None)
    if gpus < 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # gloo processes on a few cores: one thread each
    return env


def run_launch(command: list[str], env: dict[str, str], progress: Progress) -> tuple[int, list[str]]:
    """Run one launch, its standard error passed through to ``progress`` line by line; returns its
    exit status and its last lines."""
    tail: deque[str] = deque(maxlen=KEEP_LINES)
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip("\n")
            tail.append(line)
            progress.line(line)
        return proc.wait(), list(tail)
    except BaseException:
        # Ctrl-C reached the launch's processes too; give them a moment to write their part
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def merge_part(report: RunReport, part: RunReport) -> None:
    """Add a launch's results, profiler records, notes and peaks to the run's report."""
    have = {(r.case, r.arm) for r in report.results}
    for result in part.results:
        if (result.case, result.arm) not in have:
            report.results.append(result)
    for section, records in (part.profilers or {}).items():
        if not isinstance(records, dict):
            continue
        if not isinstance(report.profilers.get(section), dict):
            report.profilers[section] = {}
        report.profilers[section].update(records)
    for note in part.notes:
        if note not in report.notes:
            report.notes.append(note)
    if not report.peaks and part.peaks:
        report.peaks = dict(part.peaks)
    flops = (part.config or {}).get("flops_per_step")
    if isinstance(flops, dict):
        report.config.setdefault("flops_per_step", {}).update(flops)


def record_failed_launch(report: RunReport, cases: list[str], arms: list[str], nprocs: int, status: int,
                         tail: list[str], trials: int | None = None) -> None:
    """The arms of ``cases`` that the failed launch did not finish: ``failed``, with the exit status
    and the last line the launch printed. An arm without a result did not start; one whose result
    is still ``ok`` but holds fewer than ``trials`` trials (none, when ``trials`` is not given) died
    in its trials, and keeps the trials it finished. When every arm had finished, the launch failed
    on its way out: the report's notes say so, and the arms' results stand."""
    last = next((line for line in reversed(tail) if line.strip()), "no output").strip()
    head = f"the launch of {nprocs} process(es) exited with status {status}"
    unfinished = False
    for case in cases:
        for arm in arms:
            result = report.result(case, arm)
            if result is None:
                report.results.append(Result(case=case, arm=arm, status="failed",
                                             error=f"{head} before this arm ran: {last}"))
                unfinished = True
            elif result.status == RESULT_OK and len(result.trials) < (trials or 1):
                done = len(result.trials)
                of = f" of {trials}" if trials else ""
                result.status = "failed"
                result.error = f"{head} after {done}{of} trial(s) of this arm: {last}"
                unfinished = True
    if not unfinished:
        report.notes.append(f"{part_name(nprocs)}: {head} after its arms had run their trials: {last}")


def run_launches(report: RunReport, suite_file: Path, nprocs: list[int], cases_by_n: dict[int, list[str]],
                 arms: list[str], options: list[str], run_path: Path, gpus: int, progress: Progress,
                 write, trials: int | None = None) -> None:
    """One launch per process count (module docstring); ``write()`` rewrites the run's report;
    ``trials``: each arm's trial count, by which a failed launch's unfinished arms are told."""
    parts = report.config.setdefault("launches", {})
    for n in nprocs:
        if n > max(gpus, 0) and gpus > 0:
            error = f"{n} process(es) need {n} GPUs; this machine has {gpus}"
            progress.line(f"[{report.suite}] skipping {n} process(es): {error}")
            for case in cases_by_n[n]:
                for arm in arms:
                    report.results.append(Result(case=case, arm=arm, status="skipped", error=error))
            write()
            continue
        command = launch_command(suite_file, n, options)
        progress.line(f"[{report.suite}] launching {n} process(es): {' '.join(command[1:])}")
        status, tail = -1, []
        try:
            status, tail = run_launch(command, launch_environment(report.run_id, n, gpus), progress)
        finally:
            part_path = run_path / part_file(part_name(n))
            parts[part_name(n)] = {"nprocs": n, "exit_status": status, "part_file": part_path.name}
            if part_path.is_file():
                try:
                    merge_part(report, read_report(part_path))
                except ValueError as err:
                    report.notes.append(f"{part_name(n)}: its part could not be read: {err}")
            if status != 0:
                record_failed_launch(report, cases_by_n[n], arms, n, status, tail, trials)
            write()
