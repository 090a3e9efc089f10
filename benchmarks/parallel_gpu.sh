#!/usr/bin/env bash
# One device call for 3D parallelism on one host's GPUs: set up, then time GPT-2 in the layouts
# of PARALLEL_LAYOUTS (benchmarks/parallel_layouts.py) on every GPU of the machine, 1.5B first
# (with 50 heads of 32: GPT-2 XL's 25 heads do not split over 2 tensor-parallel ranks) and then
# PARALLEL_BIG_SIZE (6.7b: does not fit one GPU with Adam) in PARALLEL_BIG_LAYOUTS.
# Results land in $OUT (flat: layouts-<size>.json and .log); the tables print last.
#   bash benchmarks/parallel_gpu.sh            # on a 4-GPU machine
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
layouts=${PARALLEL_LAYOUTS:-"dp,pp$gpus,tp2dp$((gpus / 2)),pp2dp$((gpus / 2)),tp2pp$((gpus / 2))"}
big_layouts=${PARALLEL_BIG_LAYOUTS:-"pp$gpus,tp2pp$((gpus / 2))"}
run() {  # size layouts extra-args...
  local size=$1 layouts=$2; shift 2
  timeout "${PARALLEL_S:-500}" python3 -m torch.distributed.run --standalone --nproc_per_node "$gpus" \
    benchmarks/parallel_layouts.py --size "$size" --layouts "$layouts" --json "$OUT/layouts-$size.json" "$@" \
    > "$OUT/layouts-$size.log" 2>&1
}
run 1.5b-h50 "$layouts" --micro 4 --micro-batches 16
run "${PARALLEL_BIG_SIZE:-6.7b}" "$big_layouts" --micro 2 --micro-batches 16 --ckpt 1
for size in 1.5b-h50 "${PARALLEL_BIG_SIZE:-6.7b}"; do
  grep -v '^{' "$OUT/layouts-$size.log" | grep -v Warning | tail -12
done
