#!/usr/bin/env bash
# One device call for the lab's own measurements on one GPU: set up, then
#  1. the kernel benchmark's CUDA-graph timing on the dropout cases (captured, replayed, then run
#     eagerly; tests/kernels/dropout/test_dropout_graph_capture_gpu.py) and run.py's table for those ops;
#  2. what continuous profiling costs: GPT-2 124M with every profiler on (flops_profiler.every_n_steps
#     100, then 20) against every profiler off, in one process (benchmarks/continuous_profiling.py).
# Results land in $OUT (flat); the tables print last.
#   bash benchmarks/profiling_gpu.sh
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout "${CAPTURE_S:-240}" python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/kernels/dropout/test_dropout_graph_capture_gpu.py \
  > "$OUT/graph_capture.log" 2>&1
timeout "${KERNELS_S:-240}" python3 benchmarks/kernels/run.py --ops attention,bias_dropout_residual --rounds 3 \
  --json "$OUT/kernels_dropout.json" > "$OUT/kernels_dropout.log" 2>&1
for every in ${PROFILE_EVERY:-100 20}; do
  timeout "${CONTINUOUS_S:-300}" python3 benchmarks/continuous_profiling.py --size full --every "$every" --trials 5 \
    --out "$OUT/continuous-$every.json" > "$OUT/continuous-$every.log" 2>&1
done
tail -4 "$OUT/graph_capture.log"
grep -E "capture|ERROR|^op|p0\.1|bias_dropout" "$OUT/kernels_dropout.log" | tail -14
for every in ${PROFILE_EVERY:-100 20}; do tail -6 "$OUT/continuous-$every.log"; done
