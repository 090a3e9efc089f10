#!/usr/bin/env bash
# The multi-rank NCCL comms fixture of the dashboard (tests/dashboards/fixtures/comms_reports): one
# device call on a machine with 2 or more GPUs. `dslab bench suites/gpt2` (full scale, case 124m,
# the dslab arm) on every GPU, rank 1 slowed by COMMS_FIXTURE_SLEEP_MS (default 20) in every step,
# so that the comms logger's straggler analysis names it; the run lands in $OUT/reports and its
# run.json as $OUT/comms-<run id>.json, which goes beside the CPU fixture with this command in the
# fixture README.
#   COMMS_FIXTURE_SLEEP_MS=20 COMMS_FIXTURE_STEPS=10 COMMS_FIXTURE_S=300  bash benchmarks/comms_fixture_gpu.sh
set -uo pipefail
. benchmarks/gpu_setup.sh
out="${OUT:-/tmp/comms_fixture}"
mkdir -p "$out"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
DSLAB_INJECT_STEP_SLEEP_MS="${COMMS_FIXTURE_SLEEP_MS:-20}" DSLAB_INJECT_STEP_SLEEP_RANKS=1 \
  timeout -s INT -k 30 "${COMMS_FIXTURE_S:-300}" python3 -m torch.distributed.run --standalone --nproc_per_node "$gpus" \
  -m dslab.cli bench suites/gpt2 --scale full --cases 124m --arms dslab --trials 1 \
  --steps "${COMMS_FIXTURE_STEPS:-10}" --warmup 3 --out "$out/reports" > "$out/comms_fixture.log" 2>&1
echo "bench exit status $?"
for run in "$out"/reports/gpt2/*/run.json; do
  [ -f "$run" ] && cp "$run" "$out/comms-$(basename "$(dirname "$run")").json"
done
grep -E "straggler|trial|Error" "$out/comms_fixture.log" | tail -12
