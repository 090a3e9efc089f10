"""The end of a transformer sublayer: bias add, dropout and residual add (``bias_dropout_residual``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.dropout import bias_dropout_residual  # noqa: F401
