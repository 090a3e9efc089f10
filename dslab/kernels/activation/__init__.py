"""Activations fused with the bias add before them: bias + GELU (``bias_gelu``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.activation import bias_gelu  # noqa: F401
