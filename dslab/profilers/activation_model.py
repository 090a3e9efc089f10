"""How much activation memory a GPT-2-shaped training step keeps from its forward for its
backward: the arithmetic, no torch.

With ``s`` tokens per sequence, ``b`` sequences per micro-batch, hidden size ``h``, ``L``
layers and vocabulary ``V`` (16-bit activations under autocast):

- a layer without checkpointing keeps ``34·s·b·h`` bytes (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", §4.1: ``s·b·h·(34 + 5·a·s/h)``; the
  ``5·a·s/h`` term is the attention scores and their dropout mask, which a fused attention
  kernel does not keep);
- with the stack in checkpointed segments of ``k`` layers, each segment keeps only its input:
  dslab's models carry the residual stream in fp32, ``4·s·b·h`` bytes, ``ceil(L / k)`` of them
  (one layer's full activations exist again only during its segment's recompute, in backward);
- the head: dslab's LM head and loss (``linear_cross_entropy``) write the logits' gradient in
  their forward, ``2·s·b·V`` bytes in bf16, keep the bf16 copy of the (tied) head weight that
  autocast made for the product, ``2·V·h``, and the final LayerNorm keeps its fp32 input,
  ``4·s·b·h``.

Measured on one H200 (``benchmarks/activation_memory.py``, activation bytes = allocated after
the forward minus before it), against this estimate:

========================  =============  ==========  ==========
GPT-2, tokens             checkpointing  measured    estimate
========================  =============  ==========  ==========
1.5B, 8 x 1024            none           20.06 GiB   20.89 GiB
1.5B, 8 x 1024            every layer     3.32 GiB    3.31 GiB
1.5B, 8 x 1024            two layers      2.15 GiB    2.14 GiB
774M, 4 x 1024            none            6.18 GiB    6.50 GiB
774M, 4 x 1024            every layer     1.23 GiB    1.23 GiB
774M, 4 x 1024            two layers      0.88 GiB    0.87 GiB
========================  =============  ==========  ==========
"""

from __future__ import annotations

import math

LAYER_BYTES_PER_TOKEN_HIDDEN = 34  # Korthikanti et al. 2022, with fused attention
RESIDUAL_BYTES = 4  # the fp32 residual stream a checkpointed segment keeps as its input
LOGIT_GRAD_BYTES = 2  # the bf16 logits' gradient the fused LM head and loss write in forward
HEAD_WEIGHT_BYTES = 2  # the bf16 copy of the head weight the loss keeps


def activation_bytes(layers: int, hidden: int, seq: int, micro_batch: int, vocab: int,
                     checkpoint_layers: int = 0) -> dict[str, int]:
    """The bytes a training forward keeps for its backward (module docstring):
    ``{"layers", "head", "total"}``. ``checkpoint_layers`` is the segment length (0: none)."""
    for name, value in (("layers", layers), ("hidden", hidden), ("seq", seq),
                        ("micro_batch", micro_batch), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(checkpoint_layers, bool) or not isinstance(checkpoint_layers, int) \
            or checkpoint_layers < 0:
        raise ValueError(f"checkpoint_layers must be an int >= 0, got {checkpoint_layers!r}")
    tokens = seq * micro_batch
    if checkpoint_layers:
        stack = math.ceil(layers / checkpoint_layers) * RESIDUAL_BYTES * tokens * hidden
    else:
        stack = layers * LAYER_BYTES_PER_TOKEN_HIDDEN * tokens * hidden
    head = (LOGIT_GRAD_BYTES * tokens * vocab + HEAD_WEIGHT_BYTES * vocab * hidden
            + RESIDUAL_BYTES * tokens * hidden)
    return {"layers": stack, "head": head, "total": stack + head}


def estimate_activation_memory(config, micro_batch: int, seq: int | None = None,
                               checkpoint_layers: int | None = None) -> dict[str, int]:
    """:func:`activation_bytes` for a model config with ``layers``, ``hidden`` and
    ``vocab_size`` (dslab's ``GPT2Config``): ``seq`` defaults to its ``n_positions`` and
    ``checkpoint_layers`` to its own."""
    seq = getattr(config, "n_positions", None) if seq is None else seq
    every = getattr(config, "checkpoint_layers", 0) if checkpoint_layers is None else checkpoint_layers
    vocab = getattr(config, "padded_vocab_size", None) or config.vocab_size
    return activation_bytes(config.layers, config.hidden, seq, micro_batch, vocab, every)
