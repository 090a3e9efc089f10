"""``deepspeed.profiling.flops_profiler.profiler``'s names (the module DeepSpeed defines them in)."""

from dslab.profilers.flops import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
