#!/usr/bin/env bash
# ZeRO stages 0-3 on 1, 2 and (when present) 4 GPUs of this machine, then the weak-scaling table:
# efficiency(stage, N) = tokens/s(N) / (N x tokens/s(1)), each rank training the same micro-batch.
#
#   benchmarks/zero_scaling.sh [args for zero_scaling.py, e.g. --steps 30 --micro-batch 8]
#   ZERO_SCALING_OUT=dir  keeps the per-N JSON rows there (default: a temporary directory)
#   ZERO_SCALING_NPROCS="1 2"  overrides the process counts (on a CPU: gloo; add --tiny)
#
# NVLink multicast (NVLS) stays off: the lent machines do not support it reliably.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-$here/../.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

out="${ZERO_SCALING_OUT:-$(mktemp -d)}"
mkdir -p "$out"
if [ -n "${ZERO_SCALING_NPROCS:-}" ]; then
    nprocs="$ZERO_SCALING_NPROCS"
else
    gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())')"
    if [ "$gpus" -lt 1 ]; then
        echo "zero_scaling.sh: no CUDA GPU; set ZERO_SCALING_NPROCS (e.g. \"1 2\") and pass --tiny for a CPU check" >&2
        exit 2
    fi
    nprocs="1"
    [ "$gpus" -ge 2 ] && nprocs="$nprocs 2"
    [ "$gpus" -ge 4 ] && nprocs="$nprocs 4"
fi

for n in $nprocs; do
    echo "== $n process(es) =="
    "$python" -m torch.distributed.run --standalone --nproc_per_node "$n" \
        "$here/zero_scaling.py" --json "$out/world$n.json" "$@"
done

"$python" - "$out" $nprocs <<'PY'
import json
import sys
from pathlib import Path

out, counts = Path(sys.argv[1]), [int(n) for n in sys.argv[2:]]
runs = {n: json.loads((out / f"world{n}.json").read_text()) for n in counts}
by = {n: {row.get("label", str(row["stage"])): row for row in run["rows"]} for n, run in runs.items()}
stages = list(dict.fromkeys(s for n in counts for s in by[n]))
gib = 1024 ** 3
first = runs[counts[0]]
print(f"\nweak scaling, {'gpt2_tiny' if first['tiny'] else 'gpt2_355m'}, micro-batch {first['micro_batch']} "
      f"x seq {first['seq']} per rank, on {first['device']}")
print("efficiency = tokens/s(N) / (N x tokens/s(1)); memory per GPU in GiB (peak allocated, "
      "model states measured / estimated)")
header = f"{'stage':>13}" + "".join(f"  {'N=' + str(n) + ' tok/s':>14} {'eff':>5} {'peak':>7} {'states':>13}" for n in counts)
print(header)
for stage in stages:
    base = by.get(1, {}).get(stage)
    line = f"{stage:>13}"
    for n in counts:
        row = by[n].get(stage)
        if row is None:
            line += f"  {'-':>14} {'-':>5} {'-':>7} {'-':>13}"
            continue
        eff = row["tokens_per_s"] / (n * base["tokens_per_s"]) if base else None
        peak = "-" if row["peak_allocated_bytes"] is None else f"{row['peak_allocated_bytes'] / gib:.2f}"
        states = f"{row['measured_model_states'] / gib:.2f}/{row['estimate_model_states'] / gib:.2f}"
        line += f"  {row['tokens_per_s']:>14,.0f} {'-' if eff is None else f'{eff:.2f}':>5} {peak:>7} {states:>13}"
    print(line)
print(f"rows: {out}")
PY
