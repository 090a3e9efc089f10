"""``deepspeed.sequence.layer``'s import name: :class:`DistributedAttention` (DeepSpeed-Ulysses
sequence-parallel attention) and its all-to-all, from :mod:`dslab.parallel.sequence`."""

from dslab.parallel.sequence import DistributedAttention, seq_all_to_all

__all__ = ["DistributedAttention", "seq_all_to_all"]
