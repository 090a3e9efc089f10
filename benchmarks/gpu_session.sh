#!/usr/bin/env bash
# One lent-GPU session's measurements, by stage, so a device call can run the stages that fit:
#   bash benchmarks/gpu_session.sh tests kernels     # gpu tests, kernel table
#   bash benchmarks/gpu_session.sh bert              # dslab bench suites/bert_large (5 trials)
#   bash benchmarks/gpu_session.sh gpt2 overhead     # gpt2 124m + 1.5b, profiler + engine overhead
#   bash benchmarks/gpu_session.sh zero              # ZeRO stages 0-3 (and 1-3 with optimizer offload)
#                                                    # on 1, 2 (4) GPUs: memory, scaling
# GPU_TESTS picks the test folders of the tests stage; GPT2_CASES and GPT2_ARMS the gpt2 stage's
# --cases (default 124m,1.5b) and --arms (default the suite's; on an 80 GB card the two cases
# with all five arms outrun a 10-minute device call: run 124m, then 1.5b without hf); for the
# zero stage: ZERO_STAGES its
# --stages (default 0,1,2,3; 1o-3o offload), ZERO_TRIALS, ZERO_GRANULARITY (stage 3's
# granularity arm, default 1500000, empty for none), ZERO_SUB_GROUP and ZERO_REUSE (extra arms),
# ZERO_SCALING_NPROCS (the process counts, default 1, 2 and 4 where there are GPUs).
# Logs and reports go under $OUT (or ./gpu-out); the last lines of each stage are its table.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. benchmarks/gpu_setup.sh
out="${OUT:-gpu-out}"
mkdir -p "$out"
trials="${TRIALS:-5}"
for stage in "$@"; do
  echo "=== $stage"
  case "$stage" in
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels tests/models tests/profilers tests/engine tests/bench} 2>&1 | tail -15 | tee "$out/gpu_tests.txt" ;;
    kernels)
      python3 benchmarks/kernels/run.py --rounds 3 --json "$out/kernels.json" > "$out/kernels.log" 2>&1
      tail -18 "$out/kernels.log" ;;
    bert)
      python3 -m dslab.cli bench suites/bert_large --trials "$trials" --out "$out" > "$out/bert.log" 2>&1
      grep -A 30 "^run " "$out/bert.log" | tail -25 ;;
    gpt2)
      python3 -m dslab.cli bench suites/gpt2 --cases "${GPT2_CASES:-124m,1.5b}" --trials "$trials" \
        ${GPT2_ARMS:+--arms "$GPT2_ARMS"} --out "$out" > "$out/gpt2.log" 2>&1
      grep -A 30 "^run " "$out/gpt2.log" | tail -25 ;;
    zero)
      # about 10-20 s per arm, trial and process count: ZERO_STAGES=0,1,2,3 (5 arms with the
      # granularity one) x 3 trials on 1 and 2 GPUs fits one 10-minute call; run offload apart
      zero_args=(--stages "${ZERO_STAGES:-0,1,2,3}" --trials "${ZERO_TRIALS:-3}" --cuda-graphs)
      [ -n "${ZERO_GRANULARITY-1500000}" ] && zero_args+=(--granularity "${ZERO_GRANULARITY-1500000}")
      [ -n "${ZERO_SUB_GROUP:-}" ] && zero_args+=(--offload-sub-group "$ZERO_SUB_GROUP")
      [ -n "${ZERO_REUSE:-}" ] && zero_args+=(--reuse "$ZERO_REUSE")
      ZERO_SCALING_OUT="$out/zero" bash benchmarks/zero_scaling.sh "${zero_args[@]}" > "$out/zero.log" 2>&1
      tail -40 "$out/zero.log" ;;
    overhead)
      python3 benchmarks/profiler_overhead.py --suite suites/gpt2 --case 124m > "$out/overhead.log" 2>&1
      tail -4 "$out/overhead.log"
      python3 benchmarks/engine_overhead.py --trials 5 2>&1 | tail -5 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
