"""Exact command lines (local, multi-host, dry-run), environment propagation, and the runner's
exit status."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from dslab import cli
from dslab.engine.launch import runner
from dslab.engine.launch.commands import build_commands, is_local_host
from dslab.engine.launch.environment import env_file_values, propagated_env, read_env_file

TORCHRUN = "python -m torch.distributed.run"


def remote(host):
    return host not in ("localhost", "127.0.0.1")


def test_local_single_host():
    (command,) = build_commands({"localhost": [0, 1]}, "train.py", ["--steps", "3"], python="python",
                                master_port=29600, local_env={"A": "1"})
    assert command.local and command.node_rank == 0
    assert command.shell() == (f"A=1 {TORCHRUN} --nproc_per_node 2 --nnodes 1 --node_rank 0 "
                               "--master_addr 127.0.0.1 --master_port 29600 train.py --steps 3")


def test_local_slots_become_cuda_visible_devices():
    (command,) = build_commands({"localhost": [1, 3]}, "t.py", python="python")
    assert dict(command.env) == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert command.shell().startswith(f"CUDA_VISIBLE_DEVICES=1,3 {TORCHRUN} --nproc_per_node 2 ")


def test_two_localhost_nodes_are_local_processes():
    commands = build_commands({"localhost": [0], "127.0.0.1": [0]}, "t.py", python="python", master_port=1234)
    assert [c.local for c in commands] == [True, True]
    assert [c.shell() for c in commands] == [
        f"{TORCHRUN} --nproc_per_node 1 --nnodes 2 --node_rank 0 --master_addr 127.0.0.1 --master_port 1234 t.py",
        f"{TORCHRUN} --nproc_per_node 1 --nnodes 2 --node_rank 1 --master_addr 127.0.0.1 --master_port 1234 t.py",
    ]


def test_multi_host_over_ssh_static_rendezvous():
    commands = build_commands({"w0": [0, 1, 2, 3], "w1": [0, 2]}, "train.py", ["--lr", "1e-3 x"],
                              python="/venv/bin/python", cwd="/shared/my run", local=lambda h: False,
                              remote_env={"NCCL_DEBUG": "INFO", "PYTHONPATH": "/src"})
    assert [c.argv[:2] for c in commands] == [("ssh", "w0"), ("ssh", "w1")]
    assert [c.shell() for c in commands] == [
        "ssh w0 'cd '\"'\"'/shared/my run'\"'\"' && export NCCL_DEBUG=INFO PYTHONPATH=/src && "
        "/venv/bin/python -m torch.distributed.run --nproc_per_node 4 --nnodes 2 --node_rank 0 --master_addr w0 "
        "--master_port 29500 train.py --lr '\"'\"'1e-3 x'\"'\"''",
        "ssh w1 'cd '\"'\"'/shared/my run'\"'\"' && export NCCL_DEBUG=INFO PYTHONPATH=/src "
        "CUDA_VISIBLE_DEVICES=0,2 && /venv/bin/python -m torch.distributed.run --nproc_per_node 2 --nnodes 2 "
        "--node_rank 1 --master_addr w0 --master_port 29500 train.py --lr '\"'\"'1e-3 x'\"'\"''",
    ]
    # what the remote shell runs
    assert commands[1].argv[2] == ("cd '/shared/my run' && export NCCL_DEBUG=INFO PYTHONPATH=/src "
                                   "CUDA_VISIBLE_DEVICES=0,2 && /venv/bin/python -m torch.distributed.run "
                                   "--nproc_per_node 2 --nnodes 2 --node_rank 1 --master_addr w0 "
                                   "--master_port 29500 train.py --lr '1e-3 x'")


def test_c10d_rendezvous_and_a_local_first_host():
    commands = build_commands({"localhost": [0], "w1": [0]}, "t.py", python="python", cwd="/c",
                              rdzv_backend="c10d", master_addr="10.0.0.1", local=lambda h: not remote(h))
    assert commands[0].local and not commands[1].local
    tail = "--nnodes 2 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29500 --rdzv_id dslab t.py"
    assert commands[0].shell() == f"{TORCHRUN} --nproc_per_node 1 {tail}"
    assert commands[1].argv[2] == f"cd /c && {TORCHRUN} --nproc_per_node 1 {tail}"


@pytest.mark.parametrize("kwargs, match", [
    ({"rdzv_backend": "etcd"}, "--rdzv_backend must be one of static, c10d"),
    ({"master_port": 70000}, "--master_port must be in 1-65535"),
])
def test_command_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_commands({"localhost": [0]}, "t.py", **kwargs)


def test_local_hosts():
    import socket

    assert is_local_host("localhost") and is_local_host("127.0.1.1") and is_local_host(socket.gethostname())
    assert not is_local_host("worker-7")


def test_env_files_and_propagated_variables(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".dslab_env").write_text("# defaults\nNCCL_IB_DISABLE=1\nFROM_HOME=h\n")
    (cwd / ".dslab_env").write_text("\nNCCL_IB_DISABLE=0\nURL=http://x/?a=b\n")
    assert env_file_values(cwd, home) == {"NCCL_IB_DISABLE": "0", "FROM_HOME": "h", "URL": "http://x/?a=b"}
    environ = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "7", "PYTHONPATH": "/p", "HOME": "/h",
               "CUDA_VISIBLE_DEVICES": "0", "DSLAB_KERNELS": "torch"}
    assert propagated_env(environ, cwd, home) == {
        "DSLAB_KERNELS": "torch", "NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/p",
        "FROM_HOME": "h", "URL": "http://x/?a=b"}
    (cwd / ".dslab_env").write_text("GOOD=1\nnot a pair\n")
    with pytest.raises(ValueError, match=r"\.dslab_env:2: expected KEY=VALUE, got 'not a pair'"):
        read_env_file(cwd / ".dslab_env")


def test_dry_run_prints_exact_commands_and_runs_nothing(tmp_path, monkeypatch, capsys):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    (tmp_path / ".dslab_env").write_text("WANDB_MODE=offline\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    for key in [k for k in os.environ if k.startswith(("NCCL_", "PYTHON", "DSLAB_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setattr(runner, "run_commands", lambda commands: pytest.fail("dry run ran something"))
    code = cli.main(["launch", "--hostfile", str(hostfile), "--include", "node-a:1@node-b", "--master_port",
                     "29511", "--dry-run", "train.py", "--epochs", "2"])
    assert code == 0
    run = (f"{sys.executable} -m torch.distributed.run --nproc_per_node {{n}} --nnodes 2 --node_rank {{r}} "
           f"--master_addr node-a --master_port 29511 train.py --epochs 2")
    assert capsys.readouterr().out.splitlines() == [
        f"ssh node-a 'cd {tmp_path} && export NCCL_DEBUG=WARN WANDB_MODE=offline CUDA_VISIBLE_DEVICES=1 && "
        + run.format(n=1, r=0) + "'",
        f"ssh node-b 'cd {tmp_path} && export NCCL_DEBUG=WARN WANDB_MODE=offline && " + run.format(n=2, r=1) + "'",
    ]


def test_launch_without_a_script_is_an_error(capsys):
    assert cli.main(["launch", "--dry-run"]) == 1
    assert "needs a script to run" in capsys.readouterr().err


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_wait_all_returns_the_worst_status_and_stops_the_rest():
    assert runner.wait_all([_python("pass"), _python("pass")]) == 0
    sleeper = _python("import time; time.sleep(60)")
    failing = [_python("import sys; sys.exit(3)"), _python("import sys, time; time.sleep(0.3); sys.exit(0)"), sleeper]
    assert runner.wait_all(failing, grace_s=5) == 3
    assert sleeper.poll() is not None  # stopped, not left behind
    assert runner.wait_all([_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")]) == 128 + 9


def test_run_commands_applies_each_commands_environment(tmp_path):
    from dslab.engine.launch.commands import LaunchCommand

    out = tmp_path / "env.txt"
    code = f"import os, pathlib; pathlib.Path({str(out)!r}).write_text(os.environ['X_LAUNCH'])"
    command = LaunchCommand("localhost", 0, True, (sys.executable, "-c", code), (("X_LAUNCH", "yes"),))
    assert runner.run_commands([command]) == 0
    assert out.read_text() == "yes"


def test_plan_for_a_cpu_machine(tmp_path):
    args = argparse.Namespace(hostfile=None, include=None, exclude=None, num_nodes=None, num_gpus=2,
                              master_addr=None, master_port=29500, rdzv_backend="static", dry_run=True,
                              script=["t.py"])
    (command,) = runner.plan_launch(args, cwd=str(tmp_path), environ={}, gpu_count=lambda: 0,
                                    default_hostfile=str(tmp_path / "none"), python="python")
    assert command.shell() == (f"{TORCHRUN} --nproc_per_node 2 --nnodes 1 --node_rank 0 --master_addr 127.0.0.1 "
                               "--master_port 29500 t.py")
