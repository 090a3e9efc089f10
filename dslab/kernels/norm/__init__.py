"""Layer norms: over the last dimension, with the pre-LN residual add (``layer_norm``); over the channels
of a channels-first tensor (``layer_norm_channels``); and fused with the dropout and residual add of the
sublayer before it (``dropout_add_layer_norm``). RMS norm over the last dimension, with the pre-norm
residual add (``rms_norm``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.norm import dropout_add_layer_norm, layer_norm, layer_norm_channels, rms_norm  # noqa: F401
