"""The memory layout of the Evoformer attention kernels' outputs, shared by the op
(:mod:`dslab.kernels.evoformer.evoformer_attention`, its fake tensors) and the Triton forward and
backward that write them."""

from __future__ import annotations

import math

import torch


def output_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``t``'s shape and dtype for the kernels to write (out, dq, dk, dv), in
    ``t``'s memory layout where the kernels can address it: dense, unit stride along D and batch
    dims that merge into one. A caller passing transposed views (the Evoformer's column and
    ending-node attentions attend along the other residue axis) then gets outputs whose inverse
    transposes are contiguous, so no copy is made around the kernels. Otherwise contiguous."""
    out = torch.empty_like(t)
    if out.stride(-1) == 1:
        try:
            out.view(math.prod(t.shape[:-4]), *t.shape[-4:])
            return out
        except RuntimeError:
            pass
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)
