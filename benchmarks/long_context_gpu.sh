#!/usr/bin/env bash
# suites/long_context on every GPU of a lent machine (or LC_NPROCS of them), in one device call (10 minutes): set up
# (benchmarks/gpu_setup.sh), optionally check torch-cp against one GPU's unsplit model (LC_CHECK=1:
# the gpu-marked test of tests/bench/test_long_context_suite.py, both arms at the tiny scale on 2
# GPUs, about 2 minutes with Triton's first compiles), then run the full scale: a 1.5B Llama at 32k,
# 64k, 128k and 256k tokens on 4 GPUs, dslab-ulysses and torch-cp, 1 trial of 2 timed steps after 1
# warm-up step (the suite's own counts, 2 trials of 3, do not fit one call at 256k: a step there is
# ~2.6e16 model flops, tens of seconds per arm).
# The suite runs under a time limit sent as SIGINT to its whole process group, so that the ranks
# keep what they measured and the report is merged and summarised before the call ends.
# Reports land in $OUT/reports (each run.json also as $OUT/long_context-<run id>.json), the
# progress lines in $OUT/progress.log; the trial lines and then the summary table print last.
#
#   LC_CHECK=1  LC_CASES=32k,64k,128k,256k  LC_ARMS=dslab-ulysses,torch-cp  LC_TRIALS=1  LC_STEPS=2
#   LC_WARMUP=1  LC_CHECK_S=150  LC_SUITE_S=480  LC_NPROCS=<every GPU>    bash benchmarks/long_context_gpu.sh
# With LC_CHECK=1, leave 256k out (LC_CASES=32k,64k,128k) or lower LC_SUITE_S to stay in one call.
set -uo pipefail
. benchmarks/gpu_setup.sh
out="${OUT:-/tmp/long_context}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

if [ "${LC_CHECK:-0}" = 1 ]; then
  echo "== torch-cp and dslab-ulysses against one GPU's unsplit model (tiny scale, 2 GPUs)"
  timeout -s INT -k 30 "${LC_CHECK_S:-150}" python3 -m pytest -p no:xdist -p no:cacheprovider -q -m gpu \
    tests/bench/test_long_context_suite.py > "$out/check.log" 2>&1
  echo "check exit status $?"
  tail -8 "$out/check.log"
fi

nprocs="${LC_NPROCS:-$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)}"
echo "== dslab bench suites/long_context --scale full --nprocs $nprocs"
timeout -s INT -k 60 "${LC_SUITE_S:-480}" python3 -m dslab.cli bench suites/long_context --scale full --nprocs "$nprocs" \
  --cases "${LC_CASES:-32k,64k,128k,256k}" --arms "${LC_ARMS:-dslab-ulysses,torch-cp}" \
  --trials "${LC_TRIALS:-1}" --steps "${LC_STEPS:-2}" --warmup "${LC_WARMUP:-1}" --out "$out/reports" \
  > "$out/summary.txt" 2> "$out/progress.log"
echo "suite exit status $?"
for run in "$out"/reports/long_context/*/run.json; do
  [ -f "$run" ] && cp "$run" "$out/long_context-$(basename "$(dirname "$run")").json"
done
grep -E "trial [0-9]+/|: skipped|: failed|: oom|Error" "$out/progress.log" | tail -20
cat "$out/summary.txt"
