"""Activations fused with their neighbours: bias + GELU (``bias_gelu``), and SwiGLU on the fused
gate and up projections of a Llama MLP (``swiglu``: silu(g) * u).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.activation import bias_gelu  # noqa: F401
from dslab.kernels.activation import swiglu  # noqa: F401
