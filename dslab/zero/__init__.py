"""``deepspeed.zero``'s import name: ``Init`` (modules built with their parameters already
partitioned across the data-parallel ranks) and ``GatheredParameters`` (whole parameters for
the length of a block), from :mod:`dslab.parallel.partitioned`."""

from dslab.parallel.partitioned import GatheredParameters, Init, is_partitioned

__all__ = ["GatheredParameters", "Init", "is_partitioned"]
