"""dslab's kernels: one module per op, each with its PyTorch reference, its Triton kernel, a
custom op registered with ``torch.library`` and the dispatch between them (see
:mod:`dslab.kernels.dispatch`).

The ops are imported eagerly: a module and the function it exports share a name
(``dslab.kernels.attention``), and Python would otherwise leave the submodule, not the function,
as the package attribute once anything imported the submodule.
"""

from __future__ import annotations

from dslab.kernels.dispatch import backend, kernel_backend, planned_backend, set_backend, use_triton
from dslab.kernels.attention import attention
from dslab.kernels.attention_packed import attention_packed
from dslab.kernels.bias_dropout_residual import bias_dropout_residual
from dslab.kernels.bias_gelu import bias_gelu
from dslab.kernels.cross_entropy import softmax_cross_entropy
from dslab.kernels.decode_attention import decode_attention
from dslab.kernels.decode_linear import decode_linear
from dslab.kernels.dropout_add_layer_norm import dropout_add_layer_norm
from dslab.kernels.embedding import embedding
from dslab.kernels.evoformer_attention import evoformer_attention
from dslab.kernels.fused_adam import FusedAdam
from dslab.kernels.gate_linear import gate_linear
from dslab.kernels.grouped_gemm import grouped_gemm
from dslab.kernels.grouped_mlp import grouped_mlp
from dslab.kernels.int8_linear import dequantize_int8, int8_linear, quantize_int8
from dslab.kernels.layer_norm import layer_norm
from dslab.kernels.linear_cross_entropy import linear_cross_entropy
from dslab.kernels.moe_gating import moe_gating
from dslab.kernels.moe_permute import moe_permute, moe_unpermute
from dslab.kernels.outer_product_linear import outer_product_linear
from dslab.kernels.sigmoid_gate import sigmoid_gate

OPS = ("layer_norm", "bias_gelu", "bias_dropout_residual", "attention", "attention_packed", "softmax_cross_entropy",
       "linear_cross_entropy", "FusedAdam", "gate_linear", "grouped_gemm", "grouped_mlp", "moe_gating",
       "moe_permute", "moe_unpermute", "evoformer_attention", "sigmoid_gate", "decode_attention", "decode_linear",
       "int8_linear", "outer_product_linear", "embedding", "dropout_add_layer_norm")

__all__ = [*OPS, "quantize_int8", "dequantize_int8", "OPS", "backend", "kernel_backend", "planned_backend", "set_backend", "use_triton"]
