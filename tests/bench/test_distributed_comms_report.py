"""Comm reports from real processes: ``dslab bench suites/gpt2`` at the tiny scale under torchrun
with 3 gloo processes, rank 1 slowed with ``DSLAB_INJECT_STEP_SLEEP_MS`` and
``DSLAB_INJECT_STEP_SLEEP_RANKS=1``. The one report holds every rank's collectives, the straggler
analysis naming rank 1 and every rank's memory; its Perfetto trace has a process track per rank.
(``tests/dashboards/fixtures/comms_reports`` keeps a report of this run for the dashboard.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslab import cli
from dslab.bench.arms import describe_injected_sleep, inject_sleep_ranks, injected_sleep_ms
from dslab.report import list_runs, read_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profilers"))
from test_trace import parse, slices  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORLD = 3
SLOW_RANK = 1
SLEEP_MS = 150  # well above the arrival noise of three processes on a 2-core CI machine (tens of ms)
STEPS, WARMUP = 3, 1
# the warm-up runs on through the suite's one-off profiled steps (flops profiler 3-5, memory tracer 6)
WARMED = max(WARMUP, 7)


@pytest.mark.serial  # a rank's sleep against the others' waits
@pytest.mark.world_size(WORLD)
def test_one_slowed_rank_is_named_in_the_report_and_the_trace_has_every_rank(tmp_path, capsys):
    out = tmp_path / "reports"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               DSLAB_INJECT_STEP_SLEEP_MS=str(SLEEP_MS), DSLAB_INJECT_STEP_SLEEP_RANKS=str(SLOW_RANK))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
           "-m", "dslab.cli", "bench", str(REPO / "suites" / "gpt2"), "--scale", "tiny", "--arms", "dslab",
           "--trials", "1", "--steps", str(STEPS), "--warmup", str(WARMUP), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # rank 0 alone prints: the progress line (stderr), and the summary's note (stdout)
    line = f"DSLAB_INJECT_STEP_SLEEP_MS={SLEEP_MS} on rank {SLOW_RANK} only"
    assert proc.stderr.count(line) == 1 and proc.stdout.count(line) == 1, (proc.stdout, proc.stderr)

    (run,) = list_runs(out)
    report = read_report(run)
    assert report.status == "complete" and report.config["world_size"] == WORLD
    assert report.config["inject_step_sleep_ms"] == SLEEP_MS
    assert any(f"on rank {SLOW_RANK} only" in note for note in report.notes)
    (case,) = report.profilers["comms"]
    comms = report.profilers["comms"][case]

    # every rank's collectives: one all_reduce of the gradients per step, matched by sequence number
    per_rank = comms["per_rank"]
    assert set(per_rank) == {str(r) for r in range(WORLD)}
    reduces = {rank: [r for r in records if r["op"] == "all_reduce"] for rank, records in per_rank.items()}
    for rank, records in reduces.items():
        assert [r["seq"] for r in records] == list(range(WARMED + STEPS)), rank
        assert all(r["group"] == "0,1,2" and r["bytes"] > 0 and r["latency_ms"] > 0 for r in records)
    assert len({r["bytes"] for records in reduces.values() for r in records}) == 1
    assert {row["op"] for row in comms["ops"]} >= {"all_reduce"}

    # the straggler analysis names the slowed rank: it came last to every collective after its
    # first sleep, and the others waited about the sleep for it
    assert comms["stragglers"] == [SLOW_RANK]
    analysis = comms["straggler"]
    assert analysis["unmatched"] == 0 and analysis["matched"] == sum(len(r) for r in per_rank.values()) // WORLD
    slow = analysis["ranks"][str(SLOW_RANK)]
    assert slow["times_last"] >= analysis["matched"] - 1 and slow["last_fraction"] > 0.5
    assert slow["mean_caused_wait_ms"] >= 0.5 * SLEEP_MS
    others = [analysis["ranks"][str(r)] for r in range(WORLD) if r != SLOW_RANK]
    assert sum(o["times_last"] for o in others) <= 1  # at most the first collective (before any sleep)
    assert all(o["total_wait_ms"] >= 0.5 * SLEEP_MS * (analysis["matched"] - 1) for o in others)

    # every rank's memory
    (trial,) = report.result(case, "dslab").trials
    assert all(trial.metrics[f"peak_rss_bytes_rank{r}"] > 0 for r in range(WORLD))
    states = report.profilers["memory"][case]["model_states_per_rank"]
    assert len(states) == WORLD and all(s["params"] > 0 for s in states)

    # the Perfetto trace: one process track per rank, each with its collectives
    assert cli.main(["trace", str(run)]) == 0
    trace_path = Path(capsys.readouterr().out.strip())
    tracks = parse(trace_path.read_bytes())
    assert {name for name in tracks if name.startswith(f"{case} rank ")} == {f"{case} rank {r}" for r in range(WORLD)}
    for rank in range(WORLD):
        calls = slices(tracks[f"{case} rank {rank}"]["collectives"])
        assert len(calls) == len(per_rank[str(rank)])
        waited = [c[3]["wait_ms"] for c in calls if c[0] == "all_reduce" and c[3]["seq"] > 0]
        assert (max(waited) < 0.5 * SLEEP_MS) if rank == SLOW_RANK else (min(waited) >= 0.5 * SLEEP_MS)


def test_the_sleep_can_be_limited_to_some_ranks(monkeypatch):
    monkeypatch.delenv("DSLAB_INJECT_STEP_SLEEP_RANKS", raising=False)
    monkeypatch.delenv("DSLAB_INJECT_STEP_SLEEP_MS", raising=False)
    assert describe_injected_sleep(4) is None and injected_sleep_ms(0, 1) == 0.0
    monkeypatch.setenv("DSLAB_INJECT_STEP_SLEEP_MS", "20")
    assert inject_sleep_ranks(4) is None  # unset: every rank sleeps
    assert [injected_sleep_ms(r, 4) for r in range(4)] == [20.0] * 4
    assert "every step (a deliberate slowdown" in describe_injected_sleep(4)
    monkeypatch.setenv("DSLAB_INJECT_STEP_SLEEP_RANKS", " 3, 1,1")
    assert inject_sleep_ranks(4) == (1, 3)
    assert [injected_sleep_ms(r, 4) for r in range(4)] == [0.0, 20.0, 0.0, 20.0]
    assert describe_injected_sleep(4).startswith("DSLAB_INJECT_STEP_SLEEP_MS=20 on ranks 1, 3 only")
    monkeypatch.setenv("DSLAB_INJECT_STEP_SLEEP_RANKS", "")
    assert inject_sleep_ranks(4) is None

    for raw, message in (("1;2", r"'1;2' is not a rank"), ("1,", r"'' is not a rank"), ("-1", "'-1' is not a rank"),
                         ("4", r"names rank 4, but the run has 4 process\(es\) \(ranks 0..3\)")):
        monkeypatch.setenv("DSLAB_INJECT_STEP_SLEEP_RANKS", raw)
        with pytest.raises(ValueError, match=f"DSLAB_INJECT_STEP_SLEEP_RANKS={raw!r}.*{message}"):
            injected_sleep_ms(0, 4)
    monkeypatch.setenv("DSLAB_INJECT_STEP_SLEEP_RANKS", "1")
    with pytest.raises(ValueError, match="names rank 1, but the run has 1 process"):
        describe_injected_sleep(1)  # a single-process run is rank 0 alone
    monkeypatch.delenv("DSLAB_INJECT_STEP_SLEEP_MS")
    with pytest.raises(ValueError, match="_RANKS is set but DSLAB_INJECT_STEP_SLEEP_MS is unset or 0"):
        describe_injected_sleep(2)
