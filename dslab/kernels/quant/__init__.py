"""Quantised weights: symmetric int8 quantisation and the linear that dequantises inside its GEMM
(``int8_linear``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.quant import int8_linear  # noqa: F401
