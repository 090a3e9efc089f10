"""``dslab bench`` writes the run's Perfetto trace beside its report, with no second command: the
profiled step and measured steps of a single-process run, every rank's collectives on its own
track for a run that launched two processes; a trace that cannot be written is a warning in the
progress lines and a note in the report, and the run still completes."""

import sys
from pathlib import Path

import pytest

from dslab.bench import trace_step
from dslab.bench.runner import run_suite
from dslab.report import list_runs, read_report
from dslab.report.timeline import TRACE_FILE, TRACE_NOT_WRITTEN, trace_problem

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profilers"))
from test_runner import tiny_suite  # noqa: E402

pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2")
from test_trace import parse, slices  # noqa: E402


def test_bench_writes_the_trace_after_the_report(tmp_path):
    progress = tmp_path / "progress.txt"
    with progress.open("w") as stream:
        report, path = run_suite(tiny_suite(tmp_path), cases=["a"], trials=1, out=tmp_path / "reports", stream=stream)
    trace = path.parent / TRACE_FILE
    assert trace.is_file() and f"trace: {trace}" in progress.read_text()
    assert read_report(path).status == "complete" and trace_problem(read_report(path)) is None
    tracks = parse(trace.read_bytes())
    rank0 = tracks["a rank 0"]
    phases = [s for s in slices(rank0["profiled step"]) if s[4] == 0]
    assert [p[0] for p in phases] == ["forward", "backward", "optimizer"]
    dslab = report.result("a", "dslab")
    assert len(slices(rank0["measured steps"])) == len(dslab.trials[0].step_times_ms) == 3


def test_a_trace_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path, monkeypatch):
    def broken(run, force=False):
        raise ValueError("writing a Perfetto trace needs the perfetto package")

    monkeypatch.setattr(trace_step, "write_trace", broken)
    progress = tmp_path / "progress.txt"
    with progress.open("w") as stream:
        report, path = run_suite(tiny_suite(tmp_path), cases=["b"], arms=["torch"], trials=1,
                                 out=tmp_path / "reports", stream=stream)
    back = read_report(path)
    assert back.status == "complete" and report.status == "complete"
    assert trace_problem(back) == "ValueError: writing a Perfetto trace needs the perfetto package"
    assert f"warning: {TRACE_NOT_WRITTEN}ValueError" in progress.read_text()
    assert not (path.parent / TRACE_FILE).exists()


@pytest.mark.world_size(2)
def test_a_launched_run_has_a_track_per_rank(zero_tiny_run):
    """``dslab bench suites/zero`` at the tiny scale (tests/bench/conftest.py's ``zero_tiny_run``,
    which test_zero_suite.py checks too): its launches of 1 and 2 processes write one trace, whose
    two-process ZeRO-2 arm has a track of collectives per rank."""
    proc = zero_tiny_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = list_runs(proc.out)
    assert proc.stderr.count("trace: ") == 1  # the launcher's process writes it, not each launch
    report = read_report(run)
    case = "tiny-n2 dslab-zero2"
    per_rank = report.profilers["comms"][case]["per_rank"]
    tracks = parse((run / TRACE_FILE).read_bytes())
    for rank in (0, 1):
        calls = [c for name, events in tracks[f"{case} rank {rank}"].items() if name.startswith("collectives")
                 for c in slices(events)]
        assert len(calls) == len(per_rank[str(rank)]) > 0
        assert {c[0] for c in calls} == {r["op"] for r in per_rank[str(rank)]}
