"""AlphaFold's Evoformer: its attention with pair and mask biases (``evoformer_attention``), the outer
product mean's projection (``outer_product_linear``) and sigmoid gating (``sigmoid_gate``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.evoformer import evoformer_attention, outer_product_linear, sigmoid_gate  # noqa: F401
