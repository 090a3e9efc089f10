"""Process grids: which global rank holds which coordinate of a parallel layout, and the process
groups along each axis.

A :class:`ProcessTopology` numbers the points of a grid of ``dims`` along named ``axes`` in
row-major order: the first axis varies slowest, the last fastest. DeepSpeed's two layouts keep
their names and rank order:

- :class:`PipeDataParallelTopology` ``(num_pp, num_dp)``: axes ``pipe, data``; the ranks of one
  pipeline stage are neighbours (stage 0 is ranks ``0..dp-1``).
- :class:`PipeModelDataParallelTopology` ``(num_pp, num_mp, num_dp)``: axes ``pipe, data,
  model``; the tensor-parallel ranks of one (stage, replica) are neighbours (on one host, so
  that their frequent collectives stay on the fastest links).

:class:`PipelineParallelGrid` builds the process groups of a topology (every rank creates every
group, in one order, as ``torch.distributed.new_group`` requires) and answers the questions an
engine asks: its stage, its data-parallel group, its tensor-parallel group. It is also a
Megatron-style ``mpu`` (``get_model_parallel_*`` is the tensor axis, as in DeepSpeed's grid and
Megatron-LM's original mpu, ``get_data_parallel_*`` the data axis), so ``dslab.initialize(...,
mpu=grid)`` takes it.
"""

from __future__ import annotations

import itertools
from collections import namedtuple

from dslab import comm


class ProcessTopology:
    """A grid of ``dims`` along ``axes``; ranks in row-major order (the last axis fastest)."""

    def __init__(self, axes: list[str], dims: list[int]):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"axes {axes} and dims {dims} differ in length")
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes {axes} repeat a name")
        for axis, dim in zip(axes, dims):
            if dim < 1:
                raise ValueError(f"axis '{axis}' has size {dim}; every axis needs >= 1")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self.mapping = {}
        for rank, point in enumerate(itertools.product(*[range(d) for d in dims])):
            self.mapping[self.ProcessCoord(*point)] = rank

    def world_size(self) -> int:
        return len(self.mapping)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 for an axis the grid does not have, as DeepSpeed's)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord) -> int:
        """The global rank at ``coord`` (every axis given)."""
        if set(coord) != set(self.axes):
            raise ValueError(f"get_rank() needs every axis {self.axes}, got {sorted(coord)}")
        key = self.ProcessCoord(**coord)
        if key not in self.mapping:
            raise ValueError(f"coordinate {dict(coord)} is outside the grid {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_coord(self, rank: int):
        """The coordinate (a namedtuple with one field per axis) of global ``rank``."""
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} is outside a grid of {self.world_size()} ranks")

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``rank``'s coordinate as text, e.g. ``model_01`` (DeepSpeed's checkpoint names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in omit_axes)

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose ``axis`` coordinate is ``idx``, in rank order."""
        if axis not in self.axes:
            return []
        position = self.axes.index(axis)
        return sorted(r for c, r in self.mapping.items() if c[position] == idx)

    def filter_match(self, **filter_kwargs) -> list[int]:
        """The ranks whose coordinate matches every ``axis=value`` given, in rank order."""
        unknown = set(filter_kwargs) - set(self.axes)
        if unknown:
            raise ValueError(f"filter_match() got axes {sorted(unknown)} the grid {self.axes} lacks")
        return sorted(r for c, r in self.mapping.items()
                      if all(getattr(c, k) == v for k, v in filter_kwargs.items()))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along ``axis``: one list per point of the other
        axes (in rank order), each in ``axis`` order. Empty for an axis the grid lacks."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for point in itertools.product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, point))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def __str__(self) -> str:
        return f"ProcessTopology({dict(zip(self.axes, self.dims))})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages over data-parallel replicas: axes ``pipe, data``."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """3D: axes ``pipe, data, model`` (model = tensor parallel, the fastest-varying)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """The process groups of ``topology`` (default: every rank one pipeline stage of one
    replica, i.e. pure pipeline over the world) for this process.

    Builds one group per line of ranks along each axis (``pipe``, ``data``, and ``model`` when
    the grid has it), every rank creating all of them in the same order; keeps this rank's.
    Also the groups along which tied layers are summed are built by the pipeline module, not
    here (they depend on its layers).
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group=None):
        if process_group is not None:
            raise ValueError("PipelineParallelGrid(process_group=...) is not supported: the grid "
                             "spans the default (world) group")
        world = comm.get_world_size()
        self.global_rank = comm.get_rank()
        if topology is None:
            topology = PipeDataParallelTopology(num_pp=world, num_dp=1)
        if topology.world_size() != world:
            raise ValueError(f"{topology} holds {topology.world_size()} ranks but the world has {world}")
        self._topo = topology
        self.world_size = world
        coord = topology.get_coord(self.global_rank)
        self.stage_id = coord.pipe if "pipe" in topology.axes else 0
        self.data_parallel_id = coord.data if "data" in topology.axes else 0
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.groups: dict[str, object] = {}
        self.group_ranks: dict[str, list[int]] = {}
        for axis in ("pipe", "data", "model"):
            lists = topology.get_axis_comm_lists(axis) or [[r] for r in range(world)]
            for ranks in lists:
                # a group even of one rank: None would mean the whole world to a collective
                group = comm.new_group(ranks)
                if self.global_rank in ranks:
                    self.groups[axis] = group
                    self.group_ranks[axis] = list(ranks)
        self.pp_group = self.group_ranks["pipe"]  # DeepSpeed's name: the ranks of this pipeline

    def topology(self) -> ProcessTopology:
        return self._topo

    # -- pipeline -------------------------------------------------------------------------------

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.groups["pipe"]

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe_parallel_size - 1

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (``kwargs`` override
        them, e.g. ``data=0``)."""
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(kwargs)
        if "pipe" in coord:
            coord["pipe"] = stage_id
        return self._topo.get_rank(**coord)

    # -- data parallel --------------------------------------------------------------------------

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.groups["data"]

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.group_ranks["data"])

    # -- tensor (model) parallel: DeepSpeed's "slice" and Megatron's "model parallel" ----------

    def get_model_parallel_rank(self) -> int:
        coord = self._topo.get_coord(self.global_rank)
        return coord.model if "model" in self._topo.axes else 0

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self):
        return self.groups["model"]

    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
