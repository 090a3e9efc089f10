#!/usr/bin/env bash
# One device call for the lab's own measurements on one GPU: set up, then
#  1. the kernel benchmark's CUDA-graph timing on the dropout cases (captured, replayed, then run
#     eagerly; tests/kernels/dropout/test_dropout_graph_capture_gpu.py) and run.py's table for those ops;
#  2. the continuous profiles' stream-mark timer against kernel durations
#     (tests/profilers/test_event_time_gpu.py);
#  3. what continuous profiling costs: GPT-2 124M with every profiler on against every profiler off,
#     in one process (benchmarks/continuous_profiling.py), for each EVERY:TIMER of PROFILE_RUNS
#     (flops_profiler.every_n_steps and continuous_timer; default 100:events 100:kernels 20:events).
# Results land in $OUT (flat); the tables print last. SKIP_CAPTURE=1 leaves out step 1.
#   bash benchmarks/profiling_gpu.sh
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
RUNS=${PROFILE_RUNS:-100:events 100:kernels 20:events}
if [ -z "${SKIP_CAPTURE:-}" ]; then
  timeout "${CAPTURE_S:-240}" python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/kernels/dropout/test_dropout_graph_capture_gpu.py \
    > "$OUT/graph_capture.log" 2>&1
  timeout "${KERNELS_S:-240}" python3 benchmarks/kernels/run.py --ops attention,bias_dropout_residual --rounds 3 \
    --json "$OUT/kernels_dropout.json" > "$OUT/kernels_dropout.log" 2>&1
fi
timeout "${EVENTS_S:-300}" python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/profilers/test_event_time_gpu.py \
  > "$OUT/event_time_gpu.log" 2>&1
for run in $RUNS; do
  every=${run%%:*} timer=${run##*:}
  timeout "${CONTINUOUS_S:-300}" python3 benchmarks/continuous_profiling.py --size full --every "$every" --timer "$timer" \
    --trials 5 --out "$OUT/continuous-$every-$timer.json" > "$OUT/continuous-$every-$timer.log" 2>&1
done
if [ -z "${SKIP_CAPTURE:-}" ]; then
  tail -4 "$OUT/graph_capture.log"
  grep -E "capture|ERROR|^op|p0\.1|bias_dropout" "$OUT/kernels_dropout.log" | tail -14
fi
grep -E "later profiles|profiled step|passed|failed|Error" "$OUT/event_time_gpu.log" | tail -6
for run in $RUNS; do
  every=${run%%:*} timer=${run##*:}
  echo "== every_n_steps $every, continuous_timer $timer"
  tail -7 "$OUT/continuous-$every-$timer.log"
done
