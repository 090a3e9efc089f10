"""The per-token step of the Llama layout (Llama, Mistral, Qwen2) in five launches a layer.

:meth:`InferenceLlama.decode_step <dslab.inference.llama_modules.InferenceLlama.decode_step>`
runs :func:`fused_decode_step` when :func:`unfused_reason` finds nothing against it. With ``x`` the
residual stream, ``d`` the last MLP's output still to be added to it and ``cos``/``sin`` the rows'
rotary tables (``rope_tables(write_pos - valid_start, inv_freq)``, once a step), layer ``l`` is::

    q, x = decode_linear(d, Wqkv, bqkv, residual=x, rms_norm=RMS1, return_sum=True,
                         kv=(q, K[l], V[l], write_pos, D, (cos, sin)))   # add, norm, QKV, rope, cache writes
    c = decode_attention(q, K[l], V[l], valid_start, write_pos + 1)      # grouped-query
    a = allreduce(decode_linear(c, Wo, bo))
    h, x = decode_linear(a, Wgu, bgu, residual=x, rms_norm=RMS2, activation="swiglu", return_sum=True)
    d = allreduce(decode_linear(h, Wd, bd))

Layer 0's QKV launch gathers its input from the word embeddings (``x = E[tokens]``, nothing to
add: the layout has no position embeddings), and the LM head is one more ``decode_linear`` with
the final RMSNorm in front, its logits cut to the vocabulary: 5 launches a layer, the head, and
one small launch a step for the rotary tables and the valid range
(:func:`dslab.kernels.decode.step_tables.step_tables`), against about 11 a layer op by op
(RMSNorm, QKV GEMM, rope, two cache scatters, attention's two, output GEMM, RMSNorm, gate/up GEMM,
SwiGLU, down GEMM).
Each launch reads its weight once; the gate/up launch writes ``I`` columns, never the ``2 I`` of
the GEMM.

The same arithmetic as the op-by-op step (:func:`dslab.kernels.decode.decode_linear.decode_linear`
rounds where the separate ops round: residual adds, the norms' outputs), except that bias, rope
and SwiGLU act on the GEMM's fp32 accumulator instead of its rounded output, and int8 weights
multiply in fp32 before their scale: within bf16 rounding of the op-by-op step
(tests/inference/test_fused_decode_llama.py). Sliding windows (Mistral, Qwen2) need nothing here:
the policy caps the sequence at the window, where it masks no key, so both steps attend to the
same ``valid_start <= j <= write_pos``.

Batch 1 only by default (``fused_decode_rows = 1``): at 8 rows the op-by-op step, on cuBLAS's
tensor-core GEMMs, is faster (1.33 ms against 1.63 fused on an H200; :mod:`dslab.inference.fused_decode`
has GPT-2's figures, whose fused step wins up to 8 rows).
"""

from __future__ import annotations

import torch

from dslab.inference.fused_decode import linear, rows_reason
from dslab.kernels.decode.decode_attention import decode_attention
from dslab.kernels.decode.decode_linear import decode_linear
from dslab.kernels.decode.step_tables import step_tables


def unfused_reason(model, rows: int) -> str | None:
    """Why ``model``'s (an :class:`~dslab.inference.llama_modules.InferenceLlama`) step at ``rows``
    rows runs op by op, or None when it can be fused."""
    if not model.fused_decode:
        return "fused_decode is off"
    if not model.layers:
        return f"{model.source} has no layers"
    reason = rows_reason(model, rows)
    if reason is not None:
        return reason
    if any(linear_layer.int8 and linear_layer.group_size is not None for layer in model.layers
           for linear_layer in (layer.qkv, layer.out_proj, layer.gate_up, layer.down)):
        return "int8 weights with group scales"
    return None


def fused_decode_step(model, tokens: torch.Tensor, write_pos: torch.Tensor, valid_start: torch.Tensor,
                      cache) -> torch.Tensor:
    """Logits ``[rows, vocab]`` of one new token per row (the contract of ``decode_step``)."""
    rows, head_dim = tokens.shape[0], model.head_dim
    # write_pos + 1 and the rotary tables of write_pos - valid_start (fp32 [rows, head_dim / 2],
    # shared by the layers) in one launch
    valid_end, *rope = step_tables(write_pos, valid_start, model.rope_inv_freq)
    rope = tuple(rope)
    x = d = None
    for index, layer in enumerate(model.layers):
        keys, values = cache.keys[index], cache.values[index]
        q = torch.empty((rows, layer.heads * head_dim), dtype=model.dtype, device=tokens.device)
        kv = (q, keys, values, write_pos, head_dim, rope)
        norm = (layer.attention_norm.weight, layer.attention_norm.eps)
        if index == 0:
            q, x = linear(layer.qkv, model.word_embeddings, x_rows=tokens, rms_norm=norm, return_sum=True, kv=kv)
        else:
            q, x = linear(layer.qkv, d, residual=x, rms_norm=norm, return_sum=True, kv=kv)
        context = decode_attention(q.view(rows, layer.heads, head_dim), keys, values, valid_start, valid_end,
                                   scale=layer.scale)
        a = layer.tp.all_reduce(linear(layer.out_proj, context.view(rows, -1)))
        norm = (layer.mlp_norm.weight, layer.mlp_norm.eps)
        h, x = linear(layer.gate_up, a, residual=x, rms_norm=norm, activation="swiglu", return_sum=True)
        d = layer.tp.all_reduce(linear(layer.down, h))
    final = model.final_norm
    logits = decode_linear(d, model.lm_head, None, residual=x, rms_norm=(final.weight, final.eps))
    return logits[:, :model.vocab_size]
