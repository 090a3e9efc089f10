#!/usr/bin/env bash
# `dslab autotune` against DeepSpeed's autotuner on the same model, one GPU (issue 45's measurement):
#   bash benchmarks/autotune_vs_deepspeed.sh [MODEL]     (MODEL: gpt2_355m (default), gpt2_1558m, ...)
#
# The same job for both: dslab's GPT-2 MODEL (dslab's kernels) at seq SEQ, bf16, AdamW, clipping
# 1.0, random tokens; ZeRO stage 0-3 and the micro-batch size left to the tuner ("auto").
#   dslab      `dslab autotune` over examples/train_gpt2.py: tuner model_based, fast, CUDA graphs on
#   deepspeed  `deepspeed --autotuning tune` over examples/train_gpt2_deepspeed.py (DeepSpeed's
#              engine on the same model): fast mode, model_based, stage "all"
# Each search's wall time is measured around its command. Then its chosen config trains
# TIMED_STEPS steps in its own engine, timed the same way for both (examples' --timed_from: the
# steps after the first 5, device-synchronised), so the table compares the chosen configs' real
# tokens/s and not the tuners' own metrics (DeepSpeed's sums its forward, backward and step
# timers). TUNERS="dslab" or "deepspeed" runs one side (two device calls when one will not hold
# both); benchmarks/autotune_compare.py reads both sides' files wherever they were gathered.
# PARTS ("search timed") splits the work further: PARTS=search leaves the timed runs out, and
# PARTS=timed with FROM=<an earlier call's autotune_vs_deepspeed/MODEL folder, carried in the work
# tree> times the chosen configs found there, both in one call on one machine.
#
# DeepSpeed's autotuner ends each experiment with `pdsh ... pkill -f <experiment>`; a machine without
# pdsh gets a stand-in on PATH that runs the command locally.
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-/tmp/out}
MODEL=${1:-gpt2_355m}
SEQ=${SEQ:-1024}
TIMED_STEPS=${TIMED_STEPS:-25}
work="$OUT/autotune_vs_deepspeed/$MODEL"
mkdir -p "$work"
repo=$(pwd)
if ! command -v pdsh >/dev/null 2>&1; then
  mkdir -p "$work/bin"
  cat > "$work/bin/pdsh" <<'SH'
#!/usr/bin/env bash
# pdsh -f N -w HOSTS CMD...: the hosts are this machine; run CMD here
while [ $# -gt 0 ]; do case "$1" in -f|-w) shift 2 ;; *) break ;; esac; done
"$@" || true
SH
  chmod +x "$work/bin/pdsh"
  export PATH="$work/bin:$PATH"
fi
# DeepSpeed installed with `pip --target` has no `deepspeed` launcher on PATH; its autotuner starts
# every experiment through that command, so a stand-in runs DeepSpeed's own launcher module
if python3 -c "import deepspeed.launcher.runner" 2>/dev/null && ! command -v deepspeed >/dev/null 2>&1; then
  mkdir -p "$work/bin"
  printf '#!/usr/bin/env bash\nexec python3 -c "import sys; from deepspeed.launcher.runner import main; sys.argv[0] = \x27deepspeed\x27; main()" "$@"\n' > "$work/bin/deepspeed"
  chmod +x "$work/bin/deepspeed"
  export PATH="$work/bin:$PATH"
fi
python3 - "$work" <<'EOF'
import json, sys
work = sys.argv[1]
base = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 1.0, "steps_per_print": 1000}
dslab = dict(base, zero_optimization={"stage": [0, 1, 2, 3]}, cuda_graphs={"enabled": True},
             autotuning={"enabled": True, "fast": True, "metric": "throughput", "tuner_type": "model_based",
                         "start_profile_step": 3, "end_profile_step": 6, "results_dir": "results_dslab",
                         "exps_dir": "exps_dslab", "overwrite": True})
deepspeed = dict(base, zero_optimization={"stage": "all"},
                 autotuning={"enabled": True, "fast": True, "metric": "throughput", "tuner_type": "model_based",
                             "start_profile_step": 3, "end_profile_step": 6, "results_dir": "results_deepspeed",
                             "exps_dir": "exps_deepspeed", "overwrite": True})
json.dump(dslab, open(f"{work}/dslab.json", "w"), indent=1)
json.dump(deepspeed, open(f"{work}/deepspeed.json", "w"), indent=1)
EOF
now() { python3 -c "import time; print(time.time())"; }
PARTS=${PARTS:-search timed}
if [ -n "${FROM:-}" ]; then
  [ -d "$FROM" ] || { echo "autotune_vs_deepspeed.sh: FROM=$FROM: no such folder" >&2; exit 2; }
  cp -r "$FROM"/. "$work"/
  echo "searches from $FROM: $(ls "$work" | tr '\n' ' ')"
fi
for tuner in ${TUNERS:-dslab deepspeed}; do
  case " $PARTS " in *" search "*) ;; *) continue ;; esac
  t0=$(now)
  if [ "$tuner" = dslab ]; then
    (cd "$work" && timeout "${SEARCH_S:-900}" python3 -m dslab.cli autotune --reports "$work/reports_dslab" \
       "$repo/examples/train_gpt2.py" --model "$MODEL" --seq "$SEQ" --steps 8 --deepspeed_config dslab.json) \
       > "$work/dslab.log" 2>&1
    echo "dslab autotune: exit $?"
  else
    (cd "$work" && timeout "${SEARCH_S:-900}" deepspeed --autotuning tune --num_gpus 1 \
       "$repo/examples/train_gpt2_deepspeed.py" --model "$MODEL" --seq "$SEQ" --steps 8 --deepspeed_config deepspeed.json) \
       > "$work/deepspeed.log" 2>&1
    echo "deepspeed --autotuning tune: exit $?"
  fi
  python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$t0" > "$work/wall_$tuner.txt"
  # each experiment's output is kept (the lent machine returns the archive, not the folders)
  for log in "$work/exps_$tuner"/*/stderr.log; do
    [ -f "$log" ] || continue
    mkdir -p "$work/stderr_$tuner" && tail -200 "$log" > "$work/stderr_$tuner/$(basename "$(dirname "$log")").log"
  done
  rm -rf "$work/exps_$tuner"
done
for tuner in ${TUNERS:-dslab deepspeed}; do
  case " $PARTS " in *" timed "*) ;; *) continue ;; esac
  if [ "$tuner" = dslab ]; then
    script=examples/train_gpt2.py; launch=python3
  else
    script=examples/train_gpt2_deepspeed.py; launch="deepspeed --num_gpus 1"
  fi
  optimal="$work/results_$tuner/ds_config_optimal.json"
  if [ -f "$optimal" ]; then
    timeout "${TIMED_S:-300}" $launch "$repo/$script" --model "$MODEL" --seq "$SEQ" --steps "$TIMED_STEPS" --timed_from 5 \
      --deepspeed_config "$optimal" > "$work/timed_$tuner.log" 2>&1
  else
    echo "$tuner: no ds_config_optimal.json" > "$work/timed_$tuner.log"
  fi
done
[ -f "$work/dslab.log" ] && grep -E "^\[autotune\]|^best" "$work/dslab.log" | tail -20
[ -f "$work/deepspeed.log" ] && grep -E "Tuning completed|optimal setup" "$work/deepspeed.log" | tail -4
python3 benchmarks/autotune_compare.py "$work"
# the lent machine returns a handful of files: the whole folder as one archive
tar czf "$OUT/autotune_vs_deepspeed_$MODEL.tgz" -C "$OUT/autotune_vs_deepspeed" "$MODEL"
