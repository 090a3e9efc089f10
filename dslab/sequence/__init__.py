"""``deepspeed.sequence``'s import name: sequence-parallel attention lives in
:mod:`dslab.parallel.sequence`; :mod:`dslab.sequence.layer` re-exports it under DeepSpeed's path
(``deepspeed.sequence.layer.DistributedAttention``), and this package re-exports the rest of a
sequence-parallel run: the groups (:func:`initialize_sequence_parallel`, which the engine's
``sequence_parallel_size`` uses too), the batch's split for a rank (:func:`split_sequence`) and
the whole sequence's mean loss (:func:`sequence_mean_loss`)."""

from dslab.parallel.sequence import (
    SequenceParallelGroups, initialize_sequence_parallel, sequence_mean_loss, split_sequence,
)

__all__ = ["SequenceParallelGroups", "initialize_sequence_parallel", "sequence_mean_loss", "split_sequence"]
