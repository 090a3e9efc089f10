"""Inference decode steps: attention of one new token over a KV cache (``decode_attention``) and a
decode step's linear layer with the ops around it folded in (``decode_linear``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.decode import decode_attention, decode_linear  # noqa: F401
