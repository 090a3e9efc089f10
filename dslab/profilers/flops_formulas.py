"""What one executed op costs in floating-point operations, by its name at the dispatcher.

Every op the flops profiler sees is classified into one of three figures:

- ``MATMUL``, the total: the ops of ``torch.utils.flop_counter.flop_registry`` (mm, addmm, bmm,
  baddbmm, _scaled_mm, convolution and its backward, SDPA's flash/efficient/cudnn kernels and their
  backwards, ...), counted with torch's own formulas so that the total equals
  ``FlopCounterMode``'s on aten ops (except causal fused attention, half of torch's figure: see
  :func:`count`), plus dslab's attention, Evoformer attention, grouped GEMM,
  decode attention, int8 linear and outer-product linear custom ops. A multiply-add counts 2.
- ``ELEMENTWISE``, reported beside the total, never in it: pointwise arithmetic, activations,
  reductions, normalisations and softmax, with the small per-element constants of
  :data:`_PER_ELEMENT` (estimates: what such an op costs is its memory traffic, not its flops).
  The aten op and dslab's fused op for the same work get matching constants, so the figure does
  not change with the kernel backend.
- ``CPU_ATTENTION``, also beside the total: the CPU fused attention kernels
  (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward), which torch's counter
  has no formula for. They are counted with torch's SDPA formulas but kept out of the total so
  that the total stays equal to ``FlopCounterMode``'s; on a GPU these ops never run.

dslab's custom ops are matched by their qualified names (``"dslab::attention_forward"``), read from
the dispatcher, so counting needs no op module imported; the Evoformer's outer product and sigmoid
gate are priced by their own modules' formulas (imported when such an op is counted). Their schemas:

- ``attention_forward(q [B,H,Sq,D], k [B,H,Sk,D], v, key_padding_mask, seed, causal, dropout_p,
  scale)``: ``4 B H Sq Sk D`` (the two matmuls ``q k^T`` and ``p v``), half of it when causal
  (FlashAttention's convention: the kernel skips the blocks above the diagonal).
- ``attention_backward(grad_out, q, k, v, out, lse, key_padding_mask, seed, causal, dropout_p,
  scale)``: 2.5x the forward (five matmuls: the recomputed scores, dP, dV, dQ, dK).
- ``attention_packed_forward(qkv [B,S,3*H*D], key_padding_mask, seed, heads, causal, dropout_p,
  scale)`` and ``attention_packed_backward(grad_out, qkv, out, lse, key_padding_mask, seed, heads,
  causal, dropout_p, scale)``: the same attention read from a packed projection, the same flops as
  ``attention_forward`` / ``attention_backward`` on its ``[B, H, S, D]`` heads.
- ``evoformer_attention(q [*,S,N,H,D], k, v, mask_bias, pair_bias)``: ``4 B S N^2 H D`` with B the
  product of the batch dims (the two matmuls per (sequence, head); the bias adds are not counted);
  ``evoformer_attention_backward(grad_out, q, k, v, out, lse, mask_bias, pair_bias, mask_grad,
  pair_grad)``: 2.5x the forward, as for ``attention_backward`` (the bias gradients are sums of dS,
  not counted).
- ``grouped_gemm(x [M,K], w [G,N,K], group_offsets, bias)``: ``2 M N K`` (each row meets one
  group's weight; the fused bias add is not counted, as for ``addmm``);
  ``grouped_gemm_backward_input(dy [M,N], w, group_offsets)`` (dx) and
  ``grouped_gemm_backward_weight(dy, x [M,K], group_offsets, with_bias, fp32_out)`` (dw, and dbias uncounted):
  ``2 M N K`` each.
- ``grouped_mlp(x [M,H], w1 [G,F,H], b1, w2 [G,H,F], b2, group_offsets, activation)``: ``4 M H F``,
  its two grouped GEMMs (the activation fused into their epilogues is not counted);
  ``grouped_mlp_backward_hidden(dy [M,H], w2, group_offsets, pre, activation)`` (d_pre, the second
  GEMM's input gradient times the activation's derivative): ``2 M H F``. The rest of its backward
  is the grouped GEMM's ops.
- ``decode_attention(q [B,H,D], k_cache [B,H,S_max,D], v_cache, valid_start [B], valid_end [B],
  scale)``: ``4 H D`` per attended position (``q k^T`` and ``p v`` over the valid range of each
  sequence, which is all the kernel reads). The ranges live on the device, so the formula reads
  them on the host (one small copy per call while the profiler counts); while a CUDA graph is being
  captured it cannot, and counts the whole cache, ``4 B H S_max D``, an upper bound.
- ``int8_linear(x [M,K], qweight [N,K], scale, bias, group_size)``: ``2 M N K``, as ``addmm`` (the
  dequantisation multiplies and the bias add are not counted).
- ``outer_product_linear(x [B,R,C,R,C], weight [E,C*C], bias)``: ``2 B R^2 C^2 E``, as ``addmm`` on
  the permuted ``[B,R,R,C*C]`` input (the bias add is not counted);
  ``outer_product_linear_backward(dout, x, weight, bias)`` (dx and dW, dbias uncounted): twice that.
- ``linear_cross_entropy_forward(hidden [N,H], weight [Vp,H], bias, target, vocab, ...)``: ``2 N Vp H``,
  the LM head's matmul inside it (the softmax and the gradient it writes over the logits are not
  counted, as a fused bias is not); its backward is plain ``mm`` calls, counted as such.
- ``layer_norm``, ``add_layer_norm``, ``layer_norm_backward``, ``layer_norm_channels_first(_backward)``,
  ``bias_gelu(_backward)``, ``sigmoid_gate(_backward)``, ``column_sum``, ``bias_dropout_residual(_backward)``,
  ``cross_entropy_forward/backward``: elementwise. ``layer_norm_channels_first(x [B,C,P], weight, bias,
  eps)`` and ``layer_norm_channels_first_backward(dy, x, weight, bias, mean, rstd)`` are priced as
  ``layer_norm`` / ``layer_norm_backward`` on the same elements (the transpose they fuse costs 0).
- ``swiglu(x [M,2I])`` and ``swiglu_backward(dy [M,I], x)``: elementwise, per element of the
  ``[M, I]`` output as the profiler prices the reference's aten ops: silu and the product with
  u (2); backward 8: the products dy * u and dy * silu(g) (2) and ``silu_backward``, which the
  profiler decomposes into its six pointwise ops (sigmoid, 1 - s, an add and three products).
- ``rms_norm(x, weight, eps)``, ``add_rms_norm(x, residual, weight, eps)`` and
  ``rms_norm_backward(dy, h, weight, rstd, dh)``: elementwise, priced as the layer norm ones
  without the mean subtraction and the bias (:data:`RMS_NORM_FORWARD`, :data:`RMS_NORM_BACKWARD`),
  plus one add per element for the residual add and for a given ``dh``.
- ``rope(q [B,S,Hq,D], k [B,S,Hk,D] or None, cos, sin)`` and ``rope_backward(dq_rot, dk_rot, cos,
  sin)``: elementwise, 3 per element of q and k (two products and a sum per rotated element, as
  the reference's aten ops are priced; the tables are inputs, not counted).
- ``moe_gating(logits [T,E], k, second_choice_noise)`` and ``moe_gating_backward(dprobs,
  dgate_weight, probs [T,E], expert_index, logits_dtype)``: elementwise, a softmax per logit (plus
  the noise add); ``moe_permute(x, row_index [T,k], num_rows)`` and its backward,
  ``moe_unpermute(y_perm [R,H], row_index, gate_weight)`` and its backward: elementwise, the sums
  and gate products per element, counted as if no assignment were dropped (the row copies cost 0).
- ``embedding_backward(ids [N], grad_rows [N,H], num_rows, out_dtype, head_grad, head_scale)``:
  elementwise, one add per element of ``grad_rows`` (``embedding_dense_backward``'s price), plus
  per element of a tied head's ``head_grad`` the add autograd would have made and, with a scale,
  the multiply the fused loss's backward would have.
"""

from __future__ import annotations

import math

import torch
from torch.utils import flop_counter

from dslab.profilers.flops_causal import expand_kv_heads, runs_causal

MATMUL = "matmul"
ELEMENTWISE = "elementwise"
CPU_ATTENTION = "cpu_attention"

# Per-element costs (flops per element of the op's first output, or of its first tensor input for
# reductions and backward ops whose output is a reduction). One flop per pointwise arithmetic
# result, transcendental or not, as DeepSpeed counts activations; selection, comparison, copies,
# fills, gathers and RNG draws count 0.
_POINTWISE_ONE = (
    "add", "sub", "rsub", "mul", "div", "neg", "reciprocal", "sqrt", "rsqrt", "exp", "exp2", "log",
    "log1p", "pow", "tanh", "sigmoid", "relu", "gelu", "silu", "erf", "sin", "cos", "abs", "clamp",
    "clamp_min", "clamp_max", "maximum", "minimum", "hardtanh", "leaky_relu", "elu", "threshold_backward",
    "native_dropout_backward", "native_dropout",
)
_POINTWISE_TWO = (
    "addcmul", "addcdiv", "lerp", "gelu_backward", "sigmoid_backward", "tanh_backward", "silu_backward",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward",
)
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "linalg_vector_norm",
               "logsumexp", "embedding_dense_backward")

#: Layer norm: mean (1), variance (2), normalise (1) and the affine map (1) per element, 4 without
#: weight and bias (DeepSpeed's count); backward: dx (7: recomputed xhat 2, dy*w 1, two row sums 2
#: and their combination 2), dweight (2) and dbias (1); without weight and bias, dx alone less dy*w.
LAYER_NORM_FORWARD, LAYER_NORM_FORWARD_NO_AFFINE = 5, 4
LAYER_NORM_BACKWARD, LAYER_NORM_BACKWARD_NO_AFFINE = 10, 6
#: RMS norm: mean of squares (2), normalise (1) and the weight (1) per element, 3 without weight
#: (the reference's pow, mean and two muls); backward: dx (6: dy*w 1, the row sum of g*h 2, and
#: its combination 3) and dweight (3: h*rstd, times dy, row sum); without weight, dx less dy*w.
RMS_NORM_FORWARD, RMS_NORM_FORWARD_NO_WEIGHT = 4, 3
RMS_NORM_BACKWARD, RMS_NORM_BACKWARD_NO_WEIGHT = 9, 5
#: Softmax and log-softmax: max, subtract, exp, sum, normalise; backward: product with the
#: output, row sum, subtract, product.
SOFTMAX_FORWARD, SOFTMAX_BACKWARD = 5, 4
#: Fused cross-entropy: the log-softmax it computes per logit (forward), and softmax, one-hot
#: subtraction, smoothing and scaling per logit (backward).
CROSS_ENTROPY_FORWARD, CROSS_ENTROPY_BACKWARD = SOFTMAX_FORWARD, SOFTMAX_BACKWARD
#: MoE gating: the softmax per logit (the argmax, the top-2 masking and the per-token gate
#: normalisation are comparisons or per-token work, not counted); backward: the softmax backward.
MOE_GATING_FORWARD, MOE_GATING_BACKWARD = SOFTMAX_FORWARD, SOFTMAX_BACKWARD

_PER_ELEMENT: dict[str, tuple[int, str]] = {
    **{name: (1, "out") for name in _POINTWISE_ONE},
    **{name: (2, "out") for name in _POINTWISE_TWO},
    **{name: (1, "in") for name in _REDUCTIONS},
    "_softmax": (SOFTMAX_FORWARD, "out"),
    "_log_softmax": (SOFTMAX_FORWARD, "out"),
    "_softmax_backward_data": (SOFTMAX_BACKWARD, "out"),
    "_log_softmax_backward_data": (SOFTMAX_BACKWARD, "out"),
}


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(item) for item in x)
    return 0


def _first_tensor_numel(values) -> int:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.numel()
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return _numel(value)
    return 0


def _out_numel(out) -> int:
    if isinstance(out, (list, tuple)):
        return _first_tensor_numel(out)
    return _numel(out)


def attention_flops(q_shape, k_shape, causal: bool) -> int:
    """Forward matmul flops of attention over q ``[B, H, Sq, D]`` and k ``[B, H, Sk, D]``:
    ``4 B H Sq Sk D``, halved when causal."""
    batch, heads, seq_q, head_dim = q_shape
    seq_k = k_shape[2]
    flops = 4 * batch * heads * seq_q * seq_k * head_dim
    return flops // 2 if causal else flops


def _dslab_attention_forward(args, kwargs, out) -> int:
    q, k = args[0], args[1]
    causal = bool(args[5]) if len(args) > 5 else bool(kwargs.get("causal", False))
    return attention_flops(q.shape, k.shape, causal)


def _dslab_attention_backward(args, kwargs, out) -> int:
    q, k = args[1], args[2]
    causal = bool(args[8]) if len(args) > 8 else bool(kwargs.get("causal", False))
    return attention_flops(q.shape, k.shape, causal) * 5 // 2


def _packed_head_shape(qkv, heads: int) -> tuple[int, int, int, int]:
    """``[B, H, S, D]`` of the heads in qkv ``[B, S, 3 * H * D]``."""
    batch, seq, width = qkv.shape
    return batch, heads, seq, width // (3 * heads)


def _dslab_attention_packed_forward(args, kwargs, out) -> int:
    qkv = args[0]
    heads = int(args[3]) if len(args) > 3 else int(kwargs["heads"])
    causal = bool(args[4]) if len(args) > 4 else bool(kwargs.get("causal", False))
    shape = _packed_head_shape(qkv, heads)
    return attention_flops(shape, shape, causal)


def _dslab_attention_packed_backward(args, kwargs, out) -> int:
    qkv = args[1]
    heads = int(args[6]) if len(args) > 6 else int(kwargs["heads"])
    causal = bool(args[7]) if len(args) > 7 else bool(kwargs.get("causal", False))
    shape = _packed_head_shape(qkv, heads)
    return attention_flops(shape, shape, causal) * 5 // 2


def evoformer_attention_flops(q_shape) -> int:
    """Forward matmul flops of Evoformer attention over q ``[*, N_seq, N_res, H, D]``:
    ``4 B N_seq N_res^2 H D`` (B the product of the batch dims)."""
    *batch, n_seq, n_res, heads, head_dim = q_shape
    return 4 * math.prod(batch) * n_seq * n_res * n_res * heads * head_dim


def _evoformer_attention(args, kwargs, out) -> int:
    # (q, k, v, mask_bias, pair_bias)
    return evoformer_attention_flops(args[0].shape)


def _evoformer_attention_backward(args, kwargs, out) -> int:
    # (grad_out, q, k, v, out, lse, mask_bias, pair_bias, mask_grad, pair_grad)
    return evoformer_attention_flops(args[1].shape) * 5 // 2


def _grouped_gemm(args, kwargs, out) -> int:
    # (x [M, K], w [G, N, K], group_offsets, bias)
    (m, k), n = args[0].shape, args[1].shape[1]
    return 2 * m * n * k


def _grouped_gemm_backward_input(args, kwargs, out) -> int:
    # (dy [M, N], w [G, N, K], group_offsets)
    (m, n), k = args[0].shape, args[1].shape[2]
    return 2 * m * n * k


def _grouped_gemm_backward_weight(args, kwargs, out) -> int:
    # (dy [M, N], x [M, K], group_offsets, with_bias, fp32_out)
    (m, n), k = args[0].shape, args[1].shape[1]
    return 2 * m * n * k


def _gate_linear(args, kwargs, out) -> int:
    # (x [T, H], weight [E, H])
    (t, h), e = args[0].shape, args[1].shape[0]
    return 2 * t * h * e


def _gate_linear_backward(args, kwargs, out) -> int:
    # (dlogits [T, E], x [T, H], weight [E, H]): dx and dw
    (t, h), e = args[1].shape, args[2].shape[0]
    return 4 * t * h * e


def _grouped_mlp(args, kwargs, out) -> int:
    # (x [M, H], w1 [G, F, H], b1, w2 [G, H, F], b2, group_offsets, activation)
    (m, h), f = args[0].shape, args[1].shape[1]
    return 4 * m * h * f


def _grouped_mlp_backward_hidden(args, kwargs, out) -> int:
    # (dy [M, H], w2 [G, H, F], group_offsets, pre, activation)
    (m, h), f = args[0].shape, args[1].shape[2]
    return 2 * m * h * f


def decode_attention_flops(q_shape, attended_positions: int) -> int:
    """Matmul flops of decode attention for q ``[B, H, D]`` over ``attended_positions`` cache
    positions summed over the batch: ``4 H D`` per position."""
    _, heads, head_dim = q_shape
    return 4 * heads * head_dim * attended_positions


def _decode_attention(args, kwargs, out) -> int:
    # (q [B, H, D], k_cache [B, H, S_max, D], v_cache, valid_start [B], valid_end [B], scale)
    q, k_cache, valid_start, valid_end = args[0], args[1], args[3], args[4]
    s_max = k_cache.shape[2]
    if valid_start.is_cuda and torch.cuda.is_current_stream_capturing():
        return decode_attention_flops(q.shape, q.shape[0] * s_max)
    lengths = valid_end.clamp(max=s_max) - valid_start.clamp(min=0)
    return decode_attention_flops(q.shape, int(lengths.clamp(min=0).sum().item()))


def _int8_linear(args, kwargs, out) -> int:
    # (x [M, K], qweight [N, K], scale, bias, group_size)
    (m, k), n = args[0].shape, args[1].shape[0]
    return 2 * m * n * k


def _outer_product_linear(args, kwargs, out) -> int:
    # (x [B, R, C, R, C], weight [E, C*C], bias)
    from dslab.kernels.evoformer.outer_product_linear import outer_product_linear_flops

    batch, res, c = args[0].shape[:3]
    return outer_product_linear_flops(batch, res, c, args[1].shape[0])[0]


def _outer_product_linear_backward(args, kwargs, out) -> int:
    # (dout [B, R, R, E], x [B, R, C, R, C], weight [E, C*C], bias): dx and dw
    from dslab.kernels.evoformer.outer_product_linear import outer_product_linear_flops

    batch, res, c = args[1].shape[:3]
    return outer_product_linear_flops(batch, res, c, args[2].shape[0])[1]


def _affine(weight) -> bool:
    return weight is not None


def _layer_norm_forward(args, kwargs, out) -> int:
    # native_layer_norm(input, normalized_shape, weight, bias, eps); dslab::layer_norm(x, weight, bias, eps)
    # and dslab::layer_norm_channels_first(x, weight, bias, eps)
    x = args[0]
    weight = args[2] if isinstance(args[1], (list, tuple)) else args[1]
    per = LAYER_NORM_FORWARD if _affine(weight) else LAYER_NORM_FORWARD_NO_AFFINE
    return per * x.numel()


def _add_layer_norm(args, kwargs, out) -> int:
    # dslab::add_layer_norm(x, residual, weight, bias, eps): the residual add, then the norm.
    x, weight = args[0], args[2]
    per = LAYER_NORM_FORWARD if _affine(weight) else LAYER_NORM_FORWARD_NO_AFFINE
    return (per + 1) * x.numel()


def _native_layer_norm_backward(args, kwargs, out) -> int:
    # (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask)
    per = LAYER_NORM_BACKWARD if _affine(args[5]) else LAYER_NORM_BACKWARD_NO_AFFINE
    return per * args[1].numel()


def _dslab_layer_norm_backward(args, kwargs, out) -> int:
    # (dy, h, weight, bias, mean, rstd, dh): dh, when given, is added to dx (1 per element).
    # layer_norm_channels_first_backward(dy, x, weight, bias, mean, rstd) has no dh.
    per = LAYER_NORM_BACKWARD if _affine(args[2]) else LAYER_NORM_BACKWARD_NO_AFFINE
    dh = args[6] if len(args) > 6 else None
    return (per + (1 if dh is not None and dh.numel() else 0)) * args[1].numel()


def _rms_norm_forward(args, kwargs, out) -> int:
    # dslab::rms_norm(x, weight, eps)
    per = RMS_NORM_FORWARD if _affine(args[1]) else RMS_NORM_FORWARD_NO_WEIGHT
    return per * args[0].numel()


def _add_rms_norm(args, kwargs, out) -> int:
    # dslab::add_rms_norm(x, residual, weight, eps): the residual add, then the norm.
    per = RMS_NORM_FORWARD if _affine(args[2]) else RMS_NORM_FORWARD_NO_WEIGHT
    return (per + 1) * args[0].numel()


def _rms_norm_backward(args, kwargs, out) -> int:
    # dslab::rms_norm_backward(dy, h, weight, rstd, dh): dh, when given, is added to dx.
    per = RMS_NORM_BACKWARD if _affine(args[2]) else RMS_NORM_BACKWARD_NO_WEIGHT
    dh = args[4]
    return (per + (1 if dh is not None and dh.numel() else 0)) * args[1].numel()


def _bias_gelu(args, kwargs, out) -> int:
    # (x, bias, approximate): bias add (1) and gelu (1)
    return (2 if args[1] is not None else 1) * args[0].numel()


def _bias_gelu_backward(args, kwargs, out) -> int:
    # (dy, x, bias, approximate): recomputed x + bias (1), gelu' times dy (2), dbias sum (1)
    return (4 if args[2] is not None else 2) * args[1].numel()


def _swiglu(args, kwargs, out) -> int:
    # (x [M, 2I]): silu(g) (1) and its product with u (1) per element of y [M, I], as aten prices them
    return 2 * (args[0].numel() // 2)


def _swiglu_backward(args, kwargs, out) -> int:
    # (dy [M, I], x [M, 2I]) per output element: sigmoid(g) and sigmoid(-g) (2), silu = g * s (1),
    # silu' = s + silu * sigmoid(-g) (2), dg = dy * u * silu' (2), du = dy * silu (1); the same 8
    # as the reference's two products and decomposed silu_backward
    return 8 * args[0].numel()


def _rope(args, kwargs, out) -> int:
    # (q, k, cos, sin) and (dq_rot, dk_rot, cos, sin): x1 * cos - x2 * sin and x2 * cos + x1 * sin,
    # two products and a sum (3) per element of q and of k (None when only q is rotated)
    k = args[1]
    return 3 * (args[0].numel() + (k.numel() if k is not None else 0))


def _sigmoid_gate(args, kwargs, out) -> int:
    # (gate, x, gate_bias, x_bias, row_mask, batch, channels_first)
    from dslab.kernels.evoformer.sigmoid_gate import sigmoid_gate_flops

    biases = int(args[2] is not None) + int(args[3] is not None)
    return sigmoid_gate_flops(args[1].numel(), biases, args[4] is not None)[0]


def _sigmoid_gate_backward(args, kwargs, out) -> int:
    # (dy, gate, x, gate_bias, x_bias, row_mask, batch, channels_first)
    from dslab.kernels.evoformer.sigmoid_gate import sigmoid_gate_flops

    biases = int(args[3] is not None) + int(args[4] is not None)
    return sigmoid_gate_flops(args[2].numel(), biases, args[5] is not None)[1]


def _column_sum(args, kwargs, out) -> int:
    # (x [M, N], out_dtype): one add per element
    return args[0].numel()


def _bias_dropout_residual(args, kwargs, out) -> int:
    # (x, bias, residual, p, seed): bias add, dropout scale (when p > 0), residual add
    x, bias, p = args[0], args[1], float(args[3])
    return ((bias is not None) + (p > 0) + 1) * x.numel()


def _bias_dropout_residual_backward(args, kwargs, out) -> int:
    # (dout, bias, p, seed): dropout scale, dbias sum
    return (1 + (args[1] is not None)) * args[0].numel()


def _embedding_backward(args, kwargs, out) -> int:
    # (ids, grad_rows, num_rows, out_dtype, head_grad, head_scale)
    head_grad, head_scale = args[4], args[5]
    head = 0 if head_grad is None else (1 + (head_scale is not None)) * head_grad.numel()
    return args[1].numel() + head


def _linear_cross_entropy_forward(args, kwargs, out) -> int:
    hidden, weight = args[0], args[1]
    return 2 * hidden.shape[0] * weight.shape[0] * hidden.shape[1]


def _cross_entropy_forward(args, kwargs, out) -> int:
    return CROSS_ENTROPY_FORWARD * args[0].numel()


def _cross_entropy_backward(args, kwargs, out) -> int:
    # (grad_loss, logits, target, lse, ignore_index, label_smoothing)
    return CROSS_ENTROPY_BACKWARD * args[1].numel()


def _moe_gating(args, kwargs, out) -> int:
    # (logits [T, E], k, second_choice_noise): softmax, and the noise add when given
    logits, noise = args[0], args[2] if len(args) > 2 else kwargs.get("second_choice_noise")
    return (MOE_GATING_FORWARD + (noise is not None)) * logits.numel()


def _moe_gating_backward(args, kwargs, out) -> int:
    # (dprobs, dgate_weight, probs [T, E], expert_index, logits_dtype)
    return MOE_GATING_BACKWARD * args[2].numel()


def _moe_permute(args, kwargs, out) -> int:
    # (x, row_index, num_rows): row copies only
    return 0


def _moe_permute_backward(args, kwargs, out) -> int:
    # (dx_perm [R, H], row_index [T, k]): each token adds its k rows, k - 1 per element
    (tokens, k), hidden = args[1].shape, args[0].shape[1]
    return (k - 1) * tokens * hidden


def _moe_unpermute(args, kwargs, out) -> int:
    # (y_perm [R, H], row_index [T, k], gate_weight): k products and k - 1 adds per element of y
    (tokens, k), hidden = args[1].shape, args[0].shape[1]
    return (2 * k - 1) * tokens * hidden


def _moe_unpermute_backward(args, kwargs, out) -> int:
    # (dy [T, H], y_perm, row_index [T, k], gate_weight, need_y_perm_grad, need_gate_grad):
    # gate_weight * dy per element of each assignment's row (1), <dy, y_perm row> per assignment (2)
    (tokens, k), hidden = args[2].shape, args[0].shape[1]
    per = bool(args[4]) + 2 * bool(args[5])
    return per * k * tokens * hidden


def _cpu_attention_forward(args, kwargs, out) -> int:
    # (query, key, value, dropout_p, is_causal, *, attn_mask, scale)
    query, key, value = expand_kv_heads(tuple(args[:3]))
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward(args, kwargs, out) -> int:
    # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)
    grad_out, query, key, value = expand_kv_heads(tuple(args[:4]))
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_NAMED: dict[str, tuple[str, object]] = {
    "dslab::attention_forward": (MATMUL, _dslab_attention_forward),
    "dslab::attention_backward": (MATMUL, _dslab_attention_backward),
    "dslab::attention_packed_forward": (MATMUL, _dslab_attention_packed_forward),
    "dslab::attention_packed_backward": (MATMUL, _dslab_attention_packed_backward),
    "dslab::evoformer_attention": (MATMUL, _evoformer_attention),
    "dslab::evoformer_attention_backward": (MATMUL, _evoformer_attention_backward),
    "dslab::grouped_gemm": (MATMUL, _grouped_gemm),
    "dslab::grouped_gemm_backward_input": (MATMUL, _grouped_gemm_backward_input),
    "dslab::grouped_gemm_backward_weight": (MATMUL, _grouped_gemm_backward_weight),
    "dslab::gate_linear": (MATMUL, _gate_linear),
    "dslab::gate_linear_backward": (MATMUL, _gate_linear_backward),
    "dslab::grouped_mlp": (MATMUL, _grouped_mlp),
    "dslab::grouped_mlp_backward_hidden": (MATMUL, _grouped_mlp_backward_hidden),
    "dslab::decode_attention": (MATMUL, _decode_attention),
    "dslab::int8_linear": (MATMUL, _int8_linear),
    "dslab::outer_product_linear": (MATMUL, _outer_product_linear),
    "dslab::outer_product_linear_backward": (MATMUL, _outer_product_linear_backward),
    "dslab::layer_norm": (ELEMENTWISE, _layer_norm_forward),
    "dslab::add_layer_norm": (ELEMENTWISE, _add_layer_norm),
    "dslab::layer_norm_backward": (ELEMENTWISE, _dslab_layer_norm_backward),
    "dslab::layer_norm_channels_first": (ELEMENTWISE, _layer_norm_forward),
    "dslab::layer_norm_channels_first_backward": (ELEMENTWISE, _dslab_layer_norm_backward),
    "dslab::rms_norm": (ELEMENTWISE, _rms_norm_forward),
    "dslab::add_rms_norm": (ELEMENTWISE, _add_rms_norm),
    "dslab::rms_norm_backward": (ELEMENTWISE, _rms_norm_backward),
    "dslab::bias_gelu": (ELEMENTWISE, _bias_gelu),
    "dslab::bias_gelu_backward": (ELEMENTWISE, _bias_gelu_backward),
    "dslab::swiglu": (ELEMENTWISE, _swiglu),
    "dslab::swiglu_backward": (ELEMENTWISE, _swiglu_backward),
    "dslab::rope": (ELEMENTWISE, _rope),
    "dslab::rope_backward": (ELEMENTWISE, _rope),
    "dslab::sigmoid_gate": (ELEMENTWISE, _sigmoid_gate),
    "dslab::column_sum": (ELEMENTWISE, _column_sum),
    "dslab::sigmoid_gate_backward": (ELEMENTWISE, _sigmoid_gate_backward),
    "dslab::bias_dropout_residual": (ELEMENTWISE, _bias_dropout_residual),
    "dslab::bias_dropout_residual_backward": (ELEMENTWISE, _bias_dropout_residual_backward),
    "dslab::cross_entropy_forward": (ELEMENTWISE, _cross_entropy_forward),
    "dslab::linear_cross_entropy_forward": (MATMUL, _linear_cross_entropy_forward),
    "dslab::cross_entropy_backward": (ELEMENTWISE, _cross_entropy_backward),
    "dslab::embedding_backward": (ELEMENTWISE, _embedding_backward),
    "dslab::moe_gating": (ELEMENTWISE, _moe_gating),
    "dslab::moe_gating_backward": (ELEMENTWISE, _moe_gating_backward),
    "dslab::moe_permute": (ELEMENTWISE, _moe_permute),
    "dslab::moe_permute_backward": (ELEMENTWISE, _moe_permute_backward),
    "dslab::moe_unpermute": (ELEMENTWISE, _moe_unpermute),
    "dslab::moe_unpermute_backward": (ELEMENTWISE, _moe_unpermute_backward),
    "aten::native_layer_norm": (ELEMENTWISE, _layer_norm_forward),
    "aten::native_layer_norm_backward": (ELEMENTWISE, _native_layer_norm_backward),
    "aten::_scaled_dot_product_flash_attention_for_cpu": (CPU_ATTENTION, _cpu_attention_forward),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (CPU_ATTENTION, _cpu_attention_backward),
}


def op_name(func) -> str:
    """The qualified name of an op overload without its overload: ``"aten::mm"``,
    ``"dslab::attention_forward"``."""
    return func.name().split(".", 1)[0]


def _per_element(name: str, args, out) -> int:
    """Elementwise estimate of an aten op from :data:`_PER_ELEMENT`; ``_foreach_<op>`` ops cost
    ``<op>``'s constant per element of their first list."""
    base = name.split("::", 1)[1]
    foreach = base.startswith("_foreach_")
    if foreach:
        base = base[len("_foreach_"):]
    entry = _PER_ELEMENT.get(base[:-1] if base.endswith("_") else base)  # in-place "add_" as "add"
    if entry is None:
        return 0
    per, basis = entry
    if foreach:
        return per * _numel(args[0])
    if basis == "in":
        return per * _first_tensor_numel(args)
    return per * _out_numel(out)


def _attention_formula(formula, packet_name: str, args, kwargs, out) -> int:
    """``formula`` of an op, with grouped-query SDPA calls priced on widened key/value heads."""
    if "scaled_dot_product" not in packet_name:
        return int(formula(*args, **kwargs, out_val=out))
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except AssertionError:
        return int(formula(*expand_kv_heads(args), **kwargs, out_val=out))


def count(func, args, kwargs, out) -> tuple[str, int] | None:
    """``(figure, flops)`` for one executed op overload ``func`` with its arguments and output, or
    None when it costs nothing countable.

    A fused attention kernel called causal (:func:`runs_causal`) counts half its formula's flops,
    as dslab's own attention does: torch's SDPA formulas price the whole score square whatever the
    mask, while the fused kernels skip the blocks above the diagonal. So the same model costs the
    same flops on dslab's Triton attention, on cuDNN's (which dslab's packed attention takes on
    Hopper) and in a plain arm; only there does the total differ from ``FlopCounterMode``'s. The
    math path (``SDPBackend.MATH``) decomposes into matmuls over the whole square, counted as such.
    """
    packet = func._overloadpacket
    formula = flop_counter.flop_registry.get(packet)
    if formula is not None:
        flops = _attention_formula(formula, str(packet), args, kwargs, out)
        return MATMUL, flops // 2 if runs_causal(func, args, kwargs) else flops
    name = op_name(func)
    named = _NAMED.get(name)
    if named is not None:
        figure, formula = named
        flops = int(formula(args, kwargs, out))
        if figure == CPU_ATTENTION and runs_causal(func, args, kwargs):
            flops //= 2
        return figure, flops
    if name.startswith("aten::"):
        flops = _per_element(name, args, out)
        if flops:
            return ELEMENTWISE, flops
    return None


def describe_constants() -> str:
    """One line per elementwise constant, for the text report's notes."""
    return (
        f"elementwise estimates per element: pointwise 1 (2 for fused multiply-adds and activation "
        f"backwards), reductions 1, layer norm {LAYER_NORM_FORWARD} forward / {LAYER_NORM_BACKWARD} backward, "
        f"RMS norm {RMS_NORM_FORWARD} / {RMS_NORM_BACKWARD}, "
        f"softmax {SOFTMAX_FORWARD} / {SOFTMAX_BACKWARD}, cross-entropy {CROSS_ENTROPY_FORWARD} / "
        f"{CROSS_ENTROPY_BACKWARD} per logit"
    )

