"""DeepSpeed's ``deepspeed.profiling`` import names: ``dslab.profiling.flops_profiler`` re-exports
the flops profiler that lives in :mod:`dslab.profilers.flops`."""
