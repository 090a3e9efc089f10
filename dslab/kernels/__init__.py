"""dslab's kernels, one subpackage per op family and one module per op.

Each op module holds the op's PyTorch reference, its custom op registered with ``torch.library``
(so ``torch.compile`` traces through it), its autograd and the dispatch between the reference and
the Triton kernel, which lives beside it in ``<op>_triton.py``; :mod:`dslab.kernels.dispatch`
chooses at run time. Import an op from its module::

    from dslab.kernels.attention.attention_packed import attention_packed
    from dslab.kernels.norm.layer_norm import layer_norm

The families (:data:`FAMILIES`):

==============  ===========================================================================
``attention``   flash attention (Triton forward and backward, grouped-query included),
                packed-projection attention, cuDNN's fused attention on Hopper, rotary positions
``norm``        layer norm and RMSNorm (each with the residual add), channels-first layer norm,
                dropout + add + layer norm
``activation``  bias + GELU, SwiGLU
``dropout``     bias + dropout + residual add
``linear``      column sums (a Linear's bias gradient) and the Linear built on them
``loss``        softmax cross-entropy, the LM head fused with its cross-entropy
``optim``       multi-tensor Adam / AdamW
``embedding``   embedding lookup with a deterministic (tied) weight gradient
``moe``         gate scores, top-k gating, token permutation, grouped GEMM and MLP
``evoformer``   Evoformer attention, the outer product mean's projection, sigmoid gating
``decode``      decode attention over a KV cache, the decode step's fused linear
``quant``       int8 weights and their linear
==============  ===========================================================================

Shared by the families: :mod:`dslab.kernels.dispatch` (the backend switch), ``_grid`` (persistent
grids and their partial sums), ``_launch`` (direct launches of plain Triton kernels, past Triton's
per-call Python) and ``_triton_compat`` (the optional Triton import). Modules import
each other by their full module path, never through a package's ``__init__``, so no two files
import each other (``tests/test_import_graph.py``).

Importing the package imports every op module, which registers the custom ops.
"""

from __future__ import annotations

from dslab.kernels import (  # noqa: F401  (each family registers its ops)
    activation, attention, decode, dropout, embedding, evoformer, linear, loss, moe, norm, optim, quant,
)
from dslab.kernels.dispatch import backend, kernel_backend, planned_backend, set_backend, use_triton

# The public ops and the module of each: ``dslab.kernels.<family>.<module>``.
OP_MODULES = {
    "attention": "attention.attention", "attention_packed": "attention.attention_packed",
    "layer_norm": "norm.layer_norm", "dropout_add_layer_norm": "norm.dropout_add_layer_norm",
    "bias_gelu": "activation.bias_gelu", "bias_dropout_residual": "dropout.bias_dropout_residual",
    "softmax_cross_entropy": "loss.cross_entropy", "linear_cross_entropy": "loss.linear_cross_entropy",
    "FusedAdam": "optim.fused_adam", "embedding": "embedding.embedding",
    "gate_linear": "moe.gate_linear", "grouped_gemm": "moe.grouped_gemm", "grouped_mlp": "moe.grouped_mlp",
    "moe_gating": "moe.moe_gating", "moe_permute": "moe.moe_permute", "moe_unpermute": "moe.moe_permute",
    "evoformer_attention": "evoformer.evoformer_attention", "sigmoid_gate": "evoformer.sigmoid_gate",
    "outer_product_linear": "evoformer.outer_product_linear",
    "decode_attention": "decode.decode_attention", "decode_linear": "decode.decode_linear",
    "int8_linear": "quant.int8_linear", "quantize_int8": "quant.int8_linear", "dequantize_int8": "quant.int8_linear",
    "rms_norm": "norm.rms_norm", "swiglu": "activation.swiglu", "apply_rope": "attention.rope",
}
OPS = ("layer_norm", "bias_gelu", "bias_dropout_residual", "attention", "attention_packed", "softmax_cross_entropy",
       "linear_cross_entropy", "FusedAdam", "gate_linear", "grouped_gemm", "grouped_mlp", "moe_gating",
       "moe_permute", "moe_unpermute", "evoformer_attention", "sigmoid_gate", "decode_attention", "decode_linear",
       "int8_linear", "outer_product_linear", "embedding", "dropout_add_layer_norm", "rms_norm", "swiglu", "apply_rope")
FAMILIES = ("attention", "norm", "activation", "dropout", "linear", "loss", "optim", "embedding", "moe", "evoformer",
            "decode", "quant")

__all__ = ["OPS", "OP_MODULES", "FAMILIES", "backend", "kernel_backend", "planned_backend", "set_backend",
           "use_triton"]


def __getattr__(name: str):
    # The ops were attributes of this package before the families; say where each went.
    module = OP_MODULES.get(name)
    if module is not None:
        raise AttributeError(f"dslab.kernels.{name} is in dslab.kernels.{module}: "
                             f"from dslab.kernels.{module} import {name}")
    raise AttributeError(f"module 'dslab.kernels' has no attribute {name!r}")
