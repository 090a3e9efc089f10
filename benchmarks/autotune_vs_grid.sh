#!/usr/bin/env bash
# `dslab autotune` against the full grid it searches, on one GPU (issue 45's measurement):
#   bash benchmarks/autotune_vs_grid.sh [MODEL]        (MODEL: gpt2_355m (default), gpt2_1558m, ...)
#
# The space: ZeRO stage 0-3 x micro-batch MBS (default "4 8 16 32") at seq 1024, bf16, AdamW,
# clipping 1.0, CUDA graphs on, over examples/train_gpt2.py. Two searches, the tuned one first
# (so that it, not the grid, pays for a cold Triton cache):
#   tuned  tuner_type model_based, DeepSpeed's default early stopping (5), dominated stages held back
#   grid   gridsearch over every experiment (prune_dominated_stages false, no early stopping)
# Each search's wall time is its own (profilers.autotuning.wall_time_s: launches, warm-ups and
# profiled steps included). The table prints last: the best config and its tokens/s in each, the
# tuned search's best over the grid's best, and its wall time over the grid's. SEARCHES="tuned" or
# "grid" runs one of them (a large model's two searches may not fit one device call); the table
# reads whatever reports are under $OUT/autotune/MODEL.
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-/tmp/out}
MODEL=${1:-gpt2_355m}
MBS=${MBS:-4 8 16 32}
SEQ=${SEQ:-1024}
STEPS=${STEPS:-8}
mkdir -p "$OUT/autotune"
work="$OUT/autotune/$MODEL"
mkdir -p "$work"
mbs_json=$(python3 -c "import sys, json; print(json.dumps([int(x) for x in sys.argv[1:]]))" $MBS)
for search in ${SEARCHES:-tuned grid}; do
  python3 - "$work/$search.json" "$search" "$mbs_json" <<'EOF'
import json, sys
path, search, mbs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
autotuning = {"enabled": True, "metric": "throughput", "start_profile_step": 3, "end_profile_step": 6,
              "results_dir": f"results_{search}", "exps_dir": f"exps_{search}"}
if search == "tuned":
    autotuning.update(tuner_type="model_based")
else:
    autotuning.update(tuner_type="gridsearch", prune_dominated_stages=False, tuner_early_stopping=1000)
config = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
          "gradient_clipping": 1.0, "zero_optimization": {"stage": [0, 1, 2, 3]},
          "cuda_graphs": {"enabled": True}, "steps_per_print": 1000, "autotuning": autotuning}
json.dump(config, open(path, "w"), indent=1)
EOF
  (cd "$work" && timeout "${AUTOTUNE_S:-500}" python3 -m dslab.cli autotune --reports "$work/reports_$search" \
     "$OLDPWD/examples/train_gpt2.py" --model "$MODEL" --seq "$SEQ" --steps "$STEPS" \
     --deepspeed_config "$search.json") > "$work/$search.log" 2>&1
  echo "$search: exit $?"
  grep -E "^\[autotune\]" "$work/$search.log" | tail -20
done
python3 - "$work" "$SEQ" <<'EOF'
import json, sys
from pathlib import Path
work, seq = Path(sys.argv[1]), int(sys.argv[2])
rows = {}
for search in ("tuned", "grid"):
    runs = sorted((work / f"reports_{search}" / "autotune").glob("*/run.json"))
    if not runs:
        print(f"{search}: no report"); continue
    section = json.loads(runs[-1].read_text())["profilers"]["autotuning"]
    ran = [e for e in section["experiments"] if e["status"] != "pruned"]
    rows[search] = (section["best"], section["best_metric"], section["wall_time_s"], len(ran),
                    len(section["experiments"]))
print(f"\n{'search':<7} {'best':<16} {'tokens/s':>10} {'wall s':>8} {'launched':>9} {'of':>4}")
for search, (best, metric, wall, ran, total) in rows.items():
    tokens = metric * seq if metric is not None else float("nan")
    print(f"{search:<7} {str(best):<16} {tokens:>10.0f} {wall:>8.1f} {ran:>9} {total:>4}")
if len(rows) == 2 and rows["tuned"][1] and rows["grid"][1]:
    print(f"tuned best / grid best: {rows['tuned'][1] / rows['grid'][1]:.3f}; "
          f"tuned wall / grid wall: {rows['tuned'][2] / rows['grid'][2]:.3f}")
EOF
