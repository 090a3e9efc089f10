#!/usr/bin/env bash
# Issue 45's GPU measurements, in parts that each fit one device call (10 minutes):
#   detect    benchmarks/gate_detection.py on suites/gpt2 case 124m: A/A gate runs and gate runs
#             against a 2% injected step slowdown (calibrated to a measured 2% first, CALIBRATE_PAIRS
#             pairs a try), threshold 2%, <= 15 pairs (SESSIONS x REPEATS each)
#   autotune  benchmarks/autotune_vs_grid.sh gpt2_355m: the tuned search against the full grid
#   kernels   the kernel benchmarks (KERNEL_SELECT, a pytest -k expression; one that selects none stops
#             the part with exit 2 before any repeat; KERNEL_ROUNDS rounds, 15,
#             after KERNEL_WARMUP_S seconds of untimed calls, 1.5; rounds of at least KERNEL_ROUND_MS, 0: off)
#             once unpinned as the baseline, then KREPEATS times: an A/A run replaying the baseline's
#             kernel choices and a run with every dslab kernel slowed 3% on the device
#             (--kernel-inject-slowdown, measured where applied), each gated at 3% with the run-to-run
#             noise KERNEL_RUN_NOISE (0.3%) (dslab gate --pytest-benchmark; needs pytest-benchmark's
#             wheel in .whl/). Files land in $OUT/kernels.tgz; benchmarks/kernel_gate_summary.py
#             prints the per-benchmark table at noise 0 and KERNEL_RUN_NOISE. KERNEL_BASE (a
#             kernels_base.json from an earlier call on the same kind of machine, e.g. carried in
#             the work tree) replaces the baseline run, so the repeats can span calls; KERNEL_KINDS
#             ("aa slow") picks which of the two runs each repeat makes; each run
#             is cut at KERNEL_RUN_S seconds (240; six layer_norm cases at 10 rounds of 700 ms
#             took about 80 s on an H200); a run that could end past KERNEL_TOTAL_S seconds from
#             the part's start is not started, so the archive and the table still come back within
#             a device call (e.g. KERNEL_TOTAL_S=540). A slowed run adds its calibration to each dslab case:
#             up to warm-up rounds + rounds + 30 blocks of a round's length (about 30 s at 10
#             rounds of 700 ms; bias_gelu or bias_dropout, 10 cases, ran 118 s plain and past
#             140 s slowed). benchmarks/kernels/baselines/h200_layer_norm_700ms.json is
#             such a baseline (KERNEL_SELECT=layer_norm KERNEL_ROUND_MS=700 KERNEL_ROUNDS=10, one H200,
#             torch 2.11, 2026-11-30); so are h200_linear_cross_entropy_700ms.json and
#             h200_cross_entropy_700ms.json, and h200_bias_gelu_700ms.json, h200_bias_dropout_residual_700ms.json and
#             h200_adamw_700ms.json (KERNEL_SELECT=adamw; a module name such as fused_adam selects too),
#             h200_attention_700ms.json (KERNEL_SELECT=attention, 14 benchmarks: 226 s for the baseline
#             with its autotune, 159 s pinned A/A, 284 s slowed, so a baseline and a repeat of both kinds
#             span two calls) and h200_llama_ops_700ms.json (10 of llama_ops' 12, without the rope
#             forward+backward; 10 benchmarks ran 241 s slowed). Kernels at the power limit take 700 ms rounds: at 200 ms
#             the cross-entropy's plain rounds swung 7.7% and its slowed runs passed, unresolved.
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
        --threshold "${THRESHOLD:-0.02}" --calibrate-pairs "${CALIBRATE_PAIRS:-4}" --logs "$OUT/gate_logs" --json "$OUT/gate_detection.json" \
        > "$OUT/gate_detection.log" 2>&1
      echo "detect: exit $?"; tail -30 "$OUT/gate_detection.log" ;;
    autotune)
      bash benchmarks/autotune_vs_grid.sh "${MODEL:-gpt2_355m}" ;;
    kernels)
      select=${KERNEL_SELECT:-"layer_norm or cross_entropy"}
      kdir="$OUT/kernels"; mkdir -p "$kdir"
      started=$SECONDS
      fits() {  # whether a run cut at KERNEL_RUN_S still ends within KERNEL_TOTAL_S of the part's start
        [ $((SECONDS - started + ${KERNEL_RUN_S:-240})) -le "${KERNEL_TOTAL_S:-100000}" ] && return 0
        echo "kernels: $1 not started: it could end past KERNEL_TOTAL_S=${KERNEL_TOTAL_S}s"; return 1
      }
      bench() {  # name, extra options
        local name=$1; shift
        timeout "${KERNEL_RUN_S:-240}" python3 -m pytest benchmarks/kernels -m gpu -q -p no:cacheprovider -k "$select" \
          --kernel-rounds "${KERNEL_ROUNDS:-15}" --kernel-warmup-s "${KERNEL_WARMUP_S:-1.5}" \
          --kernel-round-ms "${KERNEL_ROUND_MS:-0}" --benchmark-json="$kdir/$name.json" --benchmark-save-data "$@" \
          > "$kdir/$name.log" 2>&1
        local rc=$?
        echo "$name: pytest exit $rc"
        if [ "$rc" = 5 ]; then  # pytest's "no tests collected": the repeats would select nothing too
          echo "gate_gpu.sh: KERNEL_SELECT='$select' selects no kernel benchmark (see $name.log)" >&2; exit 2
        fi
      }
      if [ -n "${KERNEL_BASE:-}" ]; then
        [ -f "$KERNEL_BASE" ] || { echo "gate_gpu.sh: KERNEL_BASE=$KERNEL_BASE: no such file" >&2; exit 2; }
        cp "$KERNEL_BASE" "$kdir/kernels_base.json"; echo "kernels_base: from $KERNEL_BASE"
      else
        bench kernels_base
      fi
      for i in $(seq 1 "${KREPEATS:-3}"); do
        for kind in ${KERNEL_KINDS:-aa slow}; do
          fits "kernels_${kind}_$i" || break 2
          extra=(--kernel-pins "$kdir/kernels_base.json")
          [ "$kind" = slow ] && extra+=(--kernel-inject-slowdown "${KERNEL_SLOWDOWN:-0.03}")
          bench "kernels_${kind}_$i" "${extra[@]}"
          python3 -m dslab.cli gate --pytest-benchmark "$kdir/kernels_base.json" "$kdir/kernels_${kind}_$i.json" \
            --threshold 3% --run-noise "${KERNEL_RUN_NOISE:-0.3%}" --format json > "$kdir/kernels_gate_${kind}_$i.json" 2>&1
          echo "kernels $kind run $i: gate exit $?"
        done
      done
      # the lent machine returns a handful of files: one archive, and the table
      tar czf "$OUT/kernels.tgz" -C "$OUT" kernels && rm -rf "$kdir"
      rm -rf /tmp/kernels_summary && mkdir -p /tmp/kernels_summary && tar xzf "$OUT/kernels.tgz" -C /tmp/kernels_summary
      python3 benchmarks/kernel_gate_summary.py /tmp/kernels_summary/kernels --threshold 3% \
        --run-noise 0 "${KERNEL_RUN_NOISE:-0.3%}" | tee "$OUT/kernels_gate_table.md" ;;
    *) echo "gate_gpu.sh: unknown part '$part' (detect, autotune, kernels)" >&2; exit 2 ;;
  esac
done
