#!/usr/bin/env bash
# One device call for the larger-than-GPU work: set up, check on the GPU that parameter offload
# and zero.Init give the reference losses, then measure. What runs is chosen by LARGE_PARTS
# (space-separated, in order): check, activations, ladder, hoststep (benchmarks/offload_step.py on
# this machine's CPU: the offloaded step with the clip factor folded into the fused AdamW against
# a separate scaling pass, HOSTSTEP_LAYERS Linear(4096, 4096) layers, 24 by default; HOSTSTEP_ARGS
# adds options, e.g. --param-offload for the ladder's stage-3 job). The ladder's configs and sizes come
# from LADDER_CONFIGS / LADDER_SIZES, LADDER_ARGS adds options (e.g. "--accum 16 --steps 2
# --fetch-dtype bf16 --accumulate-on gpu_resident"), and it stops at LADDER_BUDGET seconds. Results land in $OUT
# (flat: act.json, ladder.json, ladder rows) and the tables print last.
#   LARGE_PARTS="check activations ladder" LADDER_CONFIGS=stage3 bash benchmarks/large_models_gpu.sh
# On several GPUs each size runs data-parallel over them (ZeRO-3 sharded across the ranks):
#   LARGE_PARTS=ladder LADDER_CONFIGS=stage3,offload-split LADDER_SIZES=13b,13b-80l LADDER_ARGS="--nproc 4" \
#     bash benchmarks/large_models_gpu.sh
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PARTS=${LARGE_PARTS:-"check activations ladder"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
df -h /tmp | tail -1
for part in $PARTS; do
  case $part in
    check)
      timeout "${CHECK_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/engine/zero/test_param_offload_gpu.py 2>&1 | tail -15 ;;
    activations)
      timeout "${ACT_S:-240}" python3 benchmarks/activation_memory.py --json "$OUT/act.json" \
        > "$OUT/act.log" 2>&1; tail -8 "$OUT/act.log" ;;
    ladder)
      python3 benchmarks/size_ladder.py --configs "${LADDER_CONFIGS:-stage3,offload}" \
        --sizes "${LADDER_SIZES:-1.3b,2.7b,6.7b,13b}" --budget "${LADDER_BUDGET:-300}" \
        --size-timeout "${LADDER_SIZE_S:-240}" ${LADDER_ARGS:-} --json "$OUT/ladder.json" > "$OUT/ladder.log" 2>&1
      cp "$OUT"/size_ladder_rows/*.json "$OUT/" 2>/dev/null
      grep -v "^  " "$OUT/ladder.log" | tail -30 ;;
    hoststep)
      timeout "${HOSTSTEP_S:-300}" python3 benchmarks/offload_step.py --layers "${HOSTSTEP_LAYERS:-24}" --dim 4096 \
        --trials "${HOSTSTEP_TRIALS:-3}" ${HOSTSTEP_ARGS:-} --json "$OUT/hoststep.json" > "$OUT/hoststep.log" 2>&1
      tail -5 "$OUT/hoststep.log" ;;
  esac
done
