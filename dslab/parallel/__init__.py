"""Parallel layouts of a model across processes: process-group grids (:mod:`.topology`),
parameters built partitioned over a data-parallel group (:mod:`.partitioned`, DeepSpeed's
``zero.Init``), Megatron-style tensor-parallel layers and regions (:mod:`.tensor_parallel`,
:mod:`.tensor_parallel_regions`, :mod:`.vocab_parallel`) and pipeline parallelism
(:mod:`.pipe`: the layer-list module, the 1F1B schedule, the transfers between stages)."""
