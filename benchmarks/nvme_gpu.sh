#!/usr/bin/env bash
# Storage I/O on a lent GPU machine's local disk, by stage (each stage fits one 10-minute call):
#
#   bash benchmarks/nvme_gpu.sh tune [DIR]      # dslab nvme-tune, CUDA tensors, then pinned CPU
#                                               # tensors; fio beside both when installed (~3-5 min)
#   bash benchmarks/nvme_gpu.sh offload [DIR]   # GPT-2 355M: CPU vs NVMe optimizer offload,
#                                               # interleaved, 2 trials (~4-6 min)
#   bash benchmarks/nvme_gpu.sh tests           # the gpu-marked tests of tests/io (~1 min)
#
# DIR is a directory on the disk to measure (default /tmp/dslab-nvme); logs, run reports and
# JSON go to ${OUT:-out}/nvme. The offload stage passes the aio block that the CUDA tune of the
# same session recommended (else DeepSpeed's defaults). Source benchmarks/gpu_setup.sh first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stage=${1:?usage: nvme_gpu.sh tune|offload|tests [DIR]}
dir=${2:-/tmp/dslab-nvme}
out=${OUT:-out}/nvme
mkdir -p "$dir" "$out"
python=${PYTHON:-python3}
case "$stage" in
  tune)
    command -v fio >/dev/null || echo "nvme_gpu: fio is not installed here; the tuner runs alone" >&2
    df -hT "$dir" | tee "$out/disk.txt"
    for device in cuda cpu; do
      $python -m dslab.cli nvme-tune --path "$dir" --size 1G --trials 3 --device "$device" \
        --out "$out/reports" 2> "$out/tune_$device.err" | tee "$out/tune_$device.txt"
    done
    ;;
  offload)
    aio=$($python - "$out/reports" <<'PY'
import json, sys
from pathlib import Path
runs = sorted(Path(sys.argv[1]).glob("nvme_tune/*/run.json"))
best = None
for run in runs:
    record = json.loads(run.read_text())["profilers"]["io"]["tune"]
    if record.get("device") == "cuda":
        best = record["recommended_aio"]
print(json.dumps(best) if best else "")
PY
)
    $python benchmarks/nvme_offload.py --nvme-path "$dir/swap" ${aio:+--aio "$aio"} --trials 2 \
      --warmup 2 --steps 4 --json "$out/offload.json" 2>&1 | tee "$out/offload.txt"
    ;;
  tests)
    $python -m pytest -q -m gpu tests/io 2>&1 | tee "$out/tests.txt"
    ;;
  *)
    echo "nvme_gpu: unknown stage '$stage' (tune, offload, tests)" >&2
    exit 2
    ;;
esac
