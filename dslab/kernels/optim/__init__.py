"""Optimizers: Adam / AdamW stepping every tensor of a group in one multi-tensor launch (``fused_adam``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.optim import fused_adam  # noqa: F401
