"""Attention over heads: flash attention's Triton forward and backward (``attention_triton*``), the op
that reads q, k and v from a packed projection (``attention_packed``) and, on Hopper, cuDNN's fused
attention for causal self-attention (``attention_cudnn``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.attention import attention, attention_cudnn, attention_packed  # noqa: F401
