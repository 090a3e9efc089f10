#!/usr/bin/env bash
# Issue 45's GPU measurements, in parts that each fit one device call (10 minutes):
#   detect    benchmarks/gate_detection.py on suites/gpt2 case 124m: A/A gate runs and gate runs
#             against a 2% injected step slowdown, threshold 2%, <= 15 pairs (SESSIONS x REPEATS each)
#   autotune  benchmarks/autotune_vs_grid.sh gpt2_355m: the tuned search against the full grid
# Several parts in one call run in order: bash benchmarks/gate_gpu.sh detect autotune
# Results and logs land in $OUT; each part's table prints last.
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for part in "$@"; do
  case "$part" in
    detect)
      timeout "${DETECT_S:-560}" python3 benchmarks/gate_detection.py --suite suites/gpt2 --case "${CASE:-124m}" \
        --steps "${STEPS:-10}" --sessions "${SESSIONS:-2}" --repeats "${REPEATS:-5}" --slowdown "${SLOWDOWN:-0.02}" \
        --threshold "${THRESHOLD:-0.02}" --logs "$OUT/gate_logs" --json "$OUT/gate_detection.json" \
        > "$OUT/gate_detection.log" 2>&1
      echo "detect: exit $?"; tail -30 "$OUT/gate_detection.log" ;;
    autotune)
      bash benchmarks/autotune_vs_grid.sh "${MODEL:-gpt2_355m}" ;;
    *) echo "gate_gpu.sh: unknown part '$part' (detect, autotune)" >&2; exit 2 ;;
  esac
done
