"""The sublayers of an Evoformer block (AlphaFold 2 supplement, Algorithms 7-15, as OpenFold writes
them), each returning the update that the block adds to its residual stream.

Shapes: the MSA representation ``m`` is ``[batch, N_seq, N_res, c_m]``, the pair representation
``z`` is ``[batch, N_res, N_res, c_z]``; ``msa_mask`` ``[batch, N_seq, N_res]`` and ``pair_mask``
``[batch, N_res, N_res]`` hold 1 for real entries and 0 for padding (float, integer or bool).

Attention, one function per kernel set (:data:`ATTENTION`), all taking the layout of DeepSpeed's
``DS4Sci_EvoformerAttention``: q, k, v ``[*, rows, N, heads, head_dim]`` (each of ``rows`` attends
over its own ``N`` entries), ``biases`` a list of one or two additive biases in q's dtype that
broadcast against the logits ``[*, rows, heads, N, N]`` — the mask bias ``[*, rows, 1, 1, N]``
first, then an optional pair/triangle bias ``[*, 1, heads, N, N]`` — and the softmax scale
``head_dim ** -0.5`` applied inside. Each returns ``[*, rows, N, heads, head_dim]``.

- ``"torch"``: OpenFold's reference path: ``softmax(q k^T scale + biases) v`` in plain PyTorch ops,
  the logits ``[*, rows, heads, N, N]`` materialised (written and read back once per bias add, by
  the softmax and by the second matmul; kept for the backward).
- ``"sdpa"``: ``F.scaled_dot_product_attention`` with the biases summed into one float
  ``attn_mask`` ``[*, heads, N, N]`` (heads and queries broadcast where the mask has no extent; with
  a pair bias the sum is materialised at the logits' size).
- ``"dslab"``: :func:`dslab.kernels.evoformer.evoformer_attention.evoformer_attention` (DS4Sci semantics).

Masks become additive biases as in OpenFold: ``BIG * (mask - 1)`` with ``BIG = 1e9``, lowered to a
quarter of the largest finite value in fp16 so that the mask bias plus a pair bias stays finite.
A query whose every key is masked out gets near-uniform weights whose exact values depend on how an
implementation rounds ``-1e9 + logit``; no real entry is such a query when the masks come from a
crop's padding.

Already-normalised inputs: every sublayer begins with a LayerNorm of the residual stream it reads,
and its ``forward(..., normed=True)`` (or ``forward_normed``) takes that LayerNorm's output instead
(for the row attention, the normalised m; its pair-bias LayerNorm still reads z). The dslab set's
block (:class:`dslab.models.evoformer.EvoformerBlock`) computes it together with the residual add
that precedes it (:func:`add_layer_norm`); ``normed=True`` keeps the call going through the
module, so that its hooks (the flops profiler's per-sublayer counts) still see every sublayer.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.kernels.evoformer.outer_product_linear import outer_product_linear
from dslab.kernels.evoformer.sigmoid_gate import sigmoid_gate
from dslab.kernels.linear.column_sum import linear as linear_column_sum_bias
from dslab.kernels.norm.layer_norm_channels import layer_norm_channels_first
from dslab.models.ops import LayerNorm, OpSet
from dslab.models.weight_cast import weight

MASK_BIG = 1e9
#: OpenFold's epsilon added to the count of sequences the outer product mean averages over.
OUTER_PRODUCT_MEAN_EPS = 1e-3
LAYER_NORM_EPS = 1e-5


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``BIG * (mask - 1)`` for a key mask ``[*, rows, N]``, shaped ``[*, rows, 1, 1, N]`` in ``dtype``."""
    big = min(MASK_BIG, torch.finfo(dtype).max / 4)
    return (big * (mask.to(dtype) - 1))[..., :, None, None, :]


def attention_torch(q, k, v, biases):
    q, k, v = (t.transpose(-2, -3) for t in (q, k, v))  # [*, rows, heads, N, head_dim]
    logits = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    for bias in biases:
        logits = logits + bias
    return torch.matmul(torch.softmax(logits, dim=-1), v).transpose(-2, -3)


def attention_sdpa(q, k, v, biases):
    *lead, n_q, heads, head_dim = q.shape
    n_k = k.shape[-3]
    bias = biases[0]
    for extra in biases[1:]:
        bias = bias + extra
    bias = bias.expand(*lead, bias.shape[-3], bias.shape[-2], n_k)
    q, k, v = (t.transpose(-2, -3).reshape(-1, heads, t.shape[-3], head_dim) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.reshape(-1, *bias.shape[-3:]))
    return out.view(*lead, heads, n_q, head_dim).transpose(-2, -3)


def attention_dslab(q, k, v, biases):
    from dslab.kernels.evoformer.evoformer_attention import evoformer_attention

    # The kernel takes any strides, but the pair bias comes permuted from [B, R, R, H] (stride H
    # along keys) and is read once per row: one contiguous copy makes every later read coalesced.
    return evoformer_attention(q, k, v, [b.contiguous() for b in biases])


ATTENTION = {"torch": attention_torch, "sdpa": attention_sdpa, "dslab": attention_dslab}


def apply_linear(layer: nn.Linear, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``layer(x)``; with ``fused`` (the dslab set) its bias gradient comes from
    :func:`dslab.kernels.linear.column_sum.linear`'s column sums instead of PyTorch's slow row reduction."""
    return linear_column_sum_bias(x, weight(layer.weight), layer.bias) if fused else layer(x)


class _FusedProjections(torch.autograd.Function):
    """``x @ cat(weights).T`` split into one output per weight; the backward's input gradient is
    one chain of GEMMs accumulating into one buffer (``addmm`` with beta 1), each weight's
    gradient its own GEMM. Under autocast the matmuls run in the autocast dtype and each weight
    gradient is returned in its weight's dtype."""

    @staticmethod
    def forward(ctx, x, *weights):
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        with torch.autocast(x.device.type, enabled=False):
            x_c = x.to(dtype)
            w_c = [w.to(dtype) for w in weights]
            rows = x_c.reshape(-1, x_c.shape[-1])
            y = torch.mm(rows, torch.cat(w_c).t())
        ctx.save_for_backward(rows, *w_c)
        ctx.set_materialize_grads(False)  # an unused output gets no GEMMs and its weight no gradient
        ctx.x_shape, ctx.x_dtype, ctx.w_dtypes = x.shape, x.dtype, [w.dtype for w in weights]
        widths = [w.shape[0] for w in weights]
        return tuple(part.view(*x.shape[:-1], width) for part, width in zip(y.split(widths, dim=1), widths))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        rows, *w_c = ctx.saved_tensors
        dx = None
        dws = []
        with torch.autocast(rows.device.type, enabled=False):
            for grad, w, w_dtype in zip(grads, w_c, ctx.w_dtypes):
                if grad is None:
                    dws.append(None)
                    continue
                g = grad.reshape(-1, w.shape[0]).to(rows.dtype)
                if ctx.needs_input_grad[0]:
                    dx = torch.mm(g, w) if dx is None else dx.addmm_(g, w)
                dws.append(torch.mm(g.t(), rows).to(w_dtype))
        if dx is not None:
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        return (dx, *dws)


def fused_projections(x: torch.Tensor, layers: list[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """``layer(x)`` without its bias for each of ``layers`` (all reading ``x``), from one matmul
    over their concatenated weights: views of one ``[..., sum of widths]`` product.

    The Evoformer projects each normalised input four to six times (q, k, v and the gate of an
    attention; the four gates and projections of a triangle multiplication and its output gate).
    As separate Linears, the gradient of ``x`` is the sum of their input gradients: one [rows, c]
    add per extra consumer (about 90 adds of 8 to 16 MiB per step of four blocks at AlphaFold's
    initial crop, 1.3 ms on an H100). Here the forward is one GEMM and the input gradient one
    chain of GEMMs into one buffer (:class:`_FusedProjections`). The weight gradients stay one
    GEMM per layer: joining the output gradients for a single one costs a copy of them (a
    ``[65536, 640]`` concatenation took 50 to 90 us, more than the GEMMs it would merge). Widths
    should keep the product's rows 16-byte aligned (multiples of 8 in 16-bit dtypes): cuBLAS falls
    back to slower kernels otherwise, and the attention kernels read q, k, v from these rows."""
    return _FusedProjections.apply(x, *[weight(layer.weight) for layer in layers])


class GateLinear(nn.Linear):
    """A Linear whose sigmoid gates an update; its bias starts at 1 (AF2's gating init), so the
    gates start mostly open."""


def add_layer_norm(norm: LayerNorm, update: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` with ``h = residual + update``, from one ``ops.layer_norm(residual=)`` call:
    the dslab kernel writes ``h`` and its normalisation in one pass and adds ``h``'s incoming
    gradient inside the LayerNorm backward, so neither the add nor the accumulation of the residual
    stream's gradient is a kernel of its own. Both are taken in the dtype ``residual + update``
    would have (an fp32 stream stays fp32 under autocast)."""
    dtype = torch.promote_types(update.dtype, residual.dtype)
    return norm.ops.layer_norm(update.to(dtype), norm.weight, norm.bias, norm.eps, residual=residual.to(dtype))


def shared_dropout(x: torch.Tensor, p: float, shared_dim: int, training: bool) -> torch.Tensor:
    """AF2's row-/column-wise dropout: one mask for every index along ``shared_dim`` (``-3``:
    shared across rows, "DropoutRowwise"; ``-2``: across columns, "DropoutColumnwise")."""
    if not training or p == 0.0:
        return x
    shape = list(x.shape)
    shape[shared_dim] = 1
    return x * F.dropout(x.new_ones(shape), p, training=True)


class GatedAttention(nn.Module):
    """AF2's gated multi-head attention over the rows of ``x`` ``[*, rows, N, c_in]``:
    ``linear_o(sigmoid(linear_g(x)) * attention(linear_q(x), linear_k(x), linear_v(x), biases))``."""

    def __init__(self, c_in: int, heads: int, head_dim: int, kernels: str):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.attend = ATTENTION[kernels]
        self.fused_gate = kernels == "dslab"
        inner = heads * head_dim
        self.linear_q = nn.Linear(c_in, inner, bias=False)
        self.linear_k = nn.Linear(c_in, inner, bias=False)
        self.linear_v = nn.Linear(c_in, inner, bias=False)
        self.linear_g = GateLinear(c_in, inner)
        self.linear_o = nn.Linear(inner, c_in)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pair_bias: torch.Tensor | None = None,
                transposed: bool = False) -> torch.Tensor:
        """``x`` ``[B, rows, N, c_in]``, key ``mask`` ``[B, rows, N]``, ``pair_bias`` ``[B, 1, H, N, N]``.

        ``transposed``: ``x`` is ``[B, N, rows, c_in]`` (each row attends down a column of ``x``) and
        so is the result. q, k, v are projected in that layout and handed to the attention as
        transposed views; the dslab kernel writes its output in their layout (see
        :func:`dslab.kernels.evoformer.evoformer_layout.output_like`), so the update comes back in ``x``'s
        layout with no transposed copy of ``x``, the context or their gradients.

        The dslab set projects q, k, v and the gate in one matmul (:func:`fused_projections`)."""
        split = (*x.shape[:-1], self.heads, self.head_dim)
        gate = None
        if self.fused_gate:
            q, k, v, gate = fused_projections(x, [self.linear_q, self.linear_k, self.linear_v, self.linear_g])
            q, k, v = (t.view(split) for t in (q, k, v))
        else:
            q, k, v = (proj(x).view(split) for proj in (self.linear_q, self.linear_k, self.linear_v))
        if transposed:
            q, k, v = (t.transpose(-3, -4) for t in (q, k, v))
        biases = [mask_bias(mask, q.dtype)]
        if pair_bias is not None:
            biases.append(pair_bias.to(q.dtype))
        context = self.attend(q, k, v, biases)
        if transposed:
            context = context.transpose(-3, -4)
        context = context.reshape(*x.shape[:-1], -1)
        if self.fused_gate:
            gated = sigmoid_gate(gate, context, self.linear_g.bias)
        else:
            gated = torch.sigmoid(self.linear_g(x)) * context
        return apply_linear(self.linear_o, gated, self.fused_gate)


class MSARowAttentionWithPairBias(nn.Module):
    """Algorithm 7: each MSA row attends over its residues, biased by ``linear_z(LN(z))`` per head."""

    def __init__(self, c_m: int, c_z: int, heads: int, head_dim: int, ops: OpSet, kernels: str):
        super().__init__()
        self.layer_norm_m = LayerNorm(c_m, LAYER_NORM_EPS, ops)
        self.layer_norm_z = LayerNorm(c_z, LAYER_NORM_EPS, ops)
        self.linear_z = nn.Linear(c_z, heads, bias=False)
        self.mha = GatedAttention(c_m, heads, head_dim, kernels)

    def forward(self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor, normed: bool = False
                ) -> torch.Tensor:
        """``normed``: ``m`` is already ``layer_norm_m``'s output (z is always the raw pair stream)."""
        x = m if normed else self.layer_norm_m(m)
        return self.forward_normed(x, self.layer_norm_z(z), msa_mask)

    def forward_normed(self, x_m: torch.Tensor, x_z: torch.Tensor, msa_mask: torch.Tensor) -> torch.Tensor:
        """The update from ``x_m = layer_norm_m(m)`` and ``x_z = layer_norm_z(z)``."""
        if self.mha.fused_gate:  # dslab: the weight from the stack's one cast (dslab.models.weight_cast)
            pair_bias = F.linear(x_z, weight(self.linear_z.weight))
        else:
            pair_bias = self.linear_z(x_z)
        pair_bias = pair_bias.permute(0, 3, 1, 2).unsqueeze(1)  # [B, 1, H, R, R]
        return self.mha(x_m, msa_mask, pair_bias)


class MSAColumnAttention(nn.Module):
    """Algorithm 8: each residue's column of the MSA attends over the sequences (mask bias only)."""

    def __init__(self, c_m: int, heads: int, head_dim: int, ops: OpSet, kernels: str):
        super().__init__()
        self.layer_norm_m = LayerNorm(c_m, LAYER_NORM_EPS, ops)
        self.mha = GatedAttention(c_m, heads, head_dim, kernels)

    def forward(self, m: torch.Tensor, msa_mask: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """``normed``: ``m`` is already ``layer_norm_m(m)`` (in m's layout)."""
        if normed or self.mha.fused_gate:
            return self.forward_normed(m if normed else self.layer_norm_m(m), msa_mask)
        x = self.layer_norm_m(m.transpose(-2, -3))  # [B, R, S, c_m]
        return self.mha(x, msa_mask.transpose(-1, -2)).transpose(-2, -3)

    def forward_normed(self, x: torch.Tensor, msa_mask: torch.Tensor) -> torch.Tensor:
        """The update from ``x = layer_norm_m(m)`` ``[B, S, R, c_m]`` (m's layout, not transposed)."""
        if self.mha.fused_gate:  # dslab: attend down the columns of x in place
            return self.mha(x, msa_mask.transpose(-1, -2), transposed=True)
        return self.mha(x.transpose(-2, -3), msa_mask.transpose(-1, -2)).transpose(-2, -3)


class Transition(nn.Module):
    """Algorithms 9 and 15: ``mask * linear_2(relu(linear_1(LN(x))))``, hidden ``factor * c``."""

    def __init__(self, c: int, factor: int, ops: OpSet):
        super().__init__()
        self.layer_norm = LayerNorm(c, LAYER_NORM_EPS, ops)
        self.linear_1 = nn.Linear(c, factor * c)
        self.linear_2 = nn.Linear(factor * c, c)
        self.fused = ops.name == "dslab"

    def forward(self, x: torch.Tensor, mask: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """``normed``: ``x`` is already ``layer_norm(x)``."""
        return self.forward_normed(x if normed else self.layer_norm(x), mask)

    def forward_normed(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The masked update from ``x = layer_norm(stream)``."""
        hidden = F.relu(apply_linear(self.linear_1, x, self.fused))
        x = apply_linear(self.linear_2, hidden, self.fused)
        return x * mask.unsqueeze(-1).to(x.dtype)


def cast_once_weights(module: nn.Module) -> list[nn.Parameter]:
    """The weights the dslab set reads through :func:`dslab.models.weight_cast.weight`: every
    Linear's weight in ``module`` except the outer product mean's ``linear_out``, whose kernel
    (:func:`dslab.kernels.evoformer.outer_product_linear.outer_product_linear`) reads the fp32 weight itself
    and accumulates its gradient in fp32. Biases stay fp32: the gate kernels and column sums take
    them in fp32."""
    skip = {id(sub.linear_out.weight) for sub in module.modules() if isinstance(sub, OuterProductMean)}
    return [sub.weight for sub in module.modules()
            if isinstance(sub, nn.Linear) and id(sub.weight) not in skip and sub.weight.requires_grad]


class OuterProductMean(nn.Module):
    """Algorithm 10: ``linear_out(mean_s a[s,i] (x) b[s,j])`` over the unmasked sequences, where
    ``a``, ``b`` = masked ``linear_1``, ``linear_2`` of ``LN(m)`` (width ``c_hidden``). As in
    OpenFold the mean divides the projected sum (bias included) by ``count + 1e-3``, count being the
    number of sequences where both residues are unmasked."""

    def __init__(self, c_m: int, c_z: int, c_hidden: int, ops: OpSet):
        super().__init__()
        self.layer_norm = LayerNorm(c_m, LAYER_NORM_EPS, ops)
        self.linear_1 = nn.Linear(c_m, c_hidden)
        self.linear_2 = nn.Linear(c_m, c_hidden)
        self.linear_out = nn.Linear(c_hidden * c_hidden, c_z)
        self.fused = ops.name == "dslab"

    def forward(self, m: torch.Tensor, msa_mask: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """``normed``: ``m`` is already ``layer_norm(m)``."""
        return self.forward_normed(m if normed else self.layer_norm(m), msa_mask)

    def forward_normed(self, x: torch.Tensor, msa_mask: torch.Tensor) -> torch.Tensor:
        """The pair update from ``x = layer_norm(m)`` ``[B, S, R, c_m]``."""
        if self.fused:  # both projections in one matmul (see fused_projections)
            both = torch.cat([weight(self.linear_1.weight), weight(self.linear_2.weight)])
            bias = torch.cat([self.linear_1.bias, self.linear_2.bias])
            a, b = linear_column_sum_bias(x, both, bias).chunk(2, dim=-1)  # [B, S, R, c] each
        else:
            a, b = self.linear_1(x), self.linear_2(x)
        mask = msa_mask.to(a.dtype)
        a, b = a * mask.unsqueeze(-1), b * mask.unsqueeze(-1)
        batch, seqs, res, c = a.shape
        # [B, R*c, S] @ [B, S, R*c]: the sum over sequences as one matmul.
        outer = torch.matmul(a.reshape(batch, seqs, res * c).transpose(-1, -2), b.reshape(batch, seqs, res * c))
        with torch.autocast(x.device.type, enabled=False):  # counts up to N_seq, exact in fp32
            float_mask = msa_mask.float()
            count = torch.matmul(float_mask.transpose(-1, -2), float_mask)  # [B, R, R]
        if self.fused:
            # linear_out read straight from the product's [B, i, c, j, d] layout (no permuted copy
            # of it forward, nor of its gradient backward), the mean's division by the count a
            # row scale of its epilogue (and of the output gradient it reads backward).
            return outer_product_linear(outer.view(batch, res, c, res, c), self.linear_out.weight,
                                        self.linear_out.bias, row_scale=1.0 / (count + OUTER_PRODUCT_MEAN_EPS))
        outer = outer.view(batch, res, c, res, c).transpose(-2, -3).reshape(batch, res, res, c * c)
        update = apply_linear(self.linear_out, outer, self.fused)
        return (update / (count.unsqueeze(-1) + OUTER_PRODUCT_MEAN_EPS)).to(update.dtype)


class _TriangleProduct(torch.autograd.Function):
    """The triangle multiplication's ``[B, c, R, R]`` product of the channels-first ``a`` and ``b``:
    outgoing ``a b^T`` (``sum_k a[i, k] b[j, k]``), incoming ``a^T b`` (``sum_k a[k, i] b[k, j]``),
    with each input's gradient computed as one GEMM in the input's own layout: outgoing
    ``da = g b``, ``db = g^T a``; incoming ``da = b g^T``, ``db = a g``. Autograd's matmul backward
    returns the transposed operand's gradient as a transposed view, which the gate's view then
    copies (2 copies of ``[B, c, R, R]`` per block; 0.3 ms of a 24 ms step at AlphaFold's initial
    crop on an H200)."""

    @staticmethod
    def forward(ctx, a, b, outgoing):
        ctx.outgoing = outgoing
        ctx.save_for_backward(a, b)
        return torch.matmul(a, b.transpose(-1, -2)) if outgoing else torch.matmul(a.transpose(-1, -2), b)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        g = g.to(a.dtype)
        da = db = None
        if ctx.outgoing:
            if ctx.needs_input_grad[0]:
                da = torch.matmul(g, b)
            if ctx.needs_input_grad[1]:
                db = torch.matmul(g.transpose(-1, -2), a)
        else:
            if ctx.needs_input_grad[0]:
                da = torch.matmul(b, g.transpose(-1, -2))
            if ctx.needs_input_grad[1]:
                db = torch.matmul(a, g)
        return da, db, None


class TriangleMultiplication(nn.Module):
    """Algorithms 11 (``outgoing``: ``x[i,j] = sum_k a[i,k] b[j,k]``) and 12 (incoming:
    ``sum_k a[k,i] b[k,j]``) with AF2's gates: ``a = mask * sigmoid(linear_a_g(LN(z))) * linear_a_p(LN(z))``
    (``b`` alike), update ``sigmoid(linear_g(LN(z))) * linear_z(layer_norm_out(x))``."""

    def __init__(self, c_z: int, c_hidden: int, outgoing: bool, ops: OpSet):
        super().__init__()
        self.outgoing = outgoing
        self.fused_gate = ops.name == "dslab"
        self.layer_norm_in = LayerNorm(c_z, LAYER_NORM_EPS, ops)
        self.linear_a_p = nn.Linear(c_z, c_hidden)
        self.linear_a_g = GateLinear(c_z, c_hidden)
        self.linear_b_p = nn.Linear(c_z, c_hidden)
        self.linear_b_g = GateLinear(c_z, c_hidden)
        self.linear_g = GateLinear(c_z, c_z)
        self.linear_z = nn.Linear(c_hidden, c_z)
        self.layer_norm_out = LayerNorm(c_hidden, LAYER_NORM_EPS, ops)

    def forward(self, z: torch.Tensor, pair_mask: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """``normed``: ``z`` is already ``layer_norm_in(z)``."""
        return self.forward_normed(z if normed else self.layer_norm_in(z), pair_mask)

    def forward_normed(self, x: torch.Tensor, pair_mask: torch.Tensor) -> torch.Tensor:
        """The update from ``x = layer_norm_in(z)``."""
        if self.fused_gate:
            return self._forward_fused(x, pair_mask)
        a = torch.sigmoid(self.linear_a_g(x)) * self.linear_a_p(x)
        b = torch.sigmoid(self.linear_b_g(x)) * self.linear_b_p(x)
        mask = pair_mask.unsqueeze(-1).to(a.dtype)
        a, b = (a * mask).permute(0, 3, 1, 2), (b * mask).permute(0, 3, 1, 2)  # [B, c, R, R]
        if self.outgoing:
            product = torch.matmul(a, b.transpose(-1, -2))  # [B, c, i, j] = sum_k a[i, k] b[j, k]
        else:
            product = torch.matmul(a.transpose(-1, -2), b)  # sum_k a[k, i] b[k, j]
        update = self.linear_z(self.layer_norm_out(product.permute(0, 2, 3, 1)))
        return torch.sigmoid(self.linear_g(x)) * update

    def _forward_fused(self, x: torch.Tensor, pair_mask: torch.Tensor) -> torch.Tensor:
        """The same function on :func:`dslab.kernels.evoformer.sigmoid_gate.sigmoid_gate`: the five projections of
        ``x = LN(z)`` in one matmul (:func:`fused_projections`), each gate taking its two projections
        without their biases and adding them itself, and ``a``, ``b`` come out
        channels-first (``[B, c, R, R]``), the layout the triangle product multiplies in; the
        product is normalised over c by :func:`dslab.kernels.norm.layer_norm_channels.layer_norm_channels_first`,
        which reads it channels first and writes ``[B, R, R, c]``."""
        a_g, a_p, b_g, b_p, g = fused_projections(
            x, [self.linear_a_g, self.linear_a_p, self.linear_b_g, self.linear_b_p, self.linear_g])
        a = sigmoid_gate(a_g, a_p, self.linear_a_g.bias, self.linear_a_p.bias, pair_mask, channels_first=True)
        b = sigmoid_gate(b_g, b_p, self.linear_b_g.bias, self.linear_b_p.bias, pair_mask, channels_first=True)
        product = _TriangleProduct.apply(a, b, self.outgoing)
        # [B, c, R, R] normalised over c straight into [B, R, R, c]: no permuted copy of the product.
        norm = self.layer_norm_out
        hidden = layer_norm_channels_first(product, norm.weight, norm.bias, norm.eps)
        return sigmoid_gate(g, F.linear(hidden, weight(self.linear_z.weight)), self.linear_g.bias, self.linear_z.bias)


class TriangleAttention(nn.Module):
    """Algorithms 13 (starting node: row ``i`` of ``z`` attends over ``j``, biased by
    ``linear(LN(z))[j, k]``) and 14 (ending node: the same on the transposed ``z``)."""

    def __init__(self, c_z: int, heads: int, head_dim: int, starting: bool, ops: OpSet, kernels: str):
        super().__init__()
        self.starting = starting
        self.layer_norm = LayerNorm(c_z, LAYER_NORM_EPS, ops)
        self.linear = nn.Linear(c_z, heads, bias=False)
        self.mha = GatedAttention(c_z, heads, head_dim, kernels)

    def forward(self, z: torch.Tensor, pair_mask: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """``normed``: ``z`` is already ``layer_norm(z)`` (z's layout, for either node)."""
        if normed or (not self.starting and self.mha.fused_gate):
            return self.forward_normed(z if normed else self.layer_norm(z), pair_mask)
        if not self.starting:
            z, pair_mask = z.transpose(-2, -3), pair_mask.transpose(-1, -2)
        x = self.layer_norm(z)
        triangle_bias = self.linear(x).permute(0, 3, 1, 2).unsqueeze(1)  # [B, 1, H, R, R]
        update = self.mha(x, pair_mask, triangle_bias)
        return update if self.starting else update.transpose(-2, -3)

    def forward_normed(self, x: torch.Tensor, pair_mask: torch.Tensor) -> torch.Tensor:
        """The update from ``x = layer_norm(z)`` ``[B, R, R, c_z]`` (z's layout: the ending node
        is not transposed first), which the triangle bias projection reads too."""
        if not self.starting and self.mha.fused_gate:
            # dslab: the ending node attends down the columns of z in place; its bias
            # b[h, j, k] = linear(LN(z))[k, j, h] is the transposed projection.
            triangle_bias = F.linear(x, weight(self.linear.weight)).permute(0, 3, 2, 1).unsqueeze(1)
            return self.mha(x, pair_mask.transpose(-1, -2), triangle_bias, transposed=True)
        if not self.starting:
            x, pair_mask = x.transpose(-2, -3), pair_mask.transpose(-1, -2)
        if self.mha.fused_gate:
            triangle_bias = F.linear(x, weight(self.linear.weight))
        else:
            triangle_bias = self.linear(x)
        triangle_bias = triangle_bias.permute(0, 3, 1, 2).unsqueeze(1)  # [B, 1, H, R, R]
        update = self.mha(x, pair_mask, triangle_bias)
        return update if self.starting else update.transpose(-2, -3)
