"""``deepspeed.ops.deepspeed4science``'s names, so a DeepSpeed4Science script's import line works
after swapping the package name: ``from dslab.ops.deepspeed4science import
DS4Sci_EvoformerAttention``, called as ``DS4Sci_EvoformerAttention(Q, K, V, [mask_bias,
pair_bias])``."""

from dslab.kernels.evoformer.evoformer_attention import DS4Sci_EvoformerAttention

__all__ = ["DS4Sci_EvoformerAttention"]
