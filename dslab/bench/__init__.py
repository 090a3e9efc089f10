"""dslab.bench: reproducible benchmark suites and their run reports (``dslab bench SUITE``).

- :mod:`~dslab.bench.runner`: runs a suite: the processes, scale, trial counts, interleaved
  trials, failures and the report; the same for every kind of suite.
- :mod:`~dslab.bench.protocol`: what a kind of suite implements for the runner.
- :mod:`~dslab.bench.training` and :mod:`~dslab.bench.inference`: the two kinds, training steps
  and generation; :mod:`~dslab.bench.arms` and :mod:`~dslab.bench.workloads` are training's arms
  and models, :mod:`~dslab.bench.suite` and :mod:`~dslab.bench.inference_suite` the suite files.
- :mod:`~dslab.bench.data_parallel` and :mod:`~dslab.bench.model_parallel`: training on several
  processes that ``dslab bench`` launches itself (:mod:`~dslab.bench.launcher`), the arms sharding
  strategies (``suites/zero``; peers in :mod:`~dslab.bench.peers`) or parallel layouts
  (``suites/parallel``; peers in :mod:`~dslab.bench.model_parallel_peers`, on
  :mod:`~dslab.bench.torch_gpt2`'s model); :mod:`~dslab.bench.data_parallel_suite` and
  :mod:`~dslab.bench.model_parallel_suite` their suite files.
- :mod:`~dslab.bench.common`: the device, error wording, progress lines and processes they share;
  :mod:`~dslab.bench.measure`: timing and peaks.
"""
