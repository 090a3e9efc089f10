#!/usr/bin/env bash
# suites/zero as it is and with a change to its engine config, back to back on one machine (after
# . benchmarks/gpu_setup.sh): AB_PATCH is JSON deep-merged into a copy of the suite's "engine".
#   the stack graphed whole against the "auto" segments:
#     AB_PATCH='{"cuda_graphs": {"segments": 1}}' bash benchmarks/zero_engine_ab.sh
#   stage 1-2's post-step gathers waited at the next forward's readers:
#     AB_PATCH='{"zero_optimization": {"overlap_param_gather": true}}' AB_ARMS=dslab-zero1,dslab-zero2 \
#       bash benchmarks/zero_engine_ab.sh
#   AB_ARMS=dslab-zero0,dslab-zero1,dslab-zero2  AB_CASES=355m  AB_TRIALS=2  AB_NPROCS=2  AB_SUITE_S=200
set -uo pipefail
: "${AB_PATCH:?AB_PATCH: JSON merged into the suite's engine config, e.g. '{\"cuda_graphs\": {\"segments\": 1}}'}"
out="${OUT:-/tmp/zero_ab}"
patched=$(mktemp -d)/zero
cp -r suites/zero "$patched"
python3 - "$patched/suite.json" "$AB_PATCH" <<'PY'
import json, sys
path, patch = sys.argv[1], json.loads(sys.argv[2])
def merge(into, extra):
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
suite = json.load(open(path))
merge(suite["engine"], patch)
json.dump(suite, open(path, "w"), indent=2)
PY
for variant in as-is patched; do
  suite=suites/zero; [ "$variant" = patched ] && suite="$patched"
  echo "== $variant${AB_PATCH:+ }$([ "$variant" = patched ] && echo "$AB_PATCH")"
  timeout -s INT -k 30 "${AB_SUITE_S:-200}" python3 -m dslab.cli bench "$suite" --nprocs "${AB_NPROCS:-2}" \
    --cases "${AB_CASES:-355m}" --arms "${AB_ARMS:-dslab-zero0,dslab-zero1,dslab-zero2}" --trials "${AB_TRIALS:-2}" \
    --steps 8 --warmup 5 --out "$out/$variant" 2>&1 | grep -E "^  (arm|dslab|ddp|fsdp|deepspeed)|^zero /"
  run=$(ls -d "$out/$variant"/zero/*/ 2>/dev/null | tail -1)
  [ -n "$run" ] && python3 benchmarks/zero_profile_summary.py "$run" | cut -c1-150
done
