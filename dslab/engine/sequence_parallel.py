"""DeepSpeed-Ulysses sequence parallelism in the engine: the config's top-level
``sequence_parallel_size`` (DeepSpeed's key), the groups it builds and how gradients are reduced
over them::

    {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2, "zero_optimization": {"stage": 3}}

The world is ``dp x sp`` ranks (:func:`dslab.parallel.sequence.initialize_sequence_parallel`: the
``sp`` ranks of one sequence-parallel group are neighbours, a data-parallel group is strided by
``sp``). The ``sp`` ranks of a group train one replica on the chunks of the same batch:

- batch sizes count data-parallel ranks only: ``train_batch_size = micro x accumulation x dp``,
  and the engine's ``dp_rank``/``dp_world_size`` (the data loader's split) are the data axis's,
  so the ranks of one group read the same samples and the model splits each sequence;
- gradients: the model's loss is already the whole sequence's mean on every rank of the group
  (:func:`dslab.parallel.sequence.sequence_mean_loss`), and a rank's gradient is its chunk's
  share of it, so a replica's gradient is the *sum* over its group, and the step's gradient the
  *mean* over the ``dp`` replicas: the sum over all ``dp x sp`` ranks divided by ``dp``, which is
  DeepSpeed's rule (its all-reduce divides by the sequence-data-parallel size over ``sp``). The
  engine's reducers (stage 0's all-reduce and ZeRO's reduce-scatters) average over the group they
  run on, here every ``dp x sp`` rank, so the engine multiplies the loss by ``sp`` before
  ``backward`` (:attr:`SequenceParallelLayout.loss_multiplier`): the average of ``sp`` times each
  share is that sum over ``dp``;
- ZeRO (stages 1-3) shards over the sequence-data-parallel group, every rank holding the same
  replica (the world here), as DeepSpeed does with its ``seq_data_parallel_group``: the gradient
  reduction must span those ranks anyway, so the reduce-scatter over all of them replaces an
  all-reduce over the sequence group plus a reduce-scatter over the data group, and each rank
  keeps ``1/(dp sp)`` of the states instead of ``1/dp`` (the ``sp`` ranks would otherwise hold
  identical copies of the optimizer states). Stage 0's all-reduce and the start from rank 0's
  weights run over that group too.

The model is built before the engine, so it takes its group from
:func:`~dslab.parallel.sequence.initialize_sequence_parallel` (made once per size, the same groups
the engine then finds; ``engine.sequence_parallel_group`` afterwards). A model whose config states
another ``sequence_parallel_size``, or whose ``sp_group`` holds other ranks, is refused by name.
Tensor and pipeline parallelism (``mpu=``) are not combined with it, as DeepSpeed-Ulysses in
Megatron-DeepSpeed does not combine them.
"""

from __future__ import annotations

import torch.nn as nn

from dslab import comm
from dslab.engine.model_parallel import ModelParallelLayout
from dslab.parallel.sequence import initialize_sequence_parallel

KEY = "sequence_parallel_size"


class SequenceParallelLayout:
    """The engine's data and sequence axes for ``config.sequence_parallel_size``.

    ``dp_group``/``dp_world_size``/``dp_rank``: the data axis (batch sizes, the data loader);
    ``seq_dp_group``/``seq_dp_world_size``: the ranks holding the same replica, over which
    gradients are reduced and ZeRO shards (None: the world); ``group``/``size``/``rank``: the
    sequence-parallel group. With size 1 they are ``parallel``'s data-parallel ones and no group."""

    def __init__(self, config, parallel: ModelParallelLayout, module: nn.Module):
        self.size = config.sequence_parallel_size
        if self.size == 1:
            self.group, self.rank = None, 0
            self.dp_group, self.dp_world_size, self.dp_rank = (parallel.dp_group, parallel.dp_world_size,
                                                               parallel.dp_rank)
            self.seq_dp_group, self.seq_dp_world_size = parallel.dp_group, parallel.dp_world_size
            _check_model(module, self.size, None)
            return
        if parallel.mpu is not None:
            raise ValueError(f"config key '{KEY}' is {self.size} with an mpu (tensor or pipeline parallelism, "
                             f"{type(parallel.mpu).__name__}): Ulysses sequence parallelism runs with data "
                             "parallelism alone; drop mpu or set the key to 1")
        try:
            groups = initialize_sequence_parallel(self.size)
        except ValueError as err:
            raise ValueError(f"config key '{KEY}': {err}") from None
        self.group, self.rank = groups.group, groups.rank
        self.dp_group, self.dp_world_size, self.dp_rank = (groups.data_parallel_group, groups.data_parallel_size,
                                                           groups.data_parallel_rank)
        self.seq_dp_group = groups.seq_data_parallel_group
        self.seq_dp_world_size = comm.get_world_size(self.seq_dp_group)
        _check_model(module, self.size, groups.ranks())

    @property
    def loss_multiplier(self) -> int:
        """What the engine multiplies the loss by before ``backward``: ``sp``, so that the
        reducers' average over ``dp x sp`` ranks is the sum over each group averaged over ``dp``
        (module docstring)."""
        return self.size


def _check_model(module: nn.Module, size: int, ranks: list[int] | None) -> None:
    """ValueError naming the key when ``module`` states another sequence-parallel size
    (``module.config.sequence_parallel_size``, dslab's GPT-2 and Llama) or its ``sp_group`` holds
    other ranks than the engine's group (``ranks``). Models that state neither are taken as
    they are."""
    stated = getattr(getattr(module, "config", None), KEY, None)
    if isinstance(stated, int) and stated != size:
        raise ValueError(f"config key '{KEY}' is {size} but the model ({type(module).__name__}) is built with "
                         f"config.{KEY}={stated}; build it with the same size")
    if ranks is None or not hasattr(module, "sp_group"):
        return
    group = module.sp_group
    held = [comm.get_global_rank(group, r) for r in range(comm.get_world_size(group))]
    if held != ranks:
        raise ValueError(f"config key '{KEY}' is {size}: this rank's sequence-parallel group is ranks {ranks}, but "
                         f"the model's sp_group holds ranks {held}; build the model with "
                         f"dslab.sequence.initialize_sequence_parallel({size}).group")
