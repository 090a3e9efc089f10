#!/usr/bin/env bash
# Why stage 3 ran at half its isolated speed inside suites/zero: one device call that runs
#  1. the stage 3 graphed-stack check and the tensor/sequence-parallel graphs check (2 GPUs);
#  2. suites/zero's dslab-zero0, -zero2 and -zero3 arms (355m, N = GAP_NPROCS, default 1,2) as the
#     suite configures them, and dslab-zero3 again at N = 1 from a copy of the suite without its
#     profilers (engine keys flops_profiler, memory_tracer, comms_logger, telemetry,
#     wall_clock_breakdown removed);
#  3. benchmarks/zero_step_profile.py at stage 3 (the isolated step) for the same machine.
# Trial lines, the arms' CUDA-graph notes and the isolated step print last; reports land in $OUT.
# GAP_EXTRA=0 leaves out the profiler-less copy and the isolated step.
#   GAP_NPROCS=1,2 GAP_TRIALS=2 GAP_STEPS=8 GAP_EXTRA=1 bash benchmarks/zero3_suite_gap.sh
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  STACK_WORKER_FAMILIES=gpt2 timeout -k 10 120 python3 -m pytest -p no:xdist -p no:cacheprovider -q -x \
    tests/engine/zero/test_stage3_stack.py -k "not bert" > "$OUT/stage3_stack.log" 2>&1
  echo "stage 3 stack check: exit status $?" | tee "$OUT/checks.txt"
  timeout -k 10 100 python3 -m pytest -p no:xdist -p no:cacheprovider -q -m gpu \
    tests/parallel/test_parallel_graphs_gpu.py > "$OUT/parallel_graphs.log" 2>&1
  echo "parallel graphs check: exit status $?" | tee -a "$OUT/checks.txt"
fi
bench() {
  timeout -s INT -k 20 "$1" python3 -m dslab.cli bench "$2" --cases 355m --nprocs "$3" --arms "$4" \
    --trials "${GAP_TRIALS:-2}" --steps "${GAP_STEPS:-8}" --warmup 5 --out "$OUT/reports" 2>&1
}
bench 300 suites/zero "${GAP_NPROCS:-1,2}" dslab-zero0,dslab-zero2,dslab-zero3 > "$OUT/suite.log"
if [ "${GAP_EXTRA:-1}" = 1 ]; then
  mkdir -p /tmp/zero_noprof
  python3 - <<'PY'
import json
suite = json.load(open("suites/zero/suite.json"))
for key in ("flops_profiler", "memory_tracer", "comms_logger", "telemetry", "wall_clock_breakdown"):
    suite["engine"].pop(key, None)
suite["name"] = "zero_noprof"
json.dump(suite, open("/tmp/zero_noprof/suite.json", "w"), indent=1)
PY
  bench 120 /tmp/zero_noprof 1 dslab-zero3 > "$OUT/suite_noprof.log"
  timeout -k 10 90 python3 benchmarks/zero_step_profile.py --stage 3 --cuda-graphs --warmup 6 --steps 8 \
    --variants none,all > "$OUT/isolated.log" 2>&1
fi
cat "$OUT/checks.txt" 2>/dev/null
for log in suite suite_noprof; do
  echo "== $log"; grep -E "tokens/s|CUDA graphs|Error|error" "$OUT/$log.log" | grep -v Warning | tail -30
done
grep -E "^stage|Error" "$OUT/isolated.log"
python3 - "$OUT/reports" <<'PY'
import json, pathlib, sys
for run in sorted(pathlib.Path(sys.argv[1]).glob("*/*/run.json")):
    for note in json.loads(run.read_text()).get("notes", []):
        if "CUDA graphs" in note or "host" in note:
            print(run.parent.parent.name, note)
PY
