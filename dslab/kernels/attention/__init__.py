"""Attention over heads: flash attention's Triton forward and backward (``attention_triton*``), the op
that reads q, k and v from a packed projection (``attention_packed``), on Hopper cuDNN's fused
attention for causal self-attention (``attention_cudnn``), and the rotary position embedding of
Llama-family models that rotates q and k before attention (``rope``: frequencies, tables and one
Triton launch for q and k).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.attention import attention, attention_cudnn, attention_packed, rope  # noqa: F401
