"""Process-group set-up from torchrun's environment."""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import time
import weakref

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_global_rank(group, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (itself for the default group, or when
    not distributed)."""
    if group is None or not is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def new_group(ranks: list[int]):
    """A process group over ``ranks`` (every rank of the world must call this, in the same order,
    for every group created); None when not distributed."""
    return dist.new_group(ranks=list(ranks)) if is_initialized() else None


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def default_backend() -> str:
    """nccl where CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> bool:
    """Join the process group that torchrun (or ``dslab launch``) describes in the environment.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Picks nccl on CUDA and gloo on
    CPU unless ``dist_backend`` says otherwise, and binds this process to GPU ``LOCAL_RANK``.

    Returns True when a process group is (now) initialised, False when the environment describes no
    distributed job (a plain ``python train.py``): dslab then runs as a single process.
    """
    if is_initialized():
        _register_exit_handler()
        return True
    if rank >= 0 and world_size > 0:
        env_rank, env_world = rank, world_size
    else:
        missing = [k for k in _ENV_KEYS if k not in os.environ]
        if missing and init_method is None:
            if len(missing) < len(_ENV_KEYS):
                raise ValueError(
                    f"incomplete distributed environment: {', '.join(missing)} not set "
                    f"(torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
                )
            log.info("no distributed environment; running as a single process")
            return False
        env_rank = int(os.environ.get("RANK", rank))
        env_world = int(os.environ.get("WORLD_SIZE", world_size))
    backend = dist_backend or default_backend()
    device_id = None
    if backend == "nccl" and torch.cuda.is_available():
        device_id = torch.device("cuda", get_local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        backend=backend,
        init_method=init_method or "env://",
        rank=env_rank,
        world_size=env_world,
        timeout=timeout,
        # binds the group to this GPU: collectives (barrier included) need not guess the device
        device_id=device_id,
    )
    log.info("rank %d of %d joined the %s process group", env_rank, env_world, backend)
    _register_exit_handler()
    return True


_exit_handler_registered = False


def _register_exit_handler() -> None:
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_leave_at_exit)
        _exit_handler_registered = True


# How long the exit handler gives the process group's worker threads to finish releasing the
# work they completed. The release of a tensor that Python has already dropped needs the GIL,
# and the main thread holds the GIL until it blocks or its switch interval (5 ms) passes; a
# worker still waiting for it when the interpreter starts finalizing exits its thread from C++
# and aborts the process ("terminate called without an active exception", seen with gloo on
# torch 2.13 in about one run in six of a 3-rank job whose last collective ended just before exit).
_EXIT_GRACE_S = 0.1


# CUDA graphs that captured collectives (registered by :func:`dslab.comm.recording_calls`). NCCL
# cannot destroy a communicator while a live graph holds its kernels: ``ncclCommDestroy`` waits
# forever (pytorch/pytorch#115388), and a process whose engines are still referenced at exit would
# hang in the exit handler. The handler resets these graphs first.
_graphs_with_collectives: "weakref.WeakSet" = weakref.WeakSet()


def hold_graph_with_collectives(graph) -> None:
    """``graph`` (a ``torch.cuda.CUDAGraph``) captured collectives: reset it before the process
    group is destroyed at exit, if it is still alive then."""
    _graphs_with_collectives.add(graph)


def release_graphs_with_collectives() -> int:
    """Reset every live graph that captured collectives (after the device finishes its work);
    returns how many. A reset graph cannot be replayed: its owner captures it again."""
    graphs = list(_graphs_with_collectives)
    if graphs and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    for graph in graphs:
        graph.reset()
        _graphs_with_collectives.discard(graph)
    return len(graphs)


def _leave_at_exit() -> None:
    """Let the process group's threads finish, release the CUDA graphs that captured collectives,
    then destroy the group (if the program did not)."""
    if is_initialized():
        time.sleep(_EXIT_GRACE_S)
        release_graphs_with_collectives()
        dist.destroy_process_group()
