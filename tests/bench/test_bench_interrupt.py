"""``dslab bench`` stopped by SIGINT (a Ctrl-C, or ``timeout -s INT`` as the GPU scripts use):
the report is written as ``incomplete`` with the interruption noted, also when the process
started with SIGINT ignored (a background job of a non-interactive shell)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.serial  # waits for a run to start with a deadline


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_an_interrupted_run_keeps_its_report(tmp_path, inherited):
    out = tmp_path / "reports"
    cmd = [sys.executable, "-m", "dslab.cli", "bench", str(REPO / "suites" / "bert_large"), "--scale", "tiny",
           "--arms", "dslab", "--trials", "200", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
                            if inherited == "ignored" else None)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        # the run has started measuring: its report exists
        while not list(out.glob("bert_large/*/run.json")):
            assert proc.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "the run did not start: " + "".join(lines)[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("bench did not stop within 60 s of SIGINT:\n" + "".join(lines)[-3000:])
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    assert proc.returncode != 0
    (run_json,) = out.glob("bert_large/*/run.json")
    report = json.loads(run_json.read_text())
    assert report["status"] == "incomplete", report["status"]
    assert "interrupted (Ctrl-C) before the run finished" in report["notes"]
    assert report["finished"]
