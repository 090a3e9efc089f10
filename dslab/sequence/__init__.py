"""``deepspeed.sequence``'s import name: sequence-parallel attention lives in
:mod:`dslab.parallel.sequence`; :mod:`dslab.sequence.layer` re-exports it under DeepSpeed's path
(``deepspeed.sequence.layer.DistributedAttention``)."""
