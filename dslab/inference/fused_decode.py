"""The per-token step of a pre-LN causal model (GPT-2) in five launches a layer.

GPT-2's layout (:class:`~dslab.inference.modules.InferenceTransformer`): LayerNorm, bias + GELU,
learned position embeddings. The Llama layout
(:class:`~dslab.inference.llama_modules.InferenceLlama`: RMSNorm, rotary positions, grouped-query
attention, SwiGLU) has its own fused step on the same op, :mod:`dslab.inference.fused_decode_llama`,
which shares :func:`linear` and :func:`rows_reason` from here.

:meth:`InferenceTransformer.decode_step <dslab.inference.modules.InferenceTransformer.decode_step>`
runs :func:`fused_decode_step` when :func:`unfused_reason` finds nothing against it. With ``x`` the
residual stream and ``d`` the last sublayer's output still to be added to it, layer ``l`` is::

    q, x = decode_linear(d, Wqkv, bqkv, residual=x, norm=LN1, return_sum=True,
                         kv=(q, K[l], V[l], write_pos))       # add, norm, QKV, cache writes
    c = decode_attention(q, K[l], V[l], valid_start, write_pos + 1)
    a = allreduce(decode_linear(c, Wo, bo))
    h, x = decode_linear(a, W1, b1, residual=x, norm=LN2, activation=GELU, return_sum=True)
    d = allreduce(decode_linear(h, W2, b2))

Layer 0's QKV launch gathers its input from the embeddings (``x = wte[tokens]``, ``d =
wpe[write_pos - valid_start]``), and the LM head is one more ``decode_linear`` with the final norm
in front: 5 launches a layer (6 where attention splits the cache over programs) and 2 around them,
against about 12 a layer op by op. Each launch reads its weight once; ``x`` and ``d`` stay separate
tensors, never written while a launch reads them.

The same arithmetic as the op-by-op step (:func:`dslab.kernels.decode.decode_linear.decode_linear` rounds where the
separate ops round), except that bias and GELU act on the GEMM's fp32 accumulator instead of its
rounded output, and int8 weights multiply in fp32 before their scale instead of being dequantised
to the activations' dtype first: within bf16 rounding of the op-by-op step (tests/inference).

By default buckets of up to 8 rows run fused (``fused_decode_rows = 8``): there the step is a
chain of weight-streaming GEMMs whose launches and small ops dominate. On an H200
(``benchmarks/decode_profile.py``, 2026-12-01) the fused step took, against op by op: GPT-2 124M
0.241 ms against 0.553 at batch 1 and 0.456 against 0.620 at batch 8; GPT-2 1.5B 1.457 against
2.843 and 2.632 against 3.117. From more rows on, cuBLAS's tensor-core GEMMs beat the kernel's
tensor-core tile (GPT-2 1.5B at batch 32: 4.20 ms fused against 3.45 op by op), so larger buckets
run op by op; the kernel itself takes up to 64 rows (the tests run the fused step at batch 3).
Llama's step (:mod:`dslab.inference.fused_decode_llama`) keeps batch 1 only: its op-by-op step
at 8 rows is faster (1.33 ms against 1.63 fused). From 2 rows the norm runs in a kernel of its own
in front of the linear (:mod:`dslab.kernels.decode.decode_prologue_triton`) rather than in every
column program's prologue.
"""

from __future__ import annotations

import torch

from dslab.kernels.decode.decode_attention import decode_attention
from dslab.kernels.decode.decode_linear import MAX_ROWS, decode_linear
from dslab.kernels.dispatch import use_custom_op

GELUS = {"tanh": "gelu_tanh", "none": "gelu"}


def unfused_reason(model, rows: int) -> str | None:
    """Why ``model``'s step at ``rows`` rows runs op by op, or None when it can be fused."""
    if not model.fused_decode:
        return "fused_decode is off"
    if not (model.causal and model.pre_ln) or model.token_type_embeddings is not None \
            or model.embedding_norm is not None or model.mlm is not None or model.final_norm is None \
            or not model.layers:
        return f"{model.source} is not a pre-LN causal language model"
    reason = rows_reason(model, rows)
    if reason is not None:
        return reason
    if any(layer.qkv.int8 and layer.qkv.group_size is not None for layer in model.layers):
        return "int8 weights with group scales"
    return None


def rows_reason(model, rows: int) -> str | None:
    """What keeps any fused step at ``rows`` rows off: more rows than ``model.fused_decode_rows``
    (or the kernel's :data:`~dslab.kernels.decode.decode_linear.MAX_ROWS`), or an active dispatch
    mode; None otherwise."""
    if rows > min(model.fused_decode_rows, MAX_ROWS):
        return f"{rows} rows > fused_decode_rows ({min(model.fused_decode_rows, MAX_ROWS)})"
    if use_custom_op():
        return "a dispatch mode or torch.compile is active (the op-by-op step's ops are counted)"
    return None


def linear(module, x, **kwargs):
    """``decode_linear`` of an :class:`~dslab.inference.modules.InferenceLinear`'s weight, bias and
    (int8) scale."""
    scale = module.scale if module.int8 else None
    return decode_linear(x, module.weight, module.bias, scale=scale, **kwargs)


def fused_decode_step(model, tokens: torch.Tensor, write_pos: torch.Tensor, valid_start: torch.Tensor,
                      cache) -> torch.Tensor:
    """Logits ``[rows, vocab]`` of one new token per row (the contract of ``decode_step``)."""
    rows = tokens.shape[0]
    valid_end = (write_pos + 1).to(torch.int32)
    gelu = GELUS[model.gelu]
    x = d = None
    for index, layer in enumerate(model.layers):
        keys, values = cache.keys[index], cache.values[index]
        q = torch.empty((rows, layer.heads * model.head_dim), dtype=model.dtype, device=tokens.device)
        kv = (q, keys, values, write_pos, model.head_dim)
        norm = (layer.attention_norm.weight, layer.attention_norm.bias, layer.attention_norm.eps)
        if index == 0:
            q, x = linear(layer.qkv, model.word_embeddings, x_rows=tokens, residual=model.position_embeddings,
                           residual_rows=write_pos, residual_row_offset=valid_start, norm=norm,
                           return_sum=True, kv=kv)
        else:
            q, x = linear(layer.qkv, d, residual=x, norm=norm, return_sum=True, kv=kv)
        context = decode_attention(q.view(rows, layer.heads, model.head_dim), keys, values, valid_start, valid_end,
                                   scale=layer.scale)
        a = layer.tp.all_reduce(linear(layer.out_proj, context.view(rows, -1)))
        norm = (layer.mlp_norm.weight, layer.mlp_norm.bias, layer.mlp_norm.eps)
        h, x = linear(layer.fc_in, a, residual=x, norm=norm, activation=gelu, return_sum=True)
        d = layer.tp.all_reduce(linear(layer.fc_out, h))
    final = model.final_norm
    logits = decode_linear(d, model.lm_head, None, residual=x, norm=(final.weight, final.bias, final.eps))
    return logits[:, :model.vocab_size]
