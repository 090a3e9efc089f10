#!/usr/bin/env bash
# suites/zero with the layer stack graphed whole (cuda_graphs.segments 1) and cut into the
# "auto" segments, back to back on one machine: whether cutting the graphs lets the data-parallel
# reductions overlap the stack's backward. The first run uses a copy of the suite with segments 1.
#   AB_ARMS=dslab-zero0,dslab-zero1,dslab-zero2  AB_CASES=355m  AB_TRIALS=2  AB_NPROCS=2
#   bash benchmarks/zero_segments_ab.sh      (after . benchmarks/gpu_setup.sh)
set -uo pipefail
out="${OUT:-/tmp/zero_ab}"
whole=$(mktemp -d)/zero
cp -r suites/zero "$whole"
python3 - "$whole/suite.json" <<'PY'
import json, sys
path = sys.argv[1]
suite = json.load(open(path))
suite["engine"]["cuda_graphs"]["segments"] = 1
json.dump(suite, open(path, "w"), indent=2)
PY
for variant in whole auto; do
  suite=suites/zero; [ "$variant" = whole ] && suite="$whole"
  echo "== cuda_graphs.segments: $variant"
  timeout -s INT -k 30 "${AB_SUITE_S:-200}" python3 -m dslab.cli bench "$suite" --nprocs "${AB_NPROCS:-2}" \
    --cases "${AB_CASES:-355m}" --arms "${AB_ARMS:-dslab-zero0,dslab-zero1,dslab-zero2}" --trials "${AB_TRIALS:-2}" \
    --steps 8 --warmup 5 --out "$out/$variant" 2>&1 | grep -E "^  (arm|dslab|ddp|fsdp|deepspeed)|^zero /" | head -12
done
