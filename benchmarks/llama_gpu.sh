#!/usr/bin/env bash
# The Llama family's GPU measurements, in parts that each fit one device call (10 minutes):
#   tests     the gpu-marked tests of the Llama kernels and model (RMSNorm, SwiGLU, rope, GQA
#             attention and decode attention, the model and its injection)
#   kernels   benchmarks/kernels/run.py --ops llama_ops,attention (RMSNorm, SwiGLU, rope against PyTorch)
#   train1b   dslab bench suites/llama --cases 1b (dslab, torch, torch-compile, torch-compile-ro, hf, liger)
#   train3b   dslab bench suites/llama --cases 3b (ARMS, e.g. dslab,torch-compile,liger: the host holds
#             fewer parked 3B arms than the suite has)
#   infer     dslab bench suites/llama_inference (batch 1, 8, 32 decode; a 512-token prefill)
#   decode    the decode GPU tests (dependent launch, graphs, fused steps at 1 and 3 rows), then
#             benchmarks/decode_profile.py --dependent-launch --attention-combine on
#             Llama-3.2-1B's shape at batch 1 and 8 (fused, fused with dependent launch, fused with
#             attention's fused combine, op by op;
#             at batch 8 the fused step runs decode_linear's 16-row tensor-core tiles), and
#             decode_linear_bench.py's sweep of those tiles' configurations at 8 rows, hidden 2048
#             (--short-cache: the engine's step against decode attention's short caches split)
#   profile   benchmarks/profile_arms.py suites/llama --case 1b: the dslab arm (graphed, and eager with
#             its ops' shapes) beside torch-compile, kernel time per step by category
#   gaps      benchmarks/generate_gaps.py: a batch-1 generated token beyond its decode step
#   chain     benchmarks/decode_chain_bench.py: the batch-1 step's 65 projections alone, each group's
#             row-kernel configurations (a few programs an SM, or as many as the SMs hold) timed
# The liger arm needs Liger-Kernel on the machine: carry its wheel in .whl/ (gpu_setup.sh installs
# every wheel there), e.g. pip download --no-deps -d .whl liger-kernel; without it the arm is skipped.
# Several parts in one call run in order: bash benchmarks/llama_gpu.sh tests train1b
# Reports and logs land in $OUT; each part's table prints last.
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TRIALS=${TRIALS:-3}
for part in "$@"; do
  case "$part" in
    tests)
      timeout "${TESTS_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -x \
        tests/kernels/norm/test_rms_norm.py tests/kernels/activation/test_swiglu.py tests/kernels/attention/test_rope.py \
        tests/kernels/attention/test_attention_gqa.py tests/kernels/decode/test_decode_attention_gqa.py \
        tests/models/test_llama_gpu.py tests/inference/test_llama_injection.py > "$OUT/tests.log" 2>&1
      tail -15 "$OUT/tests.log" ;;
    kernels)
      timeout "${KERNELS_S:-300}" python3 benchmarks/kernels/run.py --ops llama_ops --rounds 3 \
        --json "$OUT/kernels_llama.json" > "$OUT/kernels.log" 2>&1
      tail -12 "$OUT/kernels.log" ;;
    train1b|train3b)
      case_name=${part#train}
      arms=()
      [ -n "${ARMS:-}" ] && arms=(--arms "$ARMS")
      timeout "${TRAIN_S:-540}" python3 -m dslab.cli bench suites/llama --cases "$case_name" --trials "$TRIALS" \
        ${arms[@]+"${arms[@]}"} --out "$OUT/reports" > "$OUT/$part.log" 2>&1
      grep -vE "^\[llama" "$OUT/$part.log" | tail -22 ;;
    infer)
      timeout "${INFER_S:-540}" python3 -m dslab.cli bench suites/llama_inference --trials "$TRIALS" \
        --out "$OUT/reports" > "$OUT/infer.log" 2>&1
      grep -vE "^\[llama" "$OUT/infer.log" | tail -40 ;;
    decode)
      timeout "${DECODE_TEST_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/inference/test_dependent_launch_gpu.py tests/inference/test_decode_gpu.py tests/kernels/decode \
        > "$OUT/decode_tests.log" 2>&1
      tail -5 "$OUT/decode_tests.log"
      timeout "${DECODE_S:-300}" python3 benchmarks/decode_profile.py --presets llama3_1b --batches 1,8 --trials 5 \
        --dependent-launch --attention-combine --short-cache > "$OUT/decode_profile.log" 2>&1
      grep -E "^==|dependent launch:|fused combine:|short cache|kernels/step" "$OUT/decode_profile.log"
      tail -4 "$OUT/decode_profile.log"
      timeout "${SWEEP_S:-150}" python3 benchmarks/decode_linear_bench.py --hidden 2048 --rows 8 \
        > "$OUT/decode_linear_rows8.log" 2>&1
      tail -12 "$OUT/decode_linear_rows8.log" ;;
    profile)
      timeout "${PROFILE_S:-420}" python3 benchmarks/profile_arms.py suites/llama --case 1b --shapes \
        --variants "${VARIANTS:-dslab-noprof,dslab-eager,torch-compile}" --trials 3 --steps 10 \
        --out "$OUT/profile" > "$OUT/profile.log" 2>&1
      tail -30 "$OUT/profile.log" ;;
    gaps)
      timeout "${GAPS_S:-180}" python3 benchmarks/generate_gaps.py --preset llama3_1b --batch 1 --new 64 \
        > "$OUT/gaps.log" 2>&1
      tail -25 "$OUT/gaps.log" ;;
    chain)
      timeout "${CHAIN_S:-240}" python3 benchmarks/decode_chain_bench.py --trials 5 > "$OUT/decode_chain.log" 2>&1
      grep -vE "^row \+ PDL, " "$OUT/decode_chain.log" | tail -32 ;;
    *) echo "llama_gpu.sh: unknown part '$part' (tests, kernels, train1b, train3b, infer, decode, profile, gaps, chain)" >&2; exit 2 ;;
  esac
done
