"""``dslab gate --ab`` with real worker processes on the CPU: the tiny scale of the gpt2 suite's
124m case (one layer-stack step takes some tens of milliseconds), this checkout on both sides."""

import io
import json
from pathlib import Path

import pytest

from dslab import cli
from dslab.gate import ab
from dslab.gate.command import checkout_root

SUITE = str(checkout_root() / "suites" / "gpt2")
CASE = "124m"


@pytest.fixture
def one_thread(monkeypatch):
    """Single-threaded workers (inherited by both through the environment): two OpenMP threads a
    worker on a CPU shared with other jobs wait at barriers for a descheduled thread and can slow
    a step fifty-fold at random, which says nothing about the gate."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def gate(capsys, *argv):
    code = cli.main(["gate", *argv])
    return code, capsys.readouterr()


@pytest.mark.serial  # judges timings
def test_a_a_run_is_not_a_regression(tmp_path, capsys, one_thread):
    out = tmp_path / "aa.json"
    # alpha 0.001 bounds this test's own chance of a false alarm at 1 in 1000; a 50% threshold lets a
    # noisy shared CPU rule out a threshold-sized regression early.
    code, printed = gate(capsys, "--ab", "--suite", SUITE, "--case", CASE, "--threshold", "50%", "--alpha", "0.001",
                         "--out", str(out), "--format", "json")
    result = json.loads(printed.out)
    assert code == 0 and result["exit_code"] == 0 and result["outcome"] == "pass", printed.out + printed.err
    assert result == json.loads(out.read_text())
    verdict = result["verdict"]
    pairs = result["pairs"]
    assert verdict["verdict"] == "pass" and len(pairs) == verdict["n"] <= 15
    assert [p["first"] for p in pairs] == ["baseline", "candidate"] * (len(pairs) // 2) + ["baseline"] * (len(pairs) % 2)
    for pair in pairs:
        for side in ("baseline", "candidate"):
            assert len(pair[side]["step_times_ms"]) == 3 and pair[side]["metrics"]["samples_per_s"] > 0
        assert pair["ratio"] == pytest.approx(pair["candidate"]["metrics"]["samples_per_s"] /
                                              pair["baseline"]["metrics"]["samples_per_s"])
    assert result["metric"] == "samples_per_s" and result["direction"] == "higher" and result["scale"] == "tiny"
    assert result["settings"]["threshold"] == 0.5 and result["settings"]["alpha"] == 0.001
    for side in ("baseline", "candidate"):
        worker = result["workers"][side]
        assert Path(worker["dslab_path"]) == checkout_root() / "dslab" and worker["inject_step_sleep_ms"] == 0
        assert Path(result["logs"][side]).is_file()
    assert any("A/A" in note for note in result["notes"])
    # the candidate replayed the baseline's kernel choices (on a CPU: the backend flags, no Triton configs)
    pins = json.loads(Path(result["kernel_choices_file"]).read_text())
    assert pins == result["workers"]["baseline"]["kernel_choices"] and pins["backends"]
    assert result["workers"]["baseline"]["pinned"] is None
    assert result["workers"]["candidate"]["pinned"]["source"] == result["kernel_choices_file"]


@pytest.mark.serial  # judges timings
def test_injected_slowdown_is_a_regression_found_early(tmp_path, capsys, one_thread):
    out = tmp_path / "slow.json"
    # 150 ms of sleep in every step of the candidate's dslab arm, against steps of tens of ms.
    code, printed = gate(capsys, "--ab", "--suite", SUITE, "--case", CASE, "--out", str(out),
                         "--candidate-env", "DSLAB_INJECT_STEP_SLEEP_MS=150")
    assert code == 1, printed.out + printed.err
    assert "REGRESSION (exit 1)" in printed.out and "candidate env: DSLAB_INJECT_STEP_SLEEP_MS=150" in printed.out
    result = json.loads(out.read_text())
    assert result["workers"]["candidate"]["inject_step_sleep_ms"] == 150
    assert result["workers"]["baseline"]["inject_step_sleep_ms"] == 0
    assert result["verdict"]["verdict"] == "regression" and result["verdict"]["ratio"] < 0.9
    # the sequential test stops at (or soon after) its first look that can decide, long before 15 pairs
    assert len(result["pairs"]) == result["verdict"]["n"] <= result["settings"]["looks"][0] + 2 < 15
    assert all(min(p["candidate"]["step_times_ms"]) >= 150 for p in result["pairs"])
    assert "pair 1/15 (baseline first)" in printed.err and "pair 2/15 (candidate first)" in printed.err


def test_tree_without_the_worker_is_refused_by_name(tmp_path, capsys):
    old = tmp_path / "old-checkout"
    (old / "dslab" / "bench").mkdir(parents=True)
    (old / "dslab" / "__init__.py").write_text("")
    code, printed = gate(capsys, "--ab", "--suite", SUITE, "--case", CASE, "--baseline-tree", str(old),
                         "--out", str(tmp_path / "r.json"))
    assert code == 2
    assert "dslab/bench/ab_worker.py" in printed.out and str(old) in printed.out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["outcome"] == "cannot-judge" and result["pairs"] == [] and result["workers"] == {}

    (old / "dslab" / "__init__.py").unlink()
    code, printed = gate(capsys, "--ab", "--suite", SUITE, "--case", CASE, "--baseline-tree", str(old),
                         "--out", str(tmp_path / "r.json"))
    assert code == 2 and "has no dslab package (dslab/__init__.py)" in printed.out


FAKE_WORKER = """
import json, os, random, sys
from pathlib import Path

mode = os.environ.get("FAKE_MODE", "ok")
if mode == "error":
    print(json.dumps({"error": "boom: told to fail"}), flush=True)
    sys.exit(2)
if mode == "crash":
    print("Traceback (most recent call last): a fake crash", file=sys.stderr)
    sys.exit(1)
home = Path(__file__).resolve().parents[1] if mode != "elsewhere" else Path("/elsewhere/dslab")
print(json.dumps({"ready": True, "dslab_path": str(home), "suite": "fake", "device": "cpu", "scale": "tiny",
                  "steps": 3, "warmup_steps": 1, "settle_steps": 1, "warmup_s": 0.0,
                  "inject_step_sleep_ms": 0, "injection_applies": True}), flush=True)
rng = random.Random(os.environ.get("FAKE_SEED", "0"))
scale = float(os.environ.get("FAKE_SCALE", "1"))
for k, line in enumerate(sys.stdin):
    if line.strip() == "quit":
        break
    value = 1000.0 * scale * (1.0 + rng.gauss(0.0, 0.01))
    metrics = {"step_time_ms": 1e5 / value} if mode == "nometric" else {"samples_per_s": value}
    print(json.dumps({"trial": k, "metrics": metrics, "step_times_ms": [1.0, 1.0, 1.0]}), flush=True)
"""


def fake_tree(root):
    """A source tree whose A/B worker answers at once with synthetic trials (no torch): for the
    driver's own logic, deterministically."""
    (root / "dslab" / "bench").mkdir(parents=True)
    (root / "dslab" / "__init__.py").write_text("")
    (root / "dslab" / "bench" / "__init__.py").write_text("")
    (root / "dslab" / "bench" / "ab_worker.py").write_text(FAKE_WORKER)
    return root


def fake_run(tmp_path, **candidate_env):
    tree = fake_tree(tmp_path / "tree")
    request = ab.ABRequest(suite=Path(SUITE), case=CASE, baseline_tree=tree, candidate_tree=tree,
                           candidate_env={"FAKE_SEED": "1", **candidate_env})
    return ab.run_ab(request, tmp_path / "r.json", progress=io.StringIO())


def test_driver_alternates_and_stops_at_the_verdict(tmp_path):
    result = fake_run(tmp_path, FAKE_SCALE="0.9")
    assert result["exit_code"] == 1 and result["outcome"] == "regression"
    assert len(result["pairs"]) == result["verdict"]["n"] == 9  # the first look that can decide
    assert [p["first"] for p in result["pairs"]][:4] == ["baseline", "candidate", "baseline", "candidate"]
    assert all(0.85 < p["ratio"] < 0.95 for p in result["pairs"])
    assert result == json.loads((tmp_path / "r.json").read_text()) and result["status"] == "finished"
    assert "regression" in ab.render_ab(result) and "| REGRESSION (exit 1) | 9 |" in ab.render_ab(result, "markdown")

    unchanged = fake_run(tmp_path / "again")
    assert unchanged["exit_code"] == 0 and unchanged["verdict"]["verdict"] == "pass"
    assert len(unchanged["pairs"]) < 15


@pytest.mark.parametrize("mode, message", [
    ("error", "the baseline worker (TREE) failed: boom: told to fail"),
    ("crash", "exited with status 1 before answering; the end of its log"),
    ("elsewhere", "imported dslab from /elsewhere/dslab, not from its tree"),
    ("nometric", "the baseline's trial 1 has no positive samples_per_s"),
])
def test_worker_failures_cannot_be_judged(tmp_path, monkeypatch, mode, message):
    monkeypatch.setenv("FAKE_MODE", mode)
    result = fake_run(tmp_path)
    assert result["exit_code"] == 2 and result["outcome"] == "cannot-judge"
    assert message.replace("TREE", str(tmp_path / "tree")) in result["problems"][0]
    if mode == "crash":
        assert "a fake crash" in result["problems"][0]


def test_options_of_the_other_mode_are_refused(capsys):
    code, printed = gate(capsys, "--suite", "gpt2", "--case", CASE, "--max-trials", "9")
    assert code == 2 and "--case, --max-trials: only with --ab" in printed.err
    code, printed = gate(capsys, "--ab", "--suite", SUITE, "--case", CASE, "--baseline", "some-run")
    assert code == 2 and "--baseline: not with --ab" in printed.err
    code, printed = gate(capsys, "--ab", "--suite", SUITE)
    assert code == 2 and "--ab needs --suite" in printed.err
    code, printed = gate(capsys, "--ab", "--suite", SUITE, "--case", CASE, "--candidate-env", "NOVALUE")
    assert code == 2 and "--candidate-env 'NOVALUE': write NAME=VALUE" in printed.err
    code, printed = gate(capsys, "--ab", "--suite", SUITE, "--case", CASE, "--max-trials", "6")
    assert code == 2 and "--max-trials 6 is too few" in printed.err


def test_env_assignments():
    assert ab.parse_env_assignments(["A=1", "B_C=x=y", "D="]) == {"A": "1", "B_C": "x=y", "D": ""}
    for bad in ("=1", "A", "A-B=1"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            ab.parse_env_assignments([bad])
