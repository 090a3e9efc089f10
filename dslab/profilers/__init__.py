"""dslab.profilers: flops, memory, comms, telemetry, timers and trace export.

The standalone flops profiler is importable from here as from DeepSpeed's
``deepspeed.profiling.flops_profiler``: ``get_model_profile`` and ``FlopsProfiler``."""

from dslab.profilers.flops import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
