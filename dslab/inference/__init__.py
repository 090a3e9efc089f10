"""dslab's inference engine: DeepSpeed's ``init_inference`` on dslab's kernels.

- :mod:`~dslab.inference.engine`: ``init_inference`` and :class:`InferenceEngine` (forward, generate).
- :mod:`~dslab.inference.config`: the keys (DeepSpeed's names) and their checks.
- :mod:`~dslab.inference.policies`: which models are injected and where their weights are.
- :mod:`~dslab.inference.modules`: the injected model (fused QKV, bias+GELU, residual+LayerNorm, int8);
  :mod:`~dslab.inference.llama_modules` the Llama layout's (RMSNorm, rope, grouped-query attention, SwiGLU).
- :mod:`~dslab.inference.tensor_parallel`: heads and MLP columns sliced over ranks;
  :mod:`~dslab.inference.auto_tp`: automatic tensor parallelism of a model without a policy.
- :mod:`~dslab.inference.kv_cache`, :mod:`~dslab.inference.decode`, :mod:`~dslab.inference.generate`:
  the static KV cache, the per-token step (CUDA graphs per batch bucket), token choice and
  transformers' generation arguments.
- :mod:`~dslab.inference.timing`: prefill and per-token times of one generation.
"""

from dslab.inference.config import InferenceConfig
from dslab.inference.engine import InferenceEngine, init_inference
from dslab.inference.timing import TokenClock

__all__ = ["InferenceConfig", "InferenceEngine", "TokenClock", "init_inference"]
