"""The ``liger`` arm's model: transformers' ``LlamaForCausalLM`` with Liger-Kernel's Triton ops.

Liger-Kernel (``pip install liger-kernel``) swaps transformers' Llama pieces for its own kernels:
RMSNorm and the SwiGLU MLP per module, the LM head fused with its cross-entropy per model (the
logits are never materialised), and the rotary embedding through the module-level function
``modeling_llama.apply_rotary_pos_emb``. :func:`apply_liger_kernel_to_llama` patches the first two
on the instance; the rotary function it sets module-wide, which would change the ``hf`` arm's
model too, since the runner alternates the arms' trials in one process. So :func:`build_liger_llama`
puts the module's functions back right after patching, and :func:`liger_rope` sets Liger's rotary
function for the duration of a ``liger`` step only. The arm runs eagerly, as Liger's own recipe does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from dslab.bench.common import ArmSkipped

# What apply_liger_kernel_to_llama may set on transformers' modeling_llama module.
_MODULE_GLOBALS = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")


def liger_available(device: torch.device) -> None:
    """Raise :class:`ArmSkipped` saying why the arm cannot run here (not installed, no CUDA)."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as err:
        raise ArmSkipped(f"liger-kernel is not installed ({err}); pip install liger-kernel") from None
    if device.type != "cuda":
        raise ArmSkipped(f"Liger-Kernel's Triton kernels run on CUDA devices; this run is on {device}")


def build_liger_llama(model: nn.Module) -> nn.Module:
    """``model`` (transformers' ``LlamaForCausalLM``) with Liger's RMSNorm, SwiGLU MLP and fused
    linear cross-entropy on the instance; transformers' module globals left as they were."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    saved = {name: getattr(modeling_llama, name) for name in _MODULE_GLOBALS}
    try:
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
                                    cross_entropy=False, model=model)
    finally:
        for name, value in saved.items():
            setattr(modeling_llama, name, value)
    return model


@contextlib.contextmanager
def liger_rope() -> Iterator[None]:
    """transformers' Llama rotates q and k with Liger's kernel inside the block."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = liger_rotary_pos_emb
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = original
