"""The ``evoformer`` family: AlphaFold 2's Evoformer stack trained on a fixed synthetic crop.

The model (:class:`EvoformerTrainModel`) wraps :class:`dslab.models.evoformer.EvoformerStack` of
one kernel set and returns a loss, so that every arm's step is the stack's forward, backward and
optimizer step::

    m_out, z_out = stack(m * m_scale, z * z_scale, msa_mask, pair_mask)
    loss = sum(msa_mask * m_out^2) / (sum(msa_mask) * c_m) + sum(pair_mask * z_out^2) / (sum(pair_mask) * c_z)

(in fp32): the mean square of each output over its real (unpadded) entries. The padded entries are
left out because a query whose every key is padding gets attention weights that depend on how an
implementation rounds the mask bias (:mod:`dslab.models.evoformer_blocks`), so with them the arms'
losses would differ by more than rounding. ``m_scale`` and ``z_scale`` are learnable scalars
initialised to 1: the stack's inputs then need gradients, so the backward computes them, as it
does inside AlphaFold, where ``m`` and ``z`` come from the embedders.

The batch (:func:`evoformer_batch`): ``m`` ``[micro_batch, N_seq, N_res, c_m]`` and ``z``
``[micro_batch, N_res, N_res, c_z]`` ~ N(0, 1) drawn from the suite's seed, in the precision's dtype
(bf16/fp16, else fp32); the masks in the same dtype mark the last :data:`PADDED_RESIDUES` of the
residues and the last :data:`PADDED_SEQUENCES` of the MSA rows (rounded up) of every crop as
padding, as a crop of a shorter protein with a shallower MSA is padded at its end. ``msa_mask[s, r]`` is 1 where both
sequence ``s`` and residue ``r`` are real, ``pair_mask[i, j]`` where both residues are.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from dslab.models.evoformer import EvoformerConfig, EvoformerStack

# Fractions of each crop's residues and MSA rows that are padding (at the end of the crop).
PADDED_RESIDUES = 0.125
PADDED_SEQUENCES = 0.25


class EvoformerTrainModel(nn.Module):
    """``forward(m, z, msa_mask, pair_mask) -> loss`` (fp32 scalar); see the module docstring."""

    def __init__(self, config: EvoformerConfig, kernels: str = "dslab"):
        super().__init__()
        if not isinstance(config, EvoformerConfig):
            raise ValueError(f"config must be an EvoformerConfig, got {type(config).__name__}")
        self.config = config
        self.m_scale = nn.Parameter(torch.ones(()))
        self.z_scale = nn.Parameter(torch.ones(()))
        self.stack = EvoformerStack(config, kernels=kernels)

    def forward(self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor,
                pair_mask: torch.Tensor) -> torch.Tensor:
        m_out, z_out = self.stack(m * self.m_scale.to(m.dtype), z * self.z_scale.to(z.dtype), msa_mask, pair_mask)
        return masked_mean_square(m_out, msa_mask) + masked_mean_square(z_out, pair_mask)

    def enable_cuda_graphs(self, enabled: bool = True) -> None:
        """The engine's ``cuda_graphs`` switch: the stack's blocks run from captured graphs
        (:meth:`dslab.models.evoformer.EvoformerStack.enable_cuda_graphs`)."""
        self.stack.enable_cuda_graphs(enabled)

    def release_cuda_graphs(self) -> None:
        self.stack.release_cuda_graphs()

    @property
    def cuda_graph_stats(self) -> dict[str, int]:
        return self.stack.cuda_graph_stats


def masked_mean_square(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``x ** 2`` (``[*, c]``, in fp32) over the entries where ``mask`` (``[*]``) is 1."""
    mask = mask.float()
    return (x.float().pow(2) * mask.unsqueeze(-1)).sum() / (mask.sum().clamp(min=1.0) * x.shape[-1])


def real_entries(total: int, padded_fraction: float) -> int:
    """How many of ``total`` rows are real when ``padded_fraction`` of them, rounded up, are padding
    (at least one is real; a tiny crop is padded too)."""
    return max(1, total - math.ceil(total * padded_fraction))


def evoformer_batch(config: EvoformerConfig, micro_batch: int, dtype: torch.dtype, seed: int,
                    device: torch.device | str) -> dict[str, torch.Tensor]:
    """``{"m", "z", "msa_mask", "pair_mask"}`` for ``micro_batch`` crops of ``config.n_seq`` x
    ``config.n_res`` (module docstring); ``m`` is ``micro_batch * n_seq * n_res * c_m`` values,
    ``z`` ``micro_batch * n_res^2 * c_z``."""
    seqs, res = config.n_seq, config.n_res
    generator = torch.Generator(device=device).manual_seed(seed)
    m = torch.randn(micro_batch, seqs, res, config.c_m, generator=generator, device=device).to(dtype)
    z = torch.randn(micro_batch, res, res, config.c_z, generator=generator, device=device).to(dtype)
    residue = torch.arange(res, device=device) < real_entries(res, PADDED_RESIDUES)
    sequence = torch.arange(seqs, device=device) < real_entries(seqs, PADDED_SEQUENCES)
    msa_mask = (sequence[:, None] & residue[None, :]).to(dtype).expand(micro_batch, seqs, res).contiguous()
    pair_mask = (residue[:, None] & residue[None, :]).to(dtype).expand(micro_batch, res, res).contiguous()
    return {"m": m, "z": z, "msa_mask": msa_mask, "pair_mask": pair_mask}
