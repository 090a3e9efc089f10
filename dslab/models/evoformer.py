"""The Evoformer stack of AlphaFold 2 (Jumper et al. 2021, supplement Algorithm 6, as OpenFold
writes it; training mode, without templates or the extra-MSA stack) as a plain ``nn.Module``.

Shapes: ``m`` ``[batch, N_seq, N_res, c_m]`` (the MSA representation), ``z``
``[batch, N_res, N_res, c_z]`` (the pair representation), ``msa_mask`` ``[batch, N_seq, N_res]`` and
``pair_mask`` ``[batch, N_res, N_res]`` (1 = real, 0 = padding; None = all real). Each block updates
both streams with residual adds, in AF2's order::

    m += MSARowAttentionWithPairBias(m, z)      z += OuterProductMean(m)
    m += MSAColumnAttention(m)                  z += TriangleMultiplicationOutgoing(z)
    m += MSATransition(m)                       z += TriangleMultiplicationIncoming(z)
                                                z += TriangleAttentionStartingNode(z)
                                                z += TriangleAttentionEndingNode(z)
                                                z += PairTransition(z)

The sublayers and the attention of each kernel set are in :mod:`dslab.models.evoformer_blocks`.
``kernels`` picks the attention and the layer norm: ``"torch"`` (OpenFold's reference attention in
plain PyTorch, ``F.layer_norm``), ``"sdpa"`` (``F.scaled_dot_product_attention`` with the summed
biases as its mask, ``F.layer_norm``) or ``"dslab"`` (``dslab.kernels.evoformer.evoformer_attention``,
DeepSpeed's ``DS4Sci_EvoformerAttention`` semantics, and dslab's layer norm, into which the dslab
block fuses the residual adds: see :class:`EvoformerBlock`). The three build the same parameters
under the same names, initialised identically from the same seed.

Initialisation (not AF2's): every Linear weight ~ N(0, ``initializer_range``), biases 0, except the
biases of the sigmoid gates (``GateLinear``), which are 1; LayerNorms weight 1, bias 0. AF2's
"final" init zeroes the last projection of every residual branch, which makes every branch the
identity at step 0 and leaves most weights without gradient on the first step, so tests and
benchmarks of one step would exercise little; the small normal init gives every parameter a
gradient from the start.

Dropout: AF2 trains with row-wise dropout 0.15 on the MSA row attention's update and 0.25 on the
triangle updates (row-wise, column-wise for the ending-node attention); those are
:data:`AF2_MSA_DROPOUT` and :data:`AF2_PAIR_DROPOUT`. The config defaults both to 0.0 so that a
benchmark's arms compute the same function and compare like for like.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from dslab.models.evoformer_blocks import (
    GateLinear, MSAColumnAttention, MSARowAttentionWithPairBias, OuterProductMean, Transition, TriangleAttention,
    TriangleMultiplication, add_layer_norm, cast_once_weights, shared_dropout,
)
from dslab.models.graphs import GraphedStack
from dslab.models.ops import op_set
from dslab.models.weight_cast import autocast_dtype, cast_weights, use_casts
from dslab.parallel.partitioned import GatheredParameters

EVOFORMER_KERNEL_SETS = ("dslab", "torch", "sdpa")
AF2_MSA_DROPOUT = 0.15
AF2_PAIR_DROPOUT = 0.25

_POSITIVE_INTS = ("blocks", "n_seq", "n_res", "c_m", "c_z", "msa_heads", "pair_heads", "head_dim", "opm_hidden",
                  "tri_mul_hidden", "transition_factor")


@dataclass
class EvoformerConfig:
    """The Evoformer's shape (defaults: OpenFold's, c_m 256, c_z 128, MSA attention 8 heads of 32,
    triangle attention 4 heads of 32) and regularisation (dropout off by default).

    ``n_seq`` and ``n_res`` are the crop a benchmark runs the model at (its input shapes and data);
    the model itself takes any N_seq and N_res. ``checkpoint_blocks`` recomputes each block in the
    backward (``torch.utils.checkpoint``, non-reentrant) instead of keeping its activations.
    """

    blocks: int
    n_seq: int
    n_res: int
    c_m: int = 256
    c_z: int = 128
    msa_heads: int = 8
    pair_heads: int = 4
    head_dim: int = 32
    opm_hidden: int = 32
    tri_mul_hidden: int = 128
    transition_factor: int = 4
    msa_dropout: float = 0.0
    pair_dropout: float = 0.0
    checkpoint_blocks: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for key in _POSITIVE_INTS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        for key in ("msa_dropout", "pair_dropout"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{key} must be in [0, 1), got {value!r}")
        if not isinstance(self.checkpoint_blocks, bool):
            raise ValueError(f"checkpoint_blocks must be a bool, got {self.checkpoint_blocks!r}")
        if isinstance(self.initializer_range, bool) or not isinstance(self.initializer_range, (int, float)) \
                or not self.initializer_range > 0.0:
            raise ValueError(f"initializer_range must be > 0, got {self.initializer_range!r}")


def evoformer_initial(**overrides) -> EvoformerConfig:
    """4 blocks at AlphaFold's initial-training crop: N_seq 128, N_res 256 (OpenFold's widths)."""
    return EvoformerConfig(**{"blocks": 4, "n_seq": 128, "n_res": 256, **overrides})


def evoformer_finetune(**overrides) -> EvoformerConfig:
    """4 blocks at AlphaFold's fine-tuning crop: N_seq 512, N_res 384 (OpenFold's widths)."""
    return EvoformerConfig(**{"blocks": 4, "n_seq": 512, "n_res": 384, **overrides})


def evoformer_tiny(**overrides) -> EvoformerConfig:
    """2 narrow blocks (c_m 32, c_z 16, 2 heads of 16 each: 16 is the smallest head dim dslab's
    Evoformer attention takes) at N_seq 5, N_res 7: for CPU tests and the suite's ``tiny`` scale."""
    fields = dict(blocks=2, n_seq=5, n_res=7, c_m=32, c_z=16, msa_heads=2, pair_heads=2, head_dim=16,
                  opm_hidden=8, tri_mul_hidden=16)
    return EvoformerConfig(**{**fields, **overrides})


class EvoformerBlock(nn.Module):
    """One Evoformer block (Algorithm 6): the MSA updates, then the pair updates, each residual.

    The dslab set fuses each residual add into the LayerNorm of the sublayer that reads its
    result (:func:`dslab.models.evoformer_blocks.add_layer_norm`), the sublayer then running from
    that normalised input (``normed=True``). On an H100 profile of the dslab set at N_seq 128 x
    N_res 256 (4 blocks) the separate adds and the backward's accumulation of each stream's
    gradient (the one through the residual path plus the one from the LayerNorm) were about 1 ms
    of a 27 ms step: ~18 elementwise passes over 8-16 MiB tensors per block. Fused, the add is
    part of the LayerNorm's forward kernel and the accumulation part of its backward kernel. The
    block's last add, ``z + pair_transition``, stays plain: the next block's first LayerNorms
    (the row attention's, of m and of z) read the block's outputs. The torch and sdpa sets run
    the plain adds, as OpenFold writes them.
    """

    def __init__(self, config: EvoformerConfig, kernels: str):
        super().__init__()
        self.fused_residuals = kernels == "dslab"
        ops = op_set("dslab" if kernels == "dslab" else "torch")
        c_m, c_z, head_dim = config.c_m, config.c_z, config.head_dim
        self.msa_dropout, self.pair_dropout = config.msa_dropout, config.pair_dropout
        self.msa_att_row = MSARowAttentionWithPairBias(c_m, c_z, config.msa_heads, head_dim, ops, kernels)
        self.msa_att_col = MSAColumnAttention(c_m, config.msa_heads, head_dim, ops, kernels)
        self.msa_transition = Transition(c_m, config.transition_factor, ops)
        self.outer_product_mean = OuterProductMean(c_m, c_z, config.opm_hidden, ops)
        self.tri_mul_out = TriangleMultiplication(c_z, config.tri_mul_hidden, outgoing=True, ops=ops)
        self.tri_mul_in = TriangleMultiplication(c_z, config.tri_mul_hidden, outgoing=False, ops=ops)
        self.tri_att_start = TriangleAttention(c_z, config.pair_heads, head_dim, starting=True, ops=ops,
                                               kernels=kernels)
        self.tri_att_end = TriangleAttention(c_z, config.pair_heads, head_dim, starting=False, ops=ops,
                                             kernels=kernels)
        self.pair_transition = Transition(c_z, config.transition_factor, ops)

    def forward(self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor,
                pair_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_residuals:
            return self._forward_fused(m, z, msa_mask, pair_mask)
        train, p_msa, p_pair = self.training, self.msa_dropout, self.pair_dropout
        m = m + shared_dropout(self.msa_att_row(m, z, msa_mask), p_msa, -3, train)
        m = m + self.msa_att_col(m, msa_mask)
        m = m + self.msa_transition(m, msa_mask)
        z = z + self.outer_product_mean(m, msa_mask)
        z = z + shared_dropout(self.tri_mul_out(z, pair_mask), p_pair, -3, train)
        z = z + shared_dropout(self.tri_mul_in(z, pair_mask), p_pair, -3, train)
        z = z + shared_dropout(self.tri_att_start(z, pair_mask), p_pair, -3, train)
        z = z + shared_dropout(self.tri_att_end(z, pair_mask), p_pair, -2, train)
        return m, z + self.pair_transition(z, pair_mask)

    def _forward_fused(self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor,
                       pair_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same updates, each added to its stream by the next sublayer's LayerNorm: ``x, m =
        add_layer_norm(next.layer_norm, update, m)`` gives the new stream ``m`` and ``x`` its
        normalisation, which the next sublayer takes with ``normed=True``. Dropout applies to
        each update before its add, as in :meth:`forward`."""
        train, p_msa, p_pair = self.training, self.msa_dropout, self.pair_dropout
        update = shared_dropout(self.msa_att_row(m, z, msa_mask), p_msa, -3, train)
        x, m = add_layer_norm(self.msa_att_col.layer_norm_m, update, m)
        update = self.msa_att_col(x, msa_mask, normed=True)
        x, m = add_layer_norm(self.msa_transition.layer_norm, update, m)
        update = self.msa_transition(x, msa_mask, normed=True)
        x, m = add_layer_norm(self.outer_product_mean.layer_norm, update, m)
        update = self.outer_product_mean(x, msa_mask, normed=True)
        x, z = add_layer_norm(self.tri_mul_out.layer_norm_in, update, z)
        update = shared_dropout(self.tri_mul_out(x, pair_mask, normed=True), p_pair, -3, train)
        x, z = add_layer_norm(self.tri_mul_in.layer_norm_in, update, z)
        update = shared_dropout(self.tri_mul_in(x, pair_mask, normed=True), p_pair, -3, train)
        x, z = add_layer_norm(self.tri_att_start.layer_norm, update, z)
        update = shared_dropout(self.tri_att_start(x, pair_mask, normed=True), p_pair, -3, train)
        x, z = add_layer_norm(self.tri_att_end.layer_norm, update, z)
        update = shared_dropout(self.tri_att_end(x, pair_mask, normed=True), p_pair, -2, train)
        x, z = add_layer_norm(self.pair_transition.layer_norm, update, z)
        return m, z + self.pair_transition(x, pair_mask, normed=True)


def init_evoformer_(module: nn.Module, std: float) -> None:
    """Linear weights ~ N(0, std), biases 0, gate biases 1 (LayerNorms keep their 1 and 0)."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            # whole while initialised when built partitioned (dslab.zero.Init)
            with GatheredParameters(list(sub.parameters(recurse=False)), modifier_rank=0):
                nn.init.normal_(sub.weight, mean=0.0, std=std)
                if sub.bias is not None:
                    nn.init.constant_(sub.bias, 1.0 if isinstance(sub, GateLinear) else 0.0)


def _block_with_casts(casts, block, m, z, msa_mask, pair_mask):
    with use_casts(casts):
        return block(m, z, msa_mask, pair_mask)


class EvoformerStack(nn.Module):
    """``config.blocks`` Evoformer blocks. ``forward(m, z, msa_mask=None, pair_mask=None)`` returns
    the updated ``(m, z)`` in the inputs' shapes (see the module docstring)."""

    def __init__(self, config: EvoformerConfig, kernels: str = "dslab"):
        super().__init__()
        config.validate()
        if kernels not in EVOFORMER_KERNEL_SETS:
            raise ValueError(f"kernels={kernels!r} is not an Evoformer kernel set; "
                             f"choose one of {', '.join(EVOFORMER_KERNEL_SETS)}")
        if kernels == "dslab":
            from dslab.kernels.evoformer.evoformer_attention import HEAD_DIMS

            if config.head_dim not in HEAD_DIMS:
                raise ValueError(f"head_dim={config.head_dim} is not one that kernels='dslab' supports; "
                                 f"supported head dims: {HEAD_DIMS}")
        self.config = config
        self.kernels = kernels
        self.blocks = nn.ModuleList(EvoformerBlock(config, kernels) for _ in range(config.blocks))
        init_evoformer_(self, config.initializer_range)

    _layer_graphs: GraphedStack | None = None

    def forward(self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor | None = None,
                pair_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        msa_mask, pair_mask = self._checked_masks(m, z, msa_mask, pair_mask)
        if self._layer_graphs is not None:
            m, z = self._layer_graphs.call((m, z), (msa_mask, pair_mask))
            return m, z
        return self._run_blocks(m, z, msa_mask, pair_mask)

    def _run_blocks(self, m, z, msa_mask, pair_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks in order. The dslab set under autocast first casts the blocks' Linear weights
        in one pass (:func:`dslab.models.weight_cast.cast_weights`; its backward casts their
        gradients back in one): on an H200 at the initial crop the ~180 per-weight casts it
        replaces were ~0.9 ms of a 22.7 ms step."""
        recompute = self.config.checkpoint_blocks and torch.is_grad_enabled()
        dtype = autocast_dtype(m.device.type) if self.kernels == "dslab" else None
        params = cast_once_weights(self.blocks) if dtype is not None else []
        with cast_weights(params, dtype) as casts:
            for block in self.blocks:
                if recompute:  # the recomputation sees the same casts (use_casts)
                    m, z = checkpoint(_block_with_casts, casts, block, m, z, msa_mask, pair_mask,
                                      use_reentrant=False)
                else:
                    m, z = block(m, z, msa_mask, pair_mask)
        return m, z

    def enable_cuda_graphs(self, enabled: bool = True) -> None:
        """Run the blocks from captured CUDA graphs in training (:mod:`dslab.models.graphs`: one
        graph for the forward of every block, one for the backward; ``m`` and ``z`` are the
        stack's inputs, the masks its constants). ``False`` goes back to eager and frees them.

        Refused with activation checkpointing: its recomputation restores the RNG state, which a
        capture cannot, and a graph keeps the whole forward's activations in its pool anyway.
        """
        self.release_cuda_graphs()
        self._layer_graphs = None
        if enabled:
            if self.config.checkpoint_blocks:
                raise ValueError("'cuda_graphs.enabled' cannot be combined with the Evoformer's "
                                 "checkpoint_blocks=True (activation checkpointing); turn one off")
            self._layer_graphs = GraphedStack(self.blocks, self._run_blocks)

    def release_cuda_graphs(self) -> None:
        """Free the captured graphs (they are captured again on the next graphed call)."""
        if self._layer_graphs is not None:
            self._layer_graphs.release()

    @property
    def cuda_graph_stats(self) -> dict[str, int]:
        """Captures, replays and eager calls by reason; empty when graphs are off."""
        return dict(self._layer_graphs.stats) if self._layer_graphs is not None else {}

    def _checked_masks(self, m, z, msa_mask, pair_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """The masks (all ones where None), after checking every shape against ``m``'s."""
        c_m, c_z = self.config.c_m, self.config.c_z
        if m.dim() != 4 or m.shape[-1] != c_m:
            raise ValueError(f"m must be [batch, N_seq, N_res, c_m={c_m}], got shape {tuple(m.shape)}")
        batch, n_seq, n_res, _ = m.shape
        expected = {
            "z": (z, (batch, n_res, n_res, c_z), "[batch, N_res, N_res, c_z]"),
            "msa_mask": (msa_mask, (batch, n_seq, n_res), "[batch, N_seq, N_res]"),
            "pair_mask": (pair_mask, (batch, n_res, n_res), "[batch, N_res, N_res]"),
        }
        for name, (tensor, shape, layout) in expected.items():
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ValueError(f"{name} must be {layout} = {shape} to match m {tuple(m.shape)}, "
                                 f"got shape {tuple(tensor.shape)}")
        if msa_mask is None:
            msa_mask = m.new_ones(batch, n_seq, n_res)
        if pair_mask is None:
            pair_mask = m.new_ones(batch, n_res, n_res)
        return msa_mask, pair_mask


def sublayer_flops(config: EvoformerConfig, batch: int = 1) -> dict[str, int]:
    """Matmul and attention flops of one forward of each sublayer of one block, keyed by the
    block's attribute names, at ``batch`` x ``config.n_seq`` x ``config.n_res``. A multiply-add
    counts 2: a Linear over ``rows`` rows is ``2 rows c_in c_out`` (its bias not counted), attention
    over ``rows`` rows of ``N`` entries is ``4 rows H N^2 d`` (``q k^T`` and ``p v``). With
    ``S, R = n_seq, n_res``, ``d = head_dim``, ``f = transition_factor``:

    - gated attention of width ``c`` (q, k, v, gate: 4 Linears ``c -> H d``; out: ``H d -> c``):
      ``10 rows N c H d + 4 rows H N^2 d``
    - ``msa_att_row``: gated attention (rows S, N R, c_m, H_msa) + pair bias ``2 R^2 c_z H_msa``
    - ``msa_att_col``: gated attention (rows R, N S, c_m, H_msa)
    - ``msa_transition``, ``pair_transition``: ``4 S R f c_m^2``, ``4 R^2 f c_z^2``
    - ``outer_product_mean`` (``o = opm_hidden``): projections ``4 S R c_m o``, outer product summed
      over sequences ``2 S R^2 o^2``, sequence counts ``2 S R^2``, output ``2 R^2 o^2 c_z``
    - ``tri_mul_out``, ``tri_mul_in`` (``t = tri_mul_hidden``): projections and gates ``8 R^2 c_z t``,
      output gate ``2 R^2 c_z^2``, output ``2 R^2 t c_z``, triangle product ``2 t R^3``
    - ``tri_att_start``, ``tri_att_end``: gated attention (rows R, N R, c_z, H_pair) + triangle bias
      ``2 R^2 c_z H_pair``

    Layer norms, softmax, sigmoids, masks and residual adds are elementwise and not counted.
    """
    seqs, res, d, f = config.n_seq, config.n_res, config.head_dim, config.transition_factor
    c_m, c_z, h_msa, h_pair = config.c_m, config.c_z, config.msa_heads, config.pair_heads
    o, t = config.opm_hidden, config.tri_mul_hidden

    def linear(rows: int, c_in: int, c_out: int) -> int:
        return 2 * rows * c_in * c_out

    def gated_attention(rows: int, n: int, c: int, heads: int) -> int:
        inner = heads * d
        return 4 * linear(rows * n, c, inner) + linear(rows * n, inner, c) + 4 * rows * heads * n * n * d

    triangle_mul = (4 * linear(res * res, c_z, t) + linear(res * res, c_z, c_z) + linear(res * res, t, c_z)
                    + 2 * t * res ** 3)
    triangle_att = gated_attention(res, res, c_z, h_pair) + linear(res * res, c_z, h_pair)
    flops = {
        "msa_att_row": gated_attention(seqs, res, c_m, h_msa) + linear(res * res, c_z, h_msa),
        "msa_att_col": gated_attention(res, seqs, c_m, h_msa),
        "msa_transition": 2 * linear(seqs * res, c_m, f * c_m),
        "outer_product_mean": (2 * linear(seqs * res, c_m, o) + 2 * seqs * res * res * o * o
                               + 2 * seqs * res * res + linear(res * res, o * o, c_z)),
        "tri_mul_out": triangle_mul,
        "tri_mul_in": triangle_mul,
        "tri_att_start": triangle_att,
        "tri_att_end": triangle_att,
        "pair_transition": 2 * linear(res * res, c_z, f * c_z),
    }
    return {name: batch * value for name, value in flops.items()}


def evoformer_flops(config: EvoformerConfig, batch: int = 1) -> int:
    """Matmul and attention flops of one forward of the whole stack at ``batch`` x ``config.n_seq``
    x ``config.n_res``: ``config.blocks`` times the sum of :func:`sublayer_flops` (its docstring
    has the formula). Equal to the forward matmul flops the flops profiler counts for every kernel
    set (for ``"sdpa"`` on CPU, where the profiler keeps the fused attention beside its total, the
    two figures together)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    return config.blocks * sum(sublayer_flops(config, batch).values())
