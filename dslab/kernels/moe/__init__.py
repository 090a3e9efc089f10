"""Mixture-of-experts: the gate's scores (``gate_linear``), top-k gating (``moe_gating``), tokens into
expert order and back (``moe_permute``), and the experts' grouped GEMM and MLP (``grouped_gemm``,
``grouped_mlp``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.moe import gate_linear, grouped_gemm, grouped_mlp, moe_gating, moe_permute  # noqa: F401
