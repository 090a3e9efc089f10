"""Expert-parallel process groups (DeepSpeed's layout).

With a world of ``W`` ranks and ``ep_size`` = p (p divides W):

- the *expert-parallel* groups are contiguous blocks of p ranks, ``[0 .. p-1]``, ``[p .. 2p-1]``,
  ...: the experts of a layer are sharded over one block, and tokens are exchanged inside it with
  all_to_all;
- the *expert-data-parallel* groups are the strided sets ``{r : r mod p == i}``: the ranks that
  hold the same expert shard, over which that shard's gradients are reduced.

Each ``ep_size`` gets one name, ``"ep_size_{p}"`` (the ``group_name`` DeepSpeed stamps on expert
parameters). Groups are created on first use by every rank in the same order (torch.distributed
requires each rank to create every group). Outside a distributed run only ``ep_size`` 1 exists and
the groups are None.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslab import comm


@dataclass(frozen=True)
class ExpertGroups:
    """The groups of one ``ep_size`` as seen from this rank."""

    name: str
    ep_size: int
    ep_rank: int  # this rank's index inside its expert-parallel group
    expert_parallel: object  # ProcessGroup, or None outside a distributed run
    expert_data_parallel: object  # ProcessGroup, or None
    expert_data_parallel_size: int


_groups: dict[str, ExpertGroups] = {}


def group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"


def create_expert_groups(ep_size: int) -> ExpertGroups:
    """The expert-parallel and expert-data-parallel groups for ``ep_size`` (created once)."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
    name = group_name(ep_size)
    if name in _groups:
        return _groups[name]
    world, rank = comm.get_world_size(), comm.get_rank()
    if world % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the world size {world} (the number of ranks)")
    ep_group = edp_group = None
    if comm.is_initialized():
        for start in range(0, world, ep_size):  # every rank creates every group, in one order
            made = comm.new_group(list(range(start, start + ep_size)))
            if start <= rank < start + ep_size:
                ep_group = made
        for i in range(ep_size):
            made = comm.new_group(list(range(i, world, ep_size)))
            if rank % ep_size == i:
                edp_group = made
    groups = ExpertGroups(name=name, ep_size=ep_size, ep_rank=rank % ep_size, expert_parallel=ep_group,
                          expert_data_parallel=edp_group, expert_data_parallel_size=world // ep_size)
    _groups[name] = groups
    return groups


def get_expert_groups(name: str) -> ExpertGroups:
    """The groups created under ``name`` (``"ep_size_{p}"``)."""
    if name not in _groups:
        known = ", ".join(sorted(_groups)) or "none yet"
        raise KeyError(f"no expert groups named {name!r} (created: {known}); an MoE layer with that "
                       "ep_size creates them")
    return _groups[name]


def reset_expert_groups() -> None:
    """Forget every group (after the process group is destroyed, e.g. between tests)."""
    _groups.clear()
