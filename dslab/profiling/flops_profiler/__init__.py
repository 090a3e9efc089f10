"""``deepspeed.profiling.flops_profiler``'s names, so a DeepSpeed script's import line works after
swapping the package name: ``from dslab.profiling.flops_profiler import get_model_profile``."""

from dslab.profilers.flops import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
