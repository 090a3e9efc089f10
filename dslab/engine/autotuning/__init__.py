"""DeepSpeed's autotuning: search the engine config (ZeRO stage, micro-batch size, accumulation,
offload, activation checkpointing, CUDA graphs, kernels) for the fastest one that fits.

The tuner runs the user's training script once per candidate config (an *experiment*); the engine
in that process measures a few steps and exits. The modules:

- :mod:`~dslab.engine.autotuning.config`: the ``autotuning`` config section (DeepSpeed's keys).
- :mod:`~dslab.engine.autotuning.experiment`: the engine side of one experiment (the
  ``DSLAB_AUTOTUNING_EXPERIMENT`` protocol): times the profiled steps, writes ``metrics.json``,
  exits.
- :mod:`~dslab.engine.autotuning.space`: the candidate configs, from the user's tuning scope.
- :mod:`~dslab.engine.autotuning.memory_model`: which candidates fit in device memory.
- :mod:`~dslab.engine.autotuning.tuner`: the order experiments run in (grid, random, model-based).
- :mod:`~dslab.engine.autotuning.driver`: launches the experiments and collects their metrics.
- :mod:`~dslab.engine.autotuning.outputs`: the optimal config, its command line, the summary and
  the run report.
"""
