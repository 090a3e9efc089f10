#!/usr/bin/env bash
# One device call (under 10 minutes) on a machine with 2 or more GPUs, for what the single-GPU
# machines cannot show: set up (benchmarks/gpu_setup.sh), then
#  1. the stage 3 graphed layer stack against stage 0 on 2 nccl processes, and that its processes
#     exit (tests/engine/zero/test_stage3_stack.py: graphs holding collectives are reset before
#     the process group is destroyed);
#  2. the graphed layer stack with tensor- and sequence-parallel collectives inside against the
#     eager one (tests/parallel/test_parallel_graphs_gpu.py);
#  3. where a ZeRO-3 step's time goes with suites/zero's profilers, one at a time, on one GPU
#     (benchmarks/zero_step_profile.py --variants), and what a stage 0 step's host waits on with 2
#     processes (its host time was its step time in suites/zero at N = 2, not at N = 1);
#  4. GPT-2 1.5B (50 heads) in the dp, tp2 and pp2 layouts on 2 GPUs, dp and tp2 with their layer
#     stacks graphed (benchmarks/parallel_layouts.py --cuda-graphs), with host time per step.
# Each part has a time limit; logs land in $OUT (flat) and the results print last.
#   MULTI_CHECK_S=120 MULTI_GRAPHS_S=100 MULTI_PROFILE_S=120 MULTI_STAGE0_S=90 MULTI_LAYOUTS_S=140
#     bash benchmarks/multi_gpu_checks.sh
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
STACK_WORKER_FAMILIES=gpt2 timeout -k 10 "${MULTI_CHECK_S:-120}" python3 -m pytest -p no:xdist -p no:cacheprovider -q -x \
  tests/engine/zero/test_stage3_stack.py -k "not bert" > "$OUT/stage3_stack.log" 2>&1
echo "stage 3 stack check: exit status $?"
timeout -k 10 "${MULTI_GRAPHS_S:-100}" python3 -m pytest -p no:xdist -p no:cacheprovider -q -m gpu \
  tests/parallel/test_parallel_graphs_gpu.py > "$OUT/parallel_graphs.log" 2>&1
echo "parallel graphs check: exit status $?"
timeout -k 10 "${MULTI_PROFILE_S:-120}" python3 benchmarks/zero_step_profile.py --stage 3 --cuda-graphs --warmup 6 --steps 5 \
  --variants none,all,comms_logger,memory_tracer,wall_clock_breakdown,flops_profiler,telemetry > "$OUT/zero3_variants.log" 2>&1
timeout -k 10 "${MULTI_STAGE0_S:-90}" python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
  benchmarks/zero_step_profile.py --stage 0 --cuda-graphs --steps 5 --top 20 --variants all > "$OUT/zero0_n2.log" 2>&1
timeout -s INT -k 10 "${MULTI_LAYOUTS_S:-140}" python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
  benchmarks/parallel_layouts.py --size 1.5b-h50 --layouts dp,tp2,pp2 --micro 4 --micro-batches 16 --cuda-graphs \
  --json "$OUT/layouts.json" > "$OUT/layouts.log" 2>&1
for log in stage3_stack parallel_graphs; do tail -4 "$OUT/$log.log"; done
grep -E "^stage|Error" "$OUT/zero3_variants.log"
grep -v Warning "$OUT/zero0_n2.log" | grep -A14 "^stage"
grep -v '^{' "$OUT/layouts.log" | grep -v Warning | tail -8
