#!/usr/bin/env bash
# suites/zero on the GPUs of a lent machine, in one call: set up (benchmarks/gpu_setup.sh: wheels
# carried in .whl/, DeepSpeed's sdist), check that stage 3's graphed layer stack gives stage 0's
# losses and parameters on 2 GPUs (tests/engine/zero/test_stage3_stack.py, GPT-2 tiny), then run
# the suite and leave its report in $OUT/reports (and each run.json as $OUT/zero-<run id>.json). Each part has a time limit, so that one that
# hangs cannot take the others' time; a stage 3 check that fails drops dslab-zero3 from the run.
# On a machine with an empty Triton cache the check compiles every kernel of GPT-2 tiny first
# (over 90 s on an H200); the suite's arms compile theirs in their warm-up steps.
#
#   ZERO_ARMS=...  ZERO_NPROCS=1,4  ZERO_CASES=355m  ZERO_TRIALS=3  ZERO_STEPS=8  ZERO_WARMUP=5
#   ZERO_CHECK_S=180  ZERO_SUITE_S=400  ZERO_CHECK=0 (no stack check)    bash benchmarks/zero_suite_gpu.sh
set -uo pipefail
. benchmarks/gpu_setup.sh
out="${OUT:-/tmp/zero_suite}"
mkdir -p "$out"
arms="${ZERO_ARMS:-dslab-zero0,dslab-zero1,dslab-zero2,dslab-zero3,ddp,fsdp2,deepspeed-zero2,deepspeed-zero3}"
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1

echo "== stage 3 graphed stack against stage 0 (2 GPUs, GPT-2 tiny)"
if [ "${ZERO_CHECK:-1}" = 0 ]; then
  echo "stage 3 stack check: skipped (ZERO_CHECK=0)"
elif STACK_WORKER_FAMILIES=gpt2 timeout "${ZERO_CHECK_S:-180}" python3 -m pytest -p no:xdist -q -x \
     tests/engine/zero/test_stage3_stack.py -k "not bert"; then
  echo "stage 3 stack check: passed"
else
  echo "stage 3 stack check: FAILED or timed out; dslab-zero3 is left out of the run"
  arms="$(echo "$arms" | tr ',' '\n' | grep -vx 'dslab-zero3' | paste -sd, -)"
fi
pkill -f stack_worker.py 2>/dev/null; sleep 1  # a timed-out check's processes must not hold GPUs

echo "== dslab bench suites/zero --arms $arms"
timeout -s INT -k 60 "${ZERO_SUITE_S:-400}" python3 -m dslab.cli bench suites/zero --nprocs "${ZERO_NPROCS:-1,4}" \
  --cases "${ZERO_CASES:-355m}" --arms "$arms" --trials "${ZERO_TRIALS:-3}" --steps "${ZERO_STEPS:-8}" \
  --warmup "${ZERO_WARMUP:-5}" --out "$out/reports"
echo "suite exit status $?"
for run in "$out"/reports/zero/*/run.json; do cp "$run" "$out/zero-$(basename "$(dirname "$run")").json"; done
