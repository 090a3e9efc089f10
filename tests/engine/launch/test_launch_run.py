"""A real two-"node" ``dslab launch`` on this machine: two torchrun groups (localhost and
127.0.0.1, one slot each) rendezvous on gloo and train; a failing script's status comes back."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


pytestmark = pytest.mark.serial  # waits on processes with deadlines (start-up, Ctrl-C)

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dslab_launch(tmp_path: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("DSLAB_")}
    env.update(HOME=str(home), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "dslab.cli", "launch", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.world_size(2)
def test_two_nodes_on_localhost_train_with_gloo(tmp_path):
    (tmp_path / "hostfile").write_text("# two 'nodes' on this machine\nlocalhost slots=1\n127.0.0.1 slots=1\n")
    (tmp_path / ".dslab_env").write_text("DSLAB_LAUNCH_TEST=from-env-file\n")
    out = tmp_path / "out"
    out.mkdir()
    done = dslab_launch(tmp_path, "--hostfile", "hostfile", "--master_port", str(free_port()),
                        str(HERE / "launch_worker.py"), str(out), "3")
    assert done.returncode == 0, done.stderr[-4000:]
    markers = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda m: m["rank"])
    assert [(m["rank"], m["node_rank"], m["local_rank"]) for m in markers] == [(0, 0, 0), (1, 1, 0)]
    for marker in markers:
        assert marker["world_size"] == 2 and marker["global_steps"] == 3 and marker["ranks_equal"]
        assert marker["env_file_value"] == "from-env-file"


@pytest.mark.world_size(2)
def test_a_failing_script_fails_the_launch(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    done = dslab_launch(tmp_path, "--num_gpus", "2", "--master_port", str(free_port()), str(script))
    # torchrun reports a failed worker (exit code 3) with its own status 1
    assert done.returncode == 1, done.stderr[-3000:]
    assert "exitcode  : 3" in done.stderr


@pytest.mark.world_size(2)
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_every_process(tmp_path, inherited):
    """``ignored``: the launcher starts with SIGINT ignored, as a background job of a
    non-interactive shell does (its children inherit that), and still stops on one."""
    script = tmp_path / "sleep.py"
    script.write_text("import os, pathlib, sys, time\n"
                      "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text(str(os.getpid()))\n"
                      "time.sleep(120)\n")
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "dslab.cli", "launch", "--num_gpus", "2", "--master_port",
                                 str(free_port()), str(script), str(tmp_path)], cwd=tmp_path, env=env,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
                                if inherited == "ignored" else None)
    # read as it comes, so that a full pipe never blocks the launcher or torchrun, and a failure shows it
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / rank).is_file() for rank in "01"):
            assert launcher.poll() is None and time.monotonic() < deadline, "workers did not start"
            time.sleep(0.1)
        pids = [int((tmp_path / rank).read_text()) for rank in "01"]
        launcher.send_signal(signal.SIGINT)
        try:
            status = launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the launcher did not stop within 30 s of a Ctrl-C; its stderr:\n" + "".join(lines)[-3000:])
        assert status == 130, "".join(lines)[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    reader.join(timeout=10)
    assert "interrupted" in "".join(lines)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
