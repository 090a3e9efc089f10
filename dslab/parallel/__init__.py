"""Parallel layouts of a model's parameters across processes: parameters built partitioned
over a data-parallel group (:mod:`.partitioned`, DeepSpeed's ``zero.Init``)."""
