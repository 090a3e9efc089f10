"""Losses over a large vocabulary: softmax cross-entropy (``cross_entropy``) and the LM head fused with
its cross-entropy (``linear_cross_entropy``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.loss import cross_entropy, linear_cross_entropy  # noqa: F401
