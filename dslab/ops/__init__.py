"""DeepSpeed's ``deepspeed.ops`` import names: ``dslab.ops.deepspeed4science`` re-exports the
Evoformer attention that lives in :mod:`dslab.kernels.evoformer.evoformer_attention`."""
