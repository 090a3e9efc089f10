"""The command lines of a launch: one torchrun per host.

Every host runs ``python -m torch.distributed.run --nproc_per_node <its slots> --nnodes <hosts>``
with a rendezvous every host reaches: ``static`` gives each host ``--node_rank i`` (its place in
the hostfile) and the master's ``--master_addr``/``--master_port`` (node 0 hosts the store);
``c10d`` gives all of them ``--rdzv_backend c10d --rdzv_endpoint addr:port --rdzv_id ID`` and
lets torchrun number the nodes. Slots that are not ``0..n-1`` of a host become its
``CUDA_VISIBLE_DEVICES``.

A host that is this machine (``localhost``, ``127.x.x.x``, ``::1``, this hostname) is started as
a local process, which inherits this shell's environment plus the ``.dslab_env`` variables;
any other host over ``ssh HOST "cd CWD && export K=V ... && python -m torch.distributed.run ..."``
with the propagated variables (:mod:`.environment`). The same Python path and working directory
are assumed on every host (a shared filesystem or identical images).
"""

from __future__ import annotations

import dataclasses
import shlex
import socket
import sys
from collections.abc import Callable, Mapping, Sequence

DEFAULT_MASTER_PORT = 29500
RDZV_BACKENDS = ("static", "c10d")
LOOPBACK = "127.0.0.1"


def _this_machine_names() -> set[str]:
    names = {"localhost", "localhost.localdomain", "::1"}
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names.add(name)
            names.add(name.split(".", 1)[0])
    return names


def is_local_host(host: str) -> bool:
    """True for this machine: localhost, a 127.x address, ::1 or this machine's hostname."""
    return host.startswith("127.") or host in _this_machine_names()


@dataclasses.dataclass(frozen=True)
class LaunchCommand:
    """One host's command: ``argv`` run here with ``env`` set on top of this process's environment
    (for ssh the remote variables are inside ``argv``)."""

    host: str
    node_rank: int
    local: bool
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def shell(self) -> str:
        """The command as one shell line (what ``--dry-run`` prints)."""
        prefix = "".join(f"{key}={shlex.quote(value)} " for key, value in self.env)
        return prefix + shlex.join(self.argv)


def default_master_addr(hosts: Sequence[str], local: Callable[[str], bool] = is_local_host) -> str:
    """The first host; a loopback address when every host is this machine, and this machine's
    name when the first host is this machine but others are not (they cannot reach 'localhost')."""
    first = hosts[0]
    if not local(first):
        return first
    return LOOPBACK if all(local(h) for h in hosts) else socket.getfqdn()


def torchrun_argv(python: str, nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str,
                  master_port: int, script: str, script_args: Sequence[str], rdzv_backend: str = "static",
                  rdzv_id: str = "dslab") -> list[str]:
    """``python -m torch.distributed.run ... script args`` for one host."""
    argv = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc_per_node), "--nnodes", str(nnodes)]
    if rdzv_backend == "static":
        argv += ["--node_rank", str(node_rank), "--master_addr", master_addr, "--master_port", str(master_port)]
    else:
        argv += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{master_addr}:{master_port}", "--rdzv_id", rdzv_id]
    return argv + [script, *script_args]


def _visible_devices(slots: Sequence[int]) -> str | None:
    return None if list(slots) == list(range(len(slots))) else ",".join(map(str, slots))


def build_commands(resources: Mapping[str, Sequence[int]], script: str, script_args: Sequence[str] = (), *,
                   master_addr: str | None = None, master_port: int = DEFAULT_MASTER_PORT,
                   rdzv_backend: str = "static", rdzv_id: str = "dslab", python: str = sys.executable,
                   cwd: str = ".", remote_env: Mapping[str, str] | None = None,
                   local_env: Mapping[str, str] | None = None,
                   local: Callable[[str], bool] = is_local_host) -> list[LaunchCommand]:
    """One :class:`LaunchCommand` per host of ``resources`` (``{host: slots}``, in node order).

    ``remote_env`` is exported on ssh hosts, ``local_env`` set for local ones."""
    if rdzv_backend not in RDZV_BACKENDS:
        raise ValueError(f"--rdzv_backend must be one of {', '.join(RDZV_BACKENDS)}, got {rdzv_backend!r}")
    if not 1 <= master_port <= 65535:
        raise ValueError(f"--master_port must be in 1-65535, got {master_port}")
    if not resources:
        raise ValueError("no hosts to launch on")
    hosts = list(resources)
    addr = master_addr or default_master_addr(hosts, local)
    commands = []
    for node_rank, (host, slots) in enumerate(resources.items()):
        if not slots:
            raise ValueError(f"host {host!r} has no slots to launch on")
        run = torchrun_argv(python, len(slots), len(hosts), node_rank, addr, master_port, script, script_args,
                            rdzv_backend, rdzv_id)
        devices = _visible_devices(slots)
        if local(host):
            env = dict(local_env or {})
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices
            commands.append(LaunchCommand(host, node_rank, True, tuple(run), tuple(env.items())))
            continue
        exports = dict(remote_env or {})
        if devices is not None:
            exports["CUDA_VISIBLE_DEVICES"] = devices
        steps = [f"cd {shlex.quote(cwd)}"]
        if exports:
            steps.append("export " + " ".join(f"{key}={shlex.quote(value)}" for key, value in exports.items()))
        steps.append(shlex.join(run))
        commands.append(LaunchCommand(host, node_rank, False, ("ssh", host, " && ".join(steps))))
    return commands
